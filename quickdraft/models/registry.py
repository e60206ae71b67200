"""Explicit map from Hugging Face `model_type` to our model class (no import magic)."""

from __future__ import annotations

from torch import nn

from quickdraft.models.llama import CausalLM

MODELS: dict[str, type[nn.Module]] = {
    "llama": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
}


def model_class(model_type: str) -> type[nn.Module]:
    try:
        return MODELS[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {sorted(MODELS)}"
        ) from None
