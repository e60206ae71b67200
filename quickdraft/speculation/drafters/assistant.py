"""Gemma 4 assistant drafter: the small model Gemma 4 ships beside each target
(models/heads/gemma4_assistant.py) proposes k tokens, chained, over the target's own KV.

Per request the state is one row: the target's post-norm hidden state of the position before
the last committed token (`commit` keeps the last row it is handed). `propose` runs, for every
job at once, one assistant step per draft position: the first reads (the target's embedding of
the last committed token, that hidden row), each later one (the embedding of the token just
drafted, the previous step's projected output); all at the last committed token's position L,
attending to the target's committed KV rows [0, L), read in place from the request's target
cache (`DraftJob.target_cache`). Nothing is written anywhere, so there is nothing to roll
back: after a verify the next propose reads the target's cache as committed.
vLLM runs these checkpoints as method "mtp" with the assistant as the model; so does
`--speculative-method mtp --draft-model ASSISTANT_DIR` here, and `assistant` names it too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from quickdraft.models.base import LanguageModel, module_of
from quickdraft.models.caches.kv_cache import GroupedKVCache
from quickdraft.models.heads.gemma4_assistant import Gemma4Assistant, load_assistant
from quickdraft.speculation.cost import StepShape, settle
from quickdraft.speculation.drafters.base import Draft, DraftJob, draft_position


@dataclass(slots=True)
class AssistantState:
    hidden: Tensor | None = None  # [backbone] the target's row of position `at`
    at: int = -1


class AssistantDrafter:
    needs_hidden = True
    hidden_history = False  # the newest row only: prefix-cache hits need nothing
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, head: Gemma4Assistant) -> None:
        self.head = head
        self.forwards: list[StepShape] = []

    def new_state(self, prompt_ids: list[int], tenant: str = "") -> AssistantState:
        return AssistantState()

    def commit(self, state: AssistantState, tokens: list[int], hidden: Tensor | None) -> None:
        assert hidden is not None, "the assistant reads the target's hidden states"
        state.hidden, state.at = hidden[-1], len(tokens) - 2

    def _step(
        self, ids: list[int], hidden: Tensor, caches: list[GroupedKVCache], rows: list[int]
    ) -> tuple[Tensor, Tensor]:
        embeds = self.head.embed_target(torch.tensor(ids, device=self.head.device))
        self.forwards.append(StepShape(len(ids), len(ids), 0))
        logits, back = self.head(embeds, hidden, caches, rows)
        return logits, back

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        self.forwards = []
        caches: list[GroupedKVCache] = []
        rows, hidden = [], []
        for job in jobs:
            state, cache = job.state, job.target_cache
            assert isinstance(cache, GroupedKVCache), "the target's cache rides on the job"
            committed = len(job.tokens) - 1  # KV rows the target holds: all but the last token
            assert cache.length == committed and state.at == committed - 1, (
                f"target KV {cache.length}, hidden at {state.at}, {len(job.tokens)} tokens"
            )
            assert state.hidden is not None
            caches.append(cache)
            rows.append(committed)
            hidden.append(state.hidden)
        logits, back = self._step(
            [job.tokens[-1] for job in jobs], torch.stack(hidden), caches, rows
        )
        drafts: list[tuple[list[int], list[Tensor]]] = [([], []) for _ in jobs]
        chains = [1.0] * len(jobs)
        active = list(range(len(jobs)))  # jobs whose row is in `logits` / `back`
        while True:
            still = draft_position(logits, jobs, active, drafts, chains)
            if not still:
                break
            active = [active[r] for r in still]
            logits, back = self._step(
                [drafts[j][0][-1] for j in active],
                back[still],
                [caches[j] for j in active],
                [rows[j] for j in active],
            )
        return [Draft(d, torch.stack(p) if p else None) for d, p in drafts]

    def free(self, state: AssistantState) -> None:
        state.hidden = None


def assistant_drafter(
    model: LanguageModel, path: str | Path, quantization: str = "none"
) -> AssistantDrafter:
    """The drafter for Gemma 4 target `model` from the assistant at `path` (a checkpoint dir
    or llama.cpp's GGUF; its weights in `quantization`, models/heads/gemma4_assistant.py
    `load_assistant`); a clear error for another target or an assistant made for another
    Gemma 4."""
    return AssistantDrafter(load_assistant(module_of(model), path, quantization))


def assistant_step_seconds(drafter: AssistantDrafter, context: int = 16, reps: int = 3) -> float:
    """Seconds of one single-row assistant step over `context` target rows (best of reps)."""
    head = drafter.head
    cache = head.target_cache(context)
    cache.reserve(context)
    for group in cache.groups:
        group.k.zero_()
        group.v.zero_()
    cache.commit(context)
    hidden = torch.zeros(1, head.hidden_size, dtype=head.dtype, device=head.device)
    args: Any = ([0], hidden, [cache], [context])
    drafter._step(*args)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        drafter._step(*args)
        settle(head.device)
        best = min(best, time.perf_counter() - t)
    drafter.forwards = []
    return best
