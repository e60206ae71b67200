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
  3. draft rows: the speculation policy (speculation/policy.py) picks each decoding request's
     k from its running acceptance and what the step's forward already holds; draft rows live
     in the same budget, and a sequence drafts only once it has its first output token.
A chunk that feeds a sequence's last pending token (sequence.py) samples the next one.
With a prefix cache (prefix_cache.py), admission copies the prompt's cached blocks into the new
cache first, so prefill starts after them; a hybrid target's prompt chunks end at its state
snapshot boundaries; a sequence that leaves unlocks its blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from quickdraft.config import PREFILL_CHUNK
from quickdraft.engine.prefix_cache import PrefixCache
from quickdraft.engine.sequence import SeqStatus, Sequence
from quickdraft.models.base import SequenceCache
from quickdraft.request import Request, TokenLogprob
from quickdraft.speculation.cost import StepCost, StepShape
from quickdraft.speculation.policy import Decoding, DraftPlanner


def _committed(req: Request) -> Callable[[], list[int]]:
    """`req`'s committed tokens, built when asked (only a scored lookup's peek asks)."""
    return lambda: req.all_ids


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running: int = 16  # sequences in the running batch (each holds its KV cache)
    max_step_tokens: int = PREFILL_CHUNK  # rows of one forward: decodes, drafts, prefill chunks
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


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # committed tokens fed this step (prefill chunk or the 1 decode token)
    k: int = 0  # drafts wanted (the drafter may return fewer)
    min_prob: float = 0.0  # stop drafting below this chain probability (policy.py `Plan`)
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
        prefix: PrefixCache | None = None,
    ) -> None:
        self.config = config
        self.new_cache = new_cache
        self.prefix = prefix  # the model's prefix cache (None: off)
        self.context_length = context_length
        self.planner = DraftPlanner(step_cost)  # measures the cost only when asked to price
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
                plan.items.append(ScheduledSeq(seq, self._chunk(seq, prefill)))
                prefill -= plan.items[-1].num_tokens
        deferred: list[Sequence] = []
        while self.waiting and len(self.running) < cfg.max_running and prefill > 0:
            seq = self.waiting.popleft()
            if self._follows_a_prefill(seq):
                deferred.append(seq)
                continue
            self._admit(seq)
            plan.items.append(ScheduledSeq(seq, self._chunk(seq, prefill)))
            prefill -= plan.items[-1].num_tokens
        self.waiting.extendleft(reversed(deferred))  # in arrival order, at the front
        budget = cfg.max_step_tokens - plan.num_rows
        self._choose_drafts(plan, budget)
        return plan

    def _follows_a_prefill(self, seq: Sequence) -> bool:
        """Whether `seq`'s prompt starts with a block that a running sequence of the same
        tenant is still prefilling: it then waits for that prefill and copies the blocks from
        the prefix cache instead of computing them a second time (n choices of one request, a
        burst of requests with one system prompt)."""
        if self.prefix is None or seq.request.params.reads_every_prompt_row:
            return False
        req, size = seq.request, self.prefix.size
        if len(req.prompt_ids) <= size:
            return False
        head = req.prompt_keys[:size]
        return any(
            s.pending > 1
            and not s.request.output_ids
            and s.request.tenant == req.tenant
            and s.request.prompt_keys[:size] == head
            for s in self.running
        )

    def _admit(self, seq: Sequence) -> None:
        req, speculation = seq.request, seq.speculation
        k_max = speculation.config.num_draft_tokens if speculation else 0
        seq.cache = self.new_cache(len(req.prompt_ids) + req.params.max_tokens + k_max + 1)
        if speculation is not None:
            seq.spec = speculation.start(req.prompt_ids, req.tenant)
            req.spec.method = speculation.config.method
        # cached blocks of the prompt are not prefilled, unless every prompt row must run
        if self.prefix is not None and not req.params.reads_every_prompt_row:
            seq.prefix = self.prefix.admit(
                req.prompt_ids, seq.cache, seq.spec, req.tenant, req.prompt_keys
            )
            seq.cached_tokens = seq.prefix.cached_tokens
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Prompt rows `seq` feeds this step: its pending rows within `budget` (up to a state
        snapshot boundary of the prefix cache's), an image whose rows attend both ways never
        cut (images.py `ImageLayout.chunk`: it may take the step past `budget`)."""
        rows = min(seq.pending, budget)
        if self.prefix is not None and seq.cache is not None:
            rows = self.prefix.chunk(seq.cache, seq.num_computed, rows)
        images = seq.request.images
        return rows if images is None else images.chunk(seq.num_computed, rows)

    def _choose_drafts(self, plan: StepPlan, budget: int) -> None:
        decoding = [i for i in plan.items if i.num_tokens == 1 and i.samples]
        views = []
        for item in decoding:
            seq, req = item.seq, item.seq.request
            room = min(
                req.params.max_tokens - len(req.output_ids),
                self.context_length - seq.num_computed,
            )
            committed, greedy = _committed(req), req.params.greedy
            views.append(Decoding(seq.spec, seq.decoding, room, seq.num_tokens, committed, greedy))
        masked = sum(i.num_tokens > 1 for i in plan.items)  # prefill chunks
        base = StepShape(plan.num_rows, len(plan.items), masked)
        for item, chosen in zip(decoding, self.planner.choose(views, base, budget), strict=True):
            item.k, item.min_prob = chosen.k, chosen.min_prob

    def postprocess(
        self,
        item: ScheduledSeq,
        tokens: list[int],
        drafted: int,
        accepted: int,
        logprobs: list[TokenLogprob] | None = None,
        relaxed: int = 0,
    ) -> None:
        """The sequence of `item` takes its step's tokens (empty for a mid-prefill chunk), with
        their logprobs if the request reports them; `relaxed`: accepted drafts only relaxed
        acceptance kept."""
        seq = item.seq
        if not tokens:
            return
        req = seq.request
        cycle = bool(req.output_ids)  # a verify cycle (the first token comes from prefill)
        if cycle:
            spec = seq.spec  # which drafter drafted, where a request has several
            name = spec.arm.name if spec is not None and len(spec.arms) > 1 else ""
            req.spec.record(drafted, accepted, relaxed, name)
        req.append(tokens, logprobs)
        if cycle and seq.spec is not None:
            seq.spec.record(drafted, accepted, item.k > 0, seq.num_tokens, tokens)
        if req.finished:
            self.release(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancel: the request ends (reason abort unless it already finished) and leaves."""
        seq.request.abort()
        if seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Leave the batch, unlock its prefix-cache blocks and free the KV cache and the
        drafter state (idempotent)."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        cursor, seq.prefix = seq.prefix, None
        try:
            if cursor is not None:
                assert self.prefix is not None
                failed = seq.error is not None
                self.prefix.leave(cursor, seq.spec, failed)
        finally:
            if seq.spec is not None:
                seq.spec.free()
            seq.cache, seq.spec = None, None
            seq.status = SeqStatus.FINISHED
