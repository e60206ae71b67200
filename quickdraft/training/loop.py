"""The training loop every trained drafter shares (DFlash blocks, MTP heads): labels from the
target's own greedy chain, the weighted loss, the held-out acceptance-length estimate, AdamW
with warm-up and cosine decay, checkpoints and resuming.

Stage: the loop half of `quickdraft train-drafter` (training/corpus.py makes its data,
training/dflash.py and training/mtp.py the drafters). Contract:
  DraftTrainModel   a drafter that drafts `rows` tokens after an anchor a (the position of the
        last token it is given): `rows_hidden(ids, taps, preds, anchors)` -> its final hidden
        rows [S, N, rows, H] (row j guesses token a + j), `logits(hidden)` over its head
        columns, `config_json(...)` for the checkpoint. `state_dict()` holds exactly the
        checkpoint's tensors.
  labels          row j's label is the target's greedy token at a + j: preds[a + j - 1]. It is
        known only while the corpus follows the target's greedy chain (ids[a + i] ==
        preds[a + i - 1] for every i < j): past the first disagreement the target's own
        continuation is unknown, so those rows carry no loss and are not scored at all.
  loss            cross-entropy per known row, weighted exp(-(j - 1) / gamma).
  train(...)      a held-out AL estimate every `eval_every` steps, a checkpoint every
        `save_every` (the drafter's serving layout plus the optimizer state to resume); the
        loss under bf16 autocast where the hardware multiplies bf16 (`TrainConfig.precision`:
        1.35x faster steps on an AMX CPU), the weights and optimizer state fp32 always.
The acceptance-length estimate: c_j = P(row j right | rows < j right), measured on held-out
anchors whose labels are known; AL = 1 + sum_j prod_{i <= j} c_i (the bonus token included).
"""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from quickdraft.training.corpus import TapCorpus
from quickdraft.training.layers import head_dtype

CHECKPOINT = "model.safetensors"
TRAINER_STATE = "trainer.pt"
LOG = "train_log.jsonl"


def default_gamma(block_size: int) -> float:
    """The loss-weight decay the DFlash paper pairs with each block size (7 for 16, 5 for 10,
    4 for 8 and below)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


@dataclass(frozen=True, slots=True)
class TrainConfig:
    block_size: int = 8  # DFlash: block rows (drafts + 1)
    num_layers: int = 2  # DFlash: draft layers
    mtp_steps: int = 3  # MTP: chained head steps trained per anchor (drafts)
    steps: int = 2000
    minutes: float = 0.0  # stop after this much wall time too (0: steps only)
    batch: int = 4  # sequences per step
    anchors: int = 32  # anchors (blocks, chains) per sequence per step
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.01
    gamma: float = 0.0  # 0: default_gamma(drafted rows + 1)
    eval_every: int = 100
    save_every: int = 200
    eval_blocks: int = 512  # held-out anchors per estimate
    seed: int = 0
    # the loss's matmuls: "fp32", "bf16" (autocast, fp32 weights and optimizer state) or
    # "auto": bf16 on a GPU and on a CPU that multiplies bf16 natively (head_dtype's rule)
    precision: str = "auto"


class DraftTrainModel(nn.Module, ABC):
    """A drafter under training (module docstring); subclasses set `rows` and register their
    head through `scored_head` (which registers `t2d`: target id -> the drafter's logit column,
    -1 for an id it cannot score)."""

    rows: int
    t2d: Tensor
    draft_vocab: int | None = None  # the reduced draft vocabulary's size (None: the whole one)

    def scored_head(self, head: Tensor, vocab_ids: Tensor | None) -> Tensor:
        """The frozen head [vocab, H] cut to the draft vocabulary `vocab_ids` [V_d] (ascending;
        None: all ids), registering `t2d` and, for a reduced vocabulary, the checkpoint's `d2t`
        (models/heads/draft_vocab.py)."""
        vocab = head.shape[0]
        t2d = torch.arange(vocab)  # target id -> the drafter's logit column (-1: none)
        if vocab_ids is not None:
            self.draft_vocab = len(vocab_ids)
            head = head[vocab_ids].clone()
            t2d = torch.full((vocab,), -1, dtype=torch.int64)
            t2d[vocab_ids] = torch.arange(len(vocab_ids))
            # EAGLE-3's convention: column i is token i + d2t[i]; saved in the checkpoint
            self.register_buffer("d2t", vocab_ids - torch.arange(len(vocab_ids)))
        self.register_buffer("t2d", t2d, persistent=False)
        return head

    def vocab_json(self) -> dict[str, int]:
        """config.json's `draft_vocab_size` entry, if the vocabulary is reduced."""
        return {} if self.draft_vocab is None else {"draft_vocab_size": self.draft_vocab}

    @abstractmethod
    def rows_hidden(self, ids: Tensor, taps: Tensor, preds: Tensor, anchors: Tensor) -> Tensor:
        """ids, preds [S, T], taps [S, T, F], anchors [S, N] -> hidden [S, N, rows, H]."""

    @abstractmethod
    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden rows [..., H] -> logits [..., columns] fp32."""

    @abstractmethod
    def config_json(self, target_name: str, steps: int) -> dict[str, Any]:
        """The checkpoint's config.json (the layout the serving loader reads)."""

    def labels(
        self, ids: Tensor, preds: Tensor, anchors: Tensor, hi: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """-> labels (as logit columns; -1: a token the drafter cannot score), known
        [S, N, rows] (module docstring); `hi` [S]: each row's length (default T)."""
        t = ids.shape[1]
        at = anchors[:, :, None] + torch.arange(self.rows)  # a + j - 1
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
        hidden = self.rows_hidden(ids, taps, preds, anchors)  # [S, N, rows, H]
        logits = self.logits(hidden[known])  # [known rows, columns]
        weights = torch.exp(-torch.arange(self.rows, dtype=torch.float32) / gamma)
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
    def acceptance_length(self, corpus: TapCorpus, anchors: int, seed: int = 1) -> float:
        """The held-out AL estimate (module docstring) over `anchors` seeded random anchors."""
        per = max(1, anchors // max(1, len(corpus)))
        return 1.0 + float(self.step_rates(corpus, per, seed).cumprod(0).sum())

    @torch.no_grad()
    def step_rates(self, corpus: TapCorpus, per_row: int, seed: int = 1) -> Tensor:
        """c_j [rows] (module docstring) over `per_row` seeded random anchors in each row."""
        gen = torch.Generator().manual_seed(seed)
        hi_all = corpus.bounds()[1]
        hits = torch.zeros(self.rows)
        tries = torch.zeros(self.rows)
        for start in range(0, len(corpus), 4):
            rows = torch.arange(start, min(start + 4, len(corpus)))
            ids, taps, preds = corpus.ids[rows], corpus.taps[rows], corpus.preds[rows]
            at = corpus.anchors(rows, per_row, gen)
            labels, known = self.labels(ids, preds, at, hi_all[rows])
            hidden = self.rows_hidden(ids, taps, preds, at)
            right = torch.zeros_like(known)
            right[known] = self.logits(hidden[known]).argmax(-1) == labels[known]  # -1: never
            prefix = torch.cat([torch.ones_like(right[..., :1]), right[..., :-1]], -1).cumprod(-1)
            asked = known & prefix.bool()  # rows whose label is known and whose prefix was right
            tries += asked.flatten(0, 1).sum(0)
            hits += (asked & right).flatten(0, 1).sum(0)
        return torch.where(tries > 0, hits / tries.clamp(min=1), torch.zeros_like(hits))


PRECISIONS = ("auto", "fp32", "bf16")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype the loss runs its matmuls in under autocast (None: fp32, no autocast)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        native = device.type == "cuda" or head_dtype() == torch.bfloat16
        precision = "bf16" if native else "fp32"
    return torch.bfloat16 if precision == "bf16" else None


def _lr(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    done = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


def save_checkpoint(
    model: DraftTrainModel,
    optimizer: torch.optim.Optimizer,
    step: int,
    cfg: TrainConfig,
    out: Path,
    target_name: str,
) -> None:
    """The drafter in its serving layout (config.json + model.safetensors) and the trainer's
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


def load_checkpoint(model: DraftTrainModel, optimizer: torch.optim.Optimizer, out: Path) -> int:
    """Resume from `out`'s checkpoint: the step it had reached (0 if there is none)."""
    if not (out / TRAINER_STATE).is_file():
        return 0
    model.load_state_dict(load_file(str(out / CHECKPOINT)), strict=True)
    state = torch.load(out / TRAINER_STATE, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def train(
    model: DraftTrainModel,
    data: TapCorpus,
    held_out: TapCorpus,
    cfg: TrainConfig,
    out: Path,
    target_name: str,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Train `model` on `data` (module docstring), resuming from `out` when it holds a
    checkpoint; -> the log rows of this run (also appended to out/train_log.jsonl)."""
    gamma = cfg.gamma or default_gamma(model.rows + 1)
    device = next(model.parameters()).device
    fast = autocast_dtype(cfg.precision, device)
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
        with torch.autocast(device.type, dtype=fast, enabled=fast is not None):
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
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evaluate(step, sum(recent) / len(recent))
        # the batch's loss and row-1 accuracy, and the latest held-out AL estimate
        al = f"{log[-1]['al']:.2f}" if log else "-"
        bar.set_postfix(loss=f"{stats['loss']:.3f}", row1=f"{stats['row1_acc']:.2f}", al=al)
        if step % cfg.save_every == 0 or step == cfg.steps:
            save_checkpoint(model, optimizer, step, cfg, out, target_name)
    if not log or log[-1]["step"] != step:
        evaluate(step, sum(recent) / len(recent) if recent else float("nan"))
    save_checkpoint(model, optimizer, step, cfg, out, target_name)
    bar.close()
    return log
