"""A vision tower from llama.cpp's multimodal projector file (an "mmproj" GGUF, read by its
`mtmd` library), for a GGUF target that is a vision-language model: Qwen3.5 / Qwen3.6,
Qwen2.5-VL and Gemma 4 as llama.cpp's converter writes them (projector types
`qwen3vl_merger`, `qwen2.5vl_merger`, the latter's full-attention blocks as
`clip.vision.n_wa_pattern`, its attention projections as separate q / k / v; and `gemma4v`,
hub/gguf_gemma4.py's names, its pooling kernel as `clip.vision.projector.scale_factor`).

Stage: loading, beside the target's GGUF (loading.py `load(..., mmproj=...)`). The file holds
the tower's tensors under llama.cpp's names (`v.blk.N.attn_qkv`, `v.post_ln`, `mm.0`, ...; the
Conv3d patch embedding split into two Conv2d slices `v.patch_embd.weight` and `.weight.1`) and
its shape and preprocessing under `clip.*` keys. Every tensor is dequantized (gguf's own
dequantization, any type) into the tower's dtype: the tower runs once per image, in torch ops.
The placeholder ids come from the target's tokenizer, which the mmproj does not carry
(`placeholders`: the token texts to look up for a file's projector).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quickdraft.hub.gguf_gemma4 import (
    CLAMPS,
    GEMMA4V_PROJECTOR,
    GEMMA4V_TOKENS,
    gemma4_mmproj_names,
)
from quickdraft.hub.gguf_qwen import (
    QWEN3VL_PROJECTOR,
    QWEN25VL_PROJECTOR,
    mmproj_names,
    qwen25_mmproj_names,
)
from quickdraft.images import PROCESSING, ImageProcessing
from quickdraft.models.families.vision import ImageTower, VisionConfig
from quickdraft.models.families.vision_gemma4 import Gemma4VisionTower
from quickdraft.models.registry import vision_tower

PROJECTORS = (QWEN3VL_PROJECTOR, QWEN25VL_PROJECTOR, GEMMA4V_PROJECTOR)
# the target's tokens for an image, its begin and its end, by projector (the Qwen-VL chat
# templates write the latter two themselves; Gemma 4's processor puts them around the image)
QWEN_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
QWEN_VIDEO_TOKEN = "<|video_pad|>"  # Qwen2.5-VL's video placeholder (its chat template's)
PLACEHOLDERS = {
    QWEN3VL_PROJECTOR: QWEN_TOKENS,
    QWEN25VL_PROJECTOR: QWEN_TOKENS,
    GEMMA4V_PROJECTOR: GEMMA4V_TOKENS,
}

# llama.cpp's Qwen-VL token limits per image when the file names none (clip.cpp)
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 8, 4096


class MMProjError(ValueError):
    """An mmproj file quickdraft cannot run, with the reason."""


def _reader(path: Path) -> Any:
    from quickdraft.hub.gguf_read import read_gguf

    try:
        return read_gguf(path)
    except Exception as e:  # the reader raises bare ValueErrors / struct errors
        raise MMProjError(f"{path.name}: not a readable GGUF file ({e})") from e


def _projector(path: Path, reader: Any) -> str:
    """The file's vision projector type, one quickdraft runs, else MMProjError."""
    fields = reader.fields

    def meta(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    projector = meta("clip.projector_type") or meta("clip.vision.projector_type")
    if projector not in PROJECTORS or not meta("clip.has_vision_encoder"):
        raise MMProjError(
            f"{path.name}: projector {projector!r}; quickdraft runs the Qwen3.5 / Qwen3-VL, "
            f"Qwen2.5-VL and Gemma 4 vision towers ({', '.join(PROJECTORS)})"
        )
    return str(projector)


def placeholders(path: str | Path) -> tuple[str, str, str]:
    """The target's token texts the mmproj file at `path` needs: image, begin, end."""
    return PLACEHOLDERS[_projector(Path(path), _reader(Path(path)))]


def load_mmproj(
    path: str | Path,
    token_ids: tuple[int, int, int],  # the target's `placeholders(path)` ids
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> tuple[ImageTower, ImageProcessing]:
    from gguf.quants import dequantize

    path = Path(path)
    reader = _reader(path)
    fields = reader.fields

    def meta(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        return default if field is None else field.contents()

    projector = _projector(path, reader)
    tensors = {t.name: t for t in reader.tensors}
    if any(name.startswith("v.deepstack.") for name in tensors):
        raise MMProjError(f"{path.name}: deepstack layers (Qwen3-VL) are not supported yet")

    def array(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise MMProjError(f"{path.name}: lacks tensor {name!r}")
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest dim first
        return dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)

    def required(key: str) -> int:
        value = meta(key)
        if value is None:
            raise MMProjError(f"{path.name}: lacks metadata {key!r}")
        return int(value)

    if projector == GEMMA4V_PROJECTOR:
        return _gemma4v(path, meta, required, array, set(tensors), token_ids, dtype, device)
    qwen25 = projector == QWEN25VL_PROJECTOR
    depth = required("clip.vision.block_count")
    patch0 = array("v.patch_embd.weight")  # [E, C, p, p]: the first temporal slice
    mean = meta("clip.vision.image_mean", [0.5, 0.5, 0.5])
    std = meta("clip.vision.image_std", [0.5, 0.5, 0.5])
    if qwen25:
        every = required("clip.vision.n_wa_pattern")
        positions, act = 0, "silu"
        names = qwen25_mmproj_names(depth)
        window = int(meta("clip.vision.window_size", 112))  # llama.cpp's default
        full = tuple(i for i in range(depth) if every > 0 and (i + 1) % every == 0)
    else:
        positions, act = array("v.position_embd.weight").shape[0], "gelu_pytorch_tanh"
        names = mmproj_names(depth)
        window, full = 0, ()
        if math.isqrt(positions) ** 2 != positions:
            raise MMProjError(f"{path.name}: {positions} position embeddings are not a square grid")
    cfg = VisionConfig(
        depth=depth,
        hidden_size=required("clip.vision.embedding_length"),
        intermediate_size=required("clip.vision.feed_forward_length"),
        num_heads=required("clip.vision.attention.head_count"),
        in_channels=int(patch0.shape[1]),
        patch_size=required("clip.vision.patch_size"),
        temporal_patch_size=2 if "v.patch_embd.weight.1" in tensors else 1,
        spatial_merge_size=int(meta("clip.vision.spatial_merge_size", 2)),
        out_hidden_size=required("clip.vision.projection_dim"),
        num_position_embeddings=positions,
        hidden_act=act,
        rope_theta=10000.0,  # llama.cpp's Qwen-VL graphs fix it
        image_token_id=token_ids[0],
        vision_start_token_id=token_ids[1],
        vision_end_token_id=token_ids[2],
        kind="qwen2_5_vl" if qwen25 else "qwen3_5",
        window_size=window,
        fullatt_block_indexes=full,
    )
    tower = vision_tower(cfg, dtype, device)
    params = dict(tower.named_parameters())
    values = {ours: array(theirs) for ours, theirs in names.items()}
    if qwen25:  # q, k, v -> the fused qkv
        for i in range(depth):
            for p in ("weight", "bias"):
                parts = [array(f"v.blk.{i}.attn_{x}.{p}") for x in "qkv"]
                values[f"blocks.{i}.attn.qkv.{p}"] = np.concatenate(parts)
    slices = [patch0] + ([array("v.patch_embd.weight.1")] if cfg.temporal_patch_size == 2 else [])
    values["patch_embed.proj.weight"] = np.stack(slices, axis=2)  # [E, C, T, p, p]
    with torch.no_grad():
        for name, param in params.items():
            value = torch.from_numpy(values[name])
            if tuple(value.shape) != tuple(param.shape):
                raise MMProjError(
                    f"{path.name}: {name} has shape {tuple(value.shape)}, the keys say "
                    f"{tuple(param.shape)}"
                )
            param.copy_(value)
    factor = (cfg.patch_size * cfg.spatial_merge_size) ** 2
    processing = ImageProcessing(
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.spatial_merge_size,
        min_pixels=int(meta("clip.vision.image_min_pixels", MIN_IMAGE_TOKENS * factor)),
        max_pixels=int(meta("clip.vision.image_max_pixels", MAX_IMAGE_TOKENS * factor)),
        image_mean=(float(mean[0]), float(mean[1]), float(mean[2])),
        image_std=(float(std[0]), float(std[1]), float(std[2])),
    )
    return tower, processing


def _gemma4v(
    path: Path,
    meta: Callable[..., Any],
    required: Callable[[str], int],
    array: Callable[[str], np.ndarray],
    names: set[str],
    token_ids: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[ImageTower, ImageProcessing]:
    """A `gemma4v` file's tower (models/families/vision_gemma4.py) and Gemma 4's preprocessing at
    the model's default budget of 280 placeholders (llama.cpp's mtmd allows up to 1120 by default,
    and resizes otherwise)."""
    depth = required("clip.vision.block_count")
    hidden, heads = (
        required("clip.vision.embedding_length"),
        required("clip.vision.attention.head_count"),
    )
    head_dim = hidden // heads
    patch = array("v.patch_embd.weight")  # [E, 3, p, p]
    table = array("v.position_embd.weight")  # [2, positions, E]
    kv_heads = array("v.blk.0.attn_k.weight").shape[0] // head_dim
    clipped = "v.blk.0.attn_q.input_min" in names
    standardize = "v.std_bias" in names
    cfg = VisionConfig(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=required("clip.vision.feed_forward_length"),
        num_heads=heads,
        in_channels=3,
        patch_size=required("clip.vision.patch_size"),
        temporal_patch_size=1,
        spatial_merge_size=int(meta("clip.vision.projector.scale_factor", 3)),
        out_hidden_size=required("clip.vision.projection_dim"),
        num_position_embeddings=int(table.shape[1]),
        hidden_act="gelu_pytorch_tanh",
        rope_theta=100.0,  # llama.cpp's gemma4v graph fixes it
        image_token_id=token_ids[0],
        vision_start_token_id=token_ids[1],
        vision_end_token_id=token_ids[2],
        kind="gemma4",
        num_kv_heads=kv_heads,
        head_size=head_dim,
        rms_norm_eps=float(meta("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        standardize=standardize,
        clipped_linears=clipped,
    )
    tower = vision_tower(cfg, dtype, device)
    values = {
        ours: array(theirs)
        for ours, theirs in gemma4_mmproj_names(depth, clipped, standardize).items()
    }
    for name in list(values):  # the bounds: 1-element tensors in the file, scalars here
        if name.rsplit(".", 1)[-1] in CLAMPS:
            values[name] = values[name].reshape(())
    # the Conv2d [E, 3, p, p] -> the linear over (row, column, channel) patches
    values["patch_embedder.input_proj.weight"] = patch.transpose(0, 2, 3, 1).reshape(hidden, -1)
    params = dict(tower.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            value = torch.from_numpy(np.ascontiguousarray(values[name]))
            if tuple(value.shape) != tuple(param.shape):
                raise MMProjError(
                    f"{path.name}: {name} has shape {tuple(value.shape)}, the keys say "
                    f"{tuple(param.shape)}"
                )
            param.copy_(value)
    assert isinstance(tower, Gemma4VisionTower)
    for i, layer in enumerate(tower.encoder.layers):
        if f"v.blk.{i}.out_scale.weight" in names:  # llama.cpp scales a layer's output by it
            scale = torch.from_numpy(array(f"v.blk.{i}.out_scale.weight")).to(dtype)
            layer.out_scale = scale
    base = PROCESSING["gemma4"]
    processing = ImageProcessing(
        kind="gemma4",
        patch_size=cfg.patch_size,
        temporal_patch_size=1,
        merge_size=cfg.spatial_merge_size,
        image_mean=_three(meta("clip.vision.image_mean", [0.0] * 3)),
        image_std=_three(meta("clip.vision.image_std", [1.0] * 3)),
        max_soft_tokens=base.max_soft_tokens,
    )
    return tower, processing


def _three(values: Any) -> tuple[float, float, float]:
    return float(values[0]), float(values[1]), float(values[2])
