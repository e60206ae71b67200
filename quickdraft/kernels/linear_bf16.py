"""Weight GEMMs over bf16 weights for decode and speculative verify: the nn.Linear-layout kernel
(`linear`) and the 16-row panel layout every bf16 model runs on the CPU (`PanelWeight`).

Contract:
    linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N] in x.dtype
computes x @ weight.T (+ bias), the same function as `torch.nn.functional.linear`, except that
a weight/bias of another floating dtype than x is used in x's dtype (the kernel takes fp32 x with
a bf16 weight, so every path does; F.linear itself would raise). It runs the C++ kernel in
`linear_bf16.cpp` when the extension is available (build.py) and
  * weight is a contiguous 2-D bf16 tensor and K % 8 == 0;
  * x is bf16 or fp32 (any M: see MAX_M);
  * nothing needs a gradient (the kernel has no backward);
and `fallback_linear` (F.linear) otherwise. The kernel accumulates in fp32 and rounds once to
x.dtype, so it matches `reference_linear` up to summation order; each output is one FMA chain
over k in order whatever M, so a row's bits do not depend on the other rows (batch
invariance). `linear_panel` is the same function over a `PanelWeight`; on a CPU with
AVX512_BF16 and bf16 x it runs the same chains with vdpbf16ps (linear_panel_avx512.cpp: two k
per instruction, each product exact and each sum rounded as the FMA rounds it), bit for bit
the AVX2 tile's but where a denormal is flushed: as fast at M = 1 (DRAM-bound), 1.2x at M = 5,
1.5x at 17, ~2x from 64 (~400 GFLOP/s on the 2-core EPYC, oneDNN's bf16 speed, which is not
batch-invariant).

Why: decode streams every weight once per token, and a verify pass over k+1 tokens only pays
if it costs about the same as one token. Torch's bf16 CPU matmul without AVX-512 reads the
weights at 5-20 GB/s and its cost grows ~linearly with M; these kernels read them once per call
at close to DRAM bandwidth for any M (`python bench/kernels.py`).
"""

from __future__ import annotations

import math
import mmap
import sys
import threading
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.kernels.build import extension, runnable

# Largest M routed to the kernel: none, so every row of every call is the same FMA chain
# (batch invariance: a prompt chunk, a verify and a decode step give a row the same bits).
# Measured on the panel layout with weights streamed from DRAM (bench/results/panel-bf16-*,
# 2-core EPYC with AVX512_BF16): the AVX2 tile is 0.5x oneDNN's bf16 F.linear at M = 256 and
# the AVX512_BF16 tiles 0.93-1.08x, as fast as the AVX2 tile at M = 1 (DRAM-bound), ~2x it
# from M = 64; oneDNN's row results depend on M, so it is not used. On an
# AVX2-only host the kernel beat F.linear at every M tried (1.5x at M = 1, 6-7x at M = 9..512,
# rows layout). Tests monkeypatch this limit.
MAX_M = sys.maxsize


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> [..., N] in x.dtype (see module docstring)."""
    if not x.is_cpu:
        return fallback_linear(x, weight, bias)  # CUDA etc.: torch's own kernels only
    ext = extension()
    if ext is None:
        return fallback_linear(x, weight, bias)
    # One C++ call checks eligibility and runs the kernel or the same fallback as below.
    out: Tensor = ext.linear(x, weight, bias, MAX_M)
    return out


def fallback_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear, with a weight/bias of another floating dtype cast to x's dtype first."""
    if x.dtype.is_floating_point:
        if weight.dtype != x.dtype and weight.dtype.is_floating_point:
            weight = weight.to(x.dtype)
        if bias is not None and bias.dtype != x.dtype and bias.dtype.is_floating_point:
            bias = bias.to(x.dtype)
    return F.linear(x, weight, bias)


def path_for(
    x: Tensor, weight: Tensor, bias: Tensor | None = None
) -> Literal["kernel", "fallback"]:
    """Which implementation `linear(x, weight, bias)` would run (tests, debugging)."""
    ext = extension() if x.is_cpu else None
    return "kernel" if ext is not None and ext.eligible(x, weight, bias, MAX_M) else "fallback"


def reference_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The plain fp32 reference the kernel is tested against."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


HUGE_PAGE = 2 << 20
# one shared mapping of huge pages holds the weights under 2 MiB and those `own_mapping` turns
# away; each mapping's last huge page is partly filled, so fewer, larger ones waste less (the
# full-size 35B-A3B shape's 31k packed weights: 0.30 GiB past their bytes at 32 MiB and
# padding up to half a weight, 0.07 GiB at 128 MiB and a quarter)
ARENA_BYTES = 128 << 20
_ARENA_ALIGN = 256


def _huge_region(nbytes: int) -> Tensor:
    """A 2 MiB-aligned uint8 CPU tensor of `nbytes` on its own anonymous mapping, advised to
    use transparent huge pages; the tensor keeps the mapping alive."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then map huge pages
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes]


class _Arena:
    """Weights under 2 MiB (and those `own_mapping` turns away), packed one after another into
    shared ARENA_BYTES mappings of huge pages, never freed one by one: a mapping lives while
    any weight in it does. Weights live as long as their model, and only packed weights come
    here."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.chunk: Tensor | None = None
        self.used = 0

    def take(self, nbytes: int) -> Tensor:
        with self.lock:
            if self.chunk is None or self.used + nbytes > self.chunk.numel():
                self.chunk, self.used = _huge_region(ARENA_BYTES), 0
            out = self.chunk[self.used : self.used + nbytes]
            self.used += -(-nbytes // _ARENA_ALIGN) * _ARENA_ALIGN
            return out


_arena = _Arena()


def streamed_empty(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Tensor:
    """An uninitialized CPU tensor for a packed weight that every decode step streams, on
    transparent huge pages (Linux, THP in "madvise" or "always" mode): from 2 MiB on its own 2
    MiB-aligned anonymous mapping (`own_mapping`), below that packed into a shared one (`_Arena`).
    With 4 KiB pages the stream costs a TLB miss per page and the hardware prefetcher stops at every
    page boundary: measured on the 0.5B draft's int4 weights (40 interleaved rounds, one process), a
    pass took 8.98 ms (min) / 11.84 ms (median) on huge pages vs 10.49 / 13.37 ms; its 0.5-0.65 MB
    attention projections, read from DRAM, took 24-32 us a call packed together on huge pages
    against 31-38 us each on its own 4 KiB pages (2-core Xeon). Costs up to 2 MiB of padding per
    large weight. Off the CPU, or without MADV_HUGEPAGE, plain `torch.empty`."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or torch.device(device).type != "cpu" or nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = _huge_region(nbytes) if own_mapping(nbytes) else _arena.take(nbytes)
    return raw.view(dtype).view(shape)


def own_mapping(nbytes: int) -> bool:
    """Whether a packed weight of `nbytes` gets its own huge-page mapping: from 2 MiB on,
    unless rounding it up to whole huge pages would add more than a quarter of it again and it
    fits a quarter of an arena mapping (Gemma-4-26B-A4B's 2.3 MB expert gate / up rows would
    take 4 MiB each: 6.6 GB of padding over its 3840 experts; the 35B-A3B shape's 4.6 MiB
    projection parts 6 MiB); those go to the arena."""
    if nbytes < HUGE_PAGE:
        return False
    return -nbytes % HUGE_PAGE <= nbytes // 4 or nbytes > ARENA_BYTES // 4


def streamed_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Tensor:
    """A zeroed CPU tensor that every decode step reads and writes whole (a Gated DeltaNet's
    state: 2 MiB of fp32 a layer), on its own mapping of transparent huge pages from 2 MiB on
    (freed with the tensor; the `_Arena` is for weights only), else plain `torch.zeros`. On
    4 KiB pages its pass every step stalls at each page (qwen35moe cut file, 12 alternating
    rounds in one process: 13.57 -> 13.37 ms a step)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (
        not hasattr(mmap, "MADV_HUGEPAGE")
        or torch.device(device).type != "cpu"
        or nbytes < HUGE_PAGE
    ):
        return torch.zeros(shape, dtype=dtype, device=device)
    return _huge_region(nbytes).view(dtype).view(shape).zero_()


PANEL = 16  # weight rows per panel of a PanelWeight
# The panel kernel's tiles by the extension's `panel_isa` level, and the CPU flags each needs
# (the AVX512_BF16 tiles run for bf16 x only; fp32 x always takes the AVX2 tile).
PANEL_TILES = {"avx2": 0, "avx512_bf16": 1}
PANEL_TILE_FLAGS = {
    "avx2": frozenset(),
    "avx512_bf16": frozenset({"avx512f", "avx512bw", "avx512_bf16"}),
}


def panel_tiles() -> list[str]:
    """The panel tiles this CPU's flags allow, slowest first."""
    return runnable(PANEL_TILE_FLAGS)


@dataclass(frozen=True, slots=True)
class PanelWeight:
    """A bf16 weight [N, K] repacked in panels of 16 rows for `linear_panel.cpp`: `packed`
    [ceil(N / 16), K, 16] holds, for panel p and input k, rows 16p + j at position 2j and
    16p + 8 + j at 2j + 1 (j < 8; rows past N are zero). Each kernel thread then reads one
    sequential stream and up to 6 tokens share one pass over it: measured, a 5-token verify
    costs ~1.0-1.2x a decode step here against 1.3-1.7x with the nn.Linear layout, at the same
    decode speed (bench/kernels.py). Same bytes as the bf16 weight, same values."""

    packed: Tensor  # [P, K, 16] bf16
    out_features: int

    @classmethod
    def pack(cls, weight: Tensor) -> PanelWeight:
        weight = weight.detach()
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            shape = tuple(weight.shape)
            raise ValueError(f"panels hold 2-D bf16 weights, got {weight.dtype} {shape}")
        n, k = weight.shape
        p = (n + PANEL - 1) // PANEL
        padded = F.pad(weight, (0, 0, 0, p * PANEL - n)) if p * PANEL != n else weight
        packed = streamed_empty((p, k, PANEL // 2, 2), torch.bfloat16, weight.device)
        # [p, half, j, k] -> [p, k, j, half]: position 2j + half holds row 16p + 8 half + j
        packed.copy_(padded.reshape(p, 2, PANEL // 2, k).permute(0, 3, 2, 1))
        return cls(packed.view(p, k, PANEL), n)

    def unpack(self) -> Tensor:
        """The weight [N, K] in nn.Linear layout (a copy)."""
        p, k, _ = self.packed.shape
        rows = self.packed.view(p, k, PANEL // 2, 2).permute(0, 3, 2, 1).reshape(p * PANEL, k)
        return rows[: self.out_features].contiguous()

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return self.unpack().to(dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.packed.shape[1]))


def linear_panel(x: Tensor, weight: PanelWeight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x.dtype: the panel kernel when eligible,
    else (GPU, no compiler) the unpacked weight through `linear`'s fallback."""
    ext = extension() if x.is_cpu else None
    if ext is not None and ext.eligible_panel(x, weight.packed, weight.out_features, bias):
        out: Tensor = ext.linear_panel(x, weight.packed, weight.out_features, bias)
        return out
    return fallback_linear(x, weight.unpack(), bias)
