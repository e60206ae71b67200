"""Fused per-token CPU ops (kernels/pointwise.py: RMSNorm, add + RMSNorm, RoPE, silu(gate) * up,
the gated RMSNorm of the hybrid layers): the C++ path against the plain references, and the
references against Hugging Face's own formulas."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import needs_kernel

from quickdraft.kernels import kernels_available, pointwise

pytestmark = pytest.mark.usefixtures("kernels_enabled")
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
    out = pointwise.rms_norm(x, w, 1e-6, offset)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, pointwise.reference_rms_norm(x, w, 1e-6, offset), **tol(dtype))


@needs_kernel
@DTYPES
def test_add_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x, d = (torch.randn(4, 96, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(96, generator=g).to(dtype)
    s, y = pointwise.add_rms_norm(x, d, w, 1e-5)
    s_ref, y_ref = pointwise.reference_add_rms_norm(x, d, w, 1e-5)
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
    out = pointwise.rope(q, cos, sin)
    torch.testing.assert_close(out, pointwise.reference_rope(q, cos, sin), **tol(dtype))
    torch.testing.assert_close(out[..., rot:], q[..., rot:], atol=0, rtol=0)


@DTYPES
def test_reference_rope_equals_model_rotate_half(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 32, generator=g).to(dtype)
    angles = torch.rand(5, 16, generator=g)
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    xf, half = x.float(), x.shape[-1] // 2  # HF Llama/Qwen's rotate_half convention
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    expected = (xf * cos[:, None] + rotated * sin[:, None]).to(dtype)
    torch.testing.assert_close(pointwise.reference_rope(x, cos, sin), expected, **tol(dtype))


def test_ops_fall_back_for_fp16() -> None:
    x = torch.randn(2, 16).half()
    w = torch.ones(16).half()
    torch.testing.assert_close(
        pointwise.rms_norm(x, w, 1e-6), pointwise.reference_rms_norm(x, w, 1e-6)
    )


# -- fused ops of the hybrid layers (gdn_ops.cpp): silu(gate) * up, gated RMSNorm -------------

FUSED_DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"]
)


def fused_tol(dtype: torch.dtype) -> dict[str, float]:
    # fp32: exp polynomial + summation order; bf16: the reference rounds twice, we round once
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}


@needs_kernel
@FUSED_DTYPES
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_silu_mul_matches_reference(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    inter = 44  # not a multiple of 8: the scalar tail runs too
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturated exp both ways
    assert kernels_available()
    out = pointwise.silu_mul(gate_up)
    assert out.dtype == dtype and out.shape == (rows, inter)
    torch.testing.assert_close(out, pointwise.reference_silu_mul(gate_up), **fused_tol(dtype))


@needs_kernel
@FUSED_DTYPES
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_gelu_mul_matches_reference(rows: int, dtype: torch.dtype) -> None:
    """Gemma's GeGLU: close to torch's gelu(tanh) * up, saturated ends included, and a row's
    bits alone are its bits in the batch (the tail runs the vector code too)."""
    g = torch.Generator().manual_seed(rows)
    inter = 44  # not a multiple of 8: the padded tail runs too
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -7.0])
    out = pointwise.gelu_mul(gate_up)
    assert out.dtype == dtype and out.shape == (rows, inter)
    torch.testing.assert_close(out, pointwise.reference_gelu_mul(gate_up), **fused_tol(dtype))
    alone = torch.cat([pointwise.gelu_mul(gate_up[i : i + 1]) for i in range(rows)])
    assert torch.equal(out, alone)


@needs_kernel
@FUSED_DTYPES
def test_gated_rms_norm_matches_reference_on_strided_z(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    n, heads, d = 5, 3, 20  # d not a multiple of 8
    x = torch.randn(n, heads, d, generator=g) * 2
    proj = torch.randn(n, 7 + heads * d + 4, generator=g).to(dtype)
    z = proj[:, 7 : 7 + heads * d].view(n, heads, d)  # a view into a fused projection
    for w in (torch.randn(d, generator=g), torch.randn(d, generator=g).to(dtype)):
        out = pointwise.gated_rms_norm(x, w, z, 1e-6)
        assert out.dtype == dtype and out.shape == (n, heads, d)
        ref = pointwise.reference_gated_rms_norm(x, w, z, 1e-6)
        torch.testing.assert_close(out, ref, **fused_tol(dtype))


def test_fused_ops_fall_back_for_fp16() -> None:
    gate_up = torch.randn(2, 16).half()
    torch.testing.assert_close(pointwise.silu_mul(gate_up), pointwise.reference_silu_mul(gate_up))


@needs_kernel
@FUSED_DTYPES
@pytest.mark.parametrize("shape", [(1, 7), (5, 2048), (3, 1), (2, 3, 5)], ids=str)
def test_sigmoid_matches_torch(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 6).to(dtype)
    x.view(-1)[0] = -200.0  # saturated both ways
    x.view(-1)[-1] = 200.0
    out = pointwise.sigmoid(x)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, torch.sigmoid(x), **fused_tol(dtype))


@DTYPES
def test_rope_rows_is_the_reference_in_four_ops(dtype: torch.dtype) -> None:
    """The GPU's RoPE (roll by half a head times the signed sin) is the reference's function,
    on a strided view of a fused projection as the GPU forward passes it."""
    g = torch.Generator().manual_seed(2)
    n, heads, d = 4, 5, 64
    qkv = torch.randn(n, 7 * d, generator=g).to(dtype)
    qk = qkv[:, : heads * d].view(n, heads, d)
    angles = torch.rand(n, d // 2, generator=g) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    signed = pointwise.signed_sin(sin)
    torch.testing.assert_close(pointwise.signed_sin(signed), sin, atol=0, rtol=0)
    out = pointwise.rope_rows(qk, cos, signed)
    assert out.dtype == dtype
    torch.testing.assert_close(out, pointwise.reference_rope(qk, cos, sin), **tol(dtype))


@needs_kernel
@DTYPES
@pytest.mark.parametrize("vocab", [1, 7, 8, 17, 200, 151936], ids=str)
def test_greedy_pick_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    """Ids equal torch.argmax's bit for bit (ties: the first index, NaN: the first NaN, an
    all -inf row: 0) and the probabilities the reference's softmax within fp32 rounding, on
    rows whose tail is -inf as a cut draft vocabulary leaves it."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(6, vocab, generator=g) * 4).to(dtype)
    x[1] = 1.0  # every id ties
    x[2, vocab // 2 :] = float("-inf")
    x[3] = float("-inf")
    if vocab > 3:
        x[4, 3] = x[4, vocab - 1] = float("nan")
        x[5, vocab - 1] = x[5].max() + 1  # the maximum in the scalar tail
    ids, probs = pointwise.greedy_pick(x, with_prob=True)
    ref_ids, ref_probs = pointwise.reference_greedy_pick(x, with_prob=True)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    assert probs is not None and ref_probs is not None and probs.dtype == torch.float32
    torch.testing.assert_close(probs, ref_probs, rtol=2e-6, atol=1e-7, equal_nan=True)
    only, none = pointwise.greedy_pick(x)
    assert torch.equal(only, ids) and none is None
