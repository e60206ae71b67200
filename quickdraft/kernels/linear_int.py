"""Integer weights for draft models: int8 with a row scale (`Int8Weight`) and 4-bit groups of 32
with an fp16 scale and min (`Int4Weight`), both in 16-row panels, multiplied with activations
quantized to int8 per 32 values (`quantize_activations`).

Contract: `linear_int8(x, weight, bias)` / `linear_int4(...)` compute the function each weight's
`reference_linear` computes in plain torch (per 32-value block an exact integer dot, scaled in
fp32), with the C++ kernels (linear_i8.cpp, linear_q4.cpp) when eligible and that reference
otherwise; the kernel matches the reference up to fp32 summation order. A draft model's
precision only moves the acceptance rate: the target verifies every token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.kernels.build import extension
from quickdraft.kernels.linear_bf16 import PANEL, streamed_empty

Q4_GROUP = 32  # weights per group of an Int4Weight; values per activation block (int8 kernels)


class RowSource(Protocol):
    """A weight that hands out its rows on demand (a GGUFWeight: dequantized a block at a time),
    so that quantizing it never makes a full-precision copy of the whole weight."""

    @property
    def shape(self) -> torch.Size: ...

    def rows(self, start: int, stop: int, dtype: torch.dtype = ...) -> Tensor: ...


def row_reader(
    weight: Tensor | RowSource,
) -> tuple[int, int, torch.device, Callable[[int, int], Tensor]]:
    """(N, K, device, rows(start, stop)) of a weight [N, K]."""
    if isinstance(weight, Tensor):
        w = weight.detach()
        return w.shape[0], w.shape[1], w.device, lambda a, b: w[a:b]
    n, k = weight.shape
    return n, k, torch.device("cpu"), weight.rows


def quantize_activations(x: Tensor, k32: int, block: int = Q4_GROUP) -> tuple[Tensor, Tensor]:
    """What the integer-dot kernels (quant.h, linear_gguf.cpp) do to x [..., K]: zero-pad to
    k32 columns, then per block of `block` values xq = round(x / dx) (half to even) with
    dx = max|x| / 127. Returns xq [M, k32 / block, block] (integer-valued fp32) and dx
    [M, k32 / block]."""
    xs = x.float().reshape(-1, x.shape[-1])
    if k32 != xs.shape[1]:
        xs = F.pad(xs, (0, k32 - xs.shape[1]))
    xs = xs.reshape(xs.shape[0], k32 // block, block)
    dx = xs.abs().amax(dim=2) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    return torch.round(xs * inv[..., None]), dx


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A weight [N, K] as int8 with one fp32 scale per output row (symmetric, absmax),
    w ~= q * scale[:, None], in 16-row panels of 4-column quads for `linear_i8.cpp`: `packed`
    [ceil(N / 16), K32 / 4, 64] (K32 = K rounded up to 32) holds packed[p, c, 4j + i] =
    q[16p + j, 4c + i], zero past N and K. The kernel multiplies it with activations quantized
    to int8 per 32 values (`reference_linear`). Half the bytes of bf16; for draft models, whose
    precision only moves the acceptance rate."""

    packed: Tensor  # [P, K32 / 4, 64] int8
    scale: Tensor  # [N] fp32
    in_features: int

    @classmethod
    def quantize(cls, weight: Tensor | RowSource) -> Int8Weight:
        """Row blocks of ~1 MiB in fp32, each quantized while it is in cache: Qwen2.5-Coder-0.5B's
        `quantize_("int8")` takes 0.8 s instead of 10.2 s with whole-tensor ops, and no fp32
        copy of a whole weight is made; every row comes out exactly as by whole-tensor ops."""
        n, k, device, read = row_reader(weight)
        q = torch.empty((n, k), dtype=torch.int8, device=device)
        scale = torch.empty(n, dtype=torch.float32, device=device)
        rows = max(1, (1 << 18) // max(k, 1))
        for i in range(0, n, rows):
            w = read(i, i + rows).float()
            s = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
            q[i : i + rows] = torch.round(w / s[:, None]).clamp_(-127, 127)  # w may alias weight
            scale[i : i + rows] = s
        return cls.from_rows(q, scale)

    @classmethod
    def from_rows(cls, qweight: Tensor, scale: Tensor) -> Int8Weight:
        """From int8 rows [N, K] (values in -127..127) and their fp32 scales [N]."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.shape != qweight.shape[:1]:
            raise ValueError(
                f"need int8 rows [N, K] and scales [N], got {qweight.dtype} "
                f"{tuple(qweight.shape)} and {tuple(scale.shape)}"
            )
        n, k = qweight.shape
        p, k32 = (n + PANEL - 1) // PANEL, (k + Q4_GROUP - 1) // Q4_GROUP * Q4_GROUP
        padded = F.pad(qweight, (0, k32 - k, 0, p * PANEL - n))
        packed = streamed_empty((p, k32 // 4, PANEL, 4), torch.int8, qweight.device)
        # [p, j, c, i] -> [p, c, j, i]: quad c of row 16p + j at bytes 4j..4j + 3
        packed.copy_(padded.reshape(p, PANEL, k32 // 4, 4).transpose(1, 2))
        return cls(packed.view(p, k32 // 4, 4 * PANEL), scale.float().contiguous(), k)

    @property
    def qweight(self) -> Tensor:
        """The int8 rows [N, K] (a copy)."""
        p, quads, _ = self.packed.shape
        rows = self.packed.view(p, quads, PANEL, 4).transpose(1, 2).reshape(p * PANEL, quads * 4)
        return rows[: self.out_features, : self.in_features].contiguous()

    @property
    def out_features(self) -> int:
        return int(self.scale.shape[0])

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def reference_linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """What the kernel computes, in plain torch (tests, fallback): per 32-value block an
        integer dot of the int8 activations with q, times dx, summed in fp32, times the row
        scale (+ bias)."""
        k32 = self.packed.shape[1] * 4
        xq, dx = quantize_activations(x, k32)  # [M, G, 32], [M, G]
        q = F.pad(self.qweight, (0, k32 - self.in_features)).float()
        dots = torch.einsum("mgj,ngj->mng", xq, q.reshape(q.shape[0], -1, Q4_GROUP))  # exact
        y = (dots * dx[:, None]).sum(dim=2) * self.scale
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def linear_int8(x: Tensor, weight: Int8Weight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x.dtype, activations quantized to int8 as
    `Int8Weight.reference_linear` says: the kernel when eligible, else that reference (slow,
    the same function up to summation order)."""
    ext = extension() if x.is_cpu else None
    if ext is not None and ext.eligible_i8(x, weight.packed, weight.scale, bias):
        out: Tensor = ext.linear_i8(x, weight.packed, weight.scale, bias)
        return out
    return weight.reference_linear(x, bias)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A weight [N, K] in 4 bits: per group of 32 weights of a row, w ~= d * q + mn with q in
    0..15 and d, mn in fp16 (asymmetric min/max, as GGUF's Q4_1), in 16-row panels for
    `linear_q4.cpp`: `packed` [ceil(N / 16), K / 32, 320] uint8 holds per panel p and group g
    8 quads of 32 bytes (quad c, byte 4j + i = q[16p + j][32g + 4c + i] | q[16p + 8 + j][...]
    << 4 for j < 8, i < 4), then the panel's 16 fp16 d, then its 16 fp16 mn (rows past N: 0).
    ~0.63 bytes per weight (int8: 1, bf16: 2). The kernel multiplies it with activations
    quantized to int8 per 32 values (see `reference_linear`); for draft models, where
    precision only moves the acceptance rate."""

    packed: Tensor  # [P, K / 32, 320] uint8
    out_features: int
    in_features: int

    @classmethod
    def quantize(cls, weight: Tensor | RowSource) -> Int4Weight:
        """Panels of rows in blocks of ~1 MiB of fp32, each quantized while it is in cache (no
        fp32 copy of the whole weight)."""
        n, k, device, read = row_reader(weight)
        if k % Q4_GROUP:
            raise ValueError(f"int4 weights need in_features % {Q4_GROUP} == 0, got {k}")
        groups, p = k // Q4_GROUP, (n + PANEL - 1) // PANEL
        shape = (p, groups, Q4_GROUP * PANEL // 2 + 4 * PANEL)
        packed = streamed_empty(shape, torch.uint8, device)
        step = max(1, (1 << 18) // (k * PANEL))  # panels per block
        for p0 in range(0, p, step):
            w = read(p0 * PANEL, (p0 + step) * PANEL).float()
            w = F.pad(w, (0, 0, 0, -w.shape[0] % PANEL)).reshape(-1, groups, Q4_GROUP)
            lo, hi = w.amin(dim=2), w.amax(dim=2)
            d, mn = ((hi - lo) / 15).half(), lo.half()
            # quantize against the fp16-rounded scale and min, the values the kernel will use
            d32 = d.float().clamp_min(torch.finfo(torch.float16).tiny)
            q = torch.round((w - mn.float()[..., None]) / d32[..., None]).clamp_(0, 15)
            q = q.to(torch.uint8).reshape(-1, 2, 8, groups, 8, 4)  # [p, half, j, g, c, i]
            nib = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 3, 1, 4)  # [p, g, c, j, i]
            scales = torch.cat([d.reshape(-1, PANEL, groups), mn.reshape(-1, PANEL, groups)], 1)
            packed[p0 : p0 + nib.shape[0]] = torch.cat(
                [
                    nib.reshape(nib.shape[0], groups, -1),
                    scales.transpose(1, 2).contiguous().view(torch.uint8),
                ],
                dim=2,
            )
        return cls(packed, n, k)

    def _parts(self) -> tuple[Tensor, Tensor, Tensor]:
        """d, mn [N, G] fp32 and q [N, G, 32] (values 0..15, float)."""
        p, groups, _ = self.packed.shape
        nib = self.packed[..., : Q4_GROUP * PANEL // 2].reshape(p, groups, 8, 8, 4)  # g c j i
        q = torch.stack([nib & 0x0F, nib >> 4], dim=1)  # [p, half, g, c, j, i]
        q = q.permute(0, 1, 4, 2, 3, 5).reshape(p * PANEL, groups, Q4_GROUP)
        scales = self.packed[..., Q4_GROUP * PANEL // 2 :].contiguous().view(torch.float16)
        scales = scales.float().reshape(p, groups, 2, PANEL).permute(2, 0, 3, 1)  # [2, p, j, g]
        n = self.out_features
        d, mn = scales.reshape(2, p * PANEL, groups)[:, :n]
        return d, mn, q[:n].float()

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        d, mn, q = self._parts()
        w = d[..., None] * q + mn[..., None]
        return w.reshape(self.out_features, self.in_features).to(dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def reference_linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """What the kernel computes, in plain torch (tests, fallback): x quantized per 32
        values to int8 with dx = max|x| / 127 (round half to even), integer dot with q per
        group, then d * dx * dot + mn * dx * sum(xq) per group, summed in fp32."""
        xq, dx = quantize_activations(x, self.in_features)  # [M, G, 32], [M, G]
        sx = dx * xq.sum(dim=2)  # [M, G]
        d, mn, q = self._parts()  # [N, G], [N, G, 32]
        dots = torch.einsum("mgj,ngj->mng", xq, q)  # exact: integers < 2^24
        y = (d[None] * dx[:, None] * dots + mn[None] * sx[:, None]).sum(dim=2)
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def linear_int4(x: Tensor, weight: Int4Weight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x.dtype, activations quantized to int8 as
    `Int4Weight.reference_linear` says: the kernel when eligible, else that reference (slow,
    the same function up to summation order)."""
    ext = extension() if x.is_cpu else None
    if ext is not None and ext.eligible_q4(x, weight.packed, weight.out_features, bias):
        out: Tensor = ext.linear_q4(x, weight.packed, weight.out_features, bias)
        return out
    return weight.reference_linear(x, bias)
