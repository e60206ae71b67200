"""Training a DFlash block drafter against a frozen target (self-distillation; over 400 lines:
the differentiable forward, its labels and estimate, and the loop that checkpoints it).

Stage: the training half of `quickdraft train-drafter` (training/corpus.py makes its data).
Contract:
  DFlashTrainModel(shape, taps, block, mask, embed, head)
        the DFlash forward (models/dflash.py) in plain differentiable torch, with its parameters
        named as the public checkpoint names them; the target's embedding and lm_head are
        frozen inputs, never parameters.
  .loss(ids, taps, preds, anchors) -> (loss, stats)
        many blocks per sequence in one pass: block n = [token at anchor a_n, MASK x (B-1)] at
        positions a_n .. a_n + B - 1, seeing the context entries strictly before a_n (the
        target's outputs for tokens 0 .. a_n - 1, as when serving right after committing token
        a_n) and its own rows (non-causal). Row j's label is the target's greedy token at
        a_n + j; it is known only while the corpus follows the target's greedy chain
        (ids[a_n + i] == preds[a_n + i - 1] for every i < j), so rows past the first
        disagreement carry no loss and are not scored at all. Weights exp(-(j - 1) / gamma).
  train(...)  AdamW with warm-up and cosine decay, a held-out acceptance-length estimate every
        `eval_every` steps, a checkpoint every `save_every` (the public layout, loadable with
        `--speculative-method dflash --draft-model DIR`, plus the optimizer state to resume).
The acceptance-length estimate: c_j = P(row j right | rows < j right), measured on held-out
blocks whose labels are known; AL = 1 + sum_j prod_{i <= j} c_i (the bonus token included).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from quickdraft.config import ModelConfig
from quickdraft.kernels.pointwise import reference_rope
from quickdraft.models.base import LanguageModel
from quickdraft.models.layers import Rope
from quickdraft.training.corpus import TapCorpus

CHECKPOINT = "model.safetensors"
TRAINER_STATE = "trainer.pt"
LOG = "train_log.jsonl"


def default_gamma(block_size: int) -> float:
    """The loss-weight decay the DFlash paper pairs with each block size (7 for 16, 5 for 10,
    4 for 8 and below)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


@dataclass(frozen=True, slots=True)
class TrainConfig:
    block_size: int = 8
    num_layers: int = 2
    steps: int = 2000
    minutes: float = 0.0  # stop after this much wall time too (0: steps only)
    batch: int = 4  # sequences per step
    anchors: int = 32  # blocks per sequence per step
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.01
    gamma: float = 0.0  # 0: default_gamma(block_size)
    eval_every: int = 100
    save_every: int = 200
    eval_blocks: int = 512  # held-out blocks per estimate
    seed: int = 0


class Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _linear(n_in: int, n_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


class _Attention(nn.Module):
    def __init__(self, shape: ModelConfig, std: float, out_std: float) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            shape.num_attention_heads,
            shape.num_key_value_heads,
            d,
        )
        self.q_proj = _linear(h, self.heads * d, std)
        self.k_proj = _linear(h, self.kv_heads * d, std)
        self.v_proj = _linear(h, self.kv_heads * d, std)
        self.o_proj = _linear(self.heads * d, h, out_std)
        self.q_norm = Norm(d, shape.rms_norm_eps)
        self.k_norm = Norm(d, shape.rms_norm_eps)


class _MLP(nn.Module):
    def __init__(self, shape: ModelConfig, std: float, out_std: float) -> None:
        super().__init__()
        h, i = shape.hidden_size, shape.intermediate_size
        self.gate_proj, self.up_proj = _linear(h, i, std), _linear(h, i, std)
        self.down_proj = _linear(i, h, out_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, shape: ModelConfig, std: float, out_std: float) -> None:
        super().__init__()
        self.input_layernorm = Norm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = _Attention(shape, std, out_std)
        self.post_attention_layernorm = Norm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = _MLP(shape, std, out_std)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of x [S, L, heads, d] by tables [S * L, d] (the ops' plain reference: autograd)."""
    return reference_rope(x.flatten(0, 1), cos, sin).view_as(x)


class DFlashTrainModel(nn.Module):
    """The DFlash drafter's forward in plain torch (module docstring); `state_dict()` holds
    exactly the public checkpoint's tensors."""

    head: Tensor  # buffers, typed
    t2d: Tensor

    def __init__(
        self,
        shape: ModelConfig,  # the draft layers' shapes (the target's width and heads)
        taps: tuple[int, ...],
        block_size: int,
        mask_token_id: int,
        embed: Callable[[Tensor], Tensor],  # token ids -> the target's raw embeddings [.., H]
        head: Tensor,  # [vocab, H] the target's lm_head, frozen
        num_target_layers: int,
        seed: int = 0,
        vocab_ids: Tensor | None = None,  # [V_d] ascending: the token ids the drafter scores
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shape, self.taps, self.block_size = shape, taps, block_size
        self.mask_token_id, self.num_target_layers = mask_token_id, num_target_layers
        h = shape.hidden_size
        std = 0.02
        out_std = std / math.sqrt(2 * shape.num_hidden_layers)  # GPT-2's residual scaling
        self.fc = _linear(len(taps) * h, h, std / math.sqrt(len(taps)))
        self.hidden_norm = Norm(h, shape.rms_norm_eps)
        self.layers = nn.ModuleList(
            _Layer(shape, std, out_std) for _ in range(shape.num_hidden_layers)
        )
        # the same modules, typed (ModuleList items are plain nn.Modules to a type checker)
        self.decoder_layers: list[_Layer] = list(self.layers)  # type: ignore[arg-type]
        self.norm = Norm(h, shape.rms_norm_eps)
        self._embed = embed
        self.vocab_size = head.shape[0]
        self.draft_vocab = None if vocab_ids is None else len(vocab_ids)
        t2d = torch.arange(head.shape[0])  # target id -> the drafter's logit column (-1: none)
        if vocab_ids is not None:
            head = head[vocab_ids].clone()
            t2d = torch.full((self.vocab_size,), -1, dtype=torch.int64)
            t2d[vocab_ids] = torch.arange(len(vocab_ids))
            # EAGLE-3's convention: column i is token i + d2t[i]; saved in the checkpoint
            self.register_buffer("d2t", vocab_ids - torch.arange(len(vocab_ids)))
        self.register_buffer("head", head, persistent=False)
        self.register_buffer("t2d", t2d, persistent=False)
        self.rope = Rope(shape.head_dim, shape.rope_theta, torch.device("cpu"))

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [S, L] -> cos, sin [S * L, d] fp32 (the serving model's tables)."""
        cos, sin = self.rope.tables(positions.flatten(), torch.float32)
        return cos[:, 0], sin[:, 0]

    def block_hidden(self, ids: Tensor, taps: Tensor, anchors: Tensor) -> Tensor:
        """ids [S, T], taps [S, T, F], anchors [S, N] -> the blocks' final hidden rows
        [S, N, B, H] (before the final norm)."""
        s, t = ids.shape
        n, b = anchors.shape[1], self.block_size
        shape = self.shape
        heads, kv_heads, d = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
        ctx = self.hidden_norm(self.fc(taps.to(torch.float32, copy=True)))  # [S, T, H]
        block_ids = torch.full((s, n, b), self.mask_token_id, dtype=torch.int64)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        with torch.no_grad():
            x = self._embed(block_ids.flatten()).float().clone().view(s, n * b, -1)
        block_pos = (anchors[:, :, None] + torch.arange(b)).view(s, n * b)
        cos_c, sin_c = self._rope(torch.arange(t).expand(s, t))
        cos_b, sin_b = self._rope(block_pos)
        # [S, 1, NB, T + NB]: a block sees the context before its anchor, and itself whole
        sees_ctx = (torch.arange(t)[None, None, :] < anchors[:, :, None]).repeat_interleave(b, 1)
        which = torch.arange(n).repeat_interleave(b)
        sees_block = (which[:, None] == which[None, :]).expand(s, n * b, n * b)
        mask = torch.cat([sees_ctx, sees_block], -1)[:, None]
        for layer in self.decoder_layers:
            attn = layer.self_attn
            hn = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(hn).view(s, n * b, heads, d))
            k_all = torch.cat([attn.k_proj(ctx), attn.k_proj(hn)], 1).view(
                s, t + n * b, kv_heads, d
            )
            v_all = torch.cat([attn.v_proj(ctx), attn.v_proj(hn)], 1).view(
                s, t + n * b, kv_heads, d
            )
            k_all = attn.k_norm(k_all)
            q = _rotate(q, cos_b, sin_b)
            k_all = torch.cat(
                [_rotate(k_all[:, :t], cos_c, sin_c), _rotate(k_all[:, t:], cos_b, sin_b)], 1
            )
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k_all.transpose(1, 2),
                v_all.transpose(1, 2),
                attn_mask=mask,
                enable_gqa=True,
            )  # [S, heads, NB, d]
            x = x + attn.o_proj(out.transpose(1, 2).reshape(s, n * b, heads * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x.view(s, n, b, -1)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden rows [..., H] -> logits [..., vocab] fp32 over the target's lm_head."""
        return F.linear(self.norm(hidden).to(self.head.dtype), self.head).float()

    def labels(
        self, ids: Tensor, preds: Tensor, anchors: Tensor, hi: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """-> labels (as the drafter's logit columns; -1: a token outside its vocabulary),
        known [S, N, B - 1] for block rows 1 .. B-1 (module docstring); `hi` [S]: each row's
        length (default T)."""
        t = ids.shape[1]
        at = anchors[:, :, None] + torch.arange(self.block_size - 1)  # a + j - 1
        inside = at < (t if hi is None else hi[:, None, None] - 1)
        at = at.clamp(max=t - 1)
        labels = self.t2d[preds.gather(1, at.flatten(1)).view_as(at)]
        agree = torch.zeros_like(ids, dtype=torch.bool)
        agree[:, :-1] = ids[:, 1:] == preds[:, :-1]
        follows = agree.gather(1, at.flatten(1)).view_as(at)
        chain = torch.cat([torch.ones_like(follows[..., :1]), follows[..., :-1]], -1)
        return labels, chain.cumprod(-1).bool() & inside

    def loss(
        self,
        ids: Tensor,
        taps: Tensor,
        preds: Tensor,
        anchors: Tensor,
        gamma: float,
        hi: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        labels, known = self.labels(ids, preds, anchors, hi)
        known &= labels >= 0  # a token outside the draft vocabulary cannot be learned
        hidden = self.block_hidden(ids, taps, anchors)[:, :, 1:]  # [S, N, B-1, H]
        logits = self.logits(hidden[known])  # [rows, vocab]: known rows only
        weights = torch.exp(-torch.arange(self.block_size - 1, dtype=torch.float32) / gamma)
        w = weights.expand_as(known)[known]
        ce = F.cross_entropy(logits, labels[known], reduction="none")
        loss = (ce * w).sum() / w.sum()
        first = torch.zeros_like(known)
        first[..., 0] = True
        right = logits.argmax(-1) == labels[known]
        return loss, {
            "loss": float(loss.detach()),
            "row1_acc": float(right[first[known]].float().mean()),
        }

    @torch.no_grad()
    def acceptance_length(self, corpus: TapCorpus, blocks: int, seed: int = 1) -> float:
        """The held-out AL estimate (module docstring) over `blocks` seeded random blocks."""
        gen = torch.Generator().manual_seed(seed)
        per = max(1, blocks // max(1, len(corpus)))
        hi_all = corpus.bounds()[1]
        hits = torch.zeros(self.block_size - 1)
        tries = torch.zeros(self.block_size - 1)
        for start in range(0, len(corpus), 4):
            rows = torch.arange(start, min(start + 4, len(corpus)))
            ids, taps, preds = corpus.ids[rows], corpus.taps[rows], corpus.preds[rows]
            anchors = corpus.anchors(rows, per, gen)
            labels, known = self.labels(ids, preds, anchors, hi_all[rows])
            hidden = self.block_hidden(ids, taps, anchors)[:, :, 1:]
            right = torch.zeros_like(known)
            right[known] = self.logits(hidden[known]).argmax(-1) == labels[known]  # -1: never
            prefix = torch.cat([torch.ones_like(right[..., :1]), right[..., :-1]], -1).cumprod(-1)
            asked = known & prefix.bool()  # rows whose label is known and whose prefix was right
            tries += asked.flatten(0, 1).sum(0)
            hits += (asked & right).flatten(0, 1).sum(0)
        rates = torch.where(tries > 0, hits / tries.clamp(min=1), torch.zeros_like(hits))
        return 1.0 + float(rates.cumprod(0).sum())

    def config_json(self, target_name: str, steps: int) -> dict[str, Any]:
        """config.json in the public layout (models/dflash.py reads it)."""
        s = self.shape
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": s.hidden_size,
            "num_hidden_layers": s.num_hidden_layers,
            "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim,
            "intermediate_size": s.intermediate_size,
            "rms_norm_eps": s.rms_norm_eps,
            "rope_theta": s.rope_theta,
            "max_position_embeddings": s.max_position_embeddings,
            "vocab_size": s.vocab_size,
            **({} if self.draft_vocab is None else {"draft_vocab_size": self.draft_vocab}),
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.taps),
            },
            "quickdraft": {"trained_for": target_name, "steps": steps},
        }


def head_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies bf16 natively (AVX512-BF16 / AMX), else fp32."""
    from quickdraft.kernels.build import cpu_flags

    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & cpu_flags() else torch.float32


def dense_head(weight: Any, dtype: torch.dtype) -> Tensor:
    """The target's lm_head operand (any Weight format) as a dense [vocab, H] tensor."""
    dense = weight if isinstance(weight, Tensor) else weight.dequantize(dtype)
    return dense.detach().to(dtype).clone()


def draft_vocabulary(corpus: TapCorpus, size: int, always: Sequence[int] = ()) -> Tensor:
    """The `size` token ids the target predicts most often where blocks start and run in
    `corpus` (ties to the lower id), plus `always` (end-of-text ids), ascending: a drafter
    scoring only these pays for a `size`-row head instead of the whole vocabulary (EAGLE-3's
    reduced draft vocabulary), and drafts nothing else."""
    counts = torch.bincount(corpus.preds[corpus.predicted()], minlength=1)
    top = torch.argsort(-counts, stable=True)[:size]
    keep = set(top[counts[top] > 0].tolist()) | set(always)
    return torch.tensor(sorted(keep), dtype=torch.int64)


def vocab_coverage(corpus: TapCorpus, vocab_ids: Tensor) -> float:
    """The share of the target's predictions where blocks run that `vocab_ids` holds."""
    return float(torch.isin(corpus.preds[corpus.predicted()], vocab_ids).float().mean())


def default_mask_token(vocab_size: int, tokenizer_size: int, specials: dict[int, str]) -> int:
    """A token the drafter's MASK rows embed: the first id past the tokenizer where the model's
    embedding has spare rows (never produced by the tokenizer), else the highest-id special
    token that is no end-of-text marker."""
    if vocab_size > tokenizer_size:
        return tokenizer_size
    quiet = [i for i, text in specials.items() if "end" not in text and "eos" not in text]
    return max(quiet) if quiet else vocab_size - 1


def draft_shape(target: ModelConfig, num_layers: int) -> ModelConfig:
    """The draft layers' shapes: the target's width, heads and MLP, `num_layers` deep."""
    return ModelConfig.from_dict(
        {
            "model_type": "qwen3",
            "hidden_size": target.hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": target.num_attention_heads,
            "num_key_value_heads": target.num_key_value_heads,
            "head_dim": target.head_dim,
            "intermediate_size": target.intermediate_size,
            "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": target.rope_theta,
            "max_position_embeddings": target.max_position_embeddings,
            "vocab_size": target.vocab_size,
        }
    )


def _lr(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    done = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


def save_checkpoint(
    model: DFlashTrainModel,
    optimizer: torch.optim.Optimizer,
    step: int,
    cfg: TrainConfig,
    out: Path,
    target_name: str,
) -> None:
    """The drafter in the public layout (config.json + model.safetensors) and the trainer's
    state beside it, each written to a temporary name first so a kill never leaves half."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / (CHECKPOINT + ".tmp")))
    (out / (CHECKPOINT + ".tmp")).replace(out / CHECKPOINT)
    (out / "config.json").write_text(json.dumps(model.config_json(target_name, step), indent=1))
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "config": asdict(cfg),
        "rng": torch.get_rng_state(),
    }
    torch.save(state, out / (TRAINER_STATE + ".tmp"))
    (out / (TRAINER_STATE + ".tmp")).replace(out / TRAINER_STATE)


def load_checkpoint(model: DFlashTrainModel, optimizer: torch.optim.Optimizer, out: Path) -> int:
    """Resume from `out`'s checkpoint: the step it had reached (0 if there is none)."""
    if not (out / TRAINER_STATE).is_file():
        return 0
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(out / CHECKPOINT)), strict=True)
    state = torch.load(out / TRAINER_STATE, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def train(
    model: DFlashTrainModel,
    data: TapCorpus,
    held_out: TapCorpus,
    cfg: TrainConfig,
    out: Path,
    target_name: str,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Train `model` on `data` (module docstring), resuming from `out` when it holds a
    checkpoint; -> the log rows of this run (also appended to out/train_log.jsonl)."""
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    step = load_checkpoint(model, optimizer, out)
    if step == 0:
        torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    log: list[dict[str, float]] = []
    hi = data.bounds()[1]
    start = time.monotonic()
    bar = tqdm(total=cfg.steps, initial=step, desc="train-drafter", disable=not progress)

    def evaluate(at: int, loss: float) -> None:
        model.eval()
        row = {
            "step": at,
            "loss": loss,
            "al": model.acceptance_length(held_out, cfg.eval_blocks),
            "minutes": (time.monotonic() - start) / 60,
        }
        model.train()
        log.append(row)
        with (out / LOG).open("a") as f:
            f.write(json.dumps(row) + "\n")
        bar.set_postfix(loss=f"{loss:.3f}", al=f"{row['al']:.2f}")

    if step == 0:
        evaluate(0, float("nan"))
    recent: list[float] = []
    while step < cfg.steps:
        if cfg.minutes and time.monotonic() - start > cfg.minutes * 60:
            break
        rows = torch.randint(0, len(data), (cfg.batch,))
        anchors = data.anchors(rows, cfg.anchors)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, cfg)
        loss, stats = model.loss(
            data.ids[rows], data.taps[rows], data.preds[rows], anchors, gamma, hi[rows]
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        recent = [*recent[-49:], stats["loss"]]
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", row1=f"{stats['row1_acc']:.2f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evaluate(step, sum(recent) / len(recent))
        if step % cfg.save_every == 0 or step == cfg.steps:
            save_checkpoint(model, optimizer, step, cfg, out, target_name)
    if not log or log[-1]["step"] != step:
        evaluate(step, sum(recent) / len(recent) if recent else float("nan"))
    save_checkpoint(model, optimizer, step, cfg, out, target_name)
    bar.close()
    return log


def trainer_for(
    model: LanguageModel,
    num_layers: int,
    taps: tuple[int, ...],
    block_size: int,
    mask_token_id: int,
    seed: int = 0,
    dtype: torch.dtype | None = None,  # the frozen head's (default: head_dtype())
    vocab_ids: Tensor | None = None,  # the draft vocabulary (draft_vocabulary); None: all
) -> DFlashTrainModel:
    """A fresh DFlash drafter to train for target `model` (its embedding and head, frozen)."""
    assert isinstance(model, nn.Module), "model classes are torch modules"
    target: Any = model
    shape: ModelConfig = target.config
    if not all(0 <= t < shape.num_hidden_layers for t in taps):
        raise ValueError(f"taps {list(taps)} outside the target's {shape.num_hidden_layers} layers")
    if block_size < 2:
        raise ValueError(f"block size must be >= 2, got {block_size}")
    if not 0 <= mask_token_id < shape.vocab_size:
        raise ValueError(f"mask token {mask_token_id} outside the vocabulary ({shape.vocab_size})")
    embed = target.get_submodule("model.embed_tokens")
    drafter = DFlashTrainModel(
        draft_shape(shape, num_layers),
        taps,
        block_size,
        mask_token_id,
        lambda ids: embed(ids),  # a callable, not a submodule: not in the checkpoint
        dense_head(target.head, dtype or head_dtype()),
        shape.num_hidden_layers,
        seed,
        vocab_ids,
    )
    # The final norm starts as the target's (its effective scale, whatever its convention): the
    # head expects rows at that scale, and a unit norm would start at logits of ~+-100.
    with torch.inference_mode():
        ones = torch.ones(1, shape.hidden_size, dtype=target.dtype)
        scale = target.get_submodule("model.norm")(ones)[0].float()
    with torch.no_grad():
        drafter.norm.weight.copy_(scale * math.sqrt(1 + shape.rms_norm_eps))
    return drafter
