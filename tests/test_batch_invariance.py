"""Batch invariance of the GEMM kernels: one activation row gives bit-identical output alone
(a decode step) and inside M = 2..16 rows at any position (a verify, a batched step). Without
it greedy output with speculation on can differ from speculation off.

Covered: the bf16 panel kernel (the path `load()` runs bf16 models on), the nn.Linear-layout
bf16 kernel (routed MoE experts, unpacked weights), the int8 and int4 panel kernels, with fp32
and bf16 activations, on shapes where the token count changes their schedule (token chunks,
token groups past 64 rows, weight blocks, k-blocks when K > 4096, two panels at once for one
token). 4096x896 is where the bf16 panel kernel's earlier schedule (accumulator sets
interleaved by token count) made every M in 2..16 differ from the row alone; the nn.Linear
kernel kept two accumulators per output for one token only, and summed the lanes of a few
outputs in another order than of many. The GGUF block kernels: tests/test_linear_gguf.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_checks import needs_kernel
from torch import Tensor

from quickdraft.kernels import (
    Int4Weight,
    Int8Weight,
    PanelWeight,
    kernel_calls,
    linear,
    linear_int4,
    linear_int8,
    linear_panel,
)

# (300, 896): a partial last panel, 28 groups of 32 (several blocks when M > 4)
# (40, 4608): K past 4096, where the nn.Linear kernel blocks k for M > 1
SHAPES = [(300, 896), (4096, 896), (40, 4608)]

FORMATS: dict[str, Callable[[Tensor], tuple[object, Callable[..., Tensor]]]] = {
    "bf16-panel": lambda w: (PanelWeight.pack(w), linear_panel),
    "bf16-rows": lambda w: (w, linear),
    "int8": lambda w: (Int8Weight.quantize(w), linear_int8),
    "int4": lambda w: (Int4Weight.quantize(w.float()), linear_int4),
}
CASES = [
    pytest.param(fmt, dtype, id=f"{fmt}-{str(dtype).removeprefix('torch.')}")
    for fmt in FORMATS
    for dtype in (torch.float32, torch.bfloat16)
]


@needs_kernel
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize(("fmt", "dtype"), CASES)
def test_batch_invariance_row_alone_equals_row_in_batch(
    fmt: str, dtype: torch.dtype, n: int, k: int, kernels_enabled: None
) -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(80, k, generator=g).to(dtype)
    weight, run = FORMATS[fmt](w)
    before = kernel_calls()
    alone = run(x[:1], weight, bias)
    assert kernel_calls() == before + 1  # the kernel ran, not a reference fallback
    for m in range(2, 17):
        first = run(x[:m], weight, bias)
        last = run(torch.cat([x[1:m], x[:1]]), weight, bias)
        assert torch.equal(first[:1], alone), f"row 0 of M={m} differs from the row alone"
        assert torch.equal(last[-1:], alone), f"row {m - 1} of M={m} differs from the row alone"
    # a prompt chunk: more rows than a token group (64)
    many = run(torch.cat([x[1:], x[:1]]), weight, bias)
    assert torch.equal(many[-1:], alone), "row 79 of M=80 differs from the row alone"
