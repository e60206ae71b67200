"""Load a Hugging Face-format directory (config.json + *.safetensors) into our model classes.

Tensors are streamed one at a time from the safetensors files straight into the pre-allocated
parameters (converted to the model dtype on the way), so peak memory is about one model copy.
A model type's name map (models/registry.py) may rename checkpoint tensors, place them inside a
fused parameter (per-expert MoE tensors) or skip them (a vision tower). `mtp.*` tensors belong
to an MTP head, which drafters/mtp.py loads on demand; loading the target ignores them.
Only safetensors are read: no pickle, no torch.load.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from quickdraft.hub.convert import GGUF_LINK
from quickdraft.models.base import LanguageModel
from quickdraft.models.families.gpt_oss import GptOssLM, is_mxfp4, mxfp4_experts
from quickdraft.models.families.hybrid_config import NameMap
from quickdraft.models.families.vision import ImageTower, VisionConfig
from quickdraft.models.formats.gguf_gemma4_loader import load_gemma4_gguf
from quickdraft.models.formats.gguf_loader import GGUFFormatError, is_gguf_dir, load_gguf_model
from quickdraft.models.formats.gguf_qwen_loader import QWEN_TYPES, load_qwen_gguf
from quickdraft.models.registry import (
    GEMMA4_TYPES,
    model_class,
    name_map,
    read_config,
    same_names,
    vision_tower,
)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    quantization: str = "none",
) -> LanguageModel:
    """The model in `path`. `quantization` ("int8" / "int4") is applied here only to a GGUF
    model directory, whose quantized copy is kept on disk; the caller quantizes others."""
    path = Path(path)
    if is_gguf_dir(path):
        cfg = read_config(path)
        if cfg.model_type not in (*QWEN_TYPES, *GEMMA4_TYPES):
            return load_gguf_model(path, dtype, device, quantization)
        if quantization != "none" or torch.device(device).type != "cpu":
            raise GGUFFormatError(
                f"{cfg.model_type}: GGUF weights run as they are on the CPU only (no "
                f"{quantization} copy, not on {device}); load with --dtype bf16"
            )
        if cfg.model_type in GEMMA4_TYPES:
            return load_gemma4_gguf(path / GGUF_LINK, cfg, dtype)  # type: ignore[return-value]
        return load_qwen_gguf(path / GGUF_LINK, cfg, dtype)  # type: ignore[return-value]
    cfg = read_config(path)
    cls = model_class(cfg.model_type)
    model = cls(cfg, dtype, device)
    names = name_map(cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError("no *.safetensors files to load")
    entries: TensorEntries = safetensors_entries(files)
    if is_mxfp4(cfg):  # the released gpt-oss: its MXFP4 experts stay MXFP4
        assert isinstance(model, GptOssLM)
        entries = mxfp4_experts(model, entries)
    fill_weights(model, entries, lambda name: None if name.startswith("mtp.") else names(name))
    return model  # type: ignore[return-value]  # every MODELS class implements LanguageModel


def load_vision(
    path: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> ImageTower | None:
    """The vision tower of the vision-language checkpoint in `path` (`model.visual.*`, or
    `visual.*` as the original Qwen2.5-VL release names it), or None when its config.json has
    none or its files hold no vision tensors (a text-only export of a vision-language model:
    its language model runs as text)."""
    path = Path(path)
    cfg = VisionConfig.from_dict(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    kind = "gemma4" if cfg is not None and cfg.kind == "gemma4" else "qwen"
    prefixes = _VISION_PREFIXES[kind]
    prefix = next((p for p in prefixes if any(_has_prefix(f, p) for f in files)), None)
    if cfg is None or prefix is None:
        return None
    tower = vision_tower(cfg, dtype, device)

    def names(name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        if name.startswith(prefix):
            return name[len(prefix) :], ()
        if kind == "gemma4" and name.startswith("model.embed_vision."):
            return name[len("model.") :], ()
        return None

    load_weights(tower, files, names)
    return tower


# where a checkpoint keeps its tower, by family (Gemma 4's embedder: `model.embed_vision.`)
_VISION_PREFIXES = {"qwen": ("model.visual.", "visual."), "gemma4": ("model.vision_tower.",)}


def _has_prefix(file: Path, prefix: str) -> bool:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return any(name.startswith(prefix) for name in f.keys())  # noqa: SIM118


def load_weights(model: nn.Module, files: list[Path], names: NameMap = same_names) -> None:
    if not files:
        raise FileNotFoundError("no *.safetensors files to load")
    fill_weights(model, safetensors_entries(files), names)


# (file name, tensor name, a read of the tensor): what `fill_weights` streams from
TensorEntries = Iterable[tuple[str, str, Callable[[], Tensor]]]


def safetensors_entries(files: list[Path]) -> Iterator[tuple[str, str, Callable[[], Tensor]]]:
    """The tensors of safetensors `files`, each read only when asked for."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield file.name, name, partial(f.get_tensor, name)


def fill_weights(model: nn.Module, entries: TensorEntries, names: NameMap = same_names) -> None:
    """Copy every tensor `names` maps into `model`'s parameters (dtype converted), checking
    shapes; a tensor it maps to no parameter, or a parameter left unfilled, is an error."""
    params = dict(model.named_parameters(remove_duplicate=False))
    filled = dict.fromkeys(params, 0)  # elements written per parameter
    for file, name, read in entries:
        mapped = names(name)
        if mapped is None:
            continue
        pname, index = mapped
        if pname not in params:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # some checkpoints store the (derivable) RoPE table
            raise ValueError(f"{file}: unexpected tensor {name!r}")
        target = params[pname][index] if index else params[pname]
        tensor = read()
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{file}: {name} has shape {tuple(tensor.shape)}, "
                f"model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        filled[pname] += tensor.numel()
    missing = {n for n, p in params.items() if filled[n] < p.numel()}
    # A tied parameter (lm_head sharing the embedding) was filled through its twin.
    loaded = {params[n].data_ptr() for n in params if n not in missing}
    missing = {n for n in missing if params[n].data_ptr() not in loaded}
    if missing:
        raise ValueError(f"checkpoint lacks tensors: {sorted(missing)[:8]}")
