"""Batch invariance of the kernels on the target's path: one row gives bit-identical output
alone (a decode step) and at every position of M = 2..16 rows (a verify, a batched step) and
of a prompt-sized M. Without it greedy output with speculation on can differ from speculation
off (docs/numerics.md).

GEMMs: the bf16 panel kernel (the path `load()` runs bf16 models on), the nn.Linear-layout bf16
kernel (routed MoE experts, unpacked weights), the int8 and int4 panel kernels, with fp32 and
bf16 activations, on shapes where the token count changes their schedule (token chunks, token
groups past 64 rows, weight blocks, k-blocks when K > 4096, two panels at once for one token).
4096x896 is where the bf16 panel kernel's earlier schedule (accumulator sets interleaved by
token count) made every M in 2..16 differ from the row alone; the nn.Linear kernel kept two
accumulators per output for one token only, and summed the lanes of a few outputs in another
order than of many. Then the row-wise ops and the hybrids' causal conv. The GGUF block kernels:
tests/test_linear_gguf.py; attention: tests/test_attention.py; the delta rule:
tests/test_gdn.py."""

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


def positions() -> list[tuple[int, int]]:
    """(M, position) pairs: every position of M = 2..16 (verifies, batched decode steps), and
    the ends and middle of M = 80 (a prompt chunk past a token group of 64)."""
    return [(m, pos) for m in range(2, 17) for pos in range(m)] + [(80, 0), (80, 40), (80, 79)]


def placed(m: int, pos: int) -> Tensor:
    """Row indices for M = m rows with row 0 at `pos` and rows 1..m-1 around it."""
    others = torch.arange(1, m)
    return torch.cat([others[:pos], torch.tensor([0]), others[pos:]])


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
    for m, pos in positions():
        out = run(x[placed(m, pos)], weight, bias)
        assert torch.equal(out[pos : pos + 1], alone), f"row {pos} of M={m} differs from alone"


def _row_ops(dtype: torch.dtype, rows: int = 80) -> dict[str, Callable[[Tensor], Tensor]]:
    """Each row-wise op of the target's forward as a function of the indices of the rows it
    runs on (its input and per-row side inputs are those rows of fixed random tensors)."""
    g = torch.Generator().manual_seed(1)
    hidden, heads, d = 200, 3, 40  # not multiples of 8 / 16: scalar tails run too
    x = (torch.randn(rows, hidden, generator=g) * 2).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    wd = torch.randn(d, generator=g).to(dtype)
    angles = torch.rand(rows, 16, generator=g) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    core = torch.randn(rows, heads, d, generator=g) * 2  # fp32, as the delta rule leaves it
    z = x[:, 40 : 40 + heads * d].reshape(rows, heads, d)
    a_log, dt_bias = torch.randn(16, generator=g), torch.randn(16, generator=g)

    return {
        "rms_norm": lambda i: pointwise.rms_norm(x[i], w, 1e-6),
        "add_rms_norm": lambda i: torch.cat(
            pointwise.add_rms_norm(x[i], delta[i], w, 1e-6, 1.0), dim=1
        ),
        "rope": lambda i: pointwise.rope(
            x[i, : heads * d].reshape(len(i), heads, d), cos[i], sin[i]
        ).reshape(len(i), -1),
        "silu_mul": lambda i: pointwise.silu_mul(x[i]),
        "gelu_mul": lambda i: pointwise.gelu_mul(x[i]),
        "gated_rms_norm": lambda i: pointwise.gated_rms_norm(core[i], wd, z[i], 1e-6).reshape(
            len(i), -1
        ),
        "sigmoid": lambda i: pointwise.sigmoid(x[i]),
        "sigmoid_column": lambda i: pointwise.sigmoid(x[i, :1]),  # a [N, 1] gate (MoE shared)
        "gdn_gates": lambda i: torch.cat(gdn.gates(x[i, :16], x[i, 16:32], a_log, dt_bias), dim=1),
        "greedy_pick": lambda i: _picked(pointwise.greedy_pick(x[i], with_prob=True)),
    }


def _picked(pick: tuple[Tensor, Tensor | None]) -> Tensor:
    """greedy_pick's ids and probabilities as one [N, 2] fp64 tensor (ids < 2^53: exact)."""
    ids, probs = pick
    assert probs is not None
    return torch.stack((ids.double(), probs.double()), dim=1)


ROW_OPS = [
    "rms_norm",
    "add_rms_norm",
    "rope",
    "silu_mul",
    "gelu_mul",
    "gated_rms_norm",
    "sigmoid",
    "sigmoid_column",
    "gdn_gates",
    "greedy_pick",
]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", ROW_OPS)
def test_row_ops_row_alone_equals_row_in_batch(op: str, dtype: torch.dtype) -> None:
    """Norms, RoPE, silu * up, the gated norm, the gates' sigmoid and the Gated DeltaNet's
    decay / beta: a row's output alone equals it at every position of M = 2..16 rows and in
    80, bit for bit. (torch.sigmoid and softplus fail this: their vector path and scalar tail
    are picked by an element's position in the tensor.)"""
    run = _row_ops(dtype)[op]
    alone = run(torch.tensor([0]))
    for m, pos in positions():
        assert torch.equal(run(placed(m, pos))[pos : pos + 1], alone), f"{op}: row {pos}, M={m}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "gated_rms_norm"])
def test_row_ops_split_between_threads_equal_rows_alone(op: str, dtype: torch.dtype) -> None:
    """The norms split a prompt's rows between the threads (kernels/ops.h qd_rows_grain:
    ~32K values a task, so 1,200 rows of these widths take several tasks): every row of the
    split call equals that row alone, bit for bit, on each side of every cut."""
    rows = 1200
    run = _row_ops(dtype, rows)[op]
    whole = run(torch.arange(rows))
    for r in (0, 1, 163, 164, 272, 273, 599, 600, 601, 1199):
        assert torch.equal(whole[r : r + 1], run(torch.tensor([r]))), f"{op}: row {r}"


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
