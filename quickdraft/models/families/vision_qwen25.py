"""The vision tower of Qwen2.5-VL (`model.visual.` in a `Qwen2_5_VLForConditionalGeneration`
checkpoint, `visual.` in the original release), as in transformers 5.x (its modeling file is
the reference): a bias-free patch embedding, 2-D rotary ViT blocks with RMSNorm and a SwiGLU
MLP, windowed attention, and the merger (RMSNorm, then an MLP per 2 x 2 patch group).

Windowed attention: the merged units (2 x 2 patch groups) are cut into square windows of
`window_size` pixels a side, windows in raster order and the units in each window in raster
order; every block attends within its window except the `fullatt_block_indexes` ones, which
see the whole frame. The patches run in that window order and the merger's output is put back
in raster order. Windows of one length run as one batched attention (each its own batch row),
so a window's rows depend only on that window.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quickdraft.models.families.vision import (
    ACTIVATIONS,
    BiasLinear,
    ImageTower,
    PatchEmbed,
    VisionAttention,
    VisionConfig,
    rotary_inv_freq,
)


class _RMSNorm(nn.Module):
    """HF's Qwen2_5_VLRMSNorm: normalized in fp32, scaled in the input dtype (eps 1e-6)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * xf.to(x.dtype)


class _SwiGLU(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_proj = BiasLinear(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.up_proj = BiasLinear(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.down_proj = BiasLinear(cfg.intermediate_size, cfg.hidden_size, dtype, device)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(cfg.hidden_size, dtype, device)
        self.norm2 = _RMSNorm(cfg.hidden_size, dtype, device)
        self.attn = VisionAttention(cfg, dtype, device)
        self.mlp = _SwiGLU(cfg, dtype, device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, windows: list[Tensor]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.group = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = _RMSNorm(cfg.hidden_size, dtype, device)
        self.mlp = nn.Sequential(
            BiasLinear(self.group, self.group, dtype, device),
            nn.GELU(),
            BiasLinear(self.group, cfg.out_hidden_size, dtype, device),
        )

    def forward(self, x: Tensor) -> Tensor:  # [P, hidden] -> [P / merge^2, out_hidden]
        return self.mlp(self.ln_q(x).view(-1, self.group))


class Qwen25VisionTower(ImageTower):
    """Parameter names are the checkpoint's under `model.visual.` (or `visual.`)."""

    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = cfg, dtype, device
        self.patch_embed = PatchEmbed(cfg, dtype, device, bias=False)
        self.blocks = nn.ModuleList([_Block(cfg, dtype, device) for _ in range(cfg.depth)])
        self.merger = _Merger(cfg, dtype, device)
        self.inv_freq = rotary_inv_freq(cfg, device)
        self.full = frozenset(cfg.fullatt_block_indexes)
        self.requires_grad_(False)

    @torch.inference_mode()
    def encode(self, pixels: Tensor, grid: tuple[int, int, int]) -> Tensor:
        t, h, w = grid
        m = self.config.spatial_merge_size
        x, _, _, cos, sin = self.embed_patches(pixels, grid)
        order, windows = window_order(h // m, w // m, self.window_units(), m, self.device)
        back = torch.argsort(order[:: m * m] // (m * m))  # merged units: window -> block order
        frame = h * w  # attention runs per frame (a still image is one)
        out = []
        for f in range(t):
            y = x[f * frame : (f + 1) * frame][order]
            c, s = cos[order], sin[order]
            for i, block in enumerate(self.blocks):
                y = block(y, c, s, [] if i in self.full else windows)
            out.append(self.merger(y)[back])
        return torch.cat(out) if t > 1 else out[0]

    def window_units(self) -> int:
        """A window's side in merged units (HF: window_size // merge // patch)."""
        cfg = self.config
        return max(1, cfg.window_size // cfg.spatial_merge_size // cfg.patch_size)


def window_order(
    gh: int, gw: int, side: int, merge: int, device: torch.device
) -> tuple[Tensor, list[Tensor]]:
    """For a frame of gh x gw merged units cut into `side` x `side` windows: the patch order
    (merge-block order -> window order, each unit's merge^2 patches kept together) and the
    windows as row-index tensors `[n, L]` in that order, one per window length (the units'
    merge-block order is raster order over the gh x gw grid)."""
    units: list[Tensor] = []
    by_length: dict[int, list[Tensor]] = {}
    start = 0
    unit = merge * merge
    for y in range(0, gh, side):
        for x in range(0, gw, side):
            ys = torch.arange(y, min(y + side, gh), device=device)
            xs = torch.arange(x, min(x + side, gw), device=device)
            ids = (ys[:, None] * gw + xs[None, :]).reshape(-1)
            units.append(ids)
            length = ids.numel() * unit
            by_length.setdefault(length, []).append(torch.arange(start, start + length))
            start += length
    order_units = torch.cat(units)
    order = (order_units[:, None] * unit + torch.arange(unit, device=device)).reshape(-1)
    windows = [torch.stack(ws).to(device) for ws in by_length.values()]
    return order, windows
