"""Batch-invariant bf16 / fp16 GEMMs on a GPU, in Triton: `linear(x, w, bias)` = x @ w.T
(+ bias), fp32 accumulation over K in blocks of BK, in order, every activation row in a tile of
BM = 16 rows whatever M. A row's bits then depend on that row alone: a decode step and the same
row of a verify agree, so greedy speculation is token-identical to plain decoding in bf16.
cuBLAS picks its algorithm (and its reduction order) by the shape, M included, which is why
bf16 speculation on cuBLAS diverged at near-ties (docs/gpu.md).

`project` (kernels/gemm.py) routes a CUDA bf16 / fp16 weight here for calls of up to MAX_ROWS
rows: decode, verify, batched verify and draft steps. Longer calls (prompt chunks) stay on
cuBLAS: their rows are computed alike with speculation on and off. QUICKDRAFT_CUBLAS=1 (or
ENABLED = False) turns it off, for A/B timings.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

from quickdraft.kernels import triton_ops

MAX_ROWS = 512
BM = 16  # activation rows per tile, the same for every M
BK = 64  # the K block of one dot
ENABLED = os.environ.get("QUICKDRAFT_CUBLAS", "") in ("", "0")
FORCE = False  # tests: run it on CPU tensors in Triton's interpreter


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def linear_kernel(
        x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, sx, sw, so,
        HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        rows = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)  # weight rows
        toks = tl.program_id(1) * BM + tl.arange(0, BM)
        rmask = rows < N
        tmask = toks < M
        span = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + span
            kmask = kk < K
            x = tl.load(
                x_ptr + toks[:, None] * sx + kk[None, :],
                mask=tmask[:, None] & kmask[None, :], other=0.0,
            )  # fmt: skip
            w = tl.load(
                w_ptr + rows[:, None] * sw + kk[None, :],
                mask=rmask[:, None] & kmask[None, :], other=0.0,
            )  # fmt: skip
            # bf16 / fp16 values are exact in tf32, so this is the half-precision dot; in
            # fp32 because Triton's interpreter multiplies bf16 bit patterns as integers
            xf = x.to(tl.float32)
            wf = tl.trans(w.to(tl.float32))
            acc += tl.dot(xf, wf, input_precision="tf32", out_dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
        out = o_ptr + toks[:, None] * so + rows[None, :]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=tmask[:, None] & rmask[None, :])

    return {"linear": linear_kernel}


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether `project` runs this kernel for x @ weight.T (module docstring)."""
    if not (x.is_cuda or FORCE) or not ENABLED:
        return False
    if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    if x.dtype != weight.dtype or x.numel() > MAX_ROWS * x.shape[-1]:
        return False
    return FORCE or triton_ops.available(x)


def tile_n(n: int) -> int:
    """Outputs per program: small enough for ~2 programs per SM at decode."""
    return 64 if n >= 64 * 264 else 32 if n >= 32 * 264 else 16


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, bn: int | None = None) -> Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) -> [..., N] in x.dtype, batch-invariant (module
    docstring). `bn` overrides the outputs per program (benchmarks; the bits do not change)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = x2.new_empty(m, n)
    b = bn or tile_n(n)
    _kernels()["linear"][(-(-n // b), -(-m // BM))](
        x2, weight, bias if bias is not None else weight, out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BM=BM, BN=b, BK=BK,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
