"""Assemble speculation for a loaded target: the drafter (registry `DRAFTERS`) and its measured
cost. `QUICKDRAFT_DISABLE_SPECULATION=1` turns speculation off everywhere (for bisecting).

A factory returns the drafter and its cost per draft position relative to a one-row target
forward (0 for a lookup); the batch policy (quickdraft/policy.py) scales it with the target's
measured step-cost curve, which `make_speculation` measures once per loaded target.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from quickdraft.config import SpeculativeConfig
from quickdraft.drafters.base import Drafter
from quickdraft.drafters.draft_model import DraftModelDrafter
from quickdraft.drafters.mtp import head_step_seconds, mtp_drafter
from quickdraft.drafters.ngram import NgramDrafter
from quickdraft.generate import LoadedModel, load
from quickdraft.policy import measure_step_seconds


@dataclass(slots=True)
class Speculation:
    config: SpeculativeConfig
    drafter: Drafter
    draft_cost: float  # one draft position / one-row target forward (0: free)


def disabled_by_env() -> bool:
    return os.environ.get("QUICKDRAFT_DISABLE_SPECULATION", "") not in ("", "0")


def _ngram(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, float]:
    return NgramDrafter(config.ngram_min, config.ngram_max), 0.0  # a dict lookup: free


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
    lm.step_cost()  # measured now (seconds), not in the first request's first step
    return Speculation(config, drafter, draft_cost)
