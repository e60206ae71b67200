"""How sure a lookup drafter is of each draft token: the rate at which tokens of the same kind
were kept, learned from the target's verdicts.

A lookup (n-gram, suffix) has no distribution, but each of its tokens comes with evidence: how
long a suffix of the context matched, whether every earlier occurrence went on the same way,
whether the match came from the request's own text or from other outputs. That evidence
predicts acceptance far better than the token's position in the draft. Measured on SmolLM2-135M
Q4_K_M with n-gram at k = 5 (12 prompts x 128 tokens per set, every draft that was reached):
a token after a 4-token match whose occurrences all agreed was kept 81 % of the time on code
(91 % on prose), one after a 1-token match 17-38 %, one from the shared index 8-26 %, while by
position the rates only went 0.37 / 0.64 / 0.72 / 0.70 / 0.83. docs/speculation.md has the
tables.

So the drafter gives each token a small hashable key (its kind), and `Confidence` keeps, per
key, the tokens that were reached (every draft before them kept) and those kept as well, slowly
forgotten, under a prior of `prior` weighing `weight` tokens (optimistic, so a kind not yet
seen gets tried). A draft's chain probability, the product of its tokens' rates, is the
expected number of tokens each draft position adds (`chain`), which the policy prices exactly
as it prices a profile's (policy.py: a free lookup is looked up before the step is planned).
One table per drafter, shared by its requests: it holds counts per kind of evidence, never a
token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from quickdraft.speculation.drafters.base import Draft, DraftJob

CONFIDENCE_PRIOR = 0.8  # a kind's rate before any of its tokens was verified
CONFIDENCE_WEIGHT = 2.0  # the prior counts as this many verified tokens
CONFIDENCE_FORGET = 0.998  # per verified token of the kind: the rates follow the traffic


class Confidence:
    """Per kind of draft token, the tokens reached and kept (module docstring)."""

    __slots__ = ("forget", "prior", "rates", "weight")

    def __init__(
        self,
        prior: float = CONFIDENCE_PRIOR,
        weight: float = CONFIDENCE_WEIGHT,
        forget: float = CONFIDENCE_FORGET,
    ) -> None:
        if not 0.0 < prior < 1.0 or weight <= 0.0 or not 0.0 < forget <= 1.0:
            raise ValueError(
                f"need 0 < prior < 1, weight > 0, 0 < forget <= 1; got {prior}, {weight}, {forget}"
            )
        self.prior, self.weight, self.forget = prior, weight, forget
        self.rates: dict[Hashable, list[float]] = {}  # key -> [reached, kept]

    def prob(self, key: Hashable) -> float:
        """The rate at which a token of kind `key` is kept once reached."""
        got = self.rates.get(key)
        if got is None:
            return self.prior
        reached, kept = got
        return (kept + self.prior * self.weight) / (reached + self.weight)

    def chain(self, keys: Sequence[Hashable]) -> list[float]:
        """Expected tokens each draft position adds: p_1, p_1 p_2, ... (non-increasing)."""
        out, p = [], 1.0
        for key in keys:
            p *= self.prob(key)
            out.append(p)
        return out

    def observe(self, keys: Sequence[Hashable], drafted: int, accepted: int) -> None:
        """A verify kept `accepted` of a draft's first `drafted` tokens (of kinds `keys`): each
        token up to the first rejected one was reached; those before it were kept."""
        for j in range(min(accepted + 1, drafted, len(keys))):
            got = self.rates.get(keys[j])
            if got is None:
                got = self.rates[keys[j]] = [0.0, 0.0]
            got[0] = got[0] * self.forget + 1.0
            got[1] = got[1] * self.forget + (1.0 if j < accepted else 0.0)


@dataclass(slots=True)
class Peeked:
    """A request's draft looked up by `ScoredLookup.peek` at `at` committed tokens for up to
    `k` (at = -1: none waiting for its step's propose)."""

    at: int = -1
    k: int = 0
    tokens: list[int] = field(default_factory=list)
    keys: list[Hashable] = field(default_factory=list)
    proposed: list[Hashable] = field(default_factory=list)  # the keys `outcome` scores


class ScoredLookup(ABC):
    """A lookup drafter whose tokens carry `Confidence` keys. The policy looks up before it
    plans a step (`peek`: the draft's chain probabilities) and the step's `propose` returns
    that draft cut to the k it chose, without a second lookup; a `propose` nothing peeked for
    looks up itself. `outcome` learns from the verdict. A subclass drafts with `_draft` and
    keeps a `Peeked` as its state's `peeked`."""

    confidence: Confidence

    @abstractmethod
    def _draft(self, state: Any, tokens: list[int], k: int) -> tuple[list[int], list[Hashable]]:
        """Up to k tokens after `tokens`, and each one's kind."""

    def lookup(self, state: Any, tokens: list[int], k: int) -> Draft:
        """`_draft`'s tokens, looked up now (no peek; no kinds kept for `outcome`)."""
        return Draft(self._draft(state, tokens, k)[0])

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        out = []
        for job in jobs:
            memo: Peeked = job.state.peeked
            # the draft the policy priced this step (committed tokens only grow, and a rebuild
            # drops the memo: the length names the sequence), cut to the k it chose; a lookup's
            # best draft for fewer tokens may differ from this one's first tokens (suffix:
            # another match scores best), but this one is what was priced
            if memo.at == len(job.tokens) and job.k <= memo.k:
                draft, keys = memo.tokens[: job.k], memo.keys[: job.k]
            else:
                draft, keys = self._keyed(job.state, job.tokens, job.k, job.params.greedy)
            memo.at, memo.proposed = -1, keys
            out.append(Draft(draft))
        return out

    def peek(self, state: Any, tokens: list[int], k: int, greedy: bool = True) -> list[float]:
        """The chain probabilities (`Confidence.chain`) of the draft of up to `k` tokens that
        this step's `propose` will cut to the k the policy chooses; `greedy`: the request's
        decoding (a sampled request keeps a one-hot draft less often: its own rates)."""
        memo: Peeked = state.peeked
        memo.tokens, memo.keys = self._keyed(state, tokens, k, greedy)
        memo.at, memo.k = len(tokens), k
        return self.confidence.chain(memo.keys)

    def _keyed(
        self, state: Any, tokens: list[int], k: int, greedy: bool
    ) -> tuple[list[int], list[Hashable]]:
        draft, kinds = self._draft(state, tokens, k)
        return draft, [(greedy, kind) for kind in kinds]

    def outcome(self, state: Any, drafted: int, accepted: int) -> None:
        """The target kept `accepted` of the first `drafted` tokens the last `propose` gave."""
        memo: Peeked = state.peeked
        keys, memo.proposed = memo.proposed, []
        self.confidence.observe(keys, drafted, accepted)
