"""Load a Hugging Face-format directory (config.json + *.safetensors) into our model classes.

Tensors are streamed one at a time from the safetensors files straight into the pre-allocated
parameters (converted to the model dtype on the way), so peak memory is about one model copy.
Only safetensors are read: no pickle, no torch.load.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.models.base import LanguageModel
from quickdraft.models.registry import model_class


def load_model(
    path: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> LanguageModel:
    path = Path(path)
    cfg = ModelConfig.from_hf(path)
    cls = model_class(cfg.model_type)
    model = cls(cfg, dtype, device)
    load_weights(model, sorted(path.glob("*.safetensors")))
    return model  # type: ignore[return-value]  # every MODELS class implements LanguageModel


def load_weights(model: nn.Module, files: list[Path]) -> None:
    if not files:
        raise FileNotFoundError("no *.safetensors files to load")
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(params)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name not in params:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # some checkpoints store the (derivable) RoPE table
                    raise ValueError(f"{file.name}: unexpected tensor {name!r}")
                target = params[name]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{file.name}: {name} has shape {tuple(tensor.shape)}, "
                        f"model expects {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor)
                missing.discard(name)
    # A tied parameter (lm_head sharing the embedding) was filled through its twin.
    loaded = {params[n].data_ptr() for n in params if n not in missing}
    missing = {n for n in missing if params[n].data_ptr() not in loaded}
    if missing:
        raise ValueError(f"checkpoint lacks tensors: {sorted(missing)[:8]}")
