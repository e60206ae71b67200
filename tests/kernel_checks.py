"""Helpers shared by the kernel tests: the skip marker for hosts the extension cannot run on,
and the fp32 error bound a kernel's output is held to."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.kernels import build

needs_kernel = pytest.mark.skipif(
    not build.cpu_supported(), reason="CPU lacks AVX2/FMA/F16C: the kernels cannot run here"
)

U32 = 2.0**-24  # fp32 unit roundoff
BF16_ULP = 2.0**-7  # bf16 spacing relative to the value


def assert_close_to_reference(out: Tensor, x: Tensor, w: Tensor, b: Tensor | None) -> None:
    """out vs the fp32 reference, compared in fp32 with a tolerance from the fp32 error bound:
    two fp32 sums of K products differ by O(sqrt(K) * u * sum|x*w|) (a generous 16x margin);
    a bf16 output may additionally land one bf16 ulp away."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    mag = F.linear(x.float().abs(), w.float().abs(), None if b is None else b.float().abs())
    k = x.shape[-1]
    tol = 16 * U32 * k**0.5 * mag + 1e-30
    if out.dtype == torch.bfloat16:
        tol = tol + BF16_ULP * ref.abs()
    assert out.dtype == x.dtype
    assert out.shape == ref.shape
    err = (out.float() - ref).abs()
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), (
        f"max excess at flat index {worst}: err {err.flatten()[worst]:.3g} > "
        f"tol {tol.flatten()[worst]:.3g}"
    )


def make(
    m: int, n: int, k: int, bias: bool, dtype: torch.dtype, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor | None]:
    """x [m, k] in dtype, a bf16 weight [n, k] and optionally a bf16 bias [n]."""
    g = torch.Generator().manual_seed(seed + 1000 * m + 7 * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b
