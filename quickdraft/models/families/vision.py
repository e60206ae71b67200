"""The vision tower of the Qwen3.5 / Qwen3.6 family (`model.visual.` in a
`Qwen3_5ForConditionalGeneration` checkpoint), as in transformers 5.x (its modeling file is the
reference): patch embedding, learned position embeddings resampled to the image's grid, ViT
blocks with 2-D rotary attention, and the merger that projects each 2 x 2 patch group to the
language model's hidden size.

Stage: an input stage before the target. `VisionTower.encode(pixels, grid)` turns one image's
patches (images.py's preprocessing) into the embeddings of its placeholder tokens; the language
model never sees pixels, only those rows (models/base.py `ImageRows`). Images are encoded one at
a time: attention never crosses two images, so an image's embeddings depend only on its pixels
(what lets the engine cache them by content hash).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """`vision_config` of a composite vision-language config, plus the placeholder ids around
    it. `kind` is the tower's family: "qwen3_5" (this module), "qwen2_5_vl"
    (models/families/vision_qwen25.py: windowed attention, no position table) or "gemma4"
    (models/families/vision_gemma4.py: its `spatial_merge_size` is the pooling kernel, its
    `vision_start` / `vision_end` ids the begin / end of image tokens)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    kind: str = "qwen3_5"
    window_size: int = 0  # qwen2_5_vl: a window's side in pixels
    fullatt_block_indexes: tuple[int, ...] = ()  # qwen2_5_vl: the blocks that see the image
    num_kv_heads: int = 0  # gemma4 (0: num_heads)
    head_size: int = 0  # gemma4: its own head_dim (0: hidden_size / num_heads)
    rms_norm_eps: float = 1e-6  # gemma4
    standardize: bool = False  # gemma4: the pooled features shifted and scaled (std_bias...)
    clipped_linears: bool = False  # gemma4: projections clamp their inputs and outputs
    video_token_id: int = -1  # a video's (gemma4: a frame's) placeholder (-1: no video input)
    tokens_per_second: float = 2.0  # qwen2_5_vl: M-RoPE time positions a second of video

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig | None:
        """None when `raw` (a config.json) has no vision tower."""
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            return None
        if raw.get("model_type") == "gemma4":
            return cls._gemma4(raw, vision)
        kind = "qwen2_5_vl" if raw.get("model_type") == "qwen2_5_vl" else "qwen3_5"
        base = _DEFAULTS[kind]
        rope = vision.get("rope_parameters") or {}
        text = raw.get("text_config") or {}

        def get(key: str, *aliases: str) -> Any:
            for name in (key, *aliases):
                if name in vision:
                    return vision[name]
            return base[key]

        act = str(get("hidden_act"))
        if act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {act!r} is not supported ({sorted(ACTIVATIONS)})")
        return cls(
            depth=int(get("depth")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_heads=int(get("num_heads")),
            in_channels=int(get("in_channels", "in_chans")),
            patch_size=int(get("patch_size")),
            temporal_patch_size=int(get("temporal_patch_size")),
            spatial_merge_size=int(get("spatial_merge_size")),
            out_hidden_size=int(
                vision.get("out_hidden_size", text.get("hidden_size", raw.get("hidden_size", 3584)))
            ),
            num_position_embeddings=int(get("num_position_embeddings")),
            hidden_act=act,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            image_token_id=int(raw.get("image_token_id", base["image_token_id"])),
            vision_start_token_id=int(
                raw.get("vision_start_token_id", base["vision_start_token_id"])
            ),
            vision_end_token_id=int(raw.get("vision_end_token_id", base["vision_end_token_id"])),
            kind=kind,
            window_size=int(get("window_size")),
            fullatt_block_indexes=tuple(int(i) for i in get("fullatt_block_indexes")),
            # video: Qwen2.5-VL's (one grid of temporal patches, times in M-RoPE)
            video_token_id=int(raw.get("video_token_id", base["video_token_id"])),
            tokens_per_second=float(vision.get("tokens_per_second", 2)),
        )

    @classmethod
    def _gemma4(cls, raw: dict[str, Any], vision: dict[str, Any]) -> VisionConfig:
        """A `gemma4` config's tower (transformers' Gemma4VisionConfig defaults)."""
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"gemma4 vision rope type {rope['rope_type']!r} is not supported")
        act = str(vision.get("hidden_activation", "gelu_pytorch_tanh"))
        if act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_activation {act!r} is not supported")
        heads = int(vision.get("num_attention_heads", 12))
        text = raw.get("text_config") or {}
        return cls(
            depth=int(vision.get("num_hidden_layers", 16)),
            hidden_size=int(vision.get("hidden_size", 768)),
            intermediate_size=int(vision.get("intermediate_size", 3072)),
            num_heads=heads,
            in_channels=3,
            patch_size=int(vision.get("patch_size", 16)),
            temporal_patch_size=1,
            spatial_merge_size=int(vision.get("pooling_kernel_size", 3)),
            out_hidden_size=int(text.get("hidden_size", 2304)),
            num_position_embeddings=int(vision.get("position_embedding_size", 10240)),
            hidden_act=act,
            rope_theta=float(rope.get("rope_theta", 100.0)),
            image_token_id=int(raw.get("image_token_id", 258880)),
            vision_start_token_id=int(raw.get("boi_token_id", 255999)),
            vision_end_token_id=int(raw.get("eoi_token_id", 258882)),
            kind="gemma4",
            num_kv_heads=int(vision.get("num_key_value_heads", heads)),
            head_size=int(vision.get("head_dim", 64)),
            rms_norm_eps=float(vision.get("rms_norm_eps", 1e-6)),
            standardize=bool(vision.get("standardize", False)),
            clipped_linears=bool(vision.get("use_clipped_linears", False)),
            video_token_id=int(raw.get("video_token_id", 258884)),
        )

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x temporal x patch x patch, in that order."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        """Placeholder tokens an image of patch grid (t, h, w) takes in the prompt."""
        t, h, w = grid
        return t * h * w // self.spatial_merge_size**2


# transformers' defaults per tower family (what a config.json leaves out)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5": dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        in_channels=3,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=2304,
        hidden_act="gelu_pytorch_tanh",
        image_token_id=248056,
        video_token_id=248057,
        vision_start_token_id=248053,
        vision_end_token_id=248054,
        window_size=0,
        fullatt_block_indexes=(),
    ),
    "qwen2_5_vl": dict(
        depth=32,
        hidden_size=3584,
        intermediate_size=3420,
        num_heads=16,
        in_channels=3,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=0,  # 2-D rotary only
        hidden_act="silu",
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        window_size=112,
        fullatt_block_indexes=(7, 15, 23, 31),
    ),
}

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class BiasLinear(nn.Module):
    """weight + bias under HF's names (nn.Linear would initialise them for nothing)."""

    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(n_out, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class _LayerNorm(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-6)


class _Tensors(nn.Module):
    """A bare weight (and bias) under an HF module name (the Conv3d, the position table)."""

    def __init__(
        self, shape: tuple[int, ...], bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(shape[0], dtype=dtype, device=device))


class PatchEmbed(nn.Module):
    """HF's Conv3d with stride = kernel over each patch: one matmul over flattened patches."""

    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device, bias: bool = True
    ) -> None:
        super().__init__()
        shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size) + (cfg.patch_size,) * 2
        self.proj = _Tensors(shape, bias, dtype, device)

    def forward(self, pixels: Tensor) -> Tensor:  # [P, patch_dim] -> [P, hidden]
        w = self.proj.weight
        bias = getattr(self.proj, "bias", None)
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = BiasLinear(cfg.hidden_size, 3 * cfg.hidden_size, dtype, device)
        self.proj = BiasLinear(cfg.hidden_size, cfg.hidden_size, dtype, device)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, windows: Sequence[Tensor] = ()
    ) -> Tensor:
        """`windows`: attention within each window (the rows of a window are `[n, L]` of one
        tensor, all its windows L long); none: every row sees every row."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # [P, heads, head_dim] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if not windows:
            # [1, heads, P, head_dim]: the 4-D layout torch's fused CPU attention takes (3-D
            # inputs fall back to its unfused math path, 1.2x slower here)
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
        else:  # windows of one length as one batch: each is its own batch row
            out = torch.empty_like(q)
            for rows in windows:
                qw, kw, vw = (t[rows].transpose(1, 2) for t in (q, k, v))  # [n, heads, L, hd]
                out[rows] = F.scaled_dot_product_attention(qw, kw, vw).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding over the whole head (fp32 math, as HF's vision rope)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.linear_fc1 = BiasLinear(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.linear_fc2 = BiasLinear(cfg.intermediate_size, cfg.hidden_size, dtype, device)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm1 = _LayerNorm(cfg.hidden_size, dtype, device)
        self.norm2 = _LayerNorm(cfg.hidden_size, dtype, device)
        self.attn = VisionAttention(cfg, dtype, device)
        self.mlp = _MLP(cfg, dtype, device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """LayerNorm per patch, then each merge group's patches concatenated -> MLP -> LM hidden."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.group = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = _LayerNorm(cfg.hidden_size, dtype, device)
        self.linear_fc1 = BiasLinear(self.group, self.group, dtype, device)
        self.linear_fc2 = BiasLinear(self.group, cfg.out_hidden_size, dtype, device)

    def forward(self, x: Tensor) -> Tensor:  # [P, hidden] -> [P / merge^2, out_hidden]
        x = self.norm(x).view(-1, self.group)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class ImageTower(nn.Module):
    """What the engine reads of a vision tower: its config (placeholder ids, merge size) and
    `encode`, one image at a time."""

    config: VisionConfig
    dtype: torch.dtype
    device: torch.device
    patch_embed: PatchEmbed
    inv_freq: Tensor  # the 2-D rotary frequencies (`rotary_inv_freq`)

    def encode(self, pixels: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """pixels `[t h w, patch_dim]` of ONE image (patches in merge-block order, as images.py
        lays them out) -> its placeholder rows' embeddings `[t h w / merge^2, out_hidden]`."""
        raise NotImplementedError

    def embed_patches(
        self, pixels: Tensor, grid: tuple[int, int, int]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The checked patches embedded `[t h w, hidden]`, each frame's patch rows and columns
        `[h w]` (merge-block order) and their rotary cos, sin `[h w, head_dim]`."""
        _, h, w = grid
        check_patches(pixels, grid, self.config)
        x = self.patch_embed(pixels.to(self.device))
        rows, cols = block_order(h, w, self.config.spatial_merge_size, self.device)
        cos, sin = patch_angles(rows, cols, self.inv_freq)
        return x, rows, cols, cos, sin


class VisionTower(ImageTower):
    """Qwen3.5's. Parameter names are the checkpoint's under `model.visual.`."""

    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = cfg, dtype, device
        self.patch_embed = PatchEmbed(cfg, dtype, device)
        self.pos_embed = _Tensors(
            (cfg.num_position_embeddings, cfg.hidden_size), False, dtype, device
        )
        self.side = math.isqrt(cfg.num_position_embeddings)  # the learned grid is square
        self.blocks = nn.ModuleList([_Block(cfg, dtype, device) for _ in range(cfg.depth)])
        self.merger = _Merger(cfg, dtype, device)
        self.inv_freq = rotary_inv_freq(cfg, device)
        self.requires_grad_(False)

    @torch.inference_mode()
    def encode(self, pixels: Tensor, grid: tuple[int, int, int]) -> Tensor:
        t, h, w = grid
        x, rows, cols, cos, sin = self.embed_patches(pixels, grid)
        x = x + self._position_embeddings(rows, cols, h, w).repeat(t, 1).to(x.dtype)
        cos, sin = cos.repeat(t, 1), sin.repeat(t, 1)
        frame = h * w  # attention runs per frame (a still image is one)
        out = []
        for f in range(t):
            y = x[f * frame : (f + 1) * frame]
            c, s = cos[f * frame : (f + 1) * frame], sin[f * frame : (f + 1) * frame]
            for block in self.blocks:
                y = block(y, c, s)
            out.append(y)
        return self.merger(torch.cat(out) if t > 1 else out[0])

    def _position_embeddings(self, rows: Tensor, cols: Tensor, h: int, w: int) -> Tensor:
        """The square learned table resampled to an h x w grid (bilinear, corners aligned),
        read at each patch's (row, col) `[P, hidden]`."""
        side = self.side
        table = self.pos_embed.weight
        out = torch.zeros(rows.shape[0], table.shape[1], dtype=torch.float32, device=self.device)
        taps_r, weights_r = _axis_taps(rows, h, side)
        taps_c, weights_c = _axis_taps(cols, w, side)
        for i in range(2):
            for j in range(2):
                weight = (weights_r[:, i] * weights_c[:, j])[:, None]
                out += table[taps_r[:, i] * side + taps_c[:, j]].float() * weight
        return out


def check_patches(pixels: Tensor, grid: tuple[int, int, int], cfg: VisionConfig) -> None:
    t, h, w = grid
    m = cfg.spatial_merge_size
    if pixels.shape != (t * h * w, cfg.patch_dim) or h % m or w % m:
        raise ValueError(
            f"image patches {tuple(pixels.shape)} do not fit grid {grid} "
            f"(patch_dim {cfg.patch_dim}, merge {m})"
        )


def rotary_inv_freq(cfg: VisionConfig, device: torch.device) -> Tensor:
    """2-D rotary over the head: h and w each rotate a quarter of it (twice: cos, sin)."""
    half = cfg.head_dim // 2
    return 1.0 / (
        cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    )


def patch_angles(rows: Tensor, cols: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin `[P, head_dim]` of the patches at (`rows`, `cols`)."""
    freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
    freqs = torch.cat([freqs, freqs], dim=-1)
    return freqs.cos(), freqs.sin()


def _axis_taps(index: Tensor, size: int, side: int) -> tuple[Tensor, Tensor]:
    """Bilinear taps (floor, floor + 1, clamped) and weights into a `side`-long axis for
    positions `index` of an axis `size` long, corners aligned."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def block_order(h: int, w: int, m: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row and column of each patch in merge-block order: the m x m patches a placeholder
    token stands for are consecutive, blocks in raster order."""
    r = torch.arange(h, device=device)[:, None].expand(h, w)
    c = torch.arange(w, device=device)[None, :].expand(h, w)

    def order(x: Tensor) -> Tensor:
        return x.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)

    return order(r), order(c)
