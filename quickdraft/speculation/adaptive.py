"""Adaptive drafter choice (method "adaptive"): per request and step, which drafter drafts.

Stage: asked by the policy (policy.py `DraftPlanner.choose`) for every decoding request with
several drafters (`SpecState.arms`), before the batch policy sizes the drafts; it sets
`SpecState.active`, and the step then runs exactly as for a request with that one drafter.

The estimate (a bandit's arms): per request and drafter an `Acceptance`: its depth profile
c_j, the rate at which draft j is kept once the drafts before it were (exponentially forgotten
counts, forget 0.97 per cycle the drafter drafted in), and the hit rate, the share of the
cycles it was asked in where it proposed anything (a lookup that finds no match proposes
nothing and costs nothing). Both are seeded with what the drafter achieved over earlier
requests (`Speculation.pooled`).

The choice: the arm with the best expected tokens per second of this request's share of the
step, each at its best k <= k_max, priced by the policy's calibrated cost tables (cost.py):
    tokens(k)  = 1 + h * (c_1 + c_1 c_2 + ... + c_1 ... c_k)   (Acceptance.chain)
    seconds(k) = t_share + h * (verify(k) + draft(k)) + catch_up
t_share: the plain decode step over the decoding requests; verify(k): the step's forward with k
more rows (and one more masked sequence) minus without; draft(k): the drafter's forwards, the
first feeding the tokens it has not seen (up to 2), then k - 1 one-token ones (0 for a lookup);
catch_up: a drafter that sat idle must first feed what it missed, spread over the tokens the
request can still emit (`BatchPolicy.catch_up_seconds`). The batch policy then sizes the picked
arm's drafts, down to k = 0: plain decoding when no drafter pays.

Learning while not picked: a free lookup that did not draft this step drafts beside it anyway
(engine/spec_cycle.py, `Arm.shadow`: never verified), and its prefix that matches the emitted
tokens counts as accepted (state.py `shadow_score`), so lookups learn every decode step. A
drafter with a cost cannot: an arm idle for `EXPLORE_MIN` steps or more is picked for one step
with `EXPLORE_K` forced drafts once that costs at most `EXPLORE_BUDGET` of the time its idle
steps took (the catch-up its idleness built up, priced by its table); the arm idle longest
first.

Syncing: each drafter resyncs from the committed tokens whenever it is asked (drafters/base.py:
a lookup indexes what it has not seen, a draft model trims its KV to the common prefix and
feeds the rest), so an arm that was not picked is synced lazily, when next picked, with its
catch-up priced as above. Drafters that must see every committed row's hidden state (MTP,
DFlash) cannot catch up this way and are not offered (config.ADAPTIVE_DRAFTERS). Verification
does not depend on the drafter: greedy output stays token-identical and sampling exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quickdraft.speculation.cost import DraftCost, StepShape
from quickdraft.speculation.state import Arm, SpecState

EXPLORE_MIN = 16  # idle decode steps before an arm may be explored
EXPLORE_K = 3  # drafts an exploring arm is asked for
EXPLORE_BUDGET = 0.03  # an exploration costs at most this share of the idle steps' time


@dataclass(frozen=True, slots=True)
class Pricing:
    """One step's prices for one decoding request, from the policy's calibrated tables."""

    t_share: float  # the plain decode step's seconds over the decoding requests
    verify_extra: Callable[[int], float]  # k -> extra forward seconds of k draft rows
    # (tokens to catch up, tokens left, alpha, draft cost) -> catch-up seconds charged now
    catch_up: Callable[[int, int, float, DraftCost | None], float]


@dataclass(frozen=True, slots=True)
class Pick:
    arm: int  # index into SpecState.arms
    explore: bool  # forced: draft min(k_max, EXPLORE_K) whatever the policy says


def arm_rate(arm: Arm, pricing: Pricing, k_max: int, catch_up: int, remaining: int) -> float:
    """Expected tokens per second of this request's share of the step with `arm` drafting,
    at its best k in [1, k_max] (module docstring)."""
    acc = arm.acceptance
    alpha, hit = acc.alpha, acc.hit_rate
    cost = arm.speculation.draft_cost
    catch = pricing.catch_up(catch_up, remaining, alpha, cost)
    feed = min(max(catch_up, 1), 2)
    first = 0.0 if cost is None else cost(StepShape(feed, 1, int(feed > 1)))
    step = 0.0 if cost is None else cost(StepShape(1, 1, 0))
    best = 0.0
    gain = 0.0
    for k, tokens in enumerate(acc.chain(k_max), start=1):
        gain += tokens
        draft = first + (k - 1) * step
        seconds = pricing.t_share + hit * (pricing.verify_extra(k) + draft) + catch
        best = max(best, (1.0 + hit * gain) / seconds)
    return best


def explore_seconds(arm: Arm, pricing: Pricing, k: int, catch_up: int) -> float:
    """What one forced exploration of `arm` with k drafts costs: its verify rows, its
    catch-up (whole) and its draft forwards."""
    cost = arm.speculation.draft_cost
    seconds = pricing.verify_extra(k)
    if cost is not None:
        seconds += cost(StepShape(max(catch_up, 1), 1, int(catch_up > 1)))
        seconds += (k - 1) * cost(StepShape(1, 1, 0))
    return seconds


def pick(spec: SpecState, pricing: Pricing, k_max: int, num_tokens: int, remaining: int) -> Pick:
    """The arm that drafts this step for a request that may draft up to `k_max` tokens,
    with `num_tokens` committed and `remaining` it may still emit; updates the arms' idle
    counts (module docstring)."""
    arms = spec.arms
    choice = Pick(spec.active, False)
    if len(arms) > 1 and k_max > 0:
        rates = [arm_rate(a, pricing, k_max, num_tokens - a.synced, remaining) for a in arms]
        choice = Pick(max(range(len(arms)), key=rates.__getitem__), False)
        k = min(k_max, EXPLORE_K)
        idle = sorted(
            (i for i, a in enumerate(arms) if i != choice.arm and a.idle >= EXPLORE_MIN),
            key=lambda i: -arms[i].idle,
        )
        for i in idle:
            spent = arms[i].idle * pricing.t_share
            cost = explore_seconds(arms[i], pricing, k, num_tokens - arms[i].synced)
            if cost <= EXPLORE_BUDGET * spent:
                choice = Pick(i, True)
                break
    for i, arm in enumerate(arms):
        arm.idle = 0 if i == choice.arm else arm.idle + 1
    spec.active = choice.arm
    return choice
