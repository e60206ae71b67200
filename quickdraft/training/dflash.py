"""Training a DFlash block drafter against a frozen target (self-distillation).

Stage: the DFlash half of `quickdraft train-drafter` (training/corpus.py makes its data,
training/loop.py holds the labels, loss, AL estimate and loop it shares with training/mtp.py).
Contract:
  DFlashTrainModel(shape, taps, block, mask, embed, head)
        the DFlash forward (models/heads/dflash.py) in plain differentiable torch, with its
        parameters named as the public checkpoint names them; the target's embedding and lm_head are
        frozen inputs, never parameters.
  .block_hidden(ids, taps, anchors)
        many blocks per sequence in one pass: block n = [token at anchor a_n, MASK x (B-1)] at
        positions a_n .. a_n + B - 1, seeing the context entries strictly before a_n (the
        target's outputs for tokens 0 .. a_n - 1, as when serving right after committing token
        a_n) and its own rows (non-causal). Rows 1 .. B-1 are the drafted rows the loop labels.
  trainer_for(target, layers, taps, block, mask)   a fresh drafter for a loaded target; the
        checkpoint it writes loads with `--speculative-method dflash --draft-model DIR`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.config import ModelConfig
from quickdraft.models.base import LanguageModel, module_of
from quickdraft.models.layers import Rope
from quickdraft.training.corpus import TapCorpus
from quickdraft.training.layers import Layer, Norm, frozen_target, init_stds, linear, rope_tables
from quickdraft.training.loop import DraftTrainModel


class DFlashTrainModel(DraftTrainModel):
    """The DFlash drafter's forward in plain torch (module docstring); `state_dict()` holds
    exactly the public checkpoint's tensors."""

    head: Tensor  # a buffer, typed

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
        self.rows = block_size - 1  # row 0 holds the anchor's own token
        self.mask_token_id, self.num_target_layers = mask_token_id, num_target_layers
        h = shape.hidden_size
        std, out_std = init_stds(shape.num_hidden_layers)
        self.fc = linear(len(taps) * h, h, std / math.sqrt(len(taps)))
        self.hidden_norm = Norm(h, shape.rms_norm_eps)
        self.layers = nn.ModuleList(
            Layer(shape, std, out_std) for _ in range(shape.num_hidden_layers)
        )
        # the same modules, typed (ModuleList items are plain nn.Modules to a type checker)
        self.decoder_layers: list[Layer] = list(self.layers)  # type: ignore[arg-type]
        self.norm = Norm(h, shape.rms_norm_eps)
        self._embed = embed
        self.vocab_size = head.shape[0]
        self.register_buffer("head", self.scored_head(head, vocab_ids), persistent=False)
        self.rope = Rope(shape.head_dim, shape.rope_theta, torch.device("cpu"))

    def block_hidden(self, ids: Tensor, taps: Tensor, anchors: Tensor) -> Tensor:
        """ids [S, T], taps [S, T, F], anchors [S, N] -> the blocks' final hidden rows
        [S, N, B, H] (before the final norm)."""
        s, t = ids.shape
        n, b = anchors.shape[1], self.block_size
        ctx = self.hidden_norm(self.fc(taps.to(torch.float32, copy=True)))  # [S, T, H]
        block_ids = torch.full((s, n, b), self.mask_token_id, dtype=torch.int64)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        with torch.no_grad():
            x = self._embed(block_ids.flatten()).float().clone().view(s, n * b, -1)
        block_pos = (anchors[:, :, None] + torch.arange(b)).view(s, n * b)
        cos_c, sin_c = rope_tables(self.rope, torch.arange(t).expand(s, t))
        cos_b, sin_b = rope_tables(self.rope, block_pos)
        # [S, 1, NB, T + NB]: a block sees the context before its anchor, and itself whole
        sees_ctx = (torch.arange(t)[None, None, :] < anchors[:, :, None]).repeat_interleave(b, 1)
        which = torch.arange(n).repeat_interleave(b)
        sees_block = (which[:, None] == which[None, :]).expand(s, n * b, n * b)
        mask = torch.cat([sees_ctx, sees_block], -1)[:, None]
        for layer in self.decoder_layers:
            attn = layer.self_attn
            hn = layer.input_layernorm(x)
            k_ctx, v_ctx = attn.keys(ctx, cos_c, sin_c)
            k_blk, v_blk = attn.keys(hn, cos_b, sin_b)
            q = attn.queries(hn, cos_b, sin_b)
            attended = attn.attend(
                q, torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1), mask
            )
            x = layer.finish(x, attended)
        return x.view(s, n, b, -1)

    def rows_hidden(self, ids: Tensor, taps: Tensor, preds: Tensor, anchors: Tensor) -> Tensor:
        return self.block_hidden(ids, taps, anchors)[:, :, 1:]

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden rows [..., H] -> logits [..., vocab] fp32 over the target's lm_head."""
        return F.linear(self.norm(hidden).to(self.head.dtype), self.head).float()

    def config_json(self, target_name: str, steps: int) -> dict[str, Any]:
        """config.json in the public layout (models/heads/dflash.py reads it)."""
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
            **self.vocab_json(),
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


def trainer_for(
    model: LanguageModel,
    num_layers: int,
    taps: tuple[int, ...],
    block_size: int,
    mask_token_id: int,
    seed: int = 0,
    dtype: torch.dtype | None = None,  # the frozen head's (default: layers.head_dtype())
    vocab_ids: Tensor | None = None,  # the draft vocabulary (draft_vocabulary); None: all
) -> DFlashTrainModel:
    """A fresh DFlash drafter to train for target `model` (its embedding and head, frozen)."""
    target: Any = module_of(model)
    shape: ModelConfig = target.config
    if not all(0 <= t < shape.num_hidden_layers for t in taps):
        raise ValueError(f"taps {list(taps)} outside the target's {shape.num_hidden_layers} layers")
    if block_size < 2:
        raise ValueError(f"block size must be >= 2, got {block_size}")
    if not 0 <= mask_token_id < shape.vocab_size:
        raise ValueError(f"mask token {mask_token_id} outside the vocabulary ({shape.vocab_size})")
    frozen = frozen_target(target, dtype)
    drafter = DFlashTrainModel(
        draft_shape(shape, num_layers),
        taps,
        block_size,
        mask_token_id,
        frozen.embed,
        frozen.head,
        shape.num_hidden_layers,
        seed,
        vocab_ids,
    )
    with torch.no_grad():
        drafter.norm.weight.copy_(frozen.norm_scale)
    return drafter
