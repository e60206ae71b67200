"""The step machinery for one target model, without threads: sequence -> scheduler -> cycle.

Stage: between the request API (engine.py's thread, or `stream` below for one request) and the
model. `step()` is the whole pipeline, read top-down:
    plan = scheduler.schedule()          who runs, tokens fed, drafts wanted (the policy)
    drafts = cycle.propose(plan)         one drafter.propose() per drafter, all jobs packed
    out = cycle.forward(plan, drafts)    ONE packed target forward over every row of the step
    verdicts = cycle.verify(...)         per request: accepted drafts + one recovered/bonus token
    planner.observe(...)                 what the step cost calibrates the policy's prices
    commit                               caches and drafters keep what was accepted; requests
                                         take their tokens; finished sequences leave
    prefix.extend                        newly committed whole blocks join the prefix cache
A failure before the commit leaves every sequence untouched, so the step's sequences are then
re-run one at a time and only the one that fails again is failed (its `error` set, the request
aborted); the others carry on. `step` returns the sequences that produced output or ended.

`stream(lm, request, speculation)` is a one-request run of the same machinery (`quickdraft
generate`, the speculation benchmark, tests): a request alone in the engine runs exactly this,
so there is one decode loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from dataclasses import dataclass

from quickdraft.config import PREFILL_CHUNK, PrefixCacheConfig
from quickdraft.engine.prefix_cache import PrefixCache, PrefixCacheStats
from quickdraft.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, StepPlan
from quickdraft.engine.sequence import Sequence
from quickdraft.engine.spec_cycle import SpecCycle, StepOutput
from quickdraft.image_encoder import EncoderStats, ImageEncoder
from quickdraft.loading import LoadedModel
from quickdraft.request import Request
from quickdraft.speculation.cost import StepShape, model_cost
from quickdraft.speculation.drafters.base import Draft
from quickdraft.speculation.logits import LogitControls
from quickdraft.speculation.relaxed import think_tokens
from quickdraft.speculation.sampling import TokenRng
from quickdraft.speculation.state import AnySpeculation
from quickdraft.speculation.verify import Verdict

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepStats:
    """Counters over the core's lifetime (read by metrics; never reset)."""

    steps: int = 0
    rows: int = 0  # target forward rows: prefill + decode + draft
    prefill_rows: int = 0
    draft_rows: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    relaxed: int = 0  # of those, kept only by relaxed thinking-phase acceptance
    emitted: int = 0  # tokens produced (before stop truncation)
    failed: int = 0  # requests failed by an error
    seconds: float = 0.0  # wall time inside step()
    last_batch: int = 0  # sequences in the last step
    max_batch: int = 0  # most sequences in one step
    prefix_cache: PrefixCacheStats | None = None  # the model's prefix cache (None: off)
    encoder: EncoderStats | None = None  # a vision-language model's image encoder (None: text)


class EngineCore:
    def __init__(
        self,
        lm: LoadedModel,
        config: SchedulerConfig | None = None,
        prefix_cache: PrefixCacheConfig | None = None,
    ) -> None:
        """`prefix_cache`: None or not enabled = no prefix cache."""
        self.lm = lm
        model = lm.model
        self.prefix = (
            PrefixCache(prefix_cache, model.device)
            if prefix_cache is not None and prefix_cache.enabled
            else None
        )
        self.scheduler = Scheduler(
            config or SchedulerConfig(),
            model.new_cache,
            lambda: model_cost(model),
            lm.context_length,
            self.prefix,
        )
        self.encoder = None if lm.vision is None else ImageEncoder(lm.vision)
        self.cycle = SpecCycle(model, think_tokens(lm.tokenizer), self.encoder)
        self.stats = StepStats(
            prefix_cache=None if self.prefix is None else self.prefix.stats,
            encoder=None if self.encoder is None else self.encoder.stats,
        )

    def add(self, request: Request, speculation: AnySpeculation | None) -> Sequence:
        params = request.params
        rng = TokenRng.for_params(params, self.lm.model.device)
        seq = Sequence(request, speculation, rng)
        if params.shapes_logits:
            matcher = None if params.grammar is None else self.lm.grammar_matcher(params.grammar)
            vocab = self.lm.model.config.vocab_size
            seq.controls = LogitControls(
                params, request.prompt_ids, vocab, matcher, self._encode_plain
            )
        self.scheduler.add(seq)
        return seq

    def _encode_plain(self, text: str) -> list[int]:
        """Text as the model would write it (grammar-forced drafts): no special tokens."""
        return self.lm.tokenizer.encode(text, add_special_tokens=False, parse_special=False)

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
        else:  # the step's work around its forwards prices drafting too (policy.py)
            self.scheduler.planner.observe_step(time.perf_counter() - t0)
        st = self.stats
        st.steps += 1
        st.rows += plan.num_rows
        st.last_batch = len(plan.items)
        st.max_batch = max(st.max_batch, st.last_batch)
        st.seconds += time.perf_counter() - t0
        return done

    def _run(self, plan: StepPlan) -> list[Sequence]:
        t0 = time.perf_counter()
        drafts = self.cycle.propose(plan)  # one drafter.propose() per drafter, jobs packed
        t1 = time.perf_counter()
        out = self.cycle.forward(plan, drafts)  # ONE packed target forward
        t2 = time.perf_counter()
        verdicts = self.cycle.verify(plan, drafts, out)  # accepted drafts + 1 token each
        timing = (t1 - t0, time.perf_counter() - t1)
        # the forward as it ran: drafters may return fewer drafts than asked
        rows = [item.num_tokens + len(d.tokens) for item, d in zip(plan.items, drafts, strict=True)]
        forward = StepShape(sum(rows), len(rows), sum(n > 1 for n in rows))
        drafted = [
            item.seq.spec
            for item, d in zip(plan.items, drafts, strict=True)
            if d.tokens and item.seq.spec is not None
        ]
        self.scheduler.planner.observe(forward, t2 - t1, drafted, t1 - t0)
        return self._commit(plan, drafts, verdicts, out, timing)

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
                self.cycle.commit(item, verdict, out, idx)
                if seq.prefix is not None:  # the cache now also holds the accepted drafts
                    assert self.prefix is not None and seq.cache is not None
                    tokens = seq.request.key_ids + (verdict.tokens if verdict else [])
                    self.prefix.extend(seq.prefix, tokens, seq.cache, seq.spec)
                if verdict is None:  # a prefill chunk: nothing to emit yet
                    self.stats.prefill_rows += item.num_tokens
                    continue
                if draft.tokens:  # wall time of the step phases this request took part in
                    seq.request.spec.draft_seconds += timing[0]
                seq.request.spec.verify_seconds += timing[1]
                self._account(item, len(draft.tokens), verdict, len(verdict.tokens))
                self.scheduler.postprocess(
                    item,
                    verdict.tokens,
                    len(draft.tokens),
                    verdict.accepted,
                    verdict.logprobs,
                    verdict.relaxed,
                )
            except Exception as exc:
                self._fail(seq, exc)
            done.append(seq)
        return done

    def _account(self, item: ScheduledSeq, drafted: int, verdict: Verdict, emitted: int) -> None:
        st = self.stats
        if not item.seq.request.output_ids:
            st.prefill_rows += item.num_tokens
        st.draft_rows += drafted
        st.accepted += verdict.accepted
        st.relaxed += verdict.relaxed
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


def stream(
    lm: LoadedModel,
    req: Request,
    speculation: AnySpeculation | None = None,
    core: EngineCore | None = None,
) -> Generator[str, None, None]:
    """Generate for `req`, yielding text deltas (stop-string safe) until it finishes; on
    `core` when given (its prefix cache then serves and keeps the request's blocks), else on
    a core of its own.

    Closing the generator early aborts the request and frees its caches and drafter state."""
    if core is None:
        core = EngineCore(lm, SchedulerConfig(max_running=1, max_step_tokens=PREFILL_CHUNK))
    seq = core.add(req, speculation)
    try:
        while not req.finished:
            core.step()
            delta = req.stream_delta()
            if delta:
                yield delta
        if seq.error is not None:
            raise seq.error
    finally:
        core.abort(seq)  # no-op when finished; marks a consumer that stopped early
