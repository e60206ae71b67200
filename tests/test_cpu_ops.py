"""Fused CPU ops (RMSNorm, add + RMSNorm, RoPE): the C++ path against the plain references,
and the references against the model code's own formulas."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels import cpu_linear, cpu_ops
from quickdraft.models.layers import apply_rope

needs_kernel = pytest.mark.skipif(
    not cpu_linear.cpu_supported(), reason="CPU lacks AVX2/FMA/F16C: the kernel cannot run here"
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def tol(dtype: torch.dtype) -> dict[str, float]:
    # one rounding of the output apart (bf16: 2^-8 relative)
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}


@needs_kernel
@DTYPES
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "1+w"])
@pytest.mark.parametrize("shape", [(1, 576), (5, 1536), (3, 2, 40), (1, 7)], ids=str)
def test_rms_norm_matches_reference(
    shape: tuple[int, ...], offset: float, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    out = cpu_ops.rms_norm(x, w, 1e-6, offset)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, cpu_ops.reference_rms_norm(x, w, 1e-6, offset), **tol(dtype))


@needs_kernel
@DTYPES
def test_add_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x, d = (torch.randn(4, 96, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(96, generator=g).to(dtype)
    s, y = cpu_ops.add_rms_norm(x, d, w, 1e-5)
    s_ref, y_ref = cpu_ops.reference_add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, s_ref)  # the residual stream is rounded exactly as x + delta
    torch.testing.assert_close(y, y_ref, **tol(dtype))


@needs_kernel
@DTYPES
@pytest.mark.parametrize("rot", [64, 16], ids=["full", "partial"])
def test_rope_matches_reference_on_strided_views(rot: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rot)
    n, heads, d = 3, 4, 64
    qkv = torch.randn(n, 3 * heads * d, generator=g).to(dtype)  # like the fused projection
    q = qkv[:, heads * d : 2 * heads * d].view(n, heads, d)  # non-contiguous in dim 0
    angles = torch.rand(n, rot // 2, generator=g) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    out = cpu_ops.rope(q, cos, sin)
    torch.testing.assert_close(out, cpu_ops.reference_rope(q, cos, sin), **tol(dtype))
    torch.testing.assert_close(out[..., rot:], q[..., rot:], atol=0, rtol=0)


@DTYPES
def test_reference_rope_equals_model_rotate_half(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 32, generator=g).to(dtype)
    angles = torch.rand(5, 16, generator=g)
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    expected = apply_rope(x.float(), cos[:, None], sin[:, None]).to(dtype)
    torch.testing.assert_close(cpu_ops.reference_rope(x, cos, sin), expected, **tol(dtype))


def test_ops_fall_back_for_fp16() -> None:
    x = torch.randn(2, 16).half()
    w = torch.ones(16).half()
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), cpu_ops.reference_rms_norm(x, w, 1e-6))
