"""Adaptive speculation length: how many tokens to draft this cycle, from measured costs.

Model (Leviathan et al. 2023, section 3): each draft token is accepted with probability alpha
given that the previous ones were. With k drafts a cycle emits on average
    E(k) = (1 - alpha^(k+1)) / (1 - alpha)         tokens (accepted + the recovered/bonus one)
and costs, in units of one plain one-token target step,
    C(k) = verify_cost[k + 1] + k * draft_cost      (verify_cost measured: forward of k+1 tokens)
Plain decoding is E = C = 1. We pick k in [0, k_max] maximising E(k) / C(k), and k = 0 unless
that ratio beats 1 by `margin`: speculating must not be slower than not speculating.

alpha is estimated per request by counting (MLE under the model above): every accepted draft is a
success, every cycle that stopped at a rejection is one failure; a prior worth a few drafts keeps
early cycles sane. When k = 0 wins, a k = 1 probe every `probe_every` cycles keeps alpha fresh, so
a prompt that turns repetitive later is noticed (cost: one extra verified row per probe).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from quickdraft.models.base import LanguageModel


@dataclass(slots=True)
class CostModel:
    verify_cost: list[
        float
    ]  # [n] -> cost of a target forward over n tokens / 1-token cost; [0] unused
    draft_cost: float = 0.0  # cost of proposing one draft token / 1-token target step

    def cycle(self, k: int) -> float:
        n = min(k + 1, len(self.verify_cost) - 1)
        return self.verify_cost[n] + k * self.draft_cost


@dataclass(slots=True)
class AdaptiveK:
    k_max: int
    cost: CostModel
    adaptive: bool = True
    prior_alpha: float = 0.5
    prior_weight: float = 4.0  # the prior counts as this many observed drafts
    margin: float = 1.02  # E/C must beat plain decoding by 2% to be worth the risk
    probe_every: int = 16
    successes: float = 0.0
    failures: float = 0.0
    idle_cycles: int = 0
    history: list[int] = field(default_factory=list)

    @property
    def alpha(self) -> float:
        s = self.successes + self.prior_alpha * self.prior_weight
        f = self.failures + (1 - self.prior_alpha) * self.prior_weight
        return s / (s + f)

    def expected_tokens(self, k: int) -> float:
        a = min(self.alpha, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def choose(self) -> int:
        if not self.adaptive or self.k_max == 0:
            return self.k_max
        best_k, best = 0, self.margin
        for k in range(1, self.k_max + 1):
            ratio = self.expected_tokens(k) / self.cost.cycle(k)
            if ratio > best:
                best_k, best = k, ratio
        if best_k == 0:
            self.idle_cycles += 1
            if self.idle_cycles >= self.probe_every:
                self.idle_cycles = 0
                return 1
        else:
            self.idle_cycles = 0
        return best_k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.successes += accepted
        if accepted < drafted:
            self.failures += 1


def measure_verify_cost(
    model: LanguageModel, max_tokens: int, context: int = 16, reps: int = 2
) -> list[float]:
    """Time target forwards over 1..max_tokens new tokens after `context` cached tokens; return
    the ratios to the 1-token forward (index = number of tokens; [0] = 0)."""
    cache = model.new_cache(context + max_tokens + 1)
    ids = torch.randint(0, model.config.vocab_size, (context + max_tokens,), device=model.device)
    model(ids[:context], [cache], [context])
    cache.commit(context)
    times = [0.0]
    for n in range(1, max_tokens + 1):
        best = float("inf")
        for _ in range(reps + 1):  # the first run of each size is a warm-up
            t = time.perf_counter()
            model(ids[context : context + n], [cache], [n], logit_rows=torch.arange(n))
            best = min(best, time.perf_counter() - t)
        times.append(best)
    base = times[1]
    # costs can only grow with n; measurement noise must not make k+1 look cheaper than k
    ratios = [0.0, 1.0]
    for n in range(2, max_tokens + 1):
        ratios.append(max(ratios[-1], times[n] / base))
    return ratios


def measure_step_seconds(model: LanguageModel, context: int = 16, reps: int = 3) -> float:
    """Seconds of one 1-token forward after `context` cached tokens (best of reps)."""
    cache = model.new_cache(context + 2)
    ids = torch.randint(0, model.config.vocab_size, (context + 1,), device=model.device)
    model(ids[:context], [cache], [context])
    cache.commit(context)
    best = float("inf")
    for _ in range(reps + 1):
        t = time.perf_counter()
        model(ids[context:], [cache], [1])
        best = min(best, time.perf_counter() - t)
    return best
