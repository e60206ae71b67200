"""Integer draft-model weights (kernels/linear_int.py): int8 and int4 quantization round trips,
the packed layouts, and the kernels against their plain torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import BF16_ULP, make, needs_kernel

from quickdraft.kernels import Int4Weight, Int8Weight, build, kernel_calls, linear_int4, linear_int8

pytestmark = pytest.mark.usefixtures("kernels_enabled")


def assert_matches_quantized_reference(
    out: torch.Tensor, x: torch.Tensor, q: Int4Weight | Int8Weight, b: torch.Tensor | None
) -> None:
    """`out` against the weight's plain-torch reference (same activation quantization: only
    the summation order differs), and that reference against the dequantized weight's product
    (up to the int8 activation rounding)."""
    bias = None if b is None else b.float()
    ref = q.reference_linear(x.float(), bias)
    assert out.dtype == x.dtype and out.shape == ref.shape
    tol = 1e-5 * (ref.abs() + 1)
    if x.dtype == torch.bfloat16:
        tol = tol + BF16_ULP * ref.abs()
    assert bool(((out.float() - ref).abs() <= tol).all())
    deq = F.linear(x.float(), q.dequantize(torch.float32), bias)
    assert float((ref - deq).abs().max()) < 0.02 * float(deq.abs().max())


def test_int8_quantize_roundtrip_error_is_half_a_step() -> None:
    w = torch.randn(50, 96, generator=torch.Generator().manual_seed(3))
    q = Int8Weight.quantize(w)
    assert q.qweight.dtype == torch.int8 and q.scale.dtype == torch.float32
    assert int(q.qweight.abs().max()) == 127  # absmax maps to the end of the range
    err = (q.dequantize(torch.float32) - w).abs()
    assert bool((err <= q.scale[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int8_quantize_in_row_blocks_equals_whole_tensor_formula(dtype: torch.dtype) -> None:
    # K = 8192: 32-row blocks, so 100 rows are 3 full blocks and a partial one; a zero row
    # takes the clamp_min path.
    w = torch.randn(100, 8192, generator=torch.Generator().manual_seed(5)).to(dtype)
    w[40] = 0
    q = Int8Weight.quantize(w)
    full = w.float()
    scale = (full.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    expect = torch.round(full / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    assert torch.equal(q.scale, scale) and torch.equal(q.qweight, expect)
    assert q.qweight.is_contiguous() and q.scale.is_contiguous()


def test_int8_panel_layout_and_row_round_trip() -> None:
    # N = 37: a partial last panel; K = 40: columns padded to 64 (two 32-blocks)
    rows = torch.randint(-127, 128, (37, 40), generator=torch.Generator().manual_seed(1))
    q = Int8Weight.from_rows(rows.to(torch.int8), torch.rand(37))
    assert q.packed.shape == (3, 16, 64) and q.shape == (37, 40)
    for n, k in [(0, 0), (5, 3), (17, 38), (36, 39)]:
        p, j, c, i = n // 16, n % 16, k // 4, k % 4
        assert int(q.packed[p, c, 4 * j + i]) == int(rows[n, k])
    assert int(q.packed[2, :, 5 * 4 :].abs().sum()) == 0  # rows 37.. of the last panel
    assert int(q.packed[:, 10:].abs().sum()) == 0  # columns 40..63
    assert torch.equal(q.qweight, rows.to(torch.int8))
    with pytest.raises(ValueError, match="int8 rows"):
        Int8Weight.from_rows(rows.float(), torch.rand(37))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k", [8, 40, 64, 896, 1100], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 17, 70], ids=lambda m: f"M{m}")
def test_linear_int8_matches_its_reference(m: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    """The kernel against `Int8Weight.reference_linear` (same activation quantization, plain
    torch): only summation order differs. K = 8, 40, 1100 need zero-padded columns, 1100 also
    several k blocks when M > 4; M = 1-4 are one token pass, 5-70 several (N = 37: a partial
    panel)."""
    x, w, b = make(m, 37, k, bias, dtype)
    q = Int8Weight.quantize(w)
    before = kernel_calls()
    out = linear_int8(x, q, b)
    assert kernel_calls() == before + 1  # the kernel ran, not the reference fallback
    assert_matches_quantized_reference(out, x, q, b)


@needs_kernel
def test_linear_int8_exact_on_small_integers() -> None:
    """Integer x whose block max is 127 (dx = 1) and integer q with scale 1: every term is an
    exact integer, so a layout, sign or block-offset bug cannot hide in rounding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (5, 96), generator=g).float()
    x[:, ::32] = 127
    x[1, 40:50] = 0  # sign(w, 0) = 0: zero activations contribute nothing
    q = Int8Weight.from_rows(
        torch.randint(-127, 128, (19, 96), generator=g).to(torch.int8), torch.ones(19)
    )
    assert torch.equal(linear_int8(x, q), x @ q.qweight.float().T)


def test_linear_int8_ineligible_input_falls_back_to_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, w, _ = make(2, 9, 12, False, torch.float32)
    q = Int8Weight.quantize(w)
    monkeypatch.setattr(build, "disabled", True)
    before = kernel_calls()
    out = linear_int8(x, q)
    assert kernel_calls() == before
    torch.testing.assert_close(out, q.reference_linear(x))
    deq = F.linear(x, q.dequantize(torch.float32))
    assert float((out - deq).abs().max()) < 0.02 * float(deq.abs().max())


# --- int4 weights ---------------------------------------------------------------------------


def test_int4_quantize_roundtrip_error_is_half_a_step() -> None:
    w = torch.randn(50, 96, generator=torch.Generator().manual_seed(3))
    q = Int4Weight.quantize(w)
    assert q.packed.dtype == torch.uint8 and q.shape == (50, 96)
    # 4 panels (the last holds 2 rows) x 3 groups x (256 nibble bytes + 16 fp16 d + 16 fp16 mn)
    assert q.packed.shape == (4, 3, 320)
    d, _mn, qv = q._parts()
    assert float(qv.min()) == 0 and float(qv.max()) == 15  # min and max map to the range ends
    err = (q.dequantize(torch.float32) - w).reshape(50, 3, 32).abs()
    # half a step, plus what fp16 rounding of d and mn adds (q * |d - d16| + |mn - mn16|)
    assert bool((err <= d[..., None] * 0.5 + 15 * d[..., None] * 2**-11 + 2e-3).all())
    with pytest.raises(ValueError, match="in_features % 32"):
        Int4Weight.quantize(torch.randn(4, 40))


def test_int4_panel_layout() -> None:
    """The documented byte layout, read back without `_parts`: N = 21 (a partial second panel),
    integer weights whose every group spans 0..15, so d = 1, mn = -8 and q = w + 8."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (21, 64), generator=g)
    q[:, ::32], q[:, 1::32] = 0, 15
    packed = Int4Weight.quantize((q - 8).float()).packed
    assert packed.shape == (2, 2, 320)
    for n, k in [(0, 0), (7, 5), (8, 5), (15, 63), (20, 33)]:
        p, r, grp, col = n // 16, n % 16, k // 32, k % 32
        byte = int(packed[p, grp, 32 * (col // 4) + 4 * (r % 8) + col % 4])
        assert (byte >> 4 if r >= 8 else byte & 0x0F) == int(q[n, k])
    scales = packed[..., 256:].contiguous().view(torch.float16).float()  # [p, g, d[16] mn[16]]
    assert bool((scales[0, :, :16] == 1).all()) and bool((scales[0, :, 16:] == -8).all())
    assert bool((scales[1, :, 5:16] == 0).all()) and bool((scales[1, :, 21:] == 0).all())
    assert int(packed[1, :, :256].reshape(2, 8, 8, 4)[:, :, 5:].sum()) == 0  # rows 21..23, 29..31
    assert torch.equal(Int4Weight.quantize((q - 8).float()).dequantize(torch.float32), (q - 8.0))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k", [32, 96, 288, 896], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("m", [1, 2, 3, 5, 17], ids=lambda m: f"M{m}")
def test_linear_int4_matches_its_reference(m: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    """The kernel against `Int4Weight.reference_linear` (same activation quantization, plain
    torch): only summation order differs. N = 37 ends in a partial panel; M = 1..5 covers
    token chunks of 1-4 and two passes, M = 17 five passes over blocks of 16 groups (K = 896:
    a partial second block)."""
    x, w, b = make(m, 37, k, bias, dtype)
    q = Int4Weight.quantize(w.float())
    before = kernel_calls()
    out = linear_int4(x, q, b)
    assert kernel_calls() == before + 1  # the kernel ran, not the reference fallback
    assert_matches_quantized_reference(out, x, q, b)


@needs_kernel
def test_linear_int4_exact_on_small_integers() -> None:
    """Integer weights with d = 1, mn = -8 and x whose block max is 127 (dx = 1): every term
    is an exact integer, so an offset, nibble order or scale bug cannot hide in rounding."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (11, 96), generator=g)
    q[:, ::32] = 0  # each group spans 0..15 exactly, so d = 1 and mn = -8
    q[:, 1::32] = 15
    w = (q - 8).float()
    x = torch.randint(-20, 21, (3, 96), generator=g).float()
    x[:, ::32] = 127  # dx = 1 in every block
    packed = Int4Weight.quantize(w)
    assert torch.equal(packed.dequantize(torch.float32), w)
    assert torch.equal(linear_int4(x, packed), x @ w.T)


def test_linear_int4_ineligible_input_falls_back_to_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, w, _ = make(2, 9, 64, False, torch.float32)
    q = Int4Weight.quantize(w.float())
    monkeypatch.setattr(build, "disabled", True)
    before = kernel_calls()
    out = linear_int4(x, q)
    assert kernel_calls() == before
    torch.testing.assert_close(out, q.reference_linear(x))
