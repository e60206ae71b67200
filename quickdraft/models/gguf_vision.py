"""A vision tower from llama.cpp's multimodal projector file (an "mmproj" GGUF, read by its
`mtmd` library), for a GGUF target that is a vision-language model: Qwen3.5 / Qwen3.6 and
Qwen2.5-VL as llama.cpp's converter writes them (projector types `qwen3vl_merger`,
`qwen2.5vl_merger`; the latter's full-attention blocks as `clip.vision.n_wa_pattern`, its
attention projections as separate q / k / v).

Stage: loading, beside the target's GGUF (loading.py `load(..., mmproj=...)`). The file holds
the tower's tensors under llama.cpp's names (`v.blk.N.attn_qkv`, `v.post_ln`, `mm.0`, ...; the
Conv3d patch embedding split into two Conv2d slices `v.patch_embd.weight` and `.weight.1`) and
its shape and preprocessing under `clip.*` keys. Every tensor is dequantized (gguf's own
dequantization, any type) into the tower's dtype: the tower runs once per image, in torch ops.
The placeholder ids come from the target's tokenizer, which the mmproj does not carry.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quickdraft.hub.gguf_qwen import (
    QWEN3VL_PROJECTOR,
    QWEN25VL_PROJECTOR,
    mmproj_names,
    qwen25_mmproj_names,
)
from quickdraft.images import ImageProcessing
from quickdraft.models.registry import vision_tower
from quickdraft.models.vision import ImageTower, VisionConfig

PROJECTORS = (QWEN3VL_PROJECTOR, QWEN25VL_PROJECTOR)

# llama.cpp's Qwen-VL token limits per image when the file names none (clip.cpp)
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 8, 4096


class MMProjError(ValueError):
    """An mmproj file quickdraft cannot run, with the reason."""


def load_mmproj(
    path: str | Path,
    token_ids: tuple[int, int, int],  # the target's <|image_pad|>, <|vision_start|>, <|vision_end|>
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> tuple[ImageTower, ImageProcessing]:
    from gguf.quants import dequantize

    from quickdraft.hub.gguf_read import read_gguf

    path = Path(path)
    try:
        reader = read_gguf(path)
    except Exception as e:  # the reader raises bare ValueErrors / struct errors
        raise MMProjError(f"{path.name}: not a readable GGUF file ({e})") from e
    fields = reader.fields

    def meta(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        return default if field is None else field.contents()

    projector = meta("clip.projector_type") or meta("clip.vision.projector_type")
    if projector not in PROJECTORS or not meta("clip.has_vision_encoder", False):
        raise MMProjError(
            f"{path.name}: projector {projector!r}; quickdraft runs the Qwen3.5 / Qwen3-VL and "
            f"Qwen2.5-VL vision towers ({', '.join(PROJECTORS)})"
        )
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
