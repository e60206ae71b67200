"""The vision tower of Gemma 4 (`model.vision_tower.` and `model.embed_vision.` in a
`Gemma4ForConditionalGeneration` checkpoint), as in transformers 5.x (its modeling file is the
reference): a linear patch embedding plus a learned position table per axis, ViT layers with
2-D axial rotary attention (q and k RMS-normed with weights, v without; scale 1; RMSNorm before
and after attention and the MLP, as the text layers), average pooling of each k x k patch group
into one placeholder token, scaled by sqrt(hidden), and the embedder that normalizes and
projects it to the language model's width.

Patches arrive in raster order, (row, column, channel) inside each (images.py, kind "gemma4"),
with the image as their grid: a patch's position is its (column, row). Attention is full over
one image (transformers pads a batch of images to one length and masks the padding, which the
valid rows never see), so an image's embeddings depend only on its pixels, as the engine's
encoder cache needs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.models.families.vision import (
    ACTIVATIONS,
    ImageTower,
    VisionConfig,
    _Tensors,
    check_patches,
)


class _Norm(nn.Module):
    """HF's Gemma4RMSNorm: x * (mean(x^2) + eps)^-0.5 [* w] in fp32, back to x's dtype."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device, scale: bool = True
    ) -> None:
        super().__init__()
        self.eps = eps
        if scale:
            self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        weight = getattr(self, "weight", None)
        return (y if weight is None else y * weight.float()).to(x.dtype)


class _Linear(nn.Module):
    """HF's Gemma4ClippableLinear: `linear.weight`, and with clipping its input and output
    clamped to the checkpoint's bounds (`input_min` ... `output_max`)."""

    def __init__(
        self, n_in: int, n_out: int, clipped: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.linear = _Tensors((n_out, n_in), False, dtype, device)
        self.clipped = clipped
        if clipped:  # scalars, as HF's buffers

            def bound(value: float) -> nn.Parameter:
                return nn.Parameter(torch.tensor(value, dtype=dtype, device=device))

            self.input_min, self.input_max = bound(-math.inf), bound(math.inf)
            self.output_min, self.output_max = bound(-math.inf), bound(math.inf)

    def forward(self, x: Tensor) -> Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        y = F.linear(x, self.linear.weight)
        return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's apply_multidimensional_rope over 2 axes: each half of the head rotates (rotate-half
    style) by its axis's angles; x `[P, heads, d]`, cos / sin `[P, d]` in x's dtype."""
    half = x.shape[-1] // 2
    parts = []
    for a in range(2):
        xa = x[..., a * half : (a + 1) * half]
        c, s = cos[:, None, a * half : (a + 1) * half], sin[:, None, a * half : (a + 1) * half]
        q = half // 2
        rotated = torch.cat((-xa[..., q:], xa[..., :q]), dim=-1)
        parts.append(xa * c + rotated * s)
    return torch.cat(parts, dim=-1)


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        d, clip = cfg.head_dim, cfg.clipped_linears
        self.heads, self.kv_heads, self.d = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads, d
        width = cfg.hidden_size
        self.q_proj = _Linear(width, self.heads * d, clip, dtype, device)
        self.k_proj = _Linear(width, self.kv_heads * d, clip, dtype, device)
        self.v_proj = _Linear(width, self.kv_heads * d, clip, dtype, device)
        self.o_proj = _Linear(self.heads * d, width, clip, dtype, device)
        self.q_norm = _Norm(d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = _Norm(d, cfg.rms_norm_eps, dtype, device)
        self.v_norm = _Norm(d, cfg.rms_norm_eps, dtype, device, scale=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        n = x.shape[0]
        q = _rotate(self.q_norm(self.q_proj(x).view(n, self.heads, self.d)), cos, sin)
        k = _rotate(self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.d)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(n, self.kv_heads, self.d))
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        # [1, heads, P, d]: the layout torch's fused CPU attention takes; every patch sees all
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)[0].transpose(0, 1)
        return self.o_proj(out.reshape(n, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        width, inner, clip = cfg.hidden_size, cfg.intermediate_size, cfg.clipped_linears
        self.gate_proj = _Linear(width, inner, clip, dtype, device)
        self.up_proj = _Linear(width, inner, clip, dtype, device)
        self.down_proj = _Linear(inner, width, clip, dtype, device)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _Attention(cfg, dtype, device)
        self.mlp = _MLP(cfg, dtype, device)
        self.input_layernorm = _Norm(size, eps, dtype, device)
        self.post_attention_layernorm = _Norm(size, eps, dtype, device)
        self.pre_feedforward_layernorm = _Norm(size, eps, dtype, device)
        self.post_feedforward_layernorm = _Norm(size, eps, dtype, device)
        self.out_scale: Tensor | None = None  # an mmproj's `out_scale` (the layer's output x it)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.post_attention_layernorm(attn)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x if self.out_scale is None else x * self.out_scale


class _PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_proj = _Tensors((cfg.hidden_size, cfg.patch_dim), False, dtype, device)
        table = torch.ones(2, cfg.num_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.position_embedding_table = nn.Parameter(table.to(device))

    def forward(self, pixels: Tensor, cols: Tensor, rows: Tensor) -> Tensor:
        w = self.input_proj.weight
        x = F.linear((2 * (pixels - 0.5)).to(w.dtype), w)  # pixels in [0, 1] -> [-1, 1]
        table = self.position_embedding_table
        return x + (table[0][cols] + table[1][rows])


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(cfg, dtype, device) for _ in range(cfg.depth)])


class _Embedder(nn.Module):
    """HF's Gemma4MultimodalEmbedder: RMSNorm without weight, then a projection to the LM."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = _Norm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype, device, scale=False
        )
        shape = (cfg.out_hidden_size, cfg.hidden_size)
        self.embedding_projection = _Tensors(shape, False, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.embedding_pre_projection_norm(x), self.embedding_projection.weight)


class Gemma4VisionTower(ImageTower):
    """Parameter names are the checkpoint's under `model.vision_tower.`, and `embed_vision.`
    for its `model.embed_vision.` (models/formats/loader.py `load_vision`)."""

    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = cfg, dtype, device
        self.patch_embedder = _PatchEmbedder(cfg, dtype, device)
        self.encoder = _Encoder(cfg, dtype, device)
        if cfg.standardize:
            self.std_bias = nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype, device=device))
            self.std_scale = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype, device=device))
        self.embed_vision = _Embedder(cfg, dtype, device)
        half = cfg.head_dim // 2  # each axis rotates half the head
        steps = torch.arange(0, half, 2, dtype=torch.float32, device=device) / half
        self.inv_freq = 1.0 / cfg.rope_theta**steps
        self.requires_grad_(False)

    @torch.inference_mode()
    def encode(self, pixels: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """pixels `[h w, p p 3]` of ONE image (raster order) -> `[h w / k^2, text hidden]`."""
        cfg = self.config
        t, h, w = grid
        k = cfg.spatial_merge_size
        if t != 1:
            raise ValueError(f"image grid {grid}: Gemma 4's tower takes one frame")
        check_patches(pixels, grid, cfg)  # the merge size is the pooling kernel here
        if max(h, w) > cfg.num_position_embeddings:
            raise ValueError(
                f"image of {h} x {w} patches is past the tower's {cfg.num_position_embeddings} "
                "positions a side"
            )
        rows = torch.arange(h, device=self.device).repeat_interleave(w)
        cols = torch.arange(w, device=self.device).repeat(h)
        x = self.patch_embedder(pixels.to(self.device), cols, rows)
        cos, sin = self._angles(cols, rows, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        # each k x k group of patches averaged (fp32), in the group grid's raster order
        groups = x.float().view(h // k, k, w // k, k, -1).permute(0, 2, 1, 3, 4)
        pooled = groups.reshape(h * w // k**2, k * k, -1).mean(dim=1).to(x.dtype)
        y = pooled.float() * math.sqrt(cfg.hidden_size)
        if cfg.standardize:
            y = (y - self.std_bias.float()) * self.std_scale.float()
        return self.embed_vision(y.to(x.dtype))

    def _angles(self, cols: Tensor, rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin `[P, head_dim]`: (column, column, row, row) quarters of the head."""
        fx = cols[:, None].float() * self.inv_freq
        fy = rows[:, None].float() * self.inv_freq
        freqs = torch.cat([fx, fx, fy, fy], dim=-1)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)
