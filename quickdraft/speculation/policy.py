"""Speculation policy: per step and per decoding request, how many tokens to draft (k >= 0).

Stage: asked by the scheduler once per step (`DraftPlanner.choose`) with every request that
decodes, told by the engine core what the step cost (`DraftPlanner.observe`). It sees the whole
batch because the price of a draft row depends on what else is in the forward: the target
streams its weights once per forward, so at batch 1 a few extra rows are nearly free, while at
batch 8 each draft row pushes the forward further into the compute-bound regime.

The rule (`BatchPolicy.choose`):
* Gain. Each request keeps a running acceptance profile (state.py `Acceptance`): c_j, the rate
  at which its j-th draft is kept once the drafts before it were; its j-th draft adds
  c_1 ... c_j expected tokens (`Acceptance.chain`; Leviathan et al. 2023, sec. 3, with one
  alpha per position instead of one for all: a lookup's first draft is its weakest). A new
  request's prior is what its drafter's earlier drafts achieved (`Speculation.pooled`). A free
  lookup that scores its tokens (drafters/confidence.py `ScoredLookup`) is looked up before
  the choice instead, and its draft is priced token by token by the rates tokens of the same
  kind were kept at (`Candidate.chain`).
* Cost. The step's forward with the drafts minus the forward without (cost.py tables, as
  calibrated by the steps that ran), plus the drafter's forwards (its own table; the n-gram
  drafter is free). A drafter that was idle must first catch up on the tokens it missed; that
  buys cheap drafting for the rest of the request, so it is charged spread over the steps the
  request can still draft (min(tokens left, CATCH_UP_HORIZON) / (1 + alpha)), except in a step
  that also prefills, whose batch is about to grow: there it is charged whole.
* Overhead. A step also spends time outside its forwards (scheduling, sampling, verify,
  commit, detokenizing), about the same whatever is drafted: a running mean of what steps
  measured is added to every step's seconds, plain decoding's too, so drafts that spread it
  over more tokens are priced at what they save.
* Choice. B decoding requests emit B tokens in the plain-decode step; an allocation D adds
  gain(D) tokens for its extra seconds. Draft counts grow one token at a time, always the token
  with the highest chain gain (gains are non-increasing per request), every total is scored by
  expected tokens per second, and k = 0 for everyone wins unless the best beats it by
  `margin`: by the model, speculation never makes a step slower.
* Probes. A request at k = 0 learns nothing, so after `probe_every` idle steps it drafts one
  token to refresh alpha, rationed so that all probes together cost at most `probe_budget` of
  the step time.
* `adaptive=False` requests always draft their ceiling (tests, forced benchmarks).
* Stopping early. k is a ceiling chosen from a running alpha; a drafter that runs a model
  also knows how sure it is of each guess. Each of its drafts adds about its chain probability
  (the drafter's probability of the whole draft so far) to the expected tokens and costs one
  drafter forward plus one verify row, so the request stops drafting where that chain falls
  below what one more draft token costs in plain-decode tokens (its seconds x plain decoding's
  tokens per second: `Plan.min_prob`; llama.cpp's `--draft-p-min` is a fixed per-token floor).
  Plain decoding's rate, not the allocation's expected one: a floor that grew with the
  acceptance it selects would feed on itself. A stop that reads only the drafter's own guesses
  leaves sampled output exact.
* Several drafters (method "adaptive"): before all this, each such request picks the drafter
  it drafts with this step (adaptive.py `pick`, priced by the same tables); the rest sees one.
docs/speculation.md has the measurements behind each of these choices.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from quickdraft.speculation.adaptive import EXPLORE_K, Pricing, pick
from quickdraft.speculation.cost import (
    Calibration,
    DraftCost,
    StepCost,
    StepShape,
    running_mean,
)
from quickdraft.speculation.drafters.confidence import ScoredLookup
from quickdraft.speculation.state import Acceptance, SpecState

CATCH_UP_HORIZON = 128  # tokens over which a draft catch-up is spread (at most what is left)


@dataclass(slots=True)
class Candidate:
    """A request that decodes this step, as the policy sees it."""

    acceptance: Acceptance
    k_max: int  # ceiling: the config's k, the room left (max_tokens, context)
    adaptive: bool = True  # False: always draft k_max
    drafter: int = 0  # index into the step's `draft_costs` (requests sharing a drafter pack)
    catch_up: int = 1  # tokens the drafter must feed before its first draft (idle phases)
    remaining: int = CATCH_UP_HORIZON  # tokens the request may still emit (max_tokens, context)
    # a scored lookup's draft, looked up before the step: what each of its tokens adds
    # (`ScoredLookup.peek`), priced instead of the acceptance profile; k_max its length
    chain: list[float] | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """One request's drafting this step: at most `k` tokens, stopping after a draft whose chain
    probability (the drafter's, of the draft so far) is below `min_prob` (module docstring)."""

    k: int
    min_prob: float = 0.0


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
    # seconds of a step outside the target forward and the drafters' (scheduling, sampling,
    # verify, commit, detokenizing): a running mean of what steps measured
    overhead: float = 0.0
    overhead_seen: int = 0
    overhead_window: int = 32
    # `seconds` by shape until the calibration next moves (a step asks ~12 times, for a few
    # shapes: the policy's Python is ~2 % of a small model's step)
    _seconds: dict[tuple[int, int, int], float] = field(default_factory=dict)

    def seconds(self, rows: int, seqs: int, masked: int) -> float:
        """The step-cost table's forward seconds for this shape, calibrated by what steps of
        the same shape measured."""
        shape = (rows, seqs, masked)
        got = self._seconds.get(shape)
        if got is None:
            got = self.cost(rows, seqs, masked) * self.calibration.factor(rows, seqs, masked)
            self._seconds[shape] = got
        return got

    def observe(self, rows: int, seqs: int, masked: int, seconds: float) -> None:
        """One step's target forward: `rows` over `seqs` sequences, `masked` with > 1 row."""
        self.calibration.observe(rows, seqs, masked, seconds, self.cost(rows, seqs, masked))
        self._seconds.clear()

    def observe_overhead(self, seconds: float) -> None:
        """One step's wall time outside its target and drafter forwards."""
        if seconds < 0.0:
            return
        self.overhead_seen += 1
        self.overhead = running_mean(
            self.overhead, self.overhead_seen, seconds, self.overhead_window
        )

    def plain_seconds(self, num_dec: int) -> float:
        """A step of plain decoding over `num_dec` requests, end to end: its forward and the
        step's work around it."""
        return self.seconds(num_dec, num_dec, 0) + self.overhead

    def catch_up_seconds(
        self, cand: Candidate, draft_cost: DraftCost | None, spread: bool = True
    ) -> float:
        """A drafter's catch-up before `cand`'s first draft, spread over the steps it can
        still draft unless `spread` is False (module docstring); 0 for the usual
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
        # per request, the expected tokens its drafts 1 .. k_max add (Acceptance.chain)
        chains = [
            c.acceptance.chain(max(c.k_max, 1)) if c.chain is None else c.chain for c in cands
        ]
        num_dec = len(cands)
        t_dec = self.plain_seconds(num_dec)  # the step of plain decoding: num_dec tokens
        t_base = self.seconds(base.rows, base.seqs, base.masked)
        # A step that prefills (base.masked: its chunks) has a batch about to grow: a catch-up
        # there is charged whole (module docstring).
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
            gain += chains[i][ks[i] - 1]
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
        # max-heap of each adaptive request's next draft gain (its chain's next entry)
        heap = [(-chains[i][0], i) for i, c in enumerate(cands) if c.adaptive and c.k_max > 0]
        heapq.heapify(heap)
        while heap and budget > 0:
            _, i = heapq.heappop(heap)
            add(i)
            budget -= 1
            s = score()
            if s > best_score:
                best, best_score = list(ks), s
            if ks[i] < cands[i].k_max:
                heapq.heappush(heap, (-chains[i][ks[i]], i))
        left = avail - (sum(best) - sum(forced))
        return self._probe(cands, best, draft_costs, base, left)

    def min_probs(
        self,
        cands: Sequence[Candidate],
        ks: Sequence[int],
        draft_costs: Sequence[DraftCost | None],
        base: StepShape,
    ) -> list[float]:
        """Per request drafting `ks` (as `choose` returned them): the chain probability below
        which it stops (module docstring): the seconds of one more draft token (its share of a
        drafter forward and one more verify row) x the tokens per second of plain decoding.
        0 where nothing prices a stop: a forced request, a free lookup drafter."""
        drafts = sum(ks)
        if drafts == 0:
            return [0.0] * len(cands)
        masked = base.masked + sum(k > 0 for k in ks)
        step = self.seconds(base.rows + drafts, base.seqs, masked)
        # what a draft row adds to the verify, on average over the allocation: the table's
        # steps between row counts must not make the last row look dear or free
        verify_row = max(0.0, step - self.seconds(base.rows, base.seqs, base.masked)) / drafts
        rate = len(cands) / self.plain_seconds(len(cands))  # plain decoding
        sharing: dict[int, int] = {}  # drafter -> requests drafting with it (one packed forward)
        for c, k in zip(cands, ks, strict=True):
            if k > 0:
                sharing[c.drafter] = sharing.get(c.drafter, 0) + 1
        floors = []
        for c, k in zip(cands, ks, strict=True):
            cost = draft_costs[c.drafter]
            if k == 0 or not c.adaptive or cost is None:
                floors.append(0.0)
                continue
            n = sharing[c.drafter]
            forward = cost(StepShape(n, n)) / n
            floors.append(min(1.0, (forward + verify_row) * rate))
        return floors

    def _probe(
        self,
        cands: Sequence[Candidate],
        ks: list[int],
        draft_costs: Sequence[DraftCost | None],
        base: StepShape,
        budget: int,
    ) -> list[int]:
        """Turn k = 0 into a 1-token probe for requests idle long enough (module docstring:
        probes are rationed by what they cost); counts idle steps."""
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
            fraction = (extra_row + catch_up) / (step + self.overhead)
            if acc.idle_steps >= math.ceil(len(cands) * fraction / self.probe_budget):
                ks[i] = 1
                budget -= 1
                acc.idle_steps = 0
                self.probes += 1
        return ks


@dataclass(frozen=True, slots=True)
class Decoding:
    """A request that decodes this step, as the scheduler sees it."""

    spec: SpecState | None  # None: the request does not speculate
    can_draft: bool  # it has its first output token (drafting starts from there)
    room: int  # tokens it may still emit (max_tokens, context)
    num_tokens: int  # committed tokens (prompt + output)
    committed: Callable[[], list[int]] = list  # the committed tokens (a scored lookup's peek)
    greedy: bool = True  # its sampling (a scored lookup keeps rates per kind of decoding)


class DraftPlanner:
    """The policy as the engine sees it: `choose` the step's draft lengths, `observe` what the
    step cost. The target's step-cost table is only measured (seconds) once a request that
    speculates adaptively decodes: forced requests never read costs."""

    def __init__(self, target_cost: Callable[[], StepCost]) -> None:
        self.target_cost = target_cost
        self._policy: BatchPolicy | None = None
        self._inside = 0.0  # the last step's forward and draft seconds (`observe`)

    @property
    def policy(self) -> BatchPolicy:
        if self._policy is None:
            self._policy = BatchPolicy(self.target_cost())
        return self._policy

    def choose(self, decoding: Sequence[Decoding], base: StepShape, budget: int) -> list[Plan]:
        """A Plan per request of `decoding` (in order). `base`: the step's forward before
        drafting; `budget`: draft rows allowed in total."""
        if not any(d.spec is not None for d in decoding):
            return [Plan(0)] * len(decoding)
        explore = self._pick_drafters(decoding, base)
        drafters: dict[int, int] = {}  # id(drafter) -> index into draft_costs
        draft_costs: list[DraftCost | None] = [None]  # index 0: no drafter
        cands = []
        for d in decoding:
            spec = d.spec
            k_max = index = 0
            if spec is not None and d.can_draft:
                k_max = max(0, min(spec.config.num_draft_tokens, d.room - 1))
                index = drafters.setdefault(id(spec.drafter), len(draft_costs))
                if index == len(draft_costs):
                    draft_costs.append(spec.speculation.draft_cost)
            acceptance = Acceptance() if spec is None else spec.acceptance
            adaptive = spec is None or spec.config.adaptive
            if spec is not None and id(spec) in explore:
                adaptive, k_max = False, min(k_max, EXPLORE_K)
            catch_up = d.num_tokens - (0 if spec is None else spec.synced)
            chain = None
            if spec is not None and adaptive and k_max > 0:
                chain = self._peek(spec, d, k_max)
                if chain is not None:
                    k_max = len(chain)
            cands.append(Candidate(acceptance, k_max, adaptive, index, catch_up, d.room, chain))
        if any(c.adaptive for c in cands):
            policy = self.policy
            ks = policy.choose(cands, draft_costs, base, budget)
            floors = policy.min_probs(cands, ks, draft_costs, base)
            return [Plan(k, p) for k, p in zip(ks, floors, strict=True)]
        # forced requests only: no cost model needed
        return [Plan(k) for k in forced_drafts(cands, budget)[0]]

    @staticmethod
    def _peek(spec: SpecState, d: Decoding, k_max: int) -> list[float] | None:
        """A scored lookup's chain for up to `k_max` drafts (None: the drafter is not one);
        a lookup that finds nothing counts as asked, as a draft of none would."""
        drafter = spec.drafter
        if not isinstance(drafter, ScoredLookup):
            return None
        chain = drafter.peek(spec.draft_state, d.committed(), k_max, d.greedy)
        if not chain:
            spec.acceptance.asked(0)
            spec.speculation.pooled.asked(0)
        return chain

    def _pick_drafters(self, decoding: Sequence[Decoding], base: StepShape) -> set[int]:
        """Requests with several drafters pick this step's (adaptive.py); returns the ids of
        the SpecStates that explore (draft EXPLORE_K, forced)."""
        explore: set[int] = set()
        several = [d for d in decoding if d.spec is not None and len(d.spec.arms) > 1]
        if not several:
            return explore
        policy = self.policy
        num_dec = len(decoding)
        t_share = policy.plain_seconds(num_dec) / num_dec
        t_base = policy.seconds(base.rows, base.seqs, base.masked)

        def verify_extra(k: int) -> float:
            return max(0.0, policy.seconds(base.rows + k, base.seqs, base.masked + 1) - t_base)

        def catch_up(tokens: int, left: int, alpha: float, cost: DraftCost | None) -> float:
            cand = Candidate(Acceptance(prior_alpha=alpha), 1, catch_up=tokens, remaining=left)
            return policy.catch_up_seconds(cand, cost, spread=base.masked == 0)

        pricing = Pricing(t_share, verify_extra, catch_up)
        for d in several:
            spec = d.spec
            assert spec is not None
            k_max = max(0, min(spec.config.num_draft_tokens, d.room - 1)) if d.can_draft else 0
            if pick(spec, pricing, k_max, d.num_tokens, d.room).explore:
                explore.add(id(spec))
        return explore

    def observe(
        self, forward: StepShape, forward_s: float, drafted: Sequence[SpecState], draft_s: float
    ) -> None:
        """One step: its target forward (`forward`'s shape, as run: drafters may return fewer
        drafts than asked) took `forward_s`, calibrating the step-cost table; the requests in
        `drafted` drafted in a phase of `draft_s`, which calibrates their drafter's table when
        they share one drafter with a cost (a phase cannot be split between drafters)."""
        self._inside = forward_s + draft_s
        if self._policy is None:
            return  # only forced requests so far: they never read costs
        self._policy.observe(forward.rows, forward.seqs, forward.masked, forward_s)
        phases = {id(s.speculation): s for s in drafted if s.speculation.draft_cost is not None}
        if len(phases) == 1:
            (spec,) = phases.values()
            cost = spec.speculation.draft_cost
            assert cost is not None
            cost.observe(spec.drafter.forwards, draft_s)

    def observe_step(self, seconds: float) -> None:
        """The whole step that `observe` described took `seconds`: what it spent outside its
        forwards prices every step's fixed work (`BatchPolicy.overhead`)."""
        if self._policy is not None:
            self._policy.observe_overhead(seconds - self._inside)
