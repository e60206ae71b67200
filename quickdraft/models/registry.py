"""Explicit maps from Hugging Face `model_type` to our model code (no import magic): the model
class, its config reader, how checkpoint tensor names map onto its parameters, and the parts an
MTP head (`mtp.*`) of that family is built from."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.models.families.gemma3 import Gemma3Config, Gemma3LM
from quickdraft.models.families.gemma4 import Gemma4LM, gemma4_name_map
from quickdraft.models.families.gemma4_config import Gemma4Config
from quickdraft.models.families.gpt_oss import GptOssConfig, GptOssLM
from quickdraft.models.families.hybrid_config import (
    HYBRID_TYPES,
    HybridConfig,
    NameMap,
    checkpoint_name_map,
)
from quickdraft.models.families.llama import CausalLM
from quickdraft.models.families.qwen3_next import HybridLM
from quickdraft.models.families.vision import ImageTower, VisionConfig, VisionTower
from quickdraft.models.families.vision_gemma4 import Gemma4VisionTower
from quickdraft.models.families.vision_qwen25 import Qwen25VisionTower
from quickdraft.models.heads.mtp import MTPParts, hybrid_mtp_parts, llama_mtp_parts

DENSE_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # CausalLM (qwen3_moe: routed experts)
# dense vision-language models: CausalLM with M-RoPE, the tower beside it
# (models/families/vision_qwen25.py)
DENSE_VL_TYPES = ("qwen2_5_vl",)
GEMMA4_TYPES = ("gemma4_text", "gemma4")  # the text decoder alone, or in the multimodal model

MODELS: dict[str, type[nn.Module]] = {
    **{t: CausalLM for t in DENSE_TYPES + DENSE_VL_TYPES},
    **{t: HybridLM for t in HYBRID_TYPES},
    "gemma3_text": Gemma3LM,
    **{t: Gemma4LM for t in GEMMA4_TYPES},
    "gpt_oss": GptOssLM,
}

# model_type -> config.json reader (model dir -> config record); default ModelConfig.from_hf
CONFIGS: dict[str, Callable[[Path], Any]] = {
    **{t: HybridConfig.from_hf for t in HYBRID_TYPES},
    "gemma3_text": Gemma3Config.from_hf,
    **{t: Gemma4Config.from_hf for t in GEMMA4_TYPES},
    "gpt_oss": GptOssConfig.from_hf,
}

# model_type -> (config -> checkpoint name map); default: checkpoint names are ours
# (Qwen3-MoE checkpoints store one tensor per expert too)
NAME_MAPS: dict[str, Callable[[Any], NameMap]] = {
    **{t: checkpoint_name_map for t in HYBRID_TYPES + DENSE_VL_TYPES},
    "qwen3_moe": checkpoint_name_map,
    **{t: gemma4_name_map for t in GEMMA4_TYPES},
}

# model_type -> (config, dtype, device -> the decoder layer / norms / RoPE of its MTP head)
MTP_PARTS: dict[str, Callable[..., MTPParts]] = {
    **{t: llama_mtp_parts for t in DENSE_TYPES},
    **{t: hybrid_mtp_parts for t in HYBRID_TYPES},
}


# vision tower family (VisionConfig.kind) -> its class
TOWERS: dict[str, type[ImageTower]] = {
    "qwen3_5": VisionTower,
    "qwen2_5_vl": Qwen25VisionTower,
    "gemma4": Gemma4VisionTower,
}


def vision_tower(cfg: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> ImageTower:
    return TOWERS[cfg.kind](cfg, dtype, device)


def model_class(model_type: str) -> type[nn.Module]:
    try:
        return MODELS[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {sorted(MODELS)}"
        ) from None


def read_config(path: Path) -> Any:
    """The config record of the model directory `path`, by its `model_type`."""
    model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    model_class(model_type)  # a clear error for unsupported types before any parsing
    return CONFIGS.get(model_type, ModelConfig.from_hf)(path)


def same_names(name: str) -> tuple[str, tuple[int | slice, ...]] | None:
    return name, ()


def name_map(cfg: Any) -> NameMap:
    factory = NAME_MAPS.get(cfg.model_type)
    return same_names if factory is None else factory(cfg)


def mtp_parts(model_type: str) -> Callable[..., MTPParts]:
    try:
        return MTP_PARTS[model_type]
    except KeyError:
        raise ValueError(f"no MTP head support for model_type {model_type!r}") from None
