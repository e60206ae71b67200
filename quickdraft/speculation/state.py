"""What a served model speculates with (`Speculation`), and one request's share of it (`SpecState`).

Stage: the records the engine holds per model and per request; the engine never reads their
fields beyond handing them to the drafter, the verify step and the policy. A `Speculation` is
built once per model configuration (speculation/factory.py) and shared by every request
submitted under it; `start(prompt)` gives a request its `SpecState`: per drafter an `Arm` (the
drafter's per-request state, the running acceptance estimate the policy prices drafts with, how
far the drafter has caught up, and the target hidden rows a hidden-reading drafter has not been
given yet). One drafter: one arm. Method "adaptive" (`AdaptiveSpeculation`): one arm per
drafter it may use, and `active` names the one the policy picked for the step
(speculation/adaptive.py); `drafter`, `draft_state`, `acceptance` and `synced` are the active
arm's, so the rest of the engine sees one drafter per request and step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from quickdraft.config import SpeculativeConfig
from quickdraft.request import SamplingParams
from quickdraft.speculation.cost import DraftCost
from quickdraft.speculation.drafters.base import Drafter, DraftJob
from quickdraft.speculation.drafters.confidence import ScoredLookup
from quickdraft.speculation.relaxed import ThinkScan

FIRST_ALPHA = 0.8  # a drafter's acceptance record before its first draft (`Speculation.pooled`)


@dataclass(slots=True)
class Acceptance:
    """One request's running draft-acceptance estimate. `alpha`: the maximum-likelihood rate
    under the 'each draft accepted with probability alpha given the previous ones' model. The
    policy prices drafts by the depth profile instead (`chain`): c_j, the rate at which draft j
    is kept once every draft before it was, counted per position. A lookup drafter's profile
    is far from flat: on SmolLM2 code with n-gram, c_1 = 0.33 but c_2..c_5 = 0.64-0.78 (a match
    that starts right tends to run on), so alpha^j (alpha 0.47) overprices the first draft and
    underprices the fourth 2x."""

    prior_alpha: float = 0.5
    prior_weight: float = 4.0  # the prior counts as this many observed drafts
    forget: float = 0.97  # per drafted cycle: the estimate follows a request's phases
    successes: float = 0.0
    failures: float = 0.0
    idle_steps: int = 0  # decode steps since it last drafted
    # the share of the cycles it was asked to draft in where the drafter proposed >= 1 token
    # (a lookup finds no match), exponentially weighted like the counts above; prior 1
    hit_rate: float = 1.0
    # per draft position j (0-based), forgotten like the counts above: cycles that drafted it
    # with every earlier draft kept, and those that kept it too; `prior_depth` the positions'
    # prior rates (a drafter's record: `Speculation.arm`), else `prior_alpha` everywhere
    reached: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)
    prior_depth: tuple[float, ...] = ()

    @property
    def alpha(self) -> float:
        s = self.successes + self.prior_alpha * self.prior_weight
        f = self.failures + (1 - self.prior_alpha) * self.prior_weight
        return min(s / (s + f), 0.999)

    def conditional(self, j: int) -> float:
        """c_j: P(draft j kept | drafts 0 .. j-1 kept), position j 0-based."""
        depth = self.prior_depth
        prior = depth[min(j, len(depth) - 1)] if depth else self.prior_alpha
        reached = self.reached[j] if j < len(self.reached) else 0.0
        kept = self.kept[j] if j < len(self.kept) else 0.0
        weight = reached + self.prior_weight
        rate = (kept + prior * self.prior_weight) / weight if weight > 0 else prior
        return min(rate, 0.999)

    def chain(self, k: int) -> list[float]:
        """Expected tokens each of drafts 1 .. k adds: c_0, c_0 c_1, ... (non-increasing)."""
        out, p = [], 1.0
        for j in range(k):
            p *= self.conditional(j)
            out.append(p)
        return out

    def depth(self) -> tuple[float, ...]:
        """c_j of every position observed so far: a new request's `prior_depth`."""
        return tuple(self.conditional(j) for j in range(len(self.reached)))

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.successes = self.successes * self.forget + accepted
        self.failures = self.failures * self.forget + (1 if accepted < drafted else 0)
        grow = drafted - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.kept += [0.0] * grow
        for j in range(len(self.reached)):
            self.reached[j] *= self.forget
            self.kept[j] *= self.forget
        for j in range(min(accepted + 1, drafted)):
            self.reached[j] += 1.0
        for j in range(accepted):
            self.kept[j] += 1.0

    def restart_from_here(self) -> None:
        """What was observed so far becomes the prior (weighing `prior_weight` drafts)."""
        self.prior_alpha, self.prior_depth = self.alpha, self.depth() or self.prior_depth
        self.successes = self.failures = 0.0
        self.reached, self.kept = [], []

    def asked(self, drafted: int) -> None:
        """The drafter was asked for drafts and proposed `drafted`. The rate moves faster than
        the counts (weight 1 - forget^4: ~0.11 per cycle for a request's estimate): whether a
        lookup finds a match changes with the text at once."""
        self.hit_rate += (1.0 - self.forget**4) * ((drafted > 0) - self.hit_rate)


@dataclass(slots=True)
class Speculation:
    """A model's speculation settings, its drafter and what the drafter's forwards cost."""

    config: SpeculativeConfig
    drafter: Drafter
    draft_cost: DraftCost | None  # None: free to draft (n-gram), or no adaptive policy
    # every request's drafts so far, slowly forgotten: a new request's prior. With a fixed
    # prior of 0.5 a draft model costing a third of the target's step priced its first draft
    # at break-even, drafted nothing, and never caught up to probe (the whole prompt to feed
    # first): after one request, the 1.5B + 0.5B pair on GGUF weights drafted in none of the
    # next ten code prompts. The same held for a drafter's very first request while its record
    # was still the neutral 0.5 (a fresh process: AL 1.46 on code where a warm record gave
    # 4.4), so a drafter's record starts optimistic, FIRST_ALPHA: its first drafted cycles pull
    # it to what the drafter achieves (the prior weighs as 4 drafts), and a drafter that
    # guesses poorly stops within a few cycles (its drafts also stop on their own chain
    # probability, policy.py).
    pooled: Acceptance = field(
        default_factory=lambda: Acceptance(prior_alpha=FIRST_ALPHA, forget=0.995)
    )

    def arm(self, prompt_ids: list[int], tenant: str = "") -> Arm:
        """A request's share of this drafter; its acceptance prior is what the drafter's
        drafts achieved so far (`pooled`)."""
        pooled = self.pooled
        prior = Acceptance(
            prior_alpha=pooled.alpha, hit_rate=pooled.hit_rate, prior_depth=pooled.depth()
        )
        return Arm(self, self.drafter.new_state(prompt_ids, tenant), prior)

    def start(self, prompt_ids: list[int], tenant: str = "") -> SpecState:
        return SpecState(self.config, [self.arm(prompt_ids, tenant)])


@dataclass(slots=True)
class AdaptiveSpeculation:
    """Method "adaptive": several drafters (each a one-drafter `Speculation` with its own cost
    table and pooled acceptance) among which each request picks per step."""

    config: SpeculativeConfig
    members: tuple[Speculation, ...]

    def start(self, prompt_ids: list[int], tenant: str = "") -> SpecState:
        arms = [m.arm(prompt_ids, tenant) for m in self.members]
        for arm in arms:
            if arm.speculation.draft_cost is None:
                warm_up(arm, prompt_ids, self.config.num_draft_tokens)
        return SpecState(self.config, arms)


# prompt positions a free lookup shadow-drafts at before a request's first pick (warm_up),
# ending WARM_UP_TAIL tokens before the prompt's end
WARM_UP_POSITIONS = 32
WARM_UP_TAIL = 8


def warm_up(arm: Arm, prompt_ids: list[int], k: int) -> None:
    """Score a free lookup on WARM_UP_POSITIONS prompt positions before the request decodes:
    at each, what it drafts from the tokens before (its state grows with them, as it would
    anyway) against the prompt's next tokens (`shadow_score`). The first pick then weighs this
    request's text, not only earlier requests' pooled prior: an agent's prompt that resends
    files makes its lookups look good at once, before a draft model is picked and pays to
    prefill the whole prompt. The last WARM_UP_TAIL positions are left out: a chat prompt ends
    in the template's turn markers, which every earlier turn also holds, and scoring them made
    the lookups look as good as the draft model on single-question code prompts (measured:
    adaptive 0.72x the draft model on the code set).

    The score becomes the request's prior, weighing as `prior_weight` drafts: it sets where the
    estimate starts, and the request's own cycles then move it at once. Kept as counts, the 24
    positions outweighed the first decode cycles: on the agentic replay a prompt tail of new
    instructions started both lookups near alpha 0.4 while the answer copied a file, and the
    policy drafted 2-6 tokens for most of a 128-token answer that the suffix drafter alone
    drafted 15 at a time (adaptive 0.94x suffix, bench/results/agentic-k16-prefix-cache)."""
    if k <= 0:
        return
    drafter = arm.speculation.drafter
    params, generator = SamplingParams(), torch.Generator()
    end = len(prompt_ids) - WARM_UP_TAIL
    for p in range(max(1, end - WARM_UP_POSITIONS), end):
        job = DraftJob(arm.draft_state, prompt_ids[:p], k, params, generator)
        arm.shadow = drafter.propose([job])[0].tokens
        shadow_score(arm, prompt_ids[p:], learn=False)
    arm.acceptance.restart_from_here()


AnySpeculation = Speculation | AdaptiveSpeculation


def shadow_score(arm: Arm, emitted: Sequence[int], learn: bool = True) -> None:
    """Learn from a shadow draft: its prefix that matches the emitted tokens is what verify
    would have accepted (greedy: the emitted tokens are the target's argmaxes; seeded sampling
    of one-hot drafts: each position's draw, verify.py `verify_one_hot`), observed as far as the
    emitted tokens reach; a mismatch within them is a rejection. `learn`: a scored lookup's
    `Confidence` learns too (not from the prompt's own text, which the target did not write)."""
    shadow, arm.shadow = arm.shadow or [], None
    n = min(len(shadow), len(emitted))
    matched = 0
    while matched < n and shadow[matched] == emitted[matched]:
        matched += 1
    arm.acceptance.asked(len(shadow))
    arm.acceptance.update(matched + 1 if matched < n else matched, matched)
    drafter = arm.speculation.drafter
    if learn and isinstance(drafter, ScoredLookup):
        drafter.outcome(arm.draft_state, n, matched)


@dataclass(slots=True, eq=False)
class Arm:
    """One request's share of one drafter."""

    speculation: Speculation
    draft_state: Any  # the drafter's own per-request state
    acceptance: Acceptance = field(default_factory=Acceptance)
    synced: int = 0  # committed tokens the drafter has seen (its catch-up, policy.py)
    prompt_hidden: list[Tensor] = field(default_factory=list)  # prefill chunks' hidden rows
    idle: int = 0  # decode steps since it was last picked to draft (adaptive.py explores)
    # a free lookup that was not picked: what it would have drafted this step (adaptive.py
    # learns its acceptance from it against the emitted tokens); None: it did not
    shadow: list[int] | None = None

    @property
    def name(self) -> str:
        return self.speculation.config.method


@dataclass(slots=True, eq=False)
class SpecState:
    """One request's speculation: its arms (one per drafter) and the active one."""

    config: SpeculativeConfig  # the request's: method "adaptive" for several arms
    arms: list[Arm]
    active: int = 0
    think: ThinkScan | None = None  # reasoning-block tracking (relaxed acceptance), when on

    @property
    def arm(self) -> Arm:
        return self.arms[self.active]

    @property
    def speculation(self) -> Speculation:
        return self.arm.speculation

    @property
    def drafter(self) -> Drafter:
        return self.arm.speculation.drafter

    @property
    def draft_state(self) -> Any:
        return self.arm.draft_state

    @property
    def acceptance(self) -> Acceptance:
        return self.arm.acceptance

    @property
    def synced(self) -> int:
        return self.arm.synced

    @synced.setter
    def synced(self, value: int) -> None:
        self.arm.synced = value

    @property
    def prompt_hidden(self) -> list[Tensor]:
        return self.arm.prompt_hidden

    def arm_of(self, drafter: object) -> Arm:
        """The arm of `drafter` (the prefix cache keeps one drafter's state per request)."""
        return next(a for a in self.arms if a.speculation.drafter is drafter)

    def record(
        self,
        drafted: int,
        accepted: int,
        drafter_ran: bool,
        num_tokens: int,
        emitted: Sequence[int] = (),
    ) -> None:
        """A verify cycle ended with `num_tokens` committed tokens: `drafted` drafts of which
        `accepted` were kept; `drafter_ran` when the (active) drafter was asked this step;
        `emitted`: the cycle's tokens (accepted drafts + one), which score the shadow drafts."""
        for other in self.arms:
            if other.shadow is not None:
                shadow_score(other, emitted)
        arm = self.arm
        arm.acceptance.update(drafted, accepted)
        arm.speculation.pooled.update(drafted, accepted)
        drafter = arm.speculation.drafter
        if drafted and isinstance(drafter, ScoredLookup):
            drafter.outcome(arm.draft_state, drafted, accepted)
        if drafter_ran:
            arm.acceptance.asked(drafted)
            arm.speculation.pooled.asked(drafted)
            # It has seen every committed token but the newest, and after an all-accepted cycle
            # not the last draft either (a draft model feeds d_1..d_{k-1}).
            arm.synced = num_tokens - (2 if 0 < drafted == accepted else 1)

    def free(self) -> None:
        for arm in self.arms:
            arm.shadow = None
            arm.speculation.drafter.free(arm.draft_state)
            arm.prompt_hidden.clear()
