"""Scheduler stage of continuous batching: which sequences run this step, with how many tokens.

Contract (nano-vllm's shape; vLLM's vocabulary: "the scheduler produces {request: num_tokens}"):
  add(seq)            a new request waits (FIFO)
  schedule()          -> StepPlan: per running sequence the committed tokens it feeds this step
                      (its whole pending token when decoding, a chunk when prefilling) and the
                      drafts it may add (k, from the speculation policy)
  postprocess(...)    a sequence takes the tokens its step produced; telemetry, acceptance
  abort(seq)          cancel: leaves at once, its cache and drafter state are freed
Finished sequences leave the running batch in `postprocess`, freeing their caches, so a
request that ends (or is cancelled) never costs another step.

One step's rows (the token budget `max_step_tokens`) are spent in this order:
  1. every decoding sequence: 1 row (its last committed token, not yet through the target);
  2. prefill chunks: sequences already admitted first, then waiting ones in arrival order while
     there are free seats (`max_running`). While others decode, prefill takes at most
     `max_prefill_with_decodes` rows per step, so a long prompt does not stall running decodes
     (it costs them one longer step per chunk instead of one very long step);
  3. draft rows: the policy (quickdraft/policy.py) picks each decoding request's k from its
     running acceptance and what the step's forward already holds; draft rows live in the same
     budget, and a sequence drafts only once it has its first output token.
A sequence's pending tokens are `all_ids[cache.length:]`: the rest of the prompt while
prefilling, exactly one token (the last committed) while decoding. So prefill and decode are the
same operation, and a chunk that feeds the last pending token samples the next one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from torch import Tensor

from quickdraft.models.base import SequenceCache
from quickdraft.policy import (
    Acceptance,
    BatchPolicy,
    Candidate,
    DraftCost,
    StepCost,
    StepShape,
    forced_drafts,
)
from quickdraft.request import Request
from quickdraft.sampling import TokenRng

if TYPE_CHECKING:
    from quickdraft.speculate import Speculation


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running: int = 16  # sequences in the running batch (each holds its KV cache)
    max_step_tokens: int = 512  # rows of one target forward: decodes + drafts + prefill chunks
    max_prefill_with_decodes: int = 64  # prefill rows per step while other sequences decode

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_step_tokens < self.max_running:
            raise ValueError(
                f"max_step_tokens ({self.max_step_tokens}) must cover one row per running "
                f"sequence (max_running {self.max_running})"
            )
        if self.max_prefill_with_decodes < 1:
            raise ValueError(
                f"max_prefill_with_decodes must be >= 1, got {self.max_prefill_with_decodes}"
            )


class SeqStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the engine: its caches, drafter state and acceptance estimate."""

    request: Request
    spec: Speculation | None
    rng: TokenRng
    acceptance: Acceptance = field(default_factory=Acceptance)
    status: SeqStatus = SeqStatus.WAITING
    cache: SequenceCache | None = None  # allocated on admission, dropped when it leaves
    draft_state: Any = None
    prompt_hidden: list[Tensor] = field(default_factory=list)  # prefill chunks' hidden rows
    synced: int = 0  # committed tokens the drafter has seen (catch-up estimate, policy.py)
    error: BaseException | None = None  # why the request failed, if it did

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.request.output_ids)

    @property
    def num_computed(self) -> int:
        """Committed tokens whose KV is in the cache."""
        return 0 if self.cache is None else self.cache.length

    @property
    def pending(self) -> int:
        """Committed tokens not yet run through the target (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def decoding(self) -> bool:
        return self.pending == 1 and bool(self.request.output_ids)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # committed tokens fed this step (prefill chunk or the 1 decode token)
    k: int = 0  # drafts wanted (the drafter may return fewer)
    samples: bool = field(init=False)  # feeds the last pending token: produces the next one

    def __post_init__(self) -> None:
        assert 0 < self.num_tokens <= self.seq.pending
        self.samples = self.num_tokens == self.seq.pending


@dataclass(slots=True)
class StepPlan:
    items: list[ScheduledSeq] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(i.num_tokens + i.k for i in self.items)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        new_cache: Callable[[int], SequenceCache],
        step_cost: Callable[[], StepCost],
        context_length: int,
    ) -> None:
        self.config = config
        self.new_cache = new_cache
        self.step_cost = step_cost  # measured lazily: only speculating requests need it
        self.context_length = context_length
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._policy: BatchPolicy | None = None

    @property
    def has_policy(self) -> bool:
        """Whether the policy (and so the measured step cost) exists: only once an adaptive
        request has decoded."""
        return self._policy is not None

    @property
    def policy(self) -> BatchPolicy:
        if self._policy is None:
            self._policy = BatchPolicy(self.step_cost())
        return self._policy

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        cfg = self.config
        budget = cfg.max_step_tokens
        plan = StepPlan()
        decodes = [s for s in self.running if s.pending == 1]
        for seq in decodes[:budget]:
            plan.items.append(ScheduledSeq(seq, 1))
        budget -= len(plan.items)
        prefill = min(budget, cfg.max_prefill_with_decodes) if plan.items else budget
        for seq in self.running:
            if prefill <= 0:
                break
            if seq.pending > 1:
                plan.items.append(ScheduledSeq(seq, min(seq.pending, prefill)))
                prefill -= plan.items[-1].num_tokens
        while self.waiting and len(self.running) < cfg.max_running and prefill > 0:
            seq = self.waiting.popleft()
            self._admit(seq)
            plan.items.append(ScheduledSeq(seq, min(seq.pending, prefill)))
            prefill -= plan.items[-1].num_tokens
        budget = cfg.max_step_tokens - plan.num_rows
        self._choose_drafts(plan, budget)
        return plan

    def _admit(self, seq: Sequence) -> None:
        req = seq.request
        k_max = seq.spec.config.num_draft_tokens if seq.spec else 0
        seq.cache = self.new_cache(len(req.prompt_ids) + req.params.max_tokens + k_max + 1)
        if seq.spec is not None:
            seq.draft_state = seq.spec.drafter.new_state(req.prompt_ids)
            req.spec.method = seq.spec.config.method
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _choose_drafts(self, plan: StepPlan, budget: int) -> None:
        decoding = [i for i in plan.items if i.num_tokens == 1 and i.samples]
        if not any(i.seq.spec is not None for i in decoding):
            return
        drafters: dict[int, int] = {}  # id(drafter) -> index into draft_costs
        draft_costs: list[DraftCost | None] = [None]  # index 0: no drafter
        cands = []
        for item in decoding:
            seq, spec = item.seq, item.seq.spec
            k_max = d = room = 0
            if spec is not None and seq.decoding:
                req = seq.request
                room = min(
                    req.params.max_tokens - len(req.output_ids),
                    self.context_length - seq.num_computed,
                )
                k_max = max(0, min(spec.config.num_draft_tokens, room - 1))
                d = drafters.setdefault(id(spec.drafter), len(draft_costs))
                if d == len(draft_costs):
                    draft_costs.append(spec.draft_cost)
            adaptive = spec is None or spec.config.adaptive
            catch_up = seq.num_tokens - seq.synced
            cands.append(Candidate(seq.acceptance, k_max, adaptive, d, catch_up, room))
        if any(c.adaptive for c in cands):
            masked = sum(i.num_tokens > 1 for i in plan.items)  # prefill chunks
            base = StepShape(plan.num_rows, len(plan.items), masked)
            ks = self.policy.choose(cands, draft_costs, base, budget)
        else:  # only forced requests: no cost model needed (and none measured)
            ks, _ = forced_drafts(cands, budget)
        for item, k in zip(decoding, ks, strict=True):
            item.k = k

    def postprocess(
        self, item: ScheduledSeq, tokens: list[int], drafted: int, accepted: int
    ) -> None:
        """The sequence of `item` takes its step's tokens (empty for a mid-prefill chunk)."""
        seq = item.seq
        if not tokens:
            return
        req = seq.request
        if req.output_ids:  # a verify cycle (the first token comes from prefill, not a cycle)
            req.spec.record(drafted, accepted)
            seq.acceptance.update(drafted, accepted)
        req.append(tokens)
        if item.k:
            # Its drafter ran this step: it has seen every committed token but the newest,
            # and after an all-accepted cycle not the last draft either (a draft model feeds
            # d_1..d_{k-1}).
            seq.synced = seq.num_tokens - (2 if 0 < drafted == accepted else 1)
        if req.finished:
            self.release(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancel: the request ends (reason abort unless it already finished) and leaves."""
        seq.request.abort()
        if seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Leave the batch and free the KV cache and the drafter state (idempotent)."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        if seq.spec is not None and seq.draft_state is not None:
            seq.spec.drafter.free(seq.draft_state)
        seq.cache, seq.draft_state = None, None
        seq.prompt_hidden.clear()
        seq.status = SeqStatus.FINISHED
