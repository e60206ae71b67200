"""quickdraft.speculation.policy and cost: the measured step cost and the batch-aware choice
of draft lengths."""

from __future__ import annotations

from pathlib import Path

import pytest
from hybrid_models import random_hybrid

from quickdraft.config import SpeculativeConfig
from quickdraft.loading import load
from quickdraft.models.caches.state_cache import HybridCache
from quickdraft.speculation.cost import (
    Calibration,
    DraftCost,
    StepCost,
    StepShape,
    cost_sequences,
    measure_step_cost,
)
from quickdraft.speculation.drafters.ngram import NgramDrafter
from quickdraft.speculation.policy import BatchPolicy, Candidate, DraftPlanner
from quickdraft.speculation.state import FIRST_ALPHA, Acceptance, Speculation

# Shapes like the ones measured on this CPU: flat up to 5 rows (weights streamed once), then
# compute-bound (each row adds ~a quarter of a one-row forward).
FLAT_THEN_STEEP = StepCost((1, 5, 64), (1.0, 1.1, 16.0))
FLAT = StepCost((1, 64), (1.0, 1.1))


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a cycle with k drafts emits on average (accepted + the recovered/bonus one)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def acceptance(alpha: float, drafts: int = 400) -> Acceptance:
    """An estimate that has seen `drafts` drafts accepted at rate ~alpha, at every depth."""
    acc = Acceptance(forget=1.0)
    acc.successes = alpha * drafts
    acc.failures = (1 - alpha) * drafts
    acc.reached = [float(drafts)] * 8
    acc.kept = [alpha * drafts] * 8
    return acc


def scaled(cost: StepCost, ratio: float) -> DraftCost | None:
    """A drafter whose forwards cost `ratio` times the target's (None for 0: a free lookup)."""
    if not ratio:
        return None
    return DraftCost(cost.scaled(ratio))


def score(
    cost: StepCost, cands: list[Candidate], ks: list[int], draft_costs: list[DraftCost | None]
) -> float:
    """Expected tokens per second of a decode-only step with drafts `ks` (the policy's model:
    a drafter forward per position over the requests drafting it, each synced candidate
    feeding one row)."""
    tokens = sum(expected_tokens(c.acceptance.alpha, k) for c, k in zip(cands, ks, strict=True))
    positions: dict[tuple[int, int], int] = {}
    for c, k in zip(cands, ks, strict=True):
        for j in range(k):
            positions[c.drafter, j] = positions.get((c.drafter, j), 0) + 1
    draft = 0.0
    for (d, _), n in positions.items():
        dc = draft_costs[d]
        draft += dc(StepShape(n, n, 0)) if dc is not None else 0.0
    masked = sum(k > 0 for k in ks)
    return tokens / (cost(len(cands) + sum(ks), len(cands), masked) + draft)


def test_step_cost_interpolates_and_extrapolates() -> None:
    cost = StepCost((1, 2, 4), (1.0, 1.0, 3.0), per_seq=0.5, per_masked=0.25)
    assert cost.of_rows(3) == pytest.approx(2.0)
    assert cost.of_rows(8) == pytest.approx(7.0)  # last slope (1 per row) continues
    assert cost(2) == pytest.approx(1.0)  # one sequence: its mask is in the table
    assert cost(2, seqs=2, masked=0) == pytest.approx(1.0 + 0.5 - 0.25)  # two decode rows
    assert cost(4, seqs=2, masked=2) == pytest.approx(3.0 + 0.5 + 0.25)  # two verifies


def test_policy_mask_overhead_keeps_batch_from_drafting() -> None:
    """Rows are free here, but each verifying sequence costs its causal mask."""
    cands = [Candidate(acceptance(0.5), 3) for _ in range(4)]
    free_rows = StepCost((1, 64), (1.0, 1.0), per_masked=0.0)
    # consistent with the mask: one sequence of >= 2 rows pays it too
    dear_masks = StepCost((1, 2, 64), (1.0, 1.5, 1.5), per_masked=0.5)
    assert sum(BatchPolicy(free_rows).choose(cands, [None], StepShape(4, 4), 64)) > 0
    assert BatchPolicy(dear_masks).choose(cands, [None], StepShape(4, 4), 64) == [0] * 4


def test_policy_batch_of_one_with_flat_cost_drafts_the_ceiling() -> None:
    cands = [Candidate(acceptance(0.8), k_max=5)]
    ks = BatchPolicy(FLAT).choose(cands, [None], StepShape(1, 1), budget=64)
    assert ks == [5]


def test_policy_low_acceptance_does_not_draft() -> None:
    cands = [Candidate(acceptance(0.01), k_max=5)]
    ks = BatchPolicy(FLAT_THEN_STEEP).choose(cands, [None], StepShape(1, 1), budget=64)
    assert ks == [0]


def test_policy_large_batch_on_compute_bound_cost_stops_drafting() -> None:
    """The same acceptance that pays at batch 1 loses at batch 8 once rows cost compute."""
    policy = BatchPolicy(FLAT_THEN_STEEP)
    alone = policy.choose([Candidate(acceptance(0.6), 5)], [None], StepShape(1, 1), 64)
    batch = [Candidate(acceptance(0.6), 5) for _ in range(8)]
    ks = policy.choose(batch, [None], StepShape(8, 8), 64)
    assert alone[0] > 0 and ks == [0] * 8


@pytest.mark.parametrize("alphas", [[0.95, 0.2, 0.2, 0.2], [0.7, 0.7, 0.6, 0.1], [0.99] * 8])
def test_policy_choice_is_never_worse_than_plain_decoding(alphas: list[float]) -> None:
    cands = [Candidate(acceptance(a), 5, drafter=1) for a in alphas]
    for cost in (FLAT, FLAT_THEN_STEEP):
        for ratio in (0.0, 0.3):
            costs = [None, scaled(cost, ratio)]
            ks = BatchPolicy(cost).choose(cands, costs, StepShape(len(cands), len(cands)), 64)
            zero = [0] * len(cands)
            assert score(cost, cands, ks, costs) >= score(cost, cands, zero, costs)


def test_policy_prefers_the_request_that_accepts_more() -> None:
    cands = [Candidate(acceptance(0.95), 5), Candidate(acceptance(0.3), 5)]
    cost = StepCost((1, 3, 64), (1.0, 1.0, 20.0))  # two spare rows, then steep
    ks = BatchPolicy(cost).choose(cands, [None], StepShape(2, 2), 64)
    assert ks[0] >= 1 and ks[0] > ks[1]


def test_policy_respects_budget_and_forced_requests() -> None:
    cands = [Candidate(acceptance(0.9), 5) for _ in range(4)]
    ks = BatchPolicy(FLAT).choose(cands, [None], StepShape(4, 4), budget=6)
    assert sum(ks) <= 6
    forced = [Candidate(acceptance(0.01), 3, adaptive=False), Candidate(acceptance(0.01), 3)]
    assert BatchPolicy(FLAT_THEN_STEEP).choose(forced, [None], StepShape(2, 2), 64) == [3, 0]


def test_policy_probes_idle_request_and_rations_probes_by_cost() -> None:
    policy = BatchPolicy(FLAT_THEN_STEEP, probe_every=4)
    alone = Candidate(acceptance(0.01), 5)
    ks_seen = [policy.choose([alone], [None], StepShape(1, 1), 64)[0] for _ in range(8)]
    assert ks_seen == [0, 0, 0, 1, 0, 0, 0, 1]  # a cheap row: every probe_every steps
    # at batch 8 on the steep part a probe row costs ~3% of the step: probes are rarer
    batch = [Candidate(acceptance(0.01), 5) for _ in range(8)]
    first = None
    for step in range(1, 200):
        if any(policy.choose(batch, [None], StepShape(8, 8), 64)):
            first = step
            break
    assert first is not None and first > 4


def test_acceptance_profile_counts_each_depth() -> None:
    """c_j counts only the cycles that reached draft j with every earlier draft kept; a
    lookup-like record (first drafts often wrong, a right start runs on) is priced deeper
    than one alpha for all positions would price it."""
    acc = Acceptance(prior_weight=0.0, forget=1.0)
    for _ in range(6):
        acc.update(4, 0)  # the first draft rejected: position 0 reached, nothing kept
    for _ in range(2):
        acc.update(4, 4)  # a right start: all four kept
    acc.update(2, 2)  # the drafter proposed only two, both kept
    assert acc.reached == [9.0, 3.0, 2.0, 2.0] and acc.kept == [3.0, 3.0, 2.0, 2.0]
    assert acc.chain(4) == pytest.approx([1 / 3] * 4, abs=0.002)  # c_j capped at 0.999
    assert acc.alpha == pytest.approx(10 / 16)  # 10 kept, 6 cycles stopped by a rejection
    assert acc.chain(4)[3] > acc.alpha**4 * 2  # the geometric model's fourth draft: 0.15
    policy = BatchPolicy(FLAT_THEN_STEEP)
    geometric = acceptance(acc.alpha)
    deep = policy.choose([Candidate(acc, 8)], [None], StepShape(1, 1), budget=64)
    flat = policy.choose([Candidate(geometric, 8)], [None], StepShape(1, 1), budget=64)
    assert deep[0] >= flat[0] > 0


def test_a_new_request_starts_from_its_drafters_profile() -> None:
    spec = Speculation(SpeculativeConfig(method="ngram"), NgramDrafter(), None)
    for _ in range(200):
        spec.pooled.update(3, 0)
        spec.pooled.update(3, 3)
    prior = spec.start(list(range(8))).acceptance
    assert prior.conditional(0) == pytest.approx(0.5, abs=0.05)  # half the starts kept
    assert prior.conditional(2) > 0.9  # and every one of those ran on


def test_policy_acceptance_counts_and_forgets() -> None:
    acc = Acceptance(prior_weight=0.0, forget=1.0)
    acc.update(4, 4)  # all accepted: 4 successes, no failure
    acc.update(4, 1)  # 1 success, stopped by a rejection
    assert acc.alpha == pytest.approx(5 / 6)
    acc.update(0, 0)  # a k = 0 step teaches nothing
    assert acc.alpha == pytest.approx(5 / 6)
    fading = Acceptance(prior_weight=0.0, forget=0.5)
    fading.update(4, 4)
    fading.update(2, 0)  # recent failure weighs more than the older successes
    assert fading.alpha < 4 / 5


def test_measure_step_cost_on_tiny_model_is_monotone(tiny_model_dir: Path) -> None:
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    cost = measure_step_cost(lm.model, rows=(1, 2, 4, 8), seqs=4)
    assert cost.rows == (1, 2, 4, 8)
    assert all(b >= a > 0 for a, b in zip(cost.seconds, cost.seconds[1:], strict=False))
    assert cost.per_seq >= 0.0 and cost.per_masked >= 0.0


def test_cost_sequences_keep_the_measurements_caches_in_budget() -> None:
    assert cost_sequences(10 << 20, 8) == 8  # a dense model's caches: all eight
    assert cost_sequences(138 << 20, 8) == 2  # the 35B-A3B shape's recurrent state: two
    assert cost_sequences(64 << 20, 8) == 4
    assert cost_sequences(1 << 30, 8) == 2  # never below two where several are asked
    assert cost_sequences(1 << 30, 1) == 1 and cost_sequences(1 << 30, 2) == 2


def test_measure_step_cost_on_a_hybrid_model_within_a_cache_budget() -> None:
    """A hybrid model's recurrent state in every cache: a budget of two caches still times the
    one-sequence rows and prices further sequences from the two."""
    model = random_hybrid("qwen3_5_moe")
    per_cache = model.new_cache(64).nbytes()
    made: list[int] = []  # the capacity of every cache the measurement makes
    new_cache = model.new_cache

    def counted(capacity: int) -> HybridCache:
        made.append(capacity)
        return new_cache(capacity)

    model.new_cache = counted  # type: ignore[method-assign]
    cost = measure_step_cost(
        model, rows=(1, 2, 4), context=16, seqs=6, others=4, cache_budget=2 * per_cache
    )
    assert len(made) == 2  # six asked, two fit the budget
    assert cost.rows == (1, 2, 4)
    assert all(b >= a > 0 for a, b in zip(cost.seconds, cost.seconds[1:], strict=False))
    assert cost.per_seq >= 0.0 and cost.per_masked >= 0.0


def test_calibration_follows_measured_steps_per_shape() -> None:
    cal = Calibration(window=4)
    assert cal.factor(8, 8, 0) == 1.0  # nothing measured: the table
    for _ in range(4):
        cal.observe(8, 8, 0, measured=0.8, predicted=1.0)
    assert cal.factor(8, 8, 0) == pytest.approx(0.8, rel=0.02)
    assert cal.factor(8, 1, 1) == pytest.approx(cal.speed)  # never run: the host's speed
    for _ in range(8):
        cal.observe(9, 1, 1, measured=2.0, predicted=1.0)  # a shape the table underrates
        cal.observe(8, 8, 0, measured=0.8, predicted=1.0)
    # each shape towards what its own steps measured, through one speed and two premiums
    # (a premium shrunk towards 1: the speed counts as one observation of it)
    assert 1.5 < cal.factor(9, 1, 1) <= 2.0
    assert 0.8 <= cal.factor(8, 8, 0) < 1.0
    assert cal.factor(9, 1, 1) / cal.factor(8, 8, 0) > 1.8
    assert cal.factor(9, 1, 1) == pytest.approx(cal.speed * cal.premium((9, 1, 1)))
    mean, n = cal.premiums[9, 1, 1]
    assert n == 8 and cal.premium((9, 1, 1)) == pytest.approx((1 + 4 * mean) / 5)
    before = cal.factor(8, 8, 0)
    cal.observe(8, 8, 0, measured=100.0, predicted=1.0)  # one stalled step: clamped to 4x
    assert before < cal.factor(8, 8, 0) < 4.0 * before
    cal.observe(40, 2, 1, measured=2.0, predicted=1.0)  # prefill-sized rows share a bucket
    assert cal.premiums[64, 2, 1][1] == 1


def test_calibration_moves_the_shapes_not_run_with_the_host() -> None:
    """Two shapes, one priced right by the table and one at twice its price, run alike; then
    the host speeds up 2x while only the first runs. The second follows the host (to ~1.0 of
    the table), keeping its premium over the first, where one running ratio per shape kept it
    at the slow phase's 2x (1.9x after the change) and the policy never chose it again."""
    cal = Calibration(window=10)
    for _ in range(20):
        cal.observe(2, 1, 1, measured=1.0, predicted=1.0)
        cal.observe(4, 1, 1, measured=2.0, predicted=1.0)
    assert cal.factor(4, 1, 1) / cal.factor(2, 1, 1) == pytest.approx(2.0, rel=0.1)
    for _ in range(40):
        cal.observe(2, 1, 1, measured=0.5, predicted=1.0)
    assert cal.factor(2, 1, 1) == pytest.approx(0.5, rel=0.05)
    assert cal.factor(4, 1, 1) == pytest.approx(1.0, rel=0.15)


def test_policy_keeps_drafting_when_the_whole_table_is_slow() -> None:
    """A start-up timed on a busy host: every shape runs 4x faster than the table says. The
    plain shape's correction must not make the draft shapes (never run yet) look dear."""
    policy = BatchPolicy(FLAT)
    cands = [Candidate(acceptance(0.5), 3)]
    for _ in range(10):
        policy.observe(1, 1, 0, FLAT(1) / 4)
    assert policy.choose(cands, [None], StepShape(1, 1), 64) == [3]


def test_policy_stops_drafting_once_the_draft_shape_measures_dear() -> None:
    """The table says a verify row is free; the steps that ran say it doubles the forward."""
    policy = BatchPolicy(FLAT)
    cands = [Candidate(acceptance(0.5), 1) for _ in range(4)]
    assert policy.choose(cands, [None], StepShape(4, 4), 64) != [0] * 4
    for _ in range(10):
        policy.observe(4, 4, 0, FLAT(4, 4, 0))  # plain decoding as the table says
        for drafting in range(1, 5):  # any draft shape: twice the table
            policy.observe(4 + drafting, 4, drafting, 2 * FLAT(4 + drafting, 4, drafting))
    assert policy.choose(cands, [None], StepShape(4, 4), 64) == [0] * 4


def test_policy_charges_a_draft_model_catch_up_over_what_is_left() -> None:
    """A request that never drafted must first feed its 200 tokens to the draft model: worth it
    with 128 tokens to go, not with 2."""
    policy = BatchPolicy(FLAT_THEN_STEEP)
    fresh = dict(acceptance=acceptance(0.7), k_max=3, drafter=1, catch_up=200)
    costs = [None, scaled(FLAT_THEN_STEEP, 0.1)]
    assert policy.choose([Candidate(**fresh, remaining=128)], costs, StepShape(1, 1), 64)[0] > 0
    assert policy.choose([Candidate(**fresh, remaining=2)], costs, StepShape(1, 1), 64) == [0]
    # caught up (the usual resync of <= 2 tokens): nothing to charge, it drafts to the end
    synced = dict(fresh, catch_up=2)
    assert policy.choose([Candidate(**synced, remaining=2)], costs, StepShape(1, 1), 64)[0] > 0
    # a lookup drafter has nothing to catch up
    free = dict(fresh, drafter=0)
    assert policy.choose([Candidate(**free, remaining=2)], costs, StepShape(1, 1), 64)[0] > 0


def test_policy_charges_a_catch_up_whole_while_others_prefill() -> None:
    """Next to a prefill chunk the batch is about to grow: no catch-up on the strength of a
    transiently small batch."""
    policy = BatchPolicy(FLAT_THEN_STEEP)
    fresh = Candidate(acceptance(0.7), 3, drafter=1, catch_up=200, remaining=128)
    costs = [None, scaled(FLAT_THEN_STEEP, 0.1)]
    assert policy.choose([fresh], costs, StepShape(1, 1), 64)[0] > 0
    assert policy.choose([fresh], costs, StepShape(17, 2, masked=1), 64) == [0]
    synced = Candidate(acceptance(0.7), 3, drafter=1, catch_up=1, remaining=128)
    assert policy.choose([synced], costs, StepShape(17, 2, masked=1), 64)[0] > 0


def test_draft_cost_follows_measured_over_predicted_phases() -> None:
    """A draft phase is predicted as the sum of its forwards from the drafter's own table; the
    ratio of measured to predicted scales every later prediction (a stalled phase clamped)."""
    cost = DraftCost(StepCost((1, 2, 64), (0.01, 0.02, 0.64), per_seq=0.001, per_masked=0.002))
    phase = [StepShape(8, 4, 4), StepShape(4, 4, 0), StepShape(0, 0)]  # an empty one: nothing
    predicted = cost.table(8, 4, 4) + cost.table(4, 4, 0)
    assert cost(StepShape(4, 4, 0)) == pytest.approx(cost.table(4, 4, 0))
    cost.observe(phase, 1.5 * predicted)
    assert cost.ratio == pytest.approx(1.5)
    assert cost(StepShape(4, 4, 0)) == pytest.approx(1.5 * cost.table(4, 4, 0))
    cost.observe(phase, 0.0)  # nothing timed: ignored
    cost.observe(phase, 100 * predicted)  # one stalled phase: counted as 4x
    assert cost.seen == 2 and cost.ratio == pytest.approx((1.5 + 4.0) / 2)
    assert cost(StepShape(0, 0)) == 0.0


def test_policy_charges_the_first_draft_position_what_the_drafter_must_resync() -> None:
    """After an all-accepted cycle the draft model feeds 2 tokens before its first draft (the
    target's token and its own last draft): here a 2-row draft forward costs 16x a 1-row one,
    so the same request drafts after a rejection and not after a full accept."""
    draft = DraftCost(StepCost((1, 2, 64), (0.05, 0.8, 30.0)))
    policy = BatchPolicy(FLAT)
    after_reject = Candidate(acceptance(0.7), 1, drafter=1, catch_up=1)
    after_accept = Candidate(acceptance(0.7), 1, drafter=1, catch_up=2)
    assert policy.choose([after_reject], [None, draft], StepShape(1, 1), 64) == [1]
    assert policy.choose([after_accept], [None, draft], StepShape(1, 1), 64) == [0]


def test_new_requests_start_from_what_earlier_drafts_achieved() -> None:
    """A request's acceptance prior is the drafter's pooled record: after requests whose
    drafts were mostly accepted, a new one starts high enough to draft at once; after poor
    ones, low. A drafter that has not drafted yet starts optimistic (FIRST_ALPHA)."""
    good = Speculation(SpeculativeConfig(method="ngram"), NgramDrafter(), None)
    assert good.start([1, 2, 3]).acceptance.alpha == pytest.approx(FIRST_ALPHA)
    for _ in range(3):
        state = good.start([1, 2, 3])
        for _ in range(40):
            state.record(5, 5 if _ % 5 else 3, True, 10)  # 9 of 10 cycles all accepted
        state.free()
    assert good.start([4, 5]).acceptance.alpha > 0.9
    poor = Speculation(SpeculativeConfig(method="ngram"), NgramDrafter(), None)
    state = poor.start([1, 2, 3])
    for _ in range(40):
        state.record(5, 0, True, 10)
    assert poor.start([4, 5]).acceptance.alpha < 0.1


def test_a_fresh_drafters_first_request_drafts() -> None:
    """A drafter's first request must draft to learn anything: with the tables measured for
    the 1.5B + 0.5B GGUF pair (2-core Xeon, 1.5 KiB prefetch: the draft forward is a third of
    the target's) and a 300-token prompt to catch up on, the optimistic first record drafts,
    where the neutral 0.5 priced every draft at a loss and never drafted (nor probed)."""
    ms = (43.5, 47.0, 51.2, 54.4, 57.4, 60.8, 63.6, 67.0, 77.8, 86.3, 103.7, 198.0, 377.1)
    rows = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 32, 64)
    target = StepCost(rows, tuple(t / 1e3 for t in ms), per_seq=0.95e-3, per_masked=0.23e-3)
    ms = (15.0, 15.1, 17.1, 19.4, 22.8, 26.7, 29.5, 33.0, 41.0, 49.1, 63.8, 124.8, 243.6)
    draft = DraftCost(StepCost(rows, tuple(t / 1e3 for t in ms), per_seq=1.09e-3))
    fresh = Speculation(SpeculativeConfig(method="ngram"), NgramDrafter(), None)
    first = fresh.start(list(range(300))).acceptance
    neutral = Acceptance(prior_alpha=0.5)
    for acc, drafts in ((first, True), (neutral, False)):
        policy = BatchPolicy(target)
        cand = Candidate(acc, 5, drafter=1, catch_up=300, remaining=128)
        for _ in range(128):  # a whole request, probes included
            ks = policy.choose([cand], [None, draft], StepShape(1, 1), 64)
            if ks[0]:
                break
        assert (ks[0] > 0) == drafts, (acc.alpha, ks)


def test_drafts_stop_where_one_more_token_costs_more_than_plain_decoding_earns() -> None:
    """`min_probs`: a request drafting with a model stops below the chain probability that
    pays one more draft token at plain decoding's rate, (its drafter forward + a verify row)
    x tokens per second of plain decoding; a dearer drafter stops sooner, a free lookup and a
    forced request never stop early, and drafters shared by a batch split their forward."""
    cost = StepCost((1, 17), (1.0, 1.4))  # a verify row adds 0.025 of a step
    policy = BatchPolicy(cost)
    cheap, dear = scaled(cost, 0.05), scaled(cost, 0.15)
    cands = [Candidate(acceptance(0.95), 8, drafter=1), Candidate(acceptance(0.95), 8, drafter=2)]
    ks = policy.choose(cands, [None, cheap, dear], StepShape(2, 2), 64)
    assert all(k > 0 for k in ks), ks
    floors = policy.min_probs(cands, ks, [None, cheap, dear], StepShape(2, 2))
    plain = cost(2, 2, 0) / 2  # seconds per token of plain decoding, two requests
    rows = 2 + sum(ks)
    verify_row = (cost(rows, 2, 2) - cost(2, 2, 0)) / sum(ks)
    for floor, dc in zip(floors, (cheap, dear), strict=True):
        assert dc is not None
        assert floor == pytest.approx((dc(StepShape(1, 1)) + verify_row) / plain)
    assert 0 < floors[0] < floors[1] < 1
    # two requests on one drafter: each is charged half of their packed forward
    shared = [Candidate(acceptance(0.95), 8, drafter=1) for _ in range(2)]
    ks = policy.choose(shared, [None, cheap], StepShape(2, 2), 64)
    halves = policy.min_probs(shared, ks, [None, cheap], StepShape(2, 2))
    assert cheap is not None and halves[0] == pytest.approx(
        (cheap(StepShape(2, 2)) / 2 + (cost(2 + sum(ks), 2, 2) - cost(2, 2, 0)) / sum(ks)) / plain
    )
    lookup = [Candidate(acceptance(0.9), 8, drafter=0)]
    assert policy.min_probs(lookup, [8], [None], StepShape(1, 1)) == [0.0]
    forced = [Candidate(acceptance(0.9), 8, adaptive=False, drafter=1)]
    assert policy.min_probs(forced, [8], [None, cheap], StepShape(1, 1)) == [0.0]


def test_policy_prices_the_steps_work_outside_the_forward() -> None:
    """A draft row adds 0.15 of a forward; at alpha 0.5 two drafts pay best when a step is its
    forward alone, three once the step's fixed work (as long as the forward) is counted: more
    tokens per step spread it thinner. The planner measures that work as the step's wall time
    less its forwards."""
    cost = StepCost((1, 9), (1.0, 2.2))
    cands = [Candidate(acceptance(0.5), 5)]
    policy = BatchPolicy(cost)
    assert policy.choose(cands, [None], StepShape(1, 1), 64) == [2]
    planner = DraftPlanner(lambda: cost)
    for _ in range(40):
        planner.policy.observe(1, 1, 0, 1.0)  # steps as long as the table says
        planner.observe(StepShape(1, 1), 1.0, [], 0.0)
        planner.observe_step(2.0)
    assert planner.policy.overhead == pytest.approx(1.0)
    assert planner.policy.choose(cands, [None], StepShape(1, 1), 64) == [3]
