"""A GGUF file's quantized weights on a GPU, in their block formats: `DeviceGGUFWeight` (a GEMM
operand) and `DeviceGGUFEmbedding` (a lookup table), run by Triton kernels.

Contract: `linear(x, w, bias)` is `GGUFWeight.reference_linear` (kernels/linear_gguf.py), the
function the CPU kernel computes: per block of the weight's format the activations are
quantized to int8 (dx = max|x| / 127, half to even), the integer sums of each sub-block are
exact (int8 tensor-core dots, int32), and the per-block terms are added in fp32 in block order.
So a row's result depends on that row alone, whatever M or the tile sizes (batch invariance: a
decode step and a verify give the same bits), and GPU and CPU agree to fp32 rounding of the
block terms. `rows(w, ids)` dequantizes table rows as the gguf package does (fp32,
(d * sc) * (u - c) or (d * sc) * u - dm * m), rounded once to the model dtype.

Device layout of one part (n rows, K padded to a multiple of 64 with zero weights and scales),
built from the CPU layout's `Parts` by `to_device`:
  * q: 4-, 5-, 6-bit formats: uint8 [n, K / 2], per 64 values c, byte l = u[64c + l] & 15 |
    (u[64c + 32 + l] & 15) << 4 (one load gives two 32-value dot operands); Q8_0: int8 [n, K];
  * hb: the bits above 4: 5-bit int32 [n, K / 32], bit l of word g = bit 4 of u[32g + l];
    6-bit int32 [n, K / 16], bits 2l, 2l + 1 of word w = bits 4, 5 of u[16w + l];
  * sc: int8 [n, K / sub] (K-quants); m: int8 [n, K / 32] (Q4_K, Q5_K);
  * d, dm: fp16 [n, K / block] (dm where the format stores one).
Weights take the file's bytes plus under 1 %; a fused operand joins its consecutive tensors of
one format into one part (one launch), and keeps one part per format otherwise.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.kernels import triton_ops
from quickdraft.kernels.linear_bf16 import PANEL
from quickdraft.kernels.linear_gguf import (
    FORMATS,
    Format,
    GGUFWeight,
    Parts,
    RowParts,
    reference_terms,
    unpack,
)

CHUNK = 64  # values per q load: two 32-value dot operands
# the formats the device layout and its kernels take; the others (Q2_K, Q3_K, IQ4_NL, IQ4_XS,
# MXFP4) run on the CPU kernels, and gguf_gpu.py dequantizes them to bf16 on a GPU
DEVICE_FORMATS = frozenset(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))


@dataclass(frozen=True, slots=True)
class DeviceGGUFPart:
    """Output rows [start, start + n) of a DeviceGGUFWeight, in one format (module docstring)."""

    fmt: Format
    n: int
    k: int  # padded to CHUNK
    q: Tensor
    hb: Tensor | None
    sc: Tensor | None
    m: Tensor | None
    d: Tensor
    dm: Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def fields(self) -> tuple[Tensor | None, ...]:
        return (self.q, self.hb, self.sc, self.m, self.d, self.dm)

    def tensors(self) -> list[Tensor]:
        return [t for t in self.fields() if t is not None]


@dataclass(frozen=True, slots=True)
class DeviceGGUFWeight(RowParts):
    """A weight [N, K] in GGUF block formats on a device, one part per row range."""

    parts: tuple[DeviceGGUFPart, ...]
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].q.device

    def row_range(self, start: int, stop: int, copy: bool = True) -> DeviceGGUFWeight:
        """Output rows [start, stop) in the same layout: a copy (a draft model's restricted
        head), or views (`copy=False`: the up half of a gate / up operand)."""
        parts, at = [], 0
        for p in self.parts:
            lo, hi = max(start - at, 0), min(stop - at, p.n)
            if lo < hi:
                fields = [
                    None if t is None else (t[lo:hi].clone() if copy else t[lo:hi])
                    for t in p.fields()
                ]
                parts.append(DeviceGGUFPart(p.fmt, hi - lo, p.k, *fields))  # type: ignore[arg-type]
            at += p.n
        if not parts:
            raise ValueError(f"rows [{start}, {stop}) of a {self.out_features}-row weight")
        return DeviceGGUFWeight(tuple(parts), self.in_features)


def _layout(fmt: Format, p: Parts, device: torch.device | str) -> DeviceGGUFPart:
    """One part's device layout (module docstring) from its parts."""
    if fmt.name not in DEVICE_FORMATS:
        raise ValueError(f"{fmt.name} has no GPU kernel (GPU formats: {', '.join(DEVICE_FORMATS)})")
    n, k = p.u.shape
    kp = -(-k // CHUNK) * CHUNK
    u = torch.from_numpy(p.u)
    if kp != k:  # a 32-value format with K = 32 (mod 64): one block of zero weights
        u = F.pad(u, (0, kp - k))
    hb = None
    if fmt.bits == 8:
        q = u.view(torch.int8)
    else:
        c = u.reshape(n, kp // CHUNK, 2, 32)
        q = ((c[:, :, 0] & 15) | ((c[:, :, 1] & 15) << 4)).reshape(n, kp // 2)
        if fmt.bits in (5, 6):
            width = 32 if fmt.bits == 5 else 16  # values per int32 word
            xb = fmt.bits - 4
            hi = ((u >> 4) & ((1 << xb) - 1)).to(torch.int64).reshape(n, kp // width, width)
            shifts = torch.arange(width, dtype=torch.int64) * xb
            word = (hi << shifts).sum(dim=2)  # < 2^32
            hb = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)

    def blocks(a: np.ndarray | None, per: int, dtype: torch.dtype) -> Tensor | None:
        if a is None:
            return None
        t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        want = kp // per
        return F.pad(t, (0, want - t.shape[1])) if want != t.shape[1] else t

    sc = blocks(p.sc, fmt.sub, torch.int8) if fmt.has_sc else None
    m = blocks(p.m, 32, torch.int8) if fmt.has_m else None
    d = blocks(p.d, fmt.block, torch.float16)
    dm = blocks(p.dm, fmt.block, torch.float16) if fmt.has_dm else None
    assert d is not None

    def put(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.contiguous().to(device)

    return DeviceGGUFPart(fmt, n, kp, put(q), put(hb), put(sc), put(m), put(d), put(dm))  # type: ignore[arg-type]


def to_device(weight: GGUFWeight, device: torch.device | str) -> DeviceGGUFWeight:
    """A CPU-layout GGUFWeight's exact values in the device layout, converted ~4M weights at a
    time (the unpacked parts of a whole 150k-row table would take GBs)."""
    pieces: list[DeviceGGUFPart] = []
    k = weight.in_features
    step = max(PANEL, (1 << 22) // k // PANEL * PANEL)
    for part in weight.parts:
        for r0 in range(0, part.n, step):
            r1 = min(part.n, r0 + step)
            packed = part.packed[r0 // PANEL : (r1 + PANEL - 1) // PANEL]
            pieces.append(_layout(part.fmt, unpack(part.fmt, packed, r1 - r0), device))
    return merged(DeviceGGUFWeight(tuple(pieces), k))  # one join per run of one format


def merged(w: DeviceGGUFWeight) -> DeviceGGUFWeight:
    """Consecutive parts of one format joined into one (a fused q / k / v or gate / up made
    of separate tensors): one launch each instead of one per tensor."""
    groups: list[list[DeviceGGUFPart]] = []
    for p in w.parts:
        if groups and groups[-1][-1].fmt is p.fmt and groups[-1][-1].k == p.k:
            groups[-1].append(p)
        else:
            groups.append([p])
    return DeviceGGUFWeight(tuple(_join(g) for g in groups), w.in_features)


def _join(pieces: list[DeviceGGUFPart]) -> DeviceGGUFPart:
    if len(pieces) == 1:
        return pieces[0]

    def cat(ts: list[Tensor | None]) -> Tensor | None:
        return None if ts[0] is None else torch.cat(ts)  # type: ignore[arg-type]

    first = pieces[0]
    fields = [cat(list(f)) for f in zip(*(p.fields() for p in pieces), strict=True)]
    return DeviceGGUFPart(first.fmt, sum(p.n for p in pieces), first.k, *fields)  # type: ignore[arg-type]


def random_weight(
    fmt_name: str, n: int, k: int, device: torch.device | str, seed: int = 0
) -> DeviceGGUFWeight:
    """A weight of random parts made on `device` in the device layout (benchmarks: a real
    model's shapes and formats without writing gigabytes of GGUF on a host with no weights):
    any bits, small sub-block scales and mins, d ~ 1e-3."""
    fmt = FORMATS[fmt_name]
    if fmt_name not in DEVICE_FORMATS:
        raise ValueError(f"{fmt_name} has no GPU kernel (GPU formats: {', '.join(DEVICE_FORMATS)})")
    if k % fmt.block:
        raise ValueError(f"{fmt_name} takes K % {fmt.block} == 0, not {k}")
    g = torch.Generator(device=device).manual_seed(seed)
    kp = -(-k // CHUNK) * CHUNK

    def ints(lo: int, hi: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.randint(lo, hi, shape, generator=g, device=device, dtype=torch.int32).to(dtype)

    def scales(scale: float) -> Tensor:
        r = torch.rand(n, kp // fmt.block, generator=g, device=device)
        return (r * scale + scale / 10).to(torch.float16)

    q = (
        ints(-128, 128, (n, kp), torch.int8)
        if fmt.bits == 8
        else ints(0, 256, (n, kp // 2), torch.uint8)
    )
    hb = None
    if fmt.bits in (5, 6):
        hb = ints(-(2**31), 2**31 - 1, (n, kp // (32 if fmt.bits == 5 else 16)), torch.int32)
    sc = (
        ints(-32 if fmt.name == "Q6_K" else 0, 64, (n, kp // fmt.sub), torch.int8)
        if fmt.has_sc
        else None
    )
    m = ints(0, 64, (n, kp // 32), torch.int8) if fmt.has_m else None
    dm = scales(1e-2) if fmt.has_dm else None
    part = DeviceGGUFPart(fmt, n, kp, q, hb, sc, m, scales(1e-3), dm)
    return DeviceGGUFWeight((part,), k)


# -- the torch reference (any device): what the kernels compute, spelled out -------------------


def unpacked(part: DeviceGGUFPart) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(u [n, K] int64 (Q8_0 signed), sc [n, K / sub], m [n, K / sub], d, dm [n, K / block]
    float64) of a part's device layout: the inverse of `_layout`."""
    fmt, n, k = part.fmt, part.n, part.k
    if fmt.bits == 8:
        u = part.q.to(torch.int64)
    else:
        b = part.q.to(torch.int64).reshape(n, k // CHUNK, 1, 32)
        u = torch.cat([b & 15, b >> 4], dim=2).reshape(n, k)
        if part.hb is not None:
            width = 32 if fmt.bits == 5 else 16
            xb = fmt.bits - 4
            shifts = torch.arange(width, device=u.device) * xb
            words = part.hb.to(torch.int64).reshape(n, -1, 1)
            u = u | (((words >> shifts) & ((1 << xb) - 1)) << 4).reshape(n, k)
    nsub = k // fmt.sub
    sc = part.sc.double() if part.sc is not None else u.new_ones(n, nsub).double()
    if part.m is not None:
        m = part.m.double()
    elif fmt.name == "Q6_K":
        m = 32 * sc
    else:
        m = torch.full((n, nsub), float(fmt.m_const), dtype=torch.float64, device=u.device)
    d = part.d.double()
    dm = part.dm.double() if part.dm is not None else d
    return u, sc, m, d, dm


def reference_linear(x: Tensor, w: DeviceGGUFWeight, bias: Tensor | None = None) -> Tensor:
    """`linear`'s function in torch ops on x's device (the module docstring's contract): the
    kernels' reference, and what runs where triton does not."""
    x2 = x.reshape(-1, w.in_features)
    outs = [_reference_part(x2, p) for p in w.parts]
    y = torch.cat(outs, dim=1)
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def _reference_part(x: Tensor, part: DeviceGGUFPart) -> Tensor:
    u, sc, m, d, dm = unpacked(part)
    return reference_terms(x, part.fmt, u, sc, m, d, dm, part.k)


def reference_rows(w: DeviceGGUFWeight, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows `ids` as the gguf package dequantizes them (fp32), in `dtype`."""
    outs = []
    at = 0
    for part in w.parts:
        sel = ids - at
        keep = (sel >= 0) & (sel < part.n)
        outs.append((keep, _rows_part(part, sel.clamp(0, part.n - 1))[:, : w.in_features]))
        at += part.n
    out = torch.zeros(ids.shape[0], w.in_features, dtype=torch.float32, device=ids.device)
    for keep, rows in outs:
        out[keep] = rows[keep]
    return out.to(dtype)


def _rows_part(part: DeviceGGUFPart, sel: Tensor) -> Tensor:
    fmt = part.fmt
    u, sc, m, d, dm = (t[sel] for t in unpacked(part))
    u32 = u.float()
    rep = fmt.sub
    sc32 = sc.float().repeat_interleave(rep, 1)
    d32 = d.float().repeat_interleave(fmt.block, 1)
    if part.dm is None:  # (d * sc) * (u - c): Q4_0 / Q5_0 c = 8 / 16, Q6_K 32, Q8_0 0
        c = 32.0 if fmt.name == "Q6_K" else float(fmt.m_const)
        w = (d32 * sc32) * (u32 - c)
    else:
        m32 = m.float().repeat_interleave(rep, 1)
        dm32 = dm.float().repeat_interleave(fmt.block, 1)
        w = (d32 * sc32) * u32 - dm32 * m32
    return w


# -- the kernels -----------------------------------------------------------------------------


@functools.cache
def _kernels() -> dict[str, Any]:
    from quickdraft.kernels import triton_gguf_jit as jit

    return {"linear": jit.gguf_linear_kernel, "rows": jit.gguf_rows_kernel}


def _flags(fmt: Format) -> dict[str, Any]:
    return dict(
        BITS=fmt.bits, BLOCK=fmt.block, SUB=fmt.sub, HAS_SC=fmt.has_sc, HAS_M=fmt.has_m,
        HAS_DM=fmt.has_dm,
    )  # fmt: skip


def tiles(m: int, n: int, interpreted: bool = False) -> tuple[int, int]:
    """(BM, BN) of a call: 16 activation rows up to a verify's 16, 32 past it (a row's result
    does not depend on them); outputs per program small enough for ~2 programs per SM at
    decode. The interpreter (tests) takes the largest tiles: it pays per program."""
    bm = 16 if m <= 16 else 32
    bn = 64 if n >= 64 * 264 or interpreted else 32 if n >= 32 * 264 else 16
    return bm, bn


def runs(x: Tensor) -> bool:
    """Whether the Triton kernels run for x: on a GPU where triton runs, or in Triton's
    interpreter on the CPU (tests)."""
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0") and triton_ops.installed():
        return os.environ.get("QUICKDRAFT_NO_TRITON", "") in ("", "0")
    return triton_ops.available(x)


def _launch(
    x2: Tensor,
    o: Tensor,
    part: DeviceGGUFPart,
    k: int,
    bias: Tensor | None,
    bn: int | None,
    up: DeviceGGUFPart | None = None,
) -> None:
    """One part's GEMM into `o` [M, part.n]; with `up` (rows in part's format), silu(x @
    part.T) * (x @ up.T) instead."""
    m = x2.shape[0]
    bm, tile_n = tiles(m, part.n, not x2.is_cuda)
    tile_n = bn or tile_n
    second = up or part

    def ptrs(p: DeviceGGUFPart) -> list[Tensor]:
        q = p.q
        return [q, p.hb if p.hb is not None else q, p.sc if p.sc is not None else q,
                p.m if p.m is not None else q, p.d, p.dm if p.dm is not None else p.d]  # fmt: skip

    _kernels()["linear"][(-(-part.n // tile_n), -(-m // bm))](
        x2, o, bias if bias is not None else part.d, *ptrs(part), *ptrs(second),
        m, part.n, k, part.k // part.fmt.block, x2.stride(0), o.stride(0),
        part.q.stride(0), part.hb.stride(0) if part.hb is not None else 0,
        part.sc.stride(0) if part.sc is not None else 0,
        part.m.stride(0) if part.m is not None else 0, part.d.stride(0),
        M_CONST=part.fmt.m_const, Q6=part.fmt.name == "Q6_K", HAS_BIAS=bias is not None,
        GLU=up is not None, BM=bm, BN=tile_n, **_flags(part.fmt),
    )  # fmt: skip


def _rows2(x: Tensor, k: int) -> Tensor:
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(
    x: Tensor, w: DeviceGGUFWeight, bias: Tensor | None = None, bn: int | None = None
) -> Tensor:
    """x [..., K] @ w.T (+ bias) -> [..., N] in x.dtype: one launch per part (module
    docstring's contract), or `reference_linear` where triton does not run. `bn` overrides the
    outputs per program (benchmarks sweep it; the bits do not change)."""
    if not runs(x):
        return reference_linear(x, w, bias)
    x2 = _rows2(x, w.in_features)
    out = x2.new_empty(x2.shape[0], w.out_features)
    at = 0
    for part in w.parts:
        b = bias[at : at + part.n] if bias is not None else None
        _launch(x2, out[:, at : at + part.n], part, w.in_features, b, bn)
        at += part.n
    return out.reshape(*x.shape[:-1], -1)


def swiglu(x: Tensor, gate_up: DeviceGGUFWeight) -> Tensor:
    """silu(x @ gate.T) * (x @ up.T) for a gate / up operand [2I, K] -> [..., I]: one launch
    where both halves are one format (the GEMMs' and `triton_ops.silu_mul`'s bits, each
    projection rounded to x.dtype first), else the GEMM then silu_mul."""
    inter = gate_up.out_features // 2
    gate, up = gate_up.row_range(0, inter, False), gate_up.row_range(inter, 2 * inter, False)
    if not runs(x):
        return _silu_mul(linear(x, gate_up))
    if len(gate.parts) != 1 or len(up.parts) != 1 or gate.parts[0].fmt is not up.parts[0].fmt:
        return triton_ops.silu_mul(linear(x, gate_up))
    x2 = _rows2(x, gate_up.in_features)
    out = x2.new_empty(x2.shape[0], inter)
    _launch(x2, out, gate.parts[0], gate_up.in_features, None, None, up.parts[0])
    return out.reshape(*x.shape[:-1], inter)


def _silu_mul(gate_up: Tensor) -> Tensor:
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    return (g / (1.0 + torch.exp(-g)) * u).to(gate_up.dtype)


def rows(w: DeviceGGUFWeight, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows `ids` [T] of w dequantized (`reference_rows`'s values) -> [T, K] in `dtype`."""
    if not runs(ids):
        return reference_rows(w, ids, dtype)
    kern = _kernels()["rows"]
    ids = ids.reshape(-1).contiguous()
    out = torch.empty(ids.shape[0], w.in_features, dtype=dtype, device=ids.device)
    at = 0
    for part in w.parts:
        fmt = part.fmt
        c = 32 if fmt.name == "Q6_K" else fmt.m_const
        kern[(ids.shape[0], part.k // CHUNK)](
            ids, out, part.q, part.hb if part.hb is not None else part.q,
            part.sc if part.sc is not None else part.q, part.m if part.m is not None else part.q,
            part.d, part.dm if part.dm is not None else part.d,
            at, part.n, w.in_features, out.stride(0), part.q.stride(0),
            part.hb.stride(0) if part.hb is not None else 0,
            part.sc.stride(0) if part.sc is not None else 0,
            part.m.stride(0) if part.m is not None else 0, part.d.stride(0), C=c,
            **_flags(fmt),
        )  # fmt: skip
        at += part.n
    return out


class DeviceGGUFEmbedding(nn.Module):
    """An embedding table left in its GGUF format on a device: a lookup dequantizes the rows it
    reads in one launch (the gguf package's values). With tied embeddings the same weight is the
    output head's operand."""

    def __init__(self, weight: DeviceGGUFWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def forward(self, ids: Tensor) -> Tensor:
        return rows(self.weight, ids.to(self.weight.device), self.dtype).view(
            *ids.shape, self.weight.in_features
        )
