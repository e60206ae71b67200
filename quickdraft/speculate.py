"""Assemble speculation for a loaded target: the drafter (registry `DRAFTERS`) and its measured
cost. `QUICKDRAFT_DISABLE_SPECULATION=1` turns speculation off everywhere (for bisecting).

A factory returns the drafter and its cost per draft position relative to a one-row target
forward (0 for a lookup); the batch policy (quickdraft/policy.py) scales it with the target's
measured step-cost curve, which `make_speculation` measures once per loaded target. That
start-up ratio is a two-forward probe and was seen off by 1.6x (0.31 instead of ~0.19 for the
0.5B int8 draft of the 1.5B, which made the policy draft too little), so once decoding runs the
engine measures the ratio in every speculative step (`Speculation.observe`: the draft phase and
the target forward of the same step) and the policy uses the median of the recent ones.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from quickdraft.config import SpeculativeConfig
from quickdraft.drafters.base import Drafter
from quickdraft.drafters.draft_model import DraftModelDrafter
from quickdraft.drafters.mtp import head_step_seconds, mtp_drafter
from quickdraft.drafters.ngram import NgramDrafter
from quickdraft.generate import LoadedModel, load
from quickdraft.policy import measure_step_seconds

COST_SAMPLES = 32  # the recent steps whose measured draft cost the policy uses (median)
MIN_COST_SAMPLES = 4  # before that many, the start-up probe


@dataclass(slots=True)
class Speculation:
    config: SpeculativeConfig
    drafter: Drafter
    startup_cost: float  # one draft position / one-row target forward, probed at start (0: free)
    cost_samples: deque[float] = field(default_factory=lambda: deque(maxlen=COST_SAMPLES))

    @property
    def draft_cost(self) -> float:
        """One draft position's cost relative to a one-row target forward, as the policy
        uses it: the median of the last COST_SAMPLES measured steps, the start-up probe until
        MIN_COST_SAMPLES exist; a free drafter (n-gram) stays 0."""
        if self.startup_cost == 0.0 or len(self.cost_samples) < MIN_COST_SAMPLES:
            return self.startup_cost
        return statistics.median(self.cost_samples)

    def observe(self, seconds_per_position: float, target_row_seconds: float) -> None:
        """One step's measurement: its draft phase per draft position, and its target forward
        scaled to one row by the step-cost curve."""
        if self.startup_cost > 0.0 and seconds_per_position > 0.0 and target_row_seconds > 0.0:
            self.cost_samples.append(seconds_per_position / target_row_seconds)


def disabled_by_env() -> bool:
    return os.environ.get("QUICKDRAFT_DISABLE_SPECULATION", "") not in ("", "0")


def _ngram(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, float]:
    drafter = NgramDrafter(
        config.ngram_min, config.ngram_max, shared_tokens=config.ngram_shared_tokens
    )
    return drafter, 0.0  # a dict lookup: free


def _draft_model(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, float]:
    assert config.draft_model is not None
    draft = load(
        config.draft_model, lm.dtype_name, progress=True, quantization=config.draft_quantization
    )
    if draft.tokenizer.fingerprint() != lm.tokenizer.fingerprint():
        raise ValueError(
            f"draft model {config.draft_model!r} does not share the target's tokenizer "
            f"({lm.name}): speculative decoding needs identical token ids"
        )
    drafter = DraftModelDrafter(draft.model, lm.model.config.vocab_size)
    ratio = measure_step_seconds(draft.model) / measure_step_seconds(lm.model)
    return drafter, ratio


def _mtp(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, float]:
    drafter = mtp_drafter(lm.model, lm.path)
    return drafter, head_step_seconds(drafter.head) / measure_step_seconds(lm.model)


# method -> factory(loaded target, config) -> (drafter, draft cost per token / target step)
DRAFTERS: dict[str, Callable[[LoadedModel, SpeculativeConfig], tuple[Drafter, float]]] = {
    "ngram": _ngram,
    "draft": _draft_model,
    "mtp": _mtp,
}


def make_speculation(lm: LoadedModel, config: SpeculativeConfig) -> Speculation | None:
    if not config.enabled or disabled_by_env():
        return None
    drafter, draft_cost = DRAFTERS[config.method](lm, config)
    if config.adaptive:  # only the adaptive policy needs it (forced requests draft k always)
        lm.step_cost()  # measured now (seconds), not in the first request's first step
    return Speculation(config, drafter, draft_cost)
