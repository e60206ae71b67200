"""What a served model speculates with (`Speculation`), and one request's share of it (`SpecState`).

Stage: the records the engine holds per model and per request; the engine never reads their
fields beyond handing them to the drafter, the verify step and the policy. A `Speculation` is
built once per model configuration (speculation/factory.py) and shared by every request
submitted under it; `start(prompt)` gives a request its `SpecState`: the drafter's per-request
state, the running acceptance estimate the policy prices drafts with, how far the drafter has
caught up, and the target hidden rows a hidden-reading drafter has not been given yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from quickdraft.config import SpeculativeConfig
from quickdraft.speculation.cost import DraftCost
from quickdraft.speculation.drafters.base import Drafter


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

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.successes = self.successes * self.forget + accepted
        self.failures = self.failures * self.forget + (1 if accepted < drafted else 0)


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
    # next ten code prompts.
    pooled: Acceptance = field(default_factory=lambda: Acceptance(forget=0.995))

    def start(self, prompt_ids: list[int], tenant: str = "") -> SpecState:
        prior = Acceptance(prior_alpha=self.pooled.alpha)
        return SpecState(self, self.drafter.new_state(prompt_ids, tenant), prior)


@dataclass(slots=True, eq=False)
class SpecState:
    """One request's speculation."""

    speculation: Speculation
    draft_state: Any  # the drafter's own per-request state
    acceptance: Acceptance = field(default_factory=Acceptance)
    synced: int = 0  # committed tokens the drafter has seen (its catch-up, policy.py)
    prompt_hidden: list[Tensor] = field(default_factory=list)  # prefill chunks' hidden rows

    @property
    def config(self) -> SpeculativeConfig:
        return self.speculation.config

    @property
    def drafter(self) -> Drafter:
        return self.speculation.drafter

    def record(self, drafted: int, accepted: int, drafter_ran: bool, num_tokens: int) -> None:
        """A verify cycle ended with `num_tokens` committed tokens: `drafted` drafts of which
        `accepted` were kept; `drafter_ran` when the drafter was asked this step."""
        self.acceptance.update(drafted, accepted)
        self.speculation.pooled.update(drafted, accepted)
        if drafter_ran:
            # It has seen every committed token but the newest, and after an all-accepted cycle
            # not the last draft either (a draft model feeds d_1..d_{k-1}).
            self.synced = num_tokens - (2 if 0 < drafted == accepted else 1)

    def free(self) -> None:
        self.drafter.free(self.draft_state)
        self.prompt_hidden.clear()
