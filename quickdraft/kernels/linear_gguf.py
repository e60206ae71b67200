# ~440 lines on purpose: the layout, its decoders per format, packing and the reference the
# kernel is tested against describe one thing and are read together.
"""A GGUF file's own quantized weights as GEMM operands (`GGUFWeight`), repacked once at load
into 16-row panels that hold exactly the values the GGUF's reference dequantization gives.

Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4 (blocks of 32 weights, one scale) and
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (super-blocks of 256 with 4-, 6- or 8-bit sub-block
scales). Every one is written as

    w = d * sc[s] * v(u) - dm * m[s]

with u an unsigned integer of 2-6 bits (Q8_0: signed 8 bits), v(u) = u except for the
non-linear formats, whose 4-bit u indexes a table of signed values (IQ4_NL / IQ4_XS: -127..113;
MXFP4: the e2m1 values doubled, -12..12), sc and m small integers per sub-block s (16 or 32
weights), and d, dm per block (fp16; MXFP4's d is an E8M0 power of two, 2^(e - 128)): Q4_0 is
d * (u - 8) (sc = 1, dm = d, m = 8), Q4_1 d * u + min (dm = -min, m = 1), Q6_K d * sc * (u - 32)
(dm = d, m = 32 sc), Q3_K d * sc * (u - 4) (m = 4 sc, u's third bit the hmask bit), Q2_K /
Q4_K / Q5_K d * sc * u - dmin * m, IQ4_XS d * sc * v(u) (sc = ls - 32). `decode` turns a
tensor's raw blocks into these parts; `GGUFWeight.from_parts` lays them out for
linear_gguf.cpp (layout below).

Contract: `linear_gguf(x, weight, bias)` computes, per output row n and token t,
    y[t, n] = sum_b ( d[n,b] dx[t,b] sum_s sc[n,s] dot_s(v(u[n]), xq[t])
                     - dm[n,b] dx[t,b] sum_s m[n,s] bsum[t,s] )
(+ bias), where per block b of the weight's format (32 or 256 values) the activations are
quantized as xq = round(x / dx) in -127..127 with dx = max|x| / 127 and bsum is the sum of xq
over sub-block s: the integer sums are exact, the block terms are added in fp32 in block order.
`GGUFWeight.reference_linear` computes the same function in plain torch (float64 integer
sums), so kernel and reference agree up to fp32 rounding of the block terms (tests: 1e-5
relative to the output's scale); against x @ dequantize(w).T the difference is the activation
quantization's (~1e-2 relative, as llama.cpp's Q8_0 / Q8_K activations). Each row's result
depends on that row alone, whatever M: a decode step and a verify pass give the same bits.

Layout (`packed`: one uint8 tensor [P, blocks, bytes_per_block] per part, P = ceil(N / 16)): per
16-row panel and block, for each 32-column group g, 8 quads c of 4 columns:
  * 4-6 bits: 4-bit low parts, 32 bytes per quad, byte 4j + i = u[j][4c+i] & 15 |
    (u[8+j][4c+i] & 15) << 4 (rows j < 8 in the low nibble, rows 8 + j in the high one), as
    Int4Weight; 2-3 bits: 2-bit low parts, 128 bytes per group, laid out as a 2-bit plane;
  * a 1-bit plane (5 bits: bit 4; 3 bits: bit 2) then, 64 bytes per group: vector v (quads
    4v..4v+3), byte 4j + i, bit 2 (c % 4) + h = that bit of u[8h + j][4c + i];
  * a 2-bit plane (6 bits: bits 4-5; the 2-bit low parts: bits 0-1), 128 bytes per group:
    vector v (quads 2v, 2v+1), bits 2k..2k+1 with k = 2 (c % 2) + h = those bits of
    u[8h + j][4c + i];
  * Q8_0 instead 64 bytes per quad: rows 0-7 then rows 8-15, byte 4j + i, signed;
  then sc [subs][16] int8 (K-quants, IQ4_XS; Q2_K: sc | m << 4, a byte, as its file), m
  [subs][16] int8 (Q4_K, Q5_K), d [16] fp16
  (MXFP4: [16] E8M0 bytes), and dm [16] fp16 (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K; where dm = d it is
  not stored). Rows past N are zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.kernels.build import extension, runnable
from quickdraft.kernels.linear_bf16 import PANEL, streamed_empty
from quickdraft.kernels.linear_int import quantize_activations

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled


@dataclass(frozen=True, slots=True)
class Format:
    """One GGUF block format as linear_gguf.cpp runs it."""

    name: str
    code: int  # the kernel's format id
    block: int  # weights per block (one d, dm)
    block_bytes: int  # bytes per block in the GGUF file
    bits: int  # bits of u
    sub: int  # weights per sub-block (one sc, m; one activation sum)
    has_sc: bool  # per-sub-block integer scales
    has_m: bool  # per-sub-block integer mins, stored (Q2_K, Q4_K, Q5_K)
    has_dm: bool  # a second fp16 per block, stored (else dm = d)
    m_const: int = 0  # m where it is one constant (Q4_0: 8, Q5_0: 16, Q4_1 / Q5_1: 1)
    m_sc: int = 0  # m = m_sc * sc (Q6_K: 32, Q3_K: 4)
    table: tuple[int, ...] | None = None  # v(u) for the non-linear formats
    e8m0: bool = False  # d is an E8M0 byte, 2^(e - 128) (MXFP4), not fp16
    packed_m: bool = False  # 4-bit sc and m share a byte, sc low (Q2_K, as its file)

    def panel_block_bytes(self) -> int:
        """Bytes of one 16-row panel's block in the packed layout."""
        quant = PANEL * self.block * self.bits // 8
        scales = PANEL * (self.block // self.sub) if self.has_sc else 0
        mins = PANEL * (self.block // self.sub) if self.has_m and not self.packed_m else 0
        return quant + scales + mins + (1 if self.e8m0 else 2) * PANEL * (2 if self.has_dm else 1)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("Q4_0", 0, 32, 18, 4, 32, False, False, False, m_const=8),
        Format("Q4_1", 1, 32, 20, 4, 32, False, False, True, m_const=1),
        Format("Q5_0", 2, 32, 22, 5, 32, False, False, False, m_const=16),
        Format("Q5_1", 3, 32, 24, 5, 32, False, False, True, m_const=1),
        Format("Q8_0", 4, 32, 34, 8, 32, False, False, False),
        Format("Q4_K", 5, 256, 144, 4, 32, True, True, True),
        Format("Q5_K", 6, 256, 176, 5, 32, True, True, True),
        Format("Q6_K", 7, 256, 210, 6, 16, True, False, False, m_sc=32),
        Format("Q2_K", 8, 256, 84, 2, 16, True, True, True, packed_m=True),
        Format("Q3_K", 9, 256, 110, 3, 16, True, False, False, m_sc=4),
        Format("IQ4_NL", 10, 32, 18, 4, 32, False, False, False, table=IQ4_VALUES),
        Format("IQ4_XS", 11, 256, 136, 4, 32, True, False, False, table=IQ4_VALUES),
        Format("MXFP4", 12, 32, 17, 4, 32, False, False, False, table=MXFP4_VALUES, e8m0=True),
    )
}
BY_CODE = {f.code: f for f in FORMATS.values()}

# The kernel's tiles by the extension's `gguf_isa` level, and the CPU flags each needs.
TILES = {"avx2": 0, "avx512": 1, "avx512_vbmi": 2}
TILE_FLAGS = {
    "avx2": frozenset(),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "avx512_vbmi": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"}),
}


def cpu_tiles() -> list[str]:
    """The tiles this CPU's flags allow, slowest first."""
    return runnable(TILE_FLAGS)


def tile_name(level: int) -> str:
    """The tile of a `gguf_isa` level (what the extension says is in use)."""
    return next(name for name, lv in TILES.items() if lv == level)


@dataclass(frozen=True, slots=True)
class Parts:
    """A weight [N, K] as w = d * sc * v(u) - dm * m (module docstring), numpy arrays."""

    u: np.ndarray  # [N, K] uint8 (Q8_0: the int8 values' bytes; IQ4 / MXFP4: table indices)
    sc: np.ndarray | None  # [N, K / sub] int8
    m: np.ndarray | None  # [N, K / sub] int16 (m_sc formats: m_sc * sc; simple ones: None)
    d: np.ndarray  # [N, K / block] fp16 (MXFP4: uint8 E8M0 exponents)
    dm: np.ndarray  # [N, K / block] fp16 (a copy of d where the format has none)


# byte offsets of d and dm in a GGUF block, where not 0 and 2
D_AT = {"Q6_K": 208, "Q2_K": 80, "Q3_K": 108}
DM_AT = {"Q2_K": 82}


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles first, then high (ggml's order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes -> 8 6-bit scales and 8 6-bit mins (get_scale_min_k4)."""
    q = scales.astype(np.uint8)
    sc = np.empty((*q.shape[:-1], 8), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4], m[..., :4] = q[..., 0:4] & 63, q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)
    m[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, m


def _q3k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes -> 16 signed 6-bit scales (ggml's kmask1 / kmask2 unpacking)."""
    a = np.ascontiguousarray(scales).view("<u4")  # [..., 3]
    lo, hi, top = a[..., 0], a[..., 1], a[..., 2]
    k1, k2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    words = [
        (lo & k2) | (((top >> 0) & k1) << 4),
        (hi & k2) | (((top >> 2) & k1) << 4),
        ((lo >> 4) & k2) | (((top >> 4) & k1) << 4),
        ((hi >> 4) & k2) | (((top >> 6) & k1) << 4),
    ]
    w = np.ascontiguousarray(np.stack(words, axis=-1).astype("<u4"))
    return w.view(np.uint8).astype(np.int16) - 32


def _two_bit(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 64 quant bytes [..., 64] -> 256 2-bit values: value 128 h + 32 j + l is
    bits 2j, 2j + 1 of byte 32 h + l."""
    q = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    return (q >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [..., 2, 4, 32]


def decode(fmt: Format, raw: np.ndarray, k: int) -> Parts:
    """A tensor's GGUF bytes ([N, K / block * block_bytes] uint8, one row per output) -> its
    parts."""
    n = raw.shape[0]
    if k % fmt.block or raw.shape[1] != k // fmt.block * fmt.block_bytes:
        raise ValueError(
            f"{fmt.name}: rows of {raw.shape[1]} bytes do not hold {k} weights "
            f"({fmt.block_bytes} bytes per {fmt.block})"
        )
    b = raw.reshape(n, k // fmt.block, fmt.block_bytes)
    d = b[..., 0].copy() if fmt.e8m0 else _f16(b, D_AT.get(fmt.name, 0))
    dm = d
    sc = m = None
    if fmt.name in ("Q4_0", "Q4_1"):
        at = 2 if fmt.name == "Q4_0" else 4
        u = _nibbles(b[..., at : at + 16])
        if fmt.name == "Q4_1":
            dm = -_f16(b, 2)
    elif fmt.name in ("Q5_0", "Q5_1"):
        at = 2 if fmt.name == "Q5_0" else 4
        qh = np.ascontiguousarray(b[..., at : at + 4]).view("<u4")  # [N, nb, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        u = _nibbles(b[..., at + 4 : at + 20]) | high
        if fmt.name == "Q5_1":
            dm = -_f16(b, 2)
    elif fmt.name == "Q8_0":
        u = b[..., 2:34]
    elif fmt.name in ("Q4_K", "Q5_K"):
        dm = _f16(b, 2)
        sc, m = _k_scales(b[..., 4:16])
        at = 16 if fmt.name == "Q4_K" else 48
        qs = b[..., at : at + 128].reshape(n, -1, 4, 32)  # chunk i: subs 2i (low), 2i+1 (high)
        u = np.stack([qs & 15, qs >> 4], axis=3)  # [N, nb, 4, 2, 32]
        if fmt.name == "Q5_K":
            qh = b[..., 16:48]  # bit 2i + half of qh[l]: the fifth bit of value l of sub 2i+half
            shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
            u = u | (((qh[:, :, None, None, :] >> shifts) & 1) << 4)
    elif fmt.name == "Q6_K":
        ql, qh = b[..., 0:128].reshape(n, -1, 2, 2, 32), b[..., 128:192].reshape(n, -1, 2, 1, 32)
        lo = np.stack([ql & 15, ql >> 4], axis=3)  # [N, nb, half, nib, l32, 32]
        # value 128 half + 64 nib + 32 l32 + l has its top bits at qh[half][l] >> 2 (2 nib + l32)
        shifts = (2 * (2 * np.arange(2).reshape(2, 1) + np.arange(2))).astype(np.uint8)
        high = (qh[:, :, :, None] >> shifts[:, :, None]) & 3  # [N, nb, half, nib, l32, 32]
        u = lo | (high << 4)
        sc = b[..., 192:208].view(np.int8)
    elif fmt.name == "Q2_K":  # scale byte: sc low nibble, min high; d at 80, dmin at 82
        dm = _f16(b, 82)
        sc, m = b[..., 0:16] & 15, b[..., 0:16] >> 4
        u = _two_bit(b[..., 16:80])
    elif fmt.name == "Q3_K":  # the third bit from hmask: bit 4 h + j of byte l (value above)
        shifts = (4 * np.arange(2).reshape(2, 1, 1) + np.arange(4).reshape(4, 1)).astype(np.uint8)
        high = (b[..., None, None, 0:32] >> shifts) & 1  # [N, nb, 2, 4, 32]
        u = _two_bit(b[..., 32:96]) | (high << 2)
        sc = _q3k_scales(b[..., 96:108]).astype(np.int8)
    elif fmt.name == "IQ4_NL":
        u = _nibbles(b[..., 2:18])
    elif fmt.name == "IQ4_XS":  # 6-bit ls: low 4 from scales_l, high 2 from scales_h
        sh = np.ascontiguousarray(b[..., 2:4]).view("<u2")  # [N, nb, 1]
        sl = b[..., 4:8]
        ib = np.arange(8)
        low = (sl[..., ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 15
        high = (sh >> (2 * ib).astype(np.uint16)) & 3
        sc = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
        u = _nibbles(b[..., 8:136].reshape(n, -1, 8, 16))
    elif fmt.name == "MXFP4":
        u = _nibbles(b[..., 1:17])
    else:
        raise ValueError(f"no decoder for {fmt.name}")
    u = np.ascontiguousarray(u).reshape(n, k)
    sc = None if sc is None else np.ascontiguousarray(sc).reshape(n, -1).astype(np.int8)
    if fmt.m_sc:
        assert sc is not None
        m = fmt.m_sc * sc.astype(np.int16)
    if m is not None:
        m = np.ascontiguousarray(m).reshape(n, -1).astype(np.int16)
    return Parts(u, sc, m, np.ascontiguousarray(d), np.ascontiguousarray(dm))


def random_blocks(fmt: Format, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF bytes [n, k / block * block_bytes] of `fmt` with finite scales (d ~ 1e-3,
    mins ~ 1e-2; MXFP4: 2^-13..2^-10): weights for kernel tests and benchmarks where no real
    tensor is needed."""
    rng = np.random.default_rng(seed)
    nb = k // fmt.block
    raw = rng.integers(0, 256, (n, nb, fmt.block_bytes), dtype=np.uint8)

    def f16(scale: float, signed: bool) -> np.ndarray:
        v = rng.random((n, nb)) * scale + scale / 10
        if signed:
            v *= rng.choice([-1.0, 1.0], (n, nb))
        return v.astype(np.float16).view(np.uint8).reshape(n, nb, 2)

    if fmt.e8m0:
        raw[..., 0] = rng.integers(115, 119, (n, nb), dtype=np.uint8)
    else:
        at = D_AT.get(fmt.name, 0)
        raw[..., at : at + 2] = f16(1e-3, False)
    if fmt.has_dm:  # Q4_1 / Q5_1: a signed min; K-quants: dmin >= 0
        at = DM_AT.get(fmt.name, 2)
        raw[..., at : at + 2] = f16(1e-2, fmt.block == 32)
    return raw.reshape(n, -1)


def scale_values(fmt: Format, d: np.ndarray) -> np.ndarray:
    """A part's d (or dm) as the float64 values it stands for (MXFP4's E8M0: 2^(e - 128),
    exact in fp32 too)."""
    if fmt.e8m0:
        return np.ldexp(1.0, d.astype(np.int32) - 128)
    return d.astype(np.float64)


def part_values(fmt: Format, p: Parts) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(v(u) [N, K], sc [N, K / sub], m [N, K / sub]) as float64 tensors (sc 1 and m the
    format's constant where it stores none) and (d, dm) [N, K / block] as float32."""
    if fmt.bits == 8:
        v = torch.from_numpy(p.u.view(np.int8)).double()
    elif fmt.table is not None:
        v = torch.tensor(fmt.table, dtype=torch.float64)[torch.from_numpy(p.u).long()]
    else:
        v = torch.from_numpy(p.u).double()
    n, nsub = v.shape[0], v.shape[1] // fmt.sub
    sc = torch.ones(n, nsub, dtype=torch.float64)
    if p.sc is not None:
        sc = torch.from_numpy(p.sc).double()
    if p.m is not None:
        m = torch.from_numpy(p.m).double()
    else:
        m = torch.full((n, nsub), float(fmt.m_const), dtype=torch.float64)
    d = torch.from_numpy(scale_values(fmt, p.d).astype(np.float32))
    dm = torch.from_numpy(scale_values(fmt, p.dm).astype(np.float32))
    return v, sc, m, d, dm


def dequantize_parts(fmt: Format, p: Parts) -> Tensor:
    """w [N, K] float64 from its parts (tests compare it with the gguf package's own)."""
    v, sc, m, d32, dm32 = part_values(fmt, p)
    d = d32.double().repeat_interleave(fmt.block, 1)
    dm = dm32.double().repeat_interleave(fmt.block, 1)
    sc, m = sc.repeat_interleave(fmt.sub, 1), m.repeat_interleave(fmt.sub, 1)
    return d * sc * v - dm * m


def _panels(a: np.ndarray, rows: int) -> Tensor:
    """[N, ...] numpy -> torch [P * 16, ...], zero rows past N."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if t.dim() == 2 else t


def _plane(u: Tensor, shift: int, xb: int) -> Tensor:
    """Bits shift..shift + xb - 1 (xb 1 or 2) of u [P, h, j, b, g, c, i] as a 1- or 2-bit
    plane (module docstring) -> [P, b, g * vectors * 32] uint8."""
    npan, _, _, nb, s, _, _ = u.shape
    per = 8 // (2 * xb)  # quads sharing a vector
    hi = ((u >> shift) & ((1 << xb) - 1)).reshape(npan, 2, 8, nb, s, 8 // per, per, 4)
    at = torch.arange(per).reshape(per, 1) * 2 + torch.arange(2)  # [cc, h] -> k
    hi = hi.permute(0, 2, 3, 4, 5, 7, 6, 1)  # [P, j, b, g, v, i, cc, h]
    byte = (hi.to(torch.int32) << (xb * at).to(torch.int32)).sum(dim=(-2, -1))
    return byte.to(torch.uint8).permute(0, 2, 3, 4, 1, 5).reshape(npan, nb, -1)


def _unplane(byte: Tensor, xb: int) -> Tensor:
    """A 1- or 2-bit plane [P, b, bytes] back to its bits [P, h, j, b, g, c, i] (uint8)."""
    npan, nb = byte.shape[:2]
    per = 8 // (2 * xb)
    s = byte.shape[2] * 8 // (PANEL * 32 * xb)
    byte = byte.reshape(npan, nb, s, 8 // per, 8, 4)  # [P, b, g, v, j, i]
    at = torch.arange(per).reshape(per, 1) * 2 + torch.arange(2)  # [cc, h]
    hi = (byte[..., None, None].to(torch.int32) >> (xb * at)) & ((1 << xb) - 1)
    hi = hi.permute(0, 7, 4, 1, 2, 3, 6, 5).reshape(npan, 2, 8, nb, s, 8, 4)
    return hi.to(torch.uint8)


def pack(fmt: Format, p: Parts, out: Tensor | None = None) -> Tensor:
    """Parts -> the panel layout [P, K / block, panel_block_bytes] uint8 (module docstring),
    written into `out` when given."""
    n, k = p.u.shape
    npan, nb, s = (n + PANEL - 1) // PANEL, k // fmt.block, fmt.block // 32
    rows = npan * PANEL
    u = _panels(p.u, rows).reshape(npan, 2, 8, nb, s, 8, 4)  # [P, h, j, b, g, c, i]
    pieces: list[Tensor] = []
    if fmt.bits == 8:
        pieces.append(u.permute(0, 3, 4, 5, 1, 2, 6).reshape(npan, nb, -1))  # [P,b,g,c,h,j,i]
    elif fmt.bits >= 4:
        nib = (u[:, 0] & 15) | ((u[:, 1] & 15) << 4)  # [P, j, b, g, c, i]
        pieces.append(nib.permute(0, 2, 3, 4, 1, 5).reshape(npan, nb, -1))
        if fmt.bits > 4:
            pieces.append(_plane(u, 4, fmt.bits - 4))
    else:  # 2-bit low parts, then Q3_K's third bit
        pieces.append(_plane(u, 0, 2))
        if fmt.bits == 3:
            pieces.append(_plane(u, 2, 1))

    def per_row(a: np.ndarray, dtype: torch.dtype) -> Tensor:
        # [N, nb * per_block] -> [P, nb, per_block * 16 rows] bytes, row fastest
        t = _panels(a, rows).reshape(npan, PANEL, nb, -1).permute(0, 2, 3, 1)
        return t.contiguous().view(dtype).reshape(npan, nb, -1).view(torch.uint8)

    if fmt.packed_m:
        assert p.sc is not None and p.m is not None
        both = (p.sc.astype(np.uint8) & 15) | (p.m.astype(np.uint8) << 4)
        pieces.append(per_row(both, torch.uint8))
    else:
        if fmt.has_sc:
            assert p.sc is not None
            pieces.append(per_row(p.sc, torch.int8))
        if fmt.has_m:
            assert p.m is not None
            pieces.append(per_row(p.m.astype(np.int8), torch.int8))
    scale = torch.uint8 if fmt.e8m0 else torch.float16
    pieces.append(per_row(p.d, scale))
    if fmt.has_dm:
        pieces.append(per_row(p.dm, scale))
    if out is None:
        out = streamed_empty((npan, nb, fmt.panel_block_bytes()), torch.uint8)
    torch.cat([x.reshape(npan, nb, -1).view(torch.uint8) for x in pieces], dim=2, out=out)
    return out


def unpack(fmt: Format, packed: Tensor, n: int) -> Parts:
    """The panel layout back to parts (tests check the round trip)."""
    npan, nb, _ = packed.shape
    s, rows, k = fmt.block // 32, npan * PANEL, nb * fmt.block
    at = 0

    def take(nbytes: int) -> Tensor:
        nonlocal at
        piece = packed[:, :, at : at + nbytes]
        at += nbytes
        return piece

    if fmt.bits == 8:
        u = take(PANEL * fmt.block).reshape(npan, nb, s, 8, 2, 8, 4).permute(0, 4, 5, 1, 2, 3, 6)
    elif fmt.bits >= 4:
        nib = take(PANEL * fmt.block // 2).reshape(npan, nb, s, 8, 8, 4)  # [P, b, g, c, j, i]
        u = torch.stack([nib & 15, nib >> 4], 1).permute(0, 1, 5, 2, 3, 4, 6)  # [P,h,j,b,g,c,i]
        if fmt.bits > 4:
            xb = fmt.bits - 4
            u = u | (_unplane(take(PANEL * fmt.block * xb // 8), xb) << 4)
    else:
        u = _unplane(take(PANEL * fmt.block // 4), 2)
        if fmt.bits == 3:
            u = u | (_unplane(take(PANEL * fmt.block // 8), 1) << 2)
    u_np = u.reshape(rows, k)[:n].contiguous().numpy()

    def rows_of(nbytes: int, dtype: torch.dtype) -> np.ndarray:
        t = take(nbytes).contiguous().view(dtype).reshape(npan, nb, -1, PANEL)
        return t.permute(0, 3, 1, 2).reshape(rows, -1)[:n].contiguous().numpy()

    subs = PANEL * fmt.block // fmt.sub
    sc: np.ndarray | None
    m: np.ndarray | None
    if fmt.packed_m:
        both = rows_of(subs, torch.uint8)
        sc, m = (both & 15).astype(np.int8), (both >> 4).astype(np.int16)
    else:
        sc = rows_of(subs, torch.int8) if fmt.has_sc else None
        m = rows_of(subs, torch.int8).astype(np.int16) if fmt.has_m else None
    if fmt.m_sc:
        assert sc is not None
        m = fmt.m_sc * sc.astype(np.int16)
    scale, width = (torch.uint8, PANEL) if fmt.e8m0 else (torch.float16, 2 * PANEL)
    d = rows_of(width, scale)
    dm = rows_of(width, scale) if fmt.has_dm else d
    return Parts(u_np, sc, m, d, dm)


@dataclass(frozen=True, slots=True)
class GGUFPart:
    """Output rows [start, start + n) of a GGUFWeight, in one format."""

    fmt: Format
    packed: Tensor  # [ceil(n / 16), K / block, fmt.panel_block_bytes()] uint8
    n: int


class RowParts:
    """The shape of a weight [N, K] stored as row ranges (`parts`, each of `n` rows): GGUFWeight
    here, DeviceGGUFWeight (kernels/triton_gguf.py) on a GPU."""

    __slots__ = ()
    parts: tuple[Any, ...]
    in_features: int

    @property
    def out_features(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))


@dataclass(frozen=True, slots=True)
class GGUFWeight(RowParts):
    """A weight [N, K] made of row ranges in GGUF block formats (one part, or several when a
    fused projection joins tensors of different formats: Q4_K_M stores some v / ffn_down in
    Q6_K), each repacked exactly into the panel layout (module docstring)."""

    parts: tuple[GGUFPart, ...]
    in_features: int

    @classmethod
    def from_raw(cls, fmt_name: str, raw: np.ndarray, k: int) -> GGUFWeight:
        """From a tensor's GGUF bytes [N, row_bytes] (uint8, e.g. a view of the mapped file)."""
        fmt = FORMATS.get(fmt_name)
        if fmt is None:
            raise ValueError(f"GGUF type {fmt_name} has no kernel; supported: {', '.join(FORMATS)}")
        n = raw.shape[0]
        packed = streamed_empty(
            ((n + PANEL - 1) // PANEL, k // fmt.block, fmt.panel_block_bytes()), torch.uint8
        )
        # in slices of ~4M weights: the decoded parts and packing temporaries of a whole
        # 150k-row output matrix would take several GB
        step = max(PANEL, (1 << 22) // k // PANEL * PANEL)
        for r0 in range(0, n, step):
            chunk = raw[r0 : r0 + step]
            pack(fmt, decode(fmt, chunk, k), packed[r0 // PANEL : (r0 + len(chunk) + 15) // PANEL])
        return cls((GGUFPart(fmt, packed, n),), k)

    @classmethod
    def concat(cls, weights: list[GGUFWeight]) -> GGUFWeight:
        """Rows of `weights` stacked in order (a fused q/k/v or gate/up operand)."""
        if len({w.in_features for w in weights}) != 1:
            raise ValueError("fused GGUF weights need one in_features")
        return cls(tuple(p for w in weights for p in w.parts), weights[0].in_features)

    @property
    def nbytes(self) -> int:
        return sum(p.packed.numel() for p in self.parts)

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """The weight [N, K] in `dtype`, made ~1M weights at a time (the float64 parts of a
        whole 150k-row output matrix would take GBs)."""
        out = torch.empty(self.out_features, self.in_features, dtype=dtype)
        step = max(PANEL, (1 << 20) // self.in_features // PANEL * PANEL)
        for r0 in range(0, self.out_features, step):
            out[r0 : r0 + step] = self.rows(r0, r0 + step, dtype)
        return out

    def rows(self, start: int, stop: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """Rows [start, stop) dequantized to `dtype` (exactly, then rounded once): what
        Int4Weight / Int8Weight.quantize read a block at a time, so that converting a GGUF
        operand never holds the whole of it dequantized."""
        stop = min(stop, self.out_features)
        pieces, at = [], 0
        for part in self.parts:
            lo, hi = max(start - at, 0), min(stop - at, part.n)
            if lo < hi:
                p0, p1 = lo // PANEL, (hi + PANEL - 1) // PANEL
                n = min(part.n, p1 * PANEL) - p0 * PANEL
                w = dequantize_parts(part.fmt, unpack(part.fmt, part.packed[p0:p1], n))
                pieces.append(w[lo - p0 * PANEL : hi - p0 * PANEL].to(dtype))
            at += part.n
        if not pieces:
            return torch.empty(0, self.in_features, dtype=dtype)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def reference_linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """What the kernel computes (module docstring), in plain torch: integer sums in
        float64 (exact), the per-block terms summed in fp32."""
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        outs = [_reference_part(x, p, self.in_features) for p in self.parts]
        y = torch.cat(outs, dim=1)
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def _reference_part(x: Tensor, part: GGUFPart, k: int) -> Tensor:
    fmt = part.fmt
    v, sc, m, d, dm = part_values(fmt, unpack(fmt, part.packed, part.n))
    return reference_terms(x.reshape(-1, k), fmt, v, sc, m, d, dm, k)


def reference_terms(
    x: Tensor, fmt: Format, u: Tensor, sc: Tensor, m: Tensor, d: Tensor, dm: Tensor, k: int
) -> Tensor:
    """The module docstring's function of x [M, K] for one format's parts as tensors: u [n, k]
    (integer values v(u)), sc and m [n, k / sub], d and dm [n, k / block] (dm = d where the format
    stores none), k >= K (weights past K are zero) -> fp32 [M, n]. Integer sums in float64
    (exact), the per-block terms summed in fp32 in block order. The GPU layout's reference
    (kernels/triton_gguf.py) runs it too."""
    xq, dx = quantize_activations(x, k, fmt.block)  # [M, nb, block], [M, nb]
    xq = xq.reshape(x.shape[0], -1).double()
    n, nsub, nb = u.shape[0], k // fmt.sub, k // fmt.block
    bsum = xq.reshape(-1, nsub, fmt.sub).sum(dim=2)
    dots = torch.einsum("msj,nsj->mns", xq.reshape(-1, nsub, fmt.sub), u.double().view(n, nsub, -1))
    per = fmt.block // fmt.sub
    isum = (dots * sc).reshape(-1, n, nb, per).sum(dim=3)  # [M, N, nb], exact
    msum = (bsum[:, None] * m).reshape(-1, n, nb, per).sum(dim=3)
    d, dm = d.float(), dm.float()
    if not fmt.has_dm:  # dm = d: the kernel subtracts in integers, then scales once
        terms = (isum - msum).float() * (d * dx[:, None])
    else:
        terms = isum.float() * (d * dx[:, None]) - msum.float() * (dm * dx[:, None])
    out = torch.zeros(terms.shape[:2], device=x.device)
    for b in range(nb):  # fp32, in block order, as the kernel adds them
        out += terms[:, :, b]
    return out


def linear_gguf(x: Tensor, weight: GGUFWeight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x.dtype, as `GGUFWeight.reference_linear`
    says: the kernel when eligible, else that reference (slow)."""
    ext = extension() if x.is_cpu else None
    if ext is not None:
        packed = [p.packed for p in weight.parts]
        codes = [p.fmt.code for p in weight.parts]
        ns = [p.n for p in weight.parts]
        if ext.eligible_gguf(x, packed, codes, ns, bias):
            out: Tensor = ext.linear_gguf(x, packed, codes, ns, bias)
            return out
    return weight.reference_linear(x, bias)
