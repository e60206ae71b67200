"""Speculation policy: per step and per decoding request, how many tokens to draft (k >= 0).

Stage: called by the scheduler once per step with every request that decodes this step. It sees
the whole batch, because the price of a draft row depends on what else is in the forward: the
target streams its weights once per forward, so at batch 1 a few extra rows are nearly free,
while at batch 8 the forward already has 8 rows and each draft row pushes it further into the
compute-bound regime (bench/kernels.py: M = 1, 2, 5, 9 rows cost 1.89, 1.70, 2.21, 4.53 ms on
one 17920x1536 weight).

The rule (documented here, implemented in `BatchPolicy.choose`):

* Cost. `StepCost` is measured at start-up: seconds of one target forward over M packed rows
  (M = 1..64, interpolated between measured points, extrapolated linearly beyond), plus what
  each further sequence costs (attention and cache writes run per sequence) and what a
  sequence with more than one row costs over a one-row one: its attention needs a causal mask
  (measured ~4 ms per such sequence per step here, as much as a few extra rows of a small
  model). A drafter with a model (`DraftCost`) has its own table, timed the same way at
  start-up: the draft model packs the requests drafting a j-th token into one forward per
  position j, of n_j rows over n_j sequences, and its first forward also feeds what it has not
  seen (the target's token, plus the last draft after an all-accepted cycle: 2 rows, masked).
  Scaling the target's curve by the draft's 1-row cost instead underrated the draft phase by
  ~50% at batch 4 (0.5B int4 draft of the 1.5B: its curve is steeper). The n-gram drafter is
  free.
* Calibration. The start-up table is a few timed forwards on a machine that may be shared: it
  was seen off by 20% and more (8 decode rows of 8 sequences predicted 319 ms, measured 254
  ms; `per_seq` 64 ms in one start-up, 0 in the next), more than the margin a draft decision
  is made on. So every step's target forward is timed (core.py) and the policy scales the
  table by a running ratio measured / predicted (`Calibration`): per step shape (rows,
  sequences, masked sequences), shrunk towards the overall ratio, so a shape never run follows
  the machine's overall speed. A shape the table underrates gets chosen, measured and
  corrected, which is the direction that matters for never being slower. The draft phase is
  timed too, and a drafter's table scaled by its measured / predicted ratio (`DraftCost`).
* Catch-up. A draft model must have fed every committed token before it drafts: a request that
  starts drafting (its first draft, or after a k = 0 phase) first costs a catch-up forward of
  the drafter's cost of the catch-up rows (0.3-1.6 s for a 0.5B draft of 100-300 tokens here).
  It buys cheap drafting for the rest of the request, so it is charged spread over the steps
  the request can still draft: min(tokens left, CATCH_UP_HORIZON) / (1 + alpha). Uncharged,
  catch-ups at the tail of a batch (few tokens left) cost 5 s of a 75 s run at concurrency 8
  (0.91x of speculation off). Except in a step that also prefills: there the batch is about to
  grow (the prefilling requests join the decodes), so a draft that looks cheap now soon stops
  paying and its catch-up would be wasted; it is charged whole. (At concurrency 8, requests
  whose prefill ended first started drafting while the others prefilled, then stopped once
  all 8 decoded: 0.96x of speculation off and +1 s median TTFT.)
* Gain. Each request keeps a running acceptance estimate alpha (`Acceptance`: every accepted
  draft a success, every cycle stopped by a rejection one failure, a prior worth a few drafts,
  mild forgetting). Its j-th draft adds alpha^j expected tokens (Leviathan et al. 2023,
  sec. 3). The prior is a fixed 0.5. At batch 4 with the 0.5B draft model the policy does
  not draft, and on this host that is right: starting each request from its drafter's recent
  acceptance (~0.85) made it draft there under the old cost model (the target's curve scaled
  by the draft's 1-row cost, which underrated the draft phase by ~50%) and measured 0.95x of
  speculation off. With the draft model's own table it declines even from 0.85: 4 decode rows
  cost 167 ms, 8 rows with 4 masks 294 ms (compute-bound past 5 rows on AVX2), and the draft
  forward 40-60 ms more, for ~3.4 expected tokens: 7.4 tokens in ~340 ms against 4 in 167.
* Choice. With B decoding requests, plain decoding emits B tokens in `t_dec` = StepCost(B rows,
  B sequences, none masked) seconds. A draft allocation D adds gain(D) tokens and costs the
  step's forward with D minus the forward without (M0 rows: decodes + prefill chunks; D adds
  |D| rows and masks every request that drafts) plus draft seconds(D); a prefill chunk in the
  step makes draft rows dearer at the margin, but its own cost is not charged to the drafts.
  We maximise expected emitted tokens per second, (B + gain(D)) / (t_dec + extra seconds(D)),
  over allocations built greedily: draft counts grow one token at a time, always the token
  with the highest alpha^j (gains are concave per request, so this is the best allocation of
  each total), and every total 0..budget is scored, so a step-shaped cost curve is handled.
  k = 0 for everyone is always a candidate and wins unless the best beats it by `margin`:
  speculation never makes a step slower by the model.
* Probes. A request at k = 0 learns nothing, so after `probe_every` idle steps it drafts one
  token to refresh alpha (a prompt that turns repetitive later is noticed). Probes are rationed
  by cost: one probe costs a fraction f of the step (its verify row, one draft position and, for
  a drafter with a cost, catching the drafter up on the tokens of the idle phase); with B
  requests probing every n steps the overhead is about B * f / n, so a request probes only once
  n >= B * f / probe_budget. At batch 1 with the n-gram drafter that is every 16 steps; a draft
  model at batch 8 essentially never probes (its catch-up alone costs more than the budget).
* `adaptive=False` requests always draft their ceiling (tests, forced benchmarks).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from quickdraft.models.base import LanguageModel

CATCH_UP_HORIZON = 128  # tokens over which a draft catch-up is spread (at most what is left)


@dataclass(frozen=True, slots=True)
class StepCost:
    """Measured seconds of one target forward.

    `rows[i]` packed rows of ONE sequence cost `seconds[i]` (ascending from 1 row,
    non-decreasing). Each further sequence adds `per_seq` (attention and cache writes run per
    sequence), and each sequence with more than one row (a verify or a prefill chunk: its
    attention needs a causal mask) adds `per_masked` over a one-row sequence; the one-sequence
    table already holds one such sequence for rows >= 2."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    per_seq: float = 0.0
    per_masked: float = 0.0

    def __post_init__(self) -> None:
        assert self.rows and self.rows[0] == 1 and len(self.rows) == len(self.seconds)

    def __call__(self, rows: int, seqs: int = 1, masked: int | None = None) -> float:
        """A forward of `rows` rows over `seqs` sequences, `masked` of them with > 1 row
        (default: the one-sequence case)."""
        in_table = 1 if rows >= 2 else 0
        masked = in_table if masked is None else masked
        extra = max(0, seqs - 1) * self.per_seq + (masked - in_table) * self.per_masked
        return max(self.of_rows(rows) + extra, self.seconds[0])

    def scaled(self, factor: float) -> StepCost:
        """The same curve, every cost times `factor`."""
        return StepCost(
            self.rows,
            tuple(x * factor for x in self.seconds),
            self.per_seq * factor,
            self.per_masked * factor,
        )

    def of_rows(self, m: int) -> float:
        r, s = self.rows, self.seconds
        if m <= r[0]:
            return s[0] * max(m, 0) / r[0] if m < r[0] else s[0]
        if m >= r[-1]:
            if len(r) == 1:
                return s[0] * m
            slope = (s[-1] - s[-2]) / (r[-1] - r[-2])
            return s[-1] + slope * (m - r[-1])
        hi = next(i for i, x in enumerate(r) if x >= m)
        lo = hi - 1
        frac = (m - r[lo]) / (r[hi] - r[lo])
        return s[lo] + frac * (s[hi] - s[lo])


COST_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 32, 64)  # dense where the curve bends


def measure_step_cost(
    model: LanguageModel, rows: Sequence[int] = COST_ROWS, context: int = 8, seqs: int = 8
) -> StepCost:
    """Time target forwards over `rows` new tokens of one sequence after `context` cached ones
    (best of three up to 16 rows, where the draft decisions are made and noise matters, one
    run above); then `seqs` sequences of one row and of two rows each, which give `per_seq` and
    `per_masked` (see StepCost). The best of three, because on a shared host one timing was
    seen 2x another of the same forward (a 64 ms `per_seq` from one start-up, 0 from the
    next); what noise is left, the policy's calibration corrects for the shapes that run.
    ~20 s for a 1.5B model on this CPU, ~1 s for a 135M one."""
    device = model.device
    max_rows = max(max(rows), 2 * seqs)
    length = max(context * seqs, context + max_rows)
    ids = torch.randint(0, model.config.vocab_size, (length,), device=device)
    caches = [model.new_cache(context + max_rows + 1) for _ in range(seqs)]
    # one packed forward fills every cache's context
    model(ids[: context * seqs], caches, [context] * seqs)
    for cache in caches:
        cache.commit(context)

    def timed(per: int, num_seqs: int) -> float:
        n = per * num_seqs
        new, logit_rows = ids[context : context + n], torch.arange(n, device=device)
        best = float("inf")
        for _ in range(3 if n <= 16 else 1):
            t = time.perf_counter()
            model(new, caches[:num_seqs], [per] * num_seqs, logit_rows=logit_rows)
            best = min(best, time.perf_counter() - t)
        return best

    timed(16, 1)  # warm-up: allocator, kernel build
    seconds: list[float] = []
    for n in rows:
        best = timed(n, 1)
        # cost cannot fall with more rows; noise must not make extra rows look free
        seconds.append(max(best, seconds[-1]) if seconds else best)
    table = StepCost(tuple(rows), tuple(seconds))
    if seqs < 2:
        return table
    one_row, two_rows = timed(1, seqs), timed(2, seqs)
    rows_delta = table.of_rows(2 * seqs) - table.of_rows(seqs)
    per_masked = max(0.0, (two_rows - one_row - rows_delta) / seqs)
    per_seq = max(0.0, (one_row - table.of_rows(seqs) + per_masked) / (seqs - 1))
    return StepCost(table.rows, table.seconds, per_seq, per_masked)


def clamped_ratio(measured: float, predicted: float) -> float:
    """measured / predicted within [1/4, 4]: one stalled step (a page fault, another process)
    cannot swing a running ratio."""
    return min(max(measured / predicted, 0.25), 4.0)


def running_mean(mean: float, n: int, x: float, window: int) -> float:
    """`mean` updated with its n-th value x: the plain mean of the first `window` values, then
    an exponential average over about `window`."""
    return mean + (x - mean) / min(n, window)


@dataclass(slots=True)
class Calibration:
    """The running ratio of measured to predicted forward seconds (module docstring,
    "Calibration"), overall and per step shape: each the mean of its first `window`
    observations, then an exponential average over about `window`. A shape's factor is its
    own ratio shrunk towards the overall one (which counts as one observation), so a shape
    never run follows the machine's overall speed: when the whole table is off (a start-up
    timed on a busy host), the shapes that ran and the ones that did not stay comparable.
    Each ratio is clamped to [1/4, 4] so one stalled step (a page fault, another process)
    cannot swing it."""

    window: int = 10
    overall: float = 1.0
    seen: int = 0
    ratios: dict[tuple[int, int, int], tuple[float, int]] = field(default_factory=dict)

    @staticmethod
    def key(rows: int, seqs: int, masked: int) -> tuple[int, int, int]:
        # rows beyond 16 (prefill chunks) share power-of-two buckets
        bucket = rows if rows <= 16 else 1 << (rows - 1).bit_length()
        return bucket, seqs, masked

    def observe(self, rows: int, seqs: int, masked: int, measured: float, predicted: float) -> None:
        if measured <= 0.0 or predicted <= 0.0:
            return
        ratio = clamped_ratio(measured, predicted)
        self.seen += 1
        self.overall = running_mean(self.overall, self.seen, ratio, self.window)
        key = self.key(rows, seqs, masked)
        mean, n = self.ratios.get(key, (1.0, 0))
        self.ratios[key] = (running_mean(mean, n + 1, ratio, self.window), n + 1)

    def factor(self, rows: int, seqs: int, masked: int) -> float:
        mean, n = self.ratios.get(self.key(rows, seqs, masked), (1.0, 0))
        n = min(n, self.window)
        return (self.overall + mean * n) / (1 + n)


@dataclass(frozen=True, slots=True)
class StepShape:
    """A forward's shape: rows, sequences, and sequences with > 1 row (a step's target forward
    before drafting, or one drafter forward)."""

    rows: int
    seqs: int
    masked: int = 0


@dataclass(slots=True)
class DraftCost:
    """Seconds of a drafter's forwards (module docstring, "Cost"): its own step-cost table,
    timed at start-up, times the running ratio of measured to predicted draft phases (the mean
    of the first `window` phases, then an exponential average; each ratio clamped to [1/4, 4]
    like `Calibration`'s). The engine times every draft phase and tells it which forwards that
    phase ran (`observe`)."""

    table: StepCost
    window: int = 10
    ratio: float = 1.0
    seen: int = 0

    def __call__(self, shape: StepShape) -> float:
        """One forward of `shape`; 0 for an empty one."""
        if shape.seqs == 0:
            return 0.0
        return self.table(shape.rows, shape.seqs, shape.masked) * self.ratio

    def observe(self, forwards: Sequence[StepShape], seconds: float) -> None:
        """One draft phase: the forwards it ran, and how long the whole phase took."""
        predicted = sum(self.table(f.rows, f.seqs, f.masked) for f in forwards if f.seqs)
        if predicted <= 0.0 or seconds <= 0.0:
            return
        self.seen += 1
        self.ratio = running_mean(
            self.ratio, self.seen, clamped_ratio(seconds, predicted), self.window
        )


@dataclass(slots=True)
class Acceptance:
    """One request's running draft-acceptance estimate (maximum likelihood under the
    'each draft accepted with probability alpha given the previous ones' model)."""

    prior_alpha: float = 0.5
    prior_weight: float = 4.0  # the prior counts as this many observed drafts
    forget: float = 0.97  # per drafted cycle: the estimate follows a request's phases
    successes: float = 0.0
    failures: float = 0.0
    idle_steps: int = 0  # decode steps since it last drafted

    @property
    def alpha(self) -> float:
        s = self.successes + self.prior_alpha * self.prior_weight
        f = self.failures + (1 - self.prior_alpha) * self.prior_weight
        return min(s / (s + f), 0.999)

    def expected_tokens(self, k: int) -> float:
        """Tokens a cycle with k drafts emits on average (accepted + the recovered/bonus one)."""
        a = self.alpha
        return (1 - a ** (k + 1)) / (1 - a)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.successes = self.successes * self.forget + accepted
        self.failures = self.failures * self.forget + (1 if accepted < drafted else 0)


@dataclass(slots=True)
class Candidate:
    """A request that decodes this step, as the policy sees it."""

    acceptance: Acceptance
    k_max: int  # ceiling: the config's k, the room left (max_tokens, context)
    adaptive: bool = True  # False: always draft k_max
    drafter: int = 0  # index into the step's `draft_costs` (requests sharing a drafter pack)
    catch_up: int = 1  # tokens the drafter must feed before its first draft (idle phases)
    remaining: int = CATCH_UP_HORIZON  # tokens the request may still emit (max_tokens, context)


def forced_drafts(cands: Sequence[Candidate], budget: int) -> tuple[list[int], int]:
    """ks of the forced (adaptive=False) requests, their ceilings in order within `budget`,
    0 for the others, and the budget left. Needs no cost model."""
    ks = [0] * len(cands)
    for i, c in enumerate(cands):
        if not c.adaptive and c.k_max > 0:
            ks[i] = min(c.k_max, budget)
            budget -= ks[i]
    return ks, budget


@dataclass(slots=True)
class BatchPolicy:
    cost: StepCost
    margin: float = 1.02  # beat plain decoding by 2% before taking the risk
    probe_every: int = 16
    probe_budget: float = 0.02  # share of step time all probes together may cost
    probes: int = field(default=0)  # probes issued (telemetry)
    calibration: Calibration = field(default_factory=Calibration)

    def seconds(self, rows: int, seqs: int, masked: int) -> float:
        """The step-cost table's forward seconds for this shape, calibrated by what steps of
        the same shape measured."""
        return self.cost(rows, seqs, masked) * self.calibration.factor(rows, seqs, masked)

    def observe(self, rows: int, seqs: int, masked: int, seconds: float) -> None:
        """One step's target forward: `rows` over `seqs` sequences, `masked` with > 1 row."""
        self.calibration.observe(rows, seqs, masked, seconds, self.cost(rows, seqs, masked))

    def catch_up_seconds(
        self, cand: Candidate, draft_cost: DraftCost | None, spread: bool = True
    ) -> float:
        """A drafter's catch-up before `cand`'s first draft, spread over the steps it can
        still draft unless `spread` is False (module docstring, "Catch-up"); 0 for the usual
        <= 2-token resync, which the first draft position's forward feeds."""
        if cand.catch_up <= 2 or draft_cost is None:
            return 0.0
        seconds = draft_cost(StepShape(cand.catch_up, 1, 1))
        if not spread:
            return seconds
        steps = min(cand.remaining, CATCH_UP_HORIZON) / (1 + cand.acceptance.alpha)
        return seconds / max(steps, 1.0)

    def choose(
        self,
        cands: Sequence[Candidate],
        draft_costs: Sequence[DraftCost | None],
        base: StepShape,
        budget: int,
    ) -> list[int]:
        """ks for `cands` (in order). `base`: the step's forward before drafting (decodes and
        prefill chunks); `draft_costs[d]`: drafter d's forward cost (None: a free lookup);
        `budget`: draft rows allowed in total."""
        ks, budget = forced_drafts(cands, budget)
        num_dec = len(cands)
        t_dec = self.seconds(num_dec, num_dec, 0)  # the step of plain decoding: num_dec tokens
        t_base = self.seconds(base.rows, base.seqs, base.masked)
        # A step that prefills (base.masked: its chunks) has a batch about to grow: a catch-up
        # there is charged whole (module docstring, "Catch-up").
        spread = base.masked == 0
        # Running totals of the allocation in `ks`, updated one draft token at a time.
        # (drafter, position) -> that drafter's packed forward for the position
        forwards: dict[tuple[int, int], StepShape] = {}
        gain = draft_s = 0.0
        drafts = drafting = 0
        empty = StepShape(0, 0)

        def add(i: int) -> None:
            nonlocal gain, draft_s, drafts, drafting
            c = cands[i]
            ks[i] += 1
            drafts += 1
            gain += c.acceptance.alpha ** ks[i]
            cost = draft_costs[c.drafter]
            if ks[i] == 1:
                drafting += 1  # its attention now needs a mask
                draft_s += self.catch_up_seconds(c, cost, spread)
            if cost is None:
                return
            # The first position's forward also feeds what the drafter has not seen: the
            # token the target emitted, and the last draft after an all-accepted cycle.
            feed = min(max(c.catch_up, 1), 2) if ks[i] == 1 else 1
            key = (c.drafter, ks[i] - 1)
            old = forwards.get(key, empty)
            new = StepShape(old.rows + feed, old.seqs + 1, old.masked + (feed > 1))
            forwards[key] = new
            draft_s += cost(new) - cost(old)

        def score() -> float:
            # extra rows never make a forward cheaper, whatever two calibrations say
            t = max(self.seconds(base.rows + drafts, base.seqs, base.masked + drafting), t_base)
            return (num_dec + gain) / (t_dec + t - t_base + draft_s)

        forced, ks = ks, [0] * len(cands)
        for i, k in enumerate(forced):
            for _ in range(k):
                add(i)
        best, best_score = list(ks), score() * self.margin
        avail = budget
        # max-heap of each adaptive request's next draft gain alpha^(k+1)
        heap = [(-c.acceptance.alpha, i) for i, c in enumerate(cands) if c.adaptive and c.k_max > 0]
        heapq.heapify(heap)
        while heap and budget > 0:
            _, i = heapq.heappop(heap)
            add(i)
            budget -= 1
            s = score()
            if s > best_score:
                best, best_score = list(ks), s
            if ks[i] < cands[i].k_max:
                heapq.heappush(heap, (-(cands[i].acceptance.alpha ** (ks[i] + 1)), i))
        left = avail - (sum(best) - sum(forced))
        return self._probe(cands, best, draft_costs, base, left)

    def _probe(
        self,
        cands: Sequence[Candidate],
        ks: list[int],
        draft_costs: Sequence[DraftCost | None],
        base: StepShape,
        budget: int,
    ) -> list[int]:
        """Turn k = 0 into a 1-token probe for requests idle long enough (see the module
        docstring for the rationing rule); counts idle steps."""
        rows = base.rows + sum(ks)
        masked = base.masked + sum(k > 0 for k in ks)
        step = self.seconds(rows, base.seqs, masked)
        extra_row = max(0.0, self.seconds(rows + 1, base.seqs, masked + 1) - step)  # + its mask
        for i, c in enumerate(cands):
            acc = c.acceptance
            if ks[i] > 0 or not c.adaptive or c.k_max == 0:
                acc.idle_steps = 0
                continue
            acc.idle_steps += 1
            if acc.idle_steps < self.probe_every or budget <= 0:
                continue
            cost = draft_costs[c.drafter]
            catch_up = 0.0 if cost is None else cost(StepShape(max(c.catch_up, 1), 1, 1))
            fraction = (extra_row + catch_up) / step
            if acc.idle_steps >= math.ceil(len(cands) * fraction / self.probe_budget):
                ks[i] = 1
                budget -= 1
                acc.idle_steps = 0
                self.probes += 1
        return ks
