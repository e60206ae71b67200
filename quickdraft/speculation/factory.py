"""Assemble speculation for a loaded target: the drafter (registry `DRAFTERS`) and its cost.

A factory returns the drafter and how to time its forwards: a step-cost table in seconds, in
the target's format (cost.py `StepCost`), or None for a lookup that costs nothing. The draft
model's table is its own, timed like the target's (once per machine: cost.py stores it); the
MTP head's (and the DFlash drafter's) is the target's scaled by one timed head (block) step
against one target step. Tables are only measured for the adaptive policy (forced requests
draft k regardless of cost), and the engine then times every draft phase against them, so a
table taken on a busy host is corrected once decoding runs.
Method "adaptive" builds one such drafter per name in `config.drafters` (each its own
`Speculation`, with its own cost table and pooled acceptance; one draft model load), and each
request picks among them per step (speculation/adaptive.py).
`QUICKDRAFT_DISABLE_SPECULATION=1` turns speculation off everywhere (bisecting).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

from quickdraft.config import SpeculativeConfig
from quickdraft.image_encoder import ImageEncoder
from quickdraft.loading import LoadedModel, load
from quickdraft.memory import trim_heap
from quickdraft.models.formats.gguf_loader import GGUFFormatError
from quickdraft.models.heads.gemma4_assistant import is_assistant_dir
from quickdraft.speculation.cost import DraftCost, StepCost, model_cost
from quickdraft.speculation.drafters.assistant import (
    AssistantDrafter,
    assistant_drafter,
    assistant_step_seconds,
)
from quickdraft.speculation.drafters.base import Drafter
from quickdraft.speculation.drafters.dflash import block_step_seconds, dflash_drafter
from quickdraft.speculation.drafters.draft_model import DraftModelDrafter
from quickdraft.speculation.drafters.eagle3 import eagle3_drafter
from quickdraft.speculation.drafters.mtp import head_step_seconds, mtp_drafter
from quickdraft.speculation.drafters.ngram import NgramDrafter
from quickdraft.speculation.drafters.suffix import SuffixDrafter
from quickdraft.speculation.state import AdaptiveSpeculation, AnySpeculation, Speculation

log = logging.getLogger(__name__)

CostTable = Callable[[], StepCost] | None  # measures a drafter's forwards; None: free


def disabled_by_env() -> bool:
    return os.environ.get("QUICKDRAFT_DISABLE_SPECULATION", "") not in ("", "0")


def _ngram(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, CostTable]:
    drafter = NgramDrafter(
        config.ngram_min,
        config.ngram_max,
        shared_tokens=config.ngram_shared_tokens,
        barrier=lm.image_token_ids,
    )
    return drafter, None  # a dict lookup: free


def _suffix(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, CostTable]:
    drafter = SuffixDrafter(
        config.suffix_max_depth,
        config.suffix_max_spec_factor,
        config.suffix_min_token_prob,
        config.suffix_shared_tokens,
        barrier=lm.image_token_ids,
    )
    return drafter, None  # a tree walk: free


def _draft_format(lm: LoadedModel, config: SpeculativeConfig) -> str:
    """--draft-quantization where the drafter runs: int8 / int4 are CPU kernels, so on a GPU
    a draft model or trained MTP head runs in the target's dtype (bf16)."""
    return config.draft_quantization if lm.model.device.type == "cpu" else "none"


def _draft_model(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, CostTable]:
    assert config.draft_model is not None
    device = lm.model.device
    quantization = _draft_format(lm, config)
    try:
        draft = load(
            config.draft_model, lm.dtype_name, str(device), progress=True, quantization=quantization
        )
    except GGUFFormatError as e:
        if quantization == "none":
            raise
        # a GGUF of a family that runs on its own blocks (MoE, hybrid, Gemma 4, gpt-oss):
        # already 4-8 bits a weight, it drafts as it is
        log.info(
            "draft model %s runs on its own GGUF blocks, not %s (%s)",
            config.draft_model,
            quantization,
            e,
        )
        draft = load(config.draft_model, lm.dtype_name, str(device), progress=True)
    if draft.tokenizer.fingerprint() != lm.tokenizer.fingerprint():
        raise ValueError(
            f"draft model {config.draft_model!r} does not share the target's tokenizer "
            f"({lm.name}): speculative decoding needs identical token ids"
        )
    encoder = None
    if draft.vision is not None and lm.vision is not None:
        same_layout(draft, lm)
        encoder = ImageEncoder(draft.vision)
    model = draft.model
    del draft  # its tokenizer (~0.2 GB for a 151k vocabulary) served only the check above
    trim_heap()
    if 0 < config.draft_vocab < model.config.vocab_size:
        model.restrict_vocab_(config.draft_vocab, lm.eos_ids)
    drafter = DraftModelDrafter(model, lm.model.config.vocab_size, encoder)
    return drafter, lambda: model_cost(model)


def same_layout(draft: LoadedModel, lm: LoadedModel) -> None:
    """A vision-language draft model reads the target's image layout (placeholder counts and
    M-RoPE positions): the two must cut an image alike."""
    assert draft.vision is not None and lm.vision is not None
    mine, theirs = draft.vision.config, lm.vision.config
    same = (
        draft.image_processing == lm.image_processing
        and mine.spatial_merge_size == theirs.spatial_merge_size
        and mine.image_token_id == theirs.image_token_id
    )
    if not same:
        raise ValueError(
            f"draft model {draft.name!r} is a vision-language model that preprocesses images "
            f"unlike the target {lm.name!r} ({draft.image_processing} vs "
            f"{lm.image_processing}): its image rows would not line up with the target's"
        )


def _mtp(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, CostTable]:
    # the target's own head, or a standalone one trained for it (train-drafter --kind mtp),
    # or a Gemma 4 assistant (vLLM's "mtp" for them); --draft-quantization int8 / int4 applies
    # to a trained head's own weights
    if config.draft_model is not None and is_assistant_dir(config.draft_model):
        return _assistant(lm, config)
    drafter = mtp_drafter(
        lm.model,
        config.draft_model or lm.path,
        quantization=_draft_format(lm, config),
        keep=config.draft_vocab,
        extra=lm.eos_ids,
    )

    def table() -> StepCost:
        target = model_cost(lm.model)  # its 1-row step is the one the head step is compared with
        return target.scaled(head_step_seconds(drafter.head) / target.seconds[0])

    return drafter, table


def _eagle3(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, CostTable]:
    if config.draft_model is None:
        raise ValueError(
            "--speculative-method eagle3 needs the head: --draft-model DIR (config.json and "
            "safetensors in the EAGLE, SpecForge or speculators layout)"
        )
    drafter = eagle3_drafter(
        lm.model, config.draft_model, _draft_format(lm, config), config.draft_vocab, lm.eos_ids
    )

    def table() -> StepCost:  # priced like the MTP head: one chained head step
        target = model_cost(lm.model)
        return target.scaled(head_step_seconds(drafter.head) / target.seconds[0])

    return drafter, table


def _dflash(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, CostTable]:
    assert config.draft_model is not None
    drafter = dflash_drafter(
        lm.model,
        config.draft_model,
        config.dflash_block_size,
        config.dflash_window,
        config.draft_vocab,
        lm.eos_ids,
    )

    def table() -> StepCost:
        # one block forward priced like the MTP head: the target's curve, scaled
        target = model_cost(lm.model)
        return target.scaled(block_step_seconds(drafter) / target.seconds[0])

    return drafter, table


def _assistant(lm: LoadedModel, config: SpeculativeConfig) -> tuple[Drafter, CostTable]:
    if config.draft_model is None:
        raise ValueError(
            "--speculative-method assistant needs the Gemma 4 assistant checkpoint: "
            "--draft-model DIR (or llama.cpp's gemma4-assistant GGUF)"
        )
    # --draft-quantization (int4 by default on the CPU) as for draft models
    drafter = assistant_drafter(lm.model, config.draft_model, _draft_format(lm, config))
    return drafter, assistant_costs(lm, drafter)


def assistant_costs(lm: LoadedModel, drafter: AssistantDrafter) -> Callable[[], StepCost]:
    """What measures an assistant's step-cost table: priced like the MTP head, one chained
    step on the target's curve."""

    def table() -> StepCost:
        target = model_cost(lm.model)
        return target.scaled(assistant_step_seconds(drafter) / target.seconds[0])

    return table


# method -> factory(loaded target, config) -> (drafter, what measures its cost table)
DRAFTERS: dict[str, Callable[[LoadedModel, SpeculativeConfig], tuple[Drafter, CostTable]]] = {
    "ngram": _ngram,
    "suffix": _suffix,
    "draft": _draft_model,
    "mtp": _mtp,
    "eagle3": _eagle3,
    "dflash": _dflash,
    "assistant": _assistant,
}


def make_speculation(lm: LoadedModel, config: SpeculativeConfig) -> AnySpeculation | None:
    if not config.enabled or disabled_by_env():
        return None
    if config.method == "adaptive":
        members = [
            _one(lm, dataclasses.replace(config, method=name, adaptive_drafters=()))
            for name in config.drafters
        ]
        return AdaptiveSpeculation(config, tuple(members))
    return _one(lm, config)


def _one(lm: LoadedModel, config: SpeculativeConfig) -> Speculation:
    if config.adaptive:  # only the adaptive policy needs costs (forced requests draft k always)
        # measured now (seconds), not in the first request's first step, and before the
        # drafter loads: the measurement's caches and logits are freed by then, so a start's
        # peak holds one or the other (a full-size hybrid's first start: 0.35 GiB less)
        model_cost(lm.model)
    drafter, table = DRAFTERS[config.method](lm, config)
    cost = DraftCost(table()) if config.adaptive and table is not None else None
    return Speculation(config, drafter, cost)
