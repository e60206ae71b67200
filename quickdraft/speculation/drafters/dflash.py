"""DFlash drafter: a block-diffusion drafter (z-lab) proposes a whole block of drafts in ONE
forward from the target's hidden states at a few tapped layers.

Per request the state holds the drafter's context (models/heads/dflash.py `ContextCache`): one K/V
entry per committed token, made from the target's outputs at `hidden_layers` for that token, and the
tap rows committed since the last propose:
  commit(tokens, hidden)   queue the tap rows of the newly committed positions
                           (`hidden` [n, len(taps) * H], positions [len - 1 - n, len - 1))
  propose(jobs)            the queued rows of every job become context entries (one packed
                           projection, committed), then ONE packed block forward: per job the
                           block [last committed token, MASK x (B - 1)] at its real positions,
                           B = min(block size, k + 1), non-causal inside the block, over the
                           job's context; its rows 1 .. B-1 give d_1 .. d_{B-1} (argmax, or
                           sampled with p_draft kept via `draft_one`, so logit controls and
                           rejection sampling stay exact). The block's K/V are written past the
                           context's committed length and never committed: the O(1) rollback.
The target then verifies d_1 .. d_{B-1} as a chain like any other draft. Context rows never
hold a guess (they come from committed tokens only), so nothing else ever rolls back.
`window` > 0 keeps a request's context to the last `window` committed tokens: a prompt longer
than that seeds it from its tail, and a block attends to that many entries at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from quickdraft.config import PREFILL_CHUNK
from quickdraft.kernels.gemm import Weight
from quickdraft.kernels.linear_bf16 import PanelWeight
from quickdraft.models.base import LanguageModel, module_of
from quickdraft.models.formats.loader import load_weights
from quickdraft.models.heads.dflash import ContextCache, DFlashConfig, DFlashModel
from quickdraft.models.heads.draft_vocab import (
    D2T,
    check_declared,
    first_ids,
    read_draft_vocabulary,
)
from quickdraft.speculation.cost import StepShape, settle
from quickdraft.speculation.drafters.base import Draft, DraftJob, draft_one

_FOREIGN = ("embed_tokens.", "lm_head.")  # a checkpoint's copies of the target's: unused


def _checkpoint_name(name: str) -> tuple[str, tuple[int | slice, ...]] | None:
    name = name.removeprefix("model.")
    return None if name.startswith(_FOREIGN) or name == D2T else (name, ())


def load_dflash(
    model: LanguageModel, path: str | Path, keep: int = 0, extra: Sequence[int] = ()
) -> DFlashModel:
    """The DFlash drafter in checkpoint dir `path` for target `model` (sharing its lm_head),
    checked against the target: a clear error for a checkpoint it cannot run. `keep` > 0
    (`--draft-vocab`): a checkpoint without its own draft vocabulary scores only ids
    [0, keep) and `extra`."""
    target = module_of(model)
    path = Path(path)
    cfg = DFlashConfig.from_dir(path)
    shape: Any = target.config
    layers = shape.num_hidden_layers
    if cfg.layers.hidden_size != shape.hidden_size:
        raise ValueError(
            f"{path}: DFlash hidden size {cfg.layers.hidden_size} != the target's "
            f"{shape.hidden_size}: it was trained for another model"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != layers:
        raise ValueError(
            f"{path}: DFlash drafter for a {cfg.num_target_layers}-layer target, this one has "
            f"{layers} layers"
        )
    if not all(0 <= t < layers for t in cfg.target_layer_ids):
        raise ValueError(
            f"{path}: target_layer_ids {list(cfg.target_layer_ids)} outside the target's "
            f"{layers} layers"
        )
    if not 0 <= cfg.mask_token_id < shape.vocab_size:
        raise ValueError(
            f"{path}: mask_token_id {cfg.mask_token_id} outside the target's vocabulary "
            f"({shape.vocab_size})"
        )
    files = sorted(path.glob("*.safetensors"))
    lm_head = cast(Weight, target.head)  # the target's operand (packed or not): shared
    drafter = DFlashModel(cfg, lm_head, model.dtype, model.device)
    load_weights(drafter, files, _checkpoint_name)
    if isinstance(lm_head, PanelWeight):  # the target runs packed: so does its drafter
        drafter.pack_()
    vocab_ids = read_draft_vocabulary(files, shape.vocab_size)
    if vocab_ids is not None:
        check_declared(path, cfg.draft_vocab_size, vocab_ids)
    elif 0 < keep < shape.vocab_size:
        vocab_ids = first_ids(keep, shape.vocab_size, extra)
    if vocab_ids is not None:
        drafter.restrict_vocab_(vocab_ids)
    return drafter


@dataclass(slots=True)
class DFlashState:
    cache: ContextCache  # context entries of committed tokens, positions [start, end)
    pending: list[Tensor] = field(default_factory=list)  # tap rows [n, taps * H] not run yet
    queued: int = 0  # rows in `pending`
    first: int = 0  # position of the first pending row


class DFlashDrafter:
    needs_hidden = True
    hidden_history = True

    def __init__(
        self,
        model: DFlashModel,
        embed: Callable[[Tensor], Tensor],  # the target's token embedding (raw, unscaled)
        block_size: int = 0,  # 0: the checkpoint's
        window: int = 0,  # context entries kept per request (0: every committed token)
    ) -> None:
        cfg = model.cfg
        if block_size == 1 or block_size < 0:
            raise ValueError(
                f"DFlash block size must be >= 2 (0: the checkpoint's), got {block_size}"
            )
        if window < 0:
            raise ValueError(f"DFlash context window must be >= 0 (0: all), got {window}")
        self.model, self.embed, self.window = model, embed, window
        self.block_size = block_size or cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.hidden_layers: tuple[int, ...] = cfg.target_layer_ids
        self.forwards: list[StepShape] = []  # the forwards of the last propose (drafters/base.py)

    def new_state(self, prompt_ids: list[int], tenant: str = "") -> DFlashState:
        # nothing crosses requests: the tenant does not matter
        capacity = len(prompt_ids) if not self.window else min(len(prompt_ids), self.window)
        return DFlashState(self.model.new_cache(capacity + 64))

    def commit(self, state: DFlashState, tokens: list[int], hidden: Tensor | None) -> None:
        assert hidden is not None, "the DFlash drafter needs the target's tapped hidden states"
        start = len(tokens) - 1 - hidden.shape[0]  # position of the first new row
        if not state.queued:
            state.first = state.cache.end
        assert start == state.first + state.queued, (
            f"hidden rows from position {start}, expected {state.first + state.queued}"
        )
        state.pending.append(hidden)
        state.queued += hidden.shape[0]
        if self.window and state.queued > 2 * self.window:  # a long k = 0 phase: keep the tail
            self._keep_tail(state)

    def _keep_tail(self, state: DFlashState) -> None:
        """Only the last `window` queued rows can ever be attended to: drop the rest."""
        rows = torch.cat(state.pending)[-self.window :]
        state.first += state.queued - rows.shape[0]
        state.pending, state.queued = [rows], rows.shape[0]

    def sync_context(self, states: list[DFlashState]) -> None:
        """Every state's queued rows -> context entries: one packed projection (long catch-ups
        chunk by chunk first, so that it stays small)."""
        ready: list[DFlashState] = []
        rows: list[Tensor] = []
        for s in states:
            if not s.queued:
                continue
            if self.window and s.queued > self.window:
                self._keep_tail(s)
            if s.first != s.cache.end:  # rows were dropped: the context restarts at the tail
                s.cache.restart(s.first)
            r = torch.cat(s.pending) if len(s.pending) > 1 else s.pending[0]
            s.pending.clear()
            s.queued = 0
            while r.shape[0] > PREFILL_CHUNK:
                self._project([s], [r[:PREFILL_CHUNK]])
                r = r[PREFILL_CHUNK:]
            ready.append(s)
            rows.append(r)
        if ready:
            self._project(ready, rows)

    def _project(self, states: list[DFlashState], rows: list[Tensor]) -> None:
        counts = [r.shape[0] for r in rows]
        self.model.extend_context(torch.cat(rows), [s.cache for s in states], counts)
        self.forwards.append(StepShape(sum(counts), len(counts), sum(n > 1 for n in counts)))

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        self.forwards = []
        states: list[DFlashState] = [job.state for job in jobs]
        self.sync_context(states)
        sizes = [min(self.block_size, job.k + 1) for job in jobs]
        ids: list[int] = []
        logit_rows: list[int] = []
        for s, job, size in zip(states, jobs, sizes, strict=True):
            assert s.cache.end == len(job.tokens) - 1, "propose() without the last commit()"
            logit_rows.extend(range(len(ids) + 1, len(ids) + size))
            ids.extend([job.tokens[-1], *[self.mask_token_id] * (size - 1)])
        device = self.model.device
        blocks = self.embed(torch.tensor(ids, device=device))  # [NB, H]
        logits = self.model(
            blocks,
            [s.cache for s in states],
            sizes,
            torch.tensor(logit_rows, device=device),
            self.window,
        )  # [sum(sizes) - len(jobs), vocab]; the blocks' K/V stay uncommitted
        self.forwards.append(StepShape(len(ids), len(jobs), len(jobs)))
        drafts: list[Draft] = []
        row = 0
        for job, size in zip(jobs, sizes, strict=True):
            draft: tuple[list[int], list[Tensor]] = ([], [])
            for _ in range(size - 1):  # rows of one forward: d_i does not see d_{i-1}
                draft_one(logits[row], job, draft)
                row += 1
            tokens, dists = draft
            drafts.append(Draft(tokens, torch.stack(dists) if dists else None))
        return drafts

    def free(self, state: DFlashState) -> None:
        state.pending.clear()
        state.queued = 0


def dflash_drafter(
    model: LanguageModel,
    path: str | Path,
    block_size: int = 0,
    window: int = 0,
    keep: int = 0,
    extra: Sequence[int] = (),
) -> DFlashDrafter:
    """The drafter for target `model` from the DFlash checkpoint dir `path` (`keep`, `extra`:
    as load_dflash)."""
    drafter = load_dflash(model, path, keep, extra)
    embed = module_of(model).get_submodule("model.embed_tokens")
    return DFlashDrafter(drafter, embed, block_size, window)


def block_step_seconds(drafter: DFlashDrafter, context: int = 16, reps: int = 3) -> float:
    """Seconds of one single-request block forward (block size rows) over `context` entries
    (best of reps)."""
    model = drafter.model
    cache = model.new_cache(context + drafter.block_size)
    taps = len(drafter.hidden_layers) * model.cfg.layers.hidden_size
    model.extend_context(torch.randn(context, taps, device=model.device), [cache], [context])
    ids = torch.full((drafter.block_size,), drafter.mask_token_id, device=model.device)
    rows = torch.arange(1, drafter.block_size, device=model.device)
    best = float("inf")
    for _ in range(reps + 1):
        t = time.perf_counter()
        model(drafter.embed(ids), [cache], [drafter.block_size], rows, drafter.window)
        settle(model.device)
        best = min(best, time.perf_counter() - t)
    return best
