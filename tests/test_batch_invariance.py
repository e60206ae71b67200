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
    gdn,
    kernel_calls,
    linear,
    linear_int4,
    linear_int8,
    linear_panel,
    pointwise,
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


def _row_ops(dtype: torch.dtype) -> dict[str, Callable[[Tensor], Tensor]]:
    """Each row-wise op of the target's forward as a function of the indices of the rows it
    runs on (its input and per-row side inputs are those rows of fixed random tensors)."""
    g = torch.Generator().manual_seed(1)
    rows, hidden, heads, d = 80, 200, 3, 40  # not multiples of 8 / 16: scalar tails run too
    x = (torch.randn(rows, hidden, generator=g) * 2).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    wd = torch.randn(d, generator=g).to(dtype)
    angles = torch.rand(rows, 16, generator=g) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    core = torch.randn(rows, heads, d, generator=g) * 2  # fp32, as the delta rule leaves it
    z = x[:, 40 : 40 + heads * d].reshape(rows, heads, d)

    return {
        "rms_norm": lambda i: pointwise.rms_norm(x[i], w, 1e-6),
        "add_rms_norm": lambda i: torch.cat(
            pointwise.add_rms_norm(x[i], delta[i], w, 1e-6, 1.0), dim=1
        ),
        "rope": lambda i: pointwise.rope(
            x[i, : heads * d].reshape(len(i), heads, d), cos[i], sin[i]
        ).reshape(len(i), -1),
        "silu_mul": lambda i: pointwise.silu_mul(x[i]),
        "gated_rms_norm": lambda i: pointwise.gated_rms_norm(core[i], wd, z[i], 1e-6).reshape(
            len(i), -1
        ),
    }


ROW_OPS = ["rms_norm", "add_rms_norm", "rope", "silu_mul", "gated_rms_norm"]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", ROW_OPS)
def test_row_ops_row_alone_equals_row_in_batch(op: str, dtype: torch.dtype) -> None:
    """Norms, RoPE, silu * up and the gated norm: a row's output alone equals it at the first
    and at the last position of M = 2..16 and 80 rows, bit for bit."""
    run = _row_ops(dtype)[op]
    alone = run(torch.tensor([0]))
    for m in [*range(2, 17), 80]:
        assert torch.equal(run(torch.arange(m))[:1], alone), f"{op}: row 0 of M={m}"
        moved = torch.cat([torch.arange(1, m), torch.tensor([0])])
        assert torch.equal(run(moved)[-1:], alone), f"{op}: row {m - 1} of M={m}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_conv_token_alone_equals_token_in_chunk(dtype: torch.dtype) -> None:
    """The Gated DeltaNet conv: token t of a T-token call equals a one-token call from the
    window the first t tokens leave."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 200, generator=g).to(dtype)
    window = torch.randn(3, 200, generator=g).to(dtype)
    weight = torch.randn(200, 4, generator=g).to(dtype)
    whole = gdn.causal_conv1d(x, window, weight)
    w = window
    for t in range(40):
        assert torch.equal(gdn.causal_conv1d(x[t : t + 1], w, weight)[0], whole[t]), f"token {t}"
        w = gdn.conv_window(w, x[t : t + 1])
