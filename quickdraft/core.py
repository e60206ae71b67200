"""The step machinery for one target model, without threads: sequence -> scheduler -> runner.

Stage: between the request API (engine.py's thread, or generate.stream for one request) and the
model. `step()` is the whole pipeline, read top-down:
    plan = scheduler.schedule()          who runs, tokens fed, drafts wanted (policy.py)
    drafts = runner.propose(plan)        one drafter.propose() per drafter, all jobs packed
    out = runner.forward(plan, drafts)   ONE packed target forward over every row of the step
    verdicts = runner.verify(...)        per request: accepted drafts + one recovered/bonus token
    commit                               caches and drafters keep what was accepted; requests
                                         take their tokens; finished sequences leave
A failure before the commit leaves every sequence untouched, so the step's sequences are then
re-run one at a time and only the one that fails again is failed (its `error` set, the request
aborted); the others carry on. `step` returns the sequences that produced output or ended.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quickdraft.drafters.base import Draft
from quickdraft.request import Request
from quickdraft.runner import ModelRunner, StepOutput
from quickdraft.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, Sequence, StepPlan
from quickdraft.verify import Verdict

if TYPE_CHECKING:
    from quickdraft.generate import LoadedModel
    from quickdraft.speculate import Speculation

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepStats:
    """Counters over the core's lifetime (read by metrics; never reset)."""

    steps: int = 0
    rows: int = 0  # target forward rows: prefill + decode + draft
    prefill_rows: int = 0
    draft_rows: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    emitted: int = 0  # tokens produced (before stop truncation)
    failed: int = 0  # requests failed by an error
    seconds: float = 0.0  # wall time inside step()
    last_batch: int = 0  # sequences in the last step
    max_batch: int = 0  # most sequences in one step


class EngineCore:
    def __init__(self, lm: LoadedModel, config: SchedulerConfig | None = None) -> None:
        self.lm = lm
        self.scheduler = Scheduler(
            config or SchedulerConfig(), lm.model.new_cache, lm.step_cost, lm.context_length
        )
        self.runner = ModelRunner(lm.model)
        self.stats = StepStats()

    def add(self, request: Request, spec: Speculation | None) -> Sequence:
        seq = Sequence(request, spec, request.params.rng(self.lm.model.device))
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[Sequence]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()  # who runs, tokens fed, drafts wanted
        if not plan.items:
            return []
        try:
            done = self._run(plan)
        except Exception as exc:  # nothing committed yet: find the culprit by running alone
            done = self._isolate(plan, exc)
        st = self.stats
        st.steps += 1
        st.rows += plan.num_rows
        st.last_batch = len(plan.items)
        st.max_batch = max(st.max_batch, st.last_batch)
        st.seconds += time.perf_counter() - t0
        return done

    def _run(self, plan: StepPlan) -> list[Sequence]:
        t0 = time.perf_counter()
        drafts = self.runner.propose(plan)  # one drafter.propose() per drafter, jobs packed
        t1 = time.perf_counter()
        out = self.runner.forward(plan, drafts)  # ONE packed target forward
        t2 = time.perf_counter()
        verdicts = self.runner.verify(plan, drafts, out)  # accepted drafts + 1 token each
        timing = (t1 - t0, time.perf_counter() - t1)
        self._observe(plan, drafts, t1 - t0, t2 - t1)
        return self._commit(plan, drafts, verdicts, out, timing)

    def _observe(
        self, plan: StepPlan, drafts: list[Draft], draft_s: float, forward_s: float
    ) -> None:
        """Feed the policy what this step cost (once it exists: only adaptive speculating
        requests create it): the target forward's time for its actual shape (drafters may
        return fewer drafts than asked), which calibrates the step-cost table; and, when one
        drafter with a cost drafted, the draft phase's time against the forwards it ran
        (`drafter.forwards`), which calibrates that drafter's table."""
        if not self.scheduler.has_policy:
            return  # (only forced requests so far: they never read costs)
        shape = [
            item.num_tokens + len(d.tokens) for item, d in zip(plan.items, drafts, strict=True)
        ]
        rows, masked = sum(shape), sum(n > 1 for n in shape)
        self.scheduler.policy.observe(rows, len(shape), masked, forward_s)
        specs = {
            id(item.seq.spec): item.seq.spec
            for item, draft in zip(plan.items, drafts, strict=True)
            if draft.tokens and item.seq.spec is not None and item.seq.spec.draft_cost is not None
        }
        if len(specs) == 1:
            (spec,) = specs.values()
            assert spec.draft_cost is not None
            spec.draft_cost.observe(getattr(spec.drafter, "forwards", ()), draft_s)

    def _commit(
        self,
        plan: StepPlan,
        drafts: list[Draft],
        verdicts: list[Verdict | None],
        out: StepOutput,
        timing: tuple[float, float],
    ) -> list[Sequence]:
        """Per sequence (a failure here fails that sequence only): the cache and the drafter
        keep what was accepted, the request takes its tokens, finished sequences leave."""
        done = []
        for idx, (item, draft, verdict) in enumerate(
            zip(plan.items, drafts, verdicts, strict=True)
        ):
            seq = item.seq
            try:
                self.runner.commit(item, verdict, out, out.row_start[idx])
                if verdict is None:  # a prefill chunk: nothing to emit yet
                    self.stats.prefill_rows += item.num_tokens
                    continue
                if draft.tokens:  # wall time of the step phases this request took part in
                    seq.request.spec.draft_seconds += timing[0]
                seq.request.spec.verify_seconds += timing[1]
                self._account(item, len(draft.tokens), verdict.accepted, len(verdict.tokens))
                self.scheduler.postprocess(
                    item, verdict.tokens, len(draft.tokens), verdict.accepted
                )
            except Exception as exc:
                self._fail(seq, exc)
            done.append(seq)
        return done

    def _account(self, item: ScheduledSeq, drafted: int, accepted: int, emitted: int) -> None:
        st = self.stats
        if not item.seq.request.output_ids:
            st.prefill_rows += item.num_tokens
        st.draft_rows += drafted
        st.accepted += accepted
        st.emitted += emitted

    def _isolate(self, plan: StepPlan, exc: Exception) -> list[Sequence]:
        if len(plan.items) == 1:
            self._fail(plan.items[0].seq, exc)
            return [plan.items[0].seq]
        log.warning(
            "a batched step failed (%s); re-running its %d sequences alone", exc, len(plan.items)
        )
        done = []
        for item in plan.items:
            try:
                done += self._run(StepPlan([item]))
            except Exception as solo_exc:
                self._fail(item.seq, solo_exc)
                done.append(item.seq)
        return done

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        log.error("request %s failed: %r", seq.request.id, exc, exc_info=exc)
        seq.error = exc
        self.stats.failed += 1
        self.scheduler.abort(seq)
