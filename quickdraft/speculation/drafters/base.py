"""The Drafter protocol: what every drafter (n-gram, draft model, MTP head, block drafter) does.

Per request, a drafter keeps a state object. The engine calls, per speculative cycle:
  propose([DraftJob(state, tokens, k, params, generator), ...]) -> [Draft, ...]
                                          guess up to k next tokens for each request of a step,
                                          batched where the drafter runs a model
  commit(state, tokens, hidden)           sync one request to its committed tokens
and free(state) when the request ends. `tokens` is always the full committed sequence
(prompt + output); a drafter trims or extends its own state to match it, so rejected guesses,
the target's recovered/bonus token and phases where speculation was off (k = 0) all resync the
same way, and no separate undo path exists.

Drafters that read the target's hidden states (MTP heads, block drafters) set
`needs_hidden = True`; the engine then asks the target for them and passes `hidden`
`[n, hidden_size]`: the target's post-final-norm hidden states of the n tokens that the target
just ran AND that were committed, i.e. positions [len(tokens) - 1 - n, len(tokens) - 1) (the
last committed token has not been through the target yet: it is the next cycle's first input).
After prefill n is the prompt length; after a verify it is accepted + 1. Every committed
position is passed exactly once, k = 0 cycles included, so the drafter's view never goes stale.
A drafter that reads inner layers instead (a DFlash block drafter) lists them in
`hidden_layers`; its rows are then those layers' outputs, concatenated in that order
`[n, len(hidden_layers) * hidden_size]`. For other drafters `hidden` is None.

Every drafter lists the shapes of the forwards its last `propose` ran in `forwards`
(`StepShape`s: rows, sequences, sequences with > 1 row), catch-ups included; the engine times
the draft phase against the drafter's cost table with them (speculation/cost.py `DraftCost`).
A lookup drafter runs none: its list stays empty.

A drafter whose per-request state is a function of the committed tokens alone (a draft model's
KV; an MTP head's KV and the target hidden rows it reads) also implements `PrefixDrafter`: the
prefix cache (engine/prefix_cache.py) keeps that state per token block beside the target's KV,
and a hit hands it to a new request, so the drafter skips that prefill too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from quickdraft.images import ImageLayout
from quickdraft.kernels.pointwise import greedy_pick
from quickdraft.models.base import KVBlock, SequenceCache
from quickdraft.request import SamplingParams
from quickdraft.speculation.cost import StepShape
from quickdraft.speculation.logits import LogitControls
from quickdraft.speculation.sampling import probabilities, sample


@dataclass(slots=True)
class DraftJob:
    """One request's share of a `propose` call."""

    state: Any
    tokens: list[int]  # the committed sequence (prompt + output)
    k: int  # drafts wanted, >= 1
    params: SamplingParams
    generator: torch.Generator
    controls: LogitControls | None = None  # the request's bias / penalties / grammar
    # stop after a draft whose chain probability (the drafter's, of the draft so far) is below
    # this (policy.py `Plan`; 0: draft all k); drafters that run a model per position read it
    min_prob: float = 0.0
    images: ImageLayout | None = None  # the prompt's images (drafters that read embeddings)
    # the target's cache of the request, committed (a drafter that reads the target's KV:
    # drafters/assistant.py); None where the caller has none (a warm-up, a shadow draft)
    target_cache: SequenceCache | None = None


@dataclass(slots=True)
class Draft:
    tokens: list[int]  # d_1..d_k proposed ids (len <= requested k; may be empty)
    p_draft: Tensor | None = None  # [len(tokens), vocab] draft distributions; None = one-hot


def draft_one(logits: Tensor, job: DraftJob, draft: tuple[list[int], list[Tensor]]) -> float:
    """Pick one draft token from a drafter's `logits` `[vocab]` row for `job` and append it to
    `draft` = (tokens, draft distributions): the argmax when greedy, else a sample from the
    job's sampling distribution (kept: rejection sampling needs p_draft). The request's logit
    controls shape the row first, as they will shape the target's. Returns the drafter's
    probability of the token when the job stops on it (`min_prob` > 0: the softmax of the
    shaped row when greedy, the sampling distribution's otherwise), else 1."""
    tokens, dists = draft
    if job.controls is not None:  # draft what the target may accept: the same shaping
        logits = job.controls.shape_next(logits[None], tokens)[0]
    if job.params.greedy:
        ids, probs = greedy_pick(logits[None], with_prob=job.min_prob > 0.0)
        tokens.append(int(ids[0]))
        return 1.0 if probs is None else float(probs[0])
    p_draft = probabilities(logits[None], job.params)  # [1, vocab]
    token = int(sample(p_draft, job.generator)[0])
    tokens.append(token)
    dists.append(p_draft[0])
    return float(p_draft[0, token]) if job.min_prob > 0.0 else 1.0


def draft_position(
    logits: Tensor,
    jobs: Sequence[DraftJob],
    active: Sequence[int],
    drafts: list[tuple[list[int], list[Tensor]]],
    chains: list[float],
) -> list[int]:
    """One draft position of a drafter that runs a forward per position: each job in `active`
    (indices into `jobs`; row r of `logits` is active[r]'s) drafts a token (`draft_one`) and
    multiplies its chain probability `chains[j]` by the token's. Returns the rows whose job
    drafts on: it wants more tokens and its chain is still >= its `min_prob`. The stop reads
    only the drafter's own guesses, so the target's verdicts keep their distribution."""
    still = []
    for row, j in enumerate(active):
        job, draft = jobs[j], drafts[j]
        chains[j] *= draft_one(logits[row], job, draft)
        if len(draft[0]) < job.k and chains[j] >= job.min_prob:
            still.append(row)
    return still


class Drafter(Protocol):
    needs_hidden: bool  # commit() gets the target's hidden states (see module docstring)
    # with needs_hidden: whether it keeps state over every committed position's rows (MTP,
    # EAGLE-3, DFlash: their own KV over them), so a prefix-cache hit needs its share of the
    # cached blocks; False: it reads only the newest row (the Gemma 4 assistant)
    hidden_history: bool
    # with needs_hidden: the target layers its rows are the outputs of; (): post-final-norm
    hidden_layers: tuple[int, ...]
    forwards: list[StepShape]  # the forwards of the last propose (see module docstring)

    def new_state(self, prompt_ids: list[int], tenant: str = "") -> Any:
        """A request's state; `tenant`: who sent it (a drafter that learns across requests
        shares what it learned only within one tenant, drafters/ngram.py)."""
        ...

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        """One Draft per job, in order (each with at most job.k tokens)."""
        ...

    def commit(self, state: Any, tokens: list[int], hidden: Tensor | None) -> None: ...

    def free(self, state: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class DraftBlock:
    """A drafter's share of one prefix-cache block: its model's KV of the block's tokens and,
    for a drafter that reads the target's hidden states, the target's hidden row of the block's
    last token `[hidden]` (what its row at that position needs besides the next token)."""

    kv: KVBlock
    hidden: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (0 if self.hidden is None else self.hidden.nbytes)


class PrefixDrafter(Protocol):
    """A drafter whose state the prefix cache keeps (see the module docstring)."""

    def export_block(self, state: Any, start: int, ids: Sequence[int]) -> DraftBlock | None:
        """Copies of what `state` holds for the committed tokens `ids` at positions
        [start, start + len(ids)), or None while it does not hold them (yet)."""
        ...

    def import_blocks(
        self, state: Any, tokens: list[int], blocks: Sequence[DraftBlock], block_size: int
    ) -> int:
        """A new request's `state` takes `blocks` (`block_size` tokens each) as the first
        committed tokens of `tokens` (no blocks: it only learns the block size, to keep what
        later exports need); returns how many committed tokens it has now seen."""
        ...
