"""The small-M bf16 CPU linear kernel: parity with the fp32 reference, that the fast path is
really taken where it should be, and that every other case falls back to F.linear correctly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.kernels import (
    Int4Weight,
    Int8Weight,
    PanelWeight,
    cpu_linear,
    kernel_calls,
    kernels_available,
    linear,
    linear_int4,
    linear_int8,
    linear_panel,
    path_for,
    reference_linear,
)

needs_kernel = pytest.mark.skipif(
    not cpu_linear.cpu_supported(), reason="CPU lacks AVX2/FMA/F16C: the kernel cannot run here"
)

U32 = 2.0**-24  # fp32 unit roundoff
BF16_ULP = 2.0**-7  # bf16 spacing relative to the value


@pytest.fixture(autouse=True)
def _kernels_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer bisecting with QUICKDRAFT_NO_KERNELS=1 must not turn these tests into no-ops.
    monkeypatch.setattr(cpu_linear, "disabled", False)


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


def test_kernel_builds_when_cpu_supports_it() -> None:
    if not cpu_linear.cpu_supported():
        pytest.skip("CPU lacks AVX2/FMA/F16C: the kernel cannot run here")
    assert kernels_available(), "AVX2 CPU but the kernel did not build (see the warning)"


PARITY_M = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32]
PARITY_N = [1, 3, 7, 64, 1000]
PARITY_K = [8, 64, 1536]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k", PARITY_K, ids=lambda k: f"K{k}")
@pytest.mark.parametrize("n", PARITY_N, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("m", PARITY_M, ids=lambda m: f"M{m}")
def test_linear_matches_reference_on_kernel_path(
    m: int, n: int, k: int, bias: bool, dtype: torch.dtype
) -> None:
    x, w, b = make(m, n, k, bias, dtype)
    assert path_for(x, w, b) == "kernel"
    before = kernel_calls()
    out = linear(x, w, b)
    assert kernel_calls() == before + 1
    assert_close_to_reference(out, x, w, b)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, 17, 130], ids=lambda m: f"M{m}")
def test_linear_exact_on_small_integers(m: int, dtype: torch.dtype) -> None:
    # Integer inputs make every partial sum exact in fp32, so any order/offset mistake in the
    # packing or tiling is a hard mismatch; sums reach ~10^4, far beyond bf16's 8-bit mantissa,
    # so a bf16 output must also round exactly like torch (nearest-even).
    g = torch.Generator().manual_seed(m)
    k, n = 8 * 13 + 16 * 5, 37  # K % 16 == 8: exercises the 8-wide tail too
    x = torch.randint(-3, 4, (m, k), generator=g).to(dtype)
    w = torch.randint(-60, 61, (n, k), generator=g).bfloat16()
    b = torch.randint(-5, 6, (n,), generator=g).float()
    out = linear(x, w, b)
    assert path_for(x, w, b) == "kernel"
    assert torch.equal(out, reference_linear(x, w, b))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
def test_linear_3d_input_keeps_leading_dims(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 64, generator=g).to(dtype)
    w = (torch.randn(48, 64, generator=g) * 0.1).bfloat16()
    b = torch.randn(48, generator=g)
    before = kernel_calls()
    out = linear(x, w, b)
    assert kernel_calls() == before + 1
    assert out.shape == (2, 5, 48)
    assert_close_to_reference(out, x, w, b)


@needs_kernel
def test_linear_non_contiguous_x_uses_kernel() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 6, generator=g).bfloat16().t()  # [6, 64], strides (1, 6)
    w = (torch.randn(10, 64, generator=g) * 0.1).bfloat16()
    assert path_for(x, w) == "kernel"
    assert_close_to_reference(linear(x, w), x, w, None)


@needs_kernel
def test_linear_fused_weight_row_slice_uses_kernel() -> None:
    # The model's q/k/v views are row slices of one fused weight: contiguous, offset storage.
    g = torch.Generator().manual_seed(5)
    fused = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    w = fused[32:80]
    x = torch.randn(3, 64, generator=g).bfloat16()
    assert path_for(x, w) == "kernel"
    assert_close_to_reference(linear(x, w), x, w, None)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
def test_linear_propagates_nan_and_inf(dtype: torch.dtype) -> None:
    x = torch.ones(3, 16, dtype=dtype)
    x[0, 5] = float("nan")
    x[1, 2] = float("inf")
    w = torch.full((4, 16), 0.5, dtype=torch.bfloat16)
    out = linear(x, w).float()
    assert out[0].isnan().all()
    assert (out[1] == float("inf")).all()
    assert (out[2] == 8.0).all()


@needs_kernel
def test_linear_empty_batch_returns_empty() -> None:
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    w = torch.zeros(5, 64, dtype=torch.bfloat16)
    out = linear(x, w)
    assert out.shape == (0, 5) and out.dtype == torch.bfloat16


@needs_kernel
def test_linear_bias_dtype_follows_reference() -> None:
    x, w, _ = make(3, 33, 64, False, torch.float32)
    b32 = torch.randn(33)  # fp32 bias with a bf16 weight: used as fp32, like the reference
    assert_close_to_reference(linear(x, w, b32), x, w, b32)


FALLBACKS = {
    "K-not-multiple-of-8": lambda: (
        torch.randn(3, 12).bfloat16(),
        torch.randn(5, 12).bfloat16(),
        torch.randn(5).bfloat16(),
    ),
    "fp32-weight": lambda: (torch.randn(3, 64), torch.randn(5, 64), None),
    "fp16-weight": lambda: (torch.randn(3, 64).half(), torch.randn(5, 64).half(), None),
    "fp16-x": lambda: (torch.randn(3, 64).half(), torch.randn(5, 64).bfloat16(), None),
    "non-contiguous-weight": lambda: (
        torch.randn(3, 64).bfloat16(),
        torch.randn(64, 5).bfloat16().t(),
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_linear_fallback_cases_match_f_linear(case: str) -> None:
    if case == "fp16-weight" and not _fp16_matmul_supported():
        pytest.skip("this torch build has no fp16 CPU matmul")
    x, w, b = FALLBACKS[case]()
    assert path_for(x, w, b) == "fallback"
    before = kernel_calls()
    out = linear(x, w, b)
    assert kernel_calls() == before
    # Mixed dtypes (fp16 x, bf16 weight) run in x's dtype rather than raise like F.linear.
    expected = F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("k", [12, 64], ids=["fallback-K12", "kernel-K64"])
def test_linear_fp32_x_with_bf16_weight_works_on_every_path(k: int) -> None:
    # The kernel takes fp32 activations with a bf16 weight; the fallback must not raise instead.
    x, w, b = make(3, 6, k, True, torch.float32)
    assert_close_to_reference(linear(x, w, b), x, w, b)


def _fp16_matmul_supported() -> bool:
    try:
        F.linear(torch.ones(1, 8).half(), torch.ones(2, 8).half())
    except RuntimeError:
        return False
    return True


@needs_kernel
@pytest.mark.parametrize("m", [65, 200], ids=lambda m: f"M{m}")
def test_linear_prefill_sized_m_matches_reference(m: int) -> None:
    # Beyond 64 tokens the kernel works in balanced token groups (65 -> 33 + 32).
    x, w, b = make(m, 100, 64, True, torch.bfloat16)
    expected_path = "kernel" if m <= cpu_linear.MAX_M else "fallback"
    assert path_for(x, w, b) == expected_path
    assert_close_to_reference(linear(x, w, b), x, w, b)


def test_linear_m_above_limit_falls_back_and_stays_correct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_linear, "MAX_M", 8)
    x, w, b = make(9, 200, 64, True, torch.bfloat16)
    assert path_for(x, w, b) == "fallback"
    before = kernel_calls()
    out = linear(x, w, b)
    assert kernel_calls() == before
    assert torch.equal(out, F.linear(x, w, b))
    assert_close_to_reference(out, x, w, b)


def test_default_max_m_is_unlimited_without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert cpu_linear.default_max_m() >= 1 << 31
    monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert cpu_linear.default_max_m() == 64


def test_linear_needing_grad_falls_back_with_grad() -> None:
    x = torch.randn(2, 64, requires_grad=True)
    w = torch.randn(5, 64).bfloat16()
    assert path_for(x, w) == "fallback"
    before = kernel_calls()
    linear(x, w.float()).sum().backward()
    assert kernel_calls() == before
    assert x.grad is not None and torch.allclose(x.grad, w.float().sum(0).expand(2, 64))


@needs_kernel
def test_linear_requires_grad_inside_no_grad_uses_kernel() -> None:
    x = torch.randn(2, 64, requires_grad=True)
    w = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        assert path_for(x, w) == "kernel"
        assert_close_to_reference(linear(x, w), x.detach(), w, None)


def test_linear_non_cpu_tensors_use_f_linear() -> None:
    # The meta device stands in for CUDA: anything off the CPU must never reach the extension.
    x = torch.empty(3, 64, dtype=torch.bfloat16, device="meta")
    w = torch.empty(5, 64, dtype=torch.bfloat16, device="meta")
    before = kernel_calls()
    out = linear(x, w)
    assert out.device.type == "meta" and out.shape == (3, 5)
    assert path_for(x, w) == "fallback"
    assert kernel_calls() == before


@needs_kernel
def test_env_var_disables_the_kernels_for_the_process() -> None:
    code = (
        "from quickdraft.kernels import cpu_linear; "
        "print(cpu_linear.disabled, cpu_linear.kernels_available())"
    )
    env = {**os.environ, cpu_linear.DISABLE_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


@needs_kernel
def test_linear_disabled_forces_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = make(4, 64, 64, True, torch.bfloat16)
    monkeypatch.setattr(cpu_linear, "disabled", True)
    assert not kernels_available()
    assert path_for(x, w, b) == "fallback"
    before = kernel_calls()
    out = linear(x, w, b)
    assert kernel_calls() == before
    assert torch.equal(out, F.linear(x, w, b))


@pytest.fixture()
def _fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pretend the extension was never loaded; the real state is restored afterwards."""
    monkeypatch.setattr(cpu_linear, "_loaded", False)
    monkeypatch.setattr(cpu_linear, "_ext", None)
    yield


@pytest.mark.usefixtures("_fresh_loader")
def test_build_failure_warns_once_then_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    calls = []

    def broken_load(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "load", broken_load)
    monkeypatch.setattr(cpu_linear, "cpu_supported", lambda: True)
    x, w, b = make(3, 8, 64, True, torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="building the CPU linear kernel failed"):
        out = linear(x, w, b)
    assert torch.equal(out, F.linear(x, w, b))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning (or a rebuild) would fail here
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))
        assert not kernels_available()
    assert len(calls) == 1


@pytest.mark.usefixtures("_fresh_loader")
def test_unsupported_cpu_never_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("tried to build on an unsupported CPU")

    monkeypatch.setattr(cpp_extension, "load", must_not_build)
    monkeypatch.setattr(cpu_linear, "cpu_supported", lambda: False)
    x, w, b = make(2, 8, 64, False, torch.bfloat16)
    assert not kernels_available()
    assert path_for(x, w, b) == "fallback"
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_reference_linear_is_fp32_math_in_x_dtype() -> None:
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    w = torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16)
    b = torch.tensor([0.5], dtype=torch.bfloat16)
    out = reference_linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.tolist() == [[11.5]]


# --- int8 weights ---------------------------------------------------------------------------


def _smaps_entry(addr: int) -> str:
    """The /proc/self/smaps block of the mapping holding `addr`."""
    blocks = Path("/proc/self/smaps").read_text().split("\n")
    entry: list[str] = []
    found = False
    for line in blocks:
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            if found:
                break
            lo, hi = (int(v, 16) for v in head.split("-"))
            found, entry = lo <= addr < hi, [line]
        else:
            entry.append(line)
    assert found, f"no mapping holds {addr:#x}"
    return "\n".join(entry)


@pytest.mark.skipif(
    not Path("/proc/self/smaps").exists()
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="needs Linux with transparent huge pages",
)
@pytest.mark.parametrize("kind", ["panel", "int8", "int4"])
def test_big_packed_weights_sit_on_huge_page_eligible_aligned_memory(kind: str) -> None:
    """Each format's packed weight, from 2 MiB on, is on its own 2 MiB-aligned mapping that
    the kernel reports as THP-eligible; smaller ones stay ordinary tensors. Values survive."""
    w = torch.randn(4000, 896, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    make = {"panel": PanelWeight.pack, "int8": Int8Weight.quantize, "int4": Int4Weight.quantize}
    big, small = make[kind](w), make[kind](w[:48])
    assert big.packed.numel() * big.packed.element_size() >= cpu_linear.HUGE_PAGE
    assert big.packed.data_ptr() % cpu_linear.HUGE_PAGE == 0
    smaps = _smaps_entry(big.packed.data_ptr())
    assert re.search(r"THPeligible:\s+1", smaps) and re.search(r"VmFlags:.* hg", smaps), smaps
    assert small.packed.data_ptr() % cpu_linear.HUGE_PAGE != 0 or small.packed.numel() == 0
    torch.testing.assert_close(big.dequantize(torch.float32)[:48], small.dequantize(torch.float32))
    torch.testing.assert_close(
        big.dequantize(torch.float32), w.float(), rtol=0, atol=float(w.abs().max()) / 6
    )


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
    ref = q.reference_linear(x.float(), None if b is None else b.float())
    assert out.dtype == x.dtype and out.shape == ref.shape
    tol = 1e-5 * (ref.abs() + 1)
    if dtype == torch.bfloat16:
        tol = tol + BF16_ULP * ref.abs()
    assert bool(((out.float() - ref).abs() <= tol).all())
    # and it is the dequantized weight's product up to the int8 activation rounding
    deq = F.linear(x.float(), q.dequantize(torch.float32), None if b is None else b.float())
    assert float((ref - deq).abs().max()) < 0.02 * float(deq.abs().max())


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
    monkeypatch.setattr(cpu_linear, "disabled", True)
    before = kernel_calls()
    out = linear_int8(x, q)
    assert kernel_calls() == before
    torch.testing.assert_close(out, q.reference_linear(x))
    deq = F.linear(x, q.dequantize(torch.float32))
    assert float((out - deq).abs().max()) < 0.02 * float(deq.abs().max())


# --- bf16 weights in 16-row panels ----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 16, 37, 100], ids=lambda n: f"N{n}")
def test_panel_pack_layout_and_roundtrip(n: int) -> None:
    w = torch.randn(n, 24, generator=torch.Generator().manual_seed(n)).bfloat16()
    p = PanelWeight.pack(w)
    panels = (n + 15) // 16
    assert p.packed.shape == (panels, 24, 16) and p.shape == (n, 24)
    # the layout the kernel decodes: position 2j = row 16p + j, 2j + 1 = row 16p + 8 + j
    for row in range(n):
        panel, j = divmod(row, 16)
        pos = 2 * j if j < 8 else 2 * (j - 8) + 1
        assert torch.equal(p.packed[panel, :, pos], w[row])
    padded = p.packed.reshape(-1, 24, 16).permute(0, 2, 1).reshape(-1, 24)
    assert int((padded != 0).sum()) == int((w != 0).sum())  # rows past n are zero
    assert torch.equal(p.unpack(), w)
    with pytest.raises(ValueError, match="2-D bf16"):
        PanelWeight.pack(w.float())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k", [1, 7, 64, 904, 1100], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 70, 130], ids=lambda m: f"M{m}")
def test_linear_panel_matches_reference(m: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    # N = 37: three panels, the last one partial; K 1100 > the 512-k blocks of M > 6; M 70 and
    # 130 span several token groups of 64; M 7 and 13 need several token chunks per panel.
    x, w, b = make(m, 37, k, bias, dtype)
    before = kernel_calls()
    out = linear_panel(x, PanelWeight.pack(w), b)
    assert kernel_calls() == before + 1  # the panel kernel ran, not the unpacking fallback
    assert_close_to_reference(out, x, w, b)


@needs_kernel
@pytest.mark.parametrize("m", [1, 5, 6, 9], ids=lambda m: f"M{m}")
def test_linear_panel_exact_on_small_integers(m: int) -> None:
    # integer x and w: every partial sum is exact, so any lane/row/panel mix-up shows
    g = torch.Generator().manual_seed(m)
    x = torch.randint(-3, 4, (m, 40), generator=g).float()
    w = torch.randint(-50, 51, (45, 40), generator=g).bfloat16()
    b = torch.randint(-9, 10, (45,), generator=g).float()
    assert torch.equal(linear_panel(x, PanelWeight.pack(w), b), x @ w.float().T + b)


def test_linear_panel_keeps_leading_dims_and_falls_back_off_cpu_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, w, b = make(6, 20, 32, True, torch.float32)
    p = PanelWeight.pack(w)
    out = linear_panel(x.view(2, 3, 32), p, b)
    assert out.shape == (2, 3, 20)
    monkeypatch.setattr(cpu_linear, "disabled", True)  # no kernel: the unpacked weight, F.linear
    before = kernel_calls()
    fallback = linear_panel(x.view(2, 3, 32), p, b)
    assert kernel_calls() == before
    torch.testing.assert_close(fallback, F.linear(x, w.float(), b.float()).view(2, 3, 20))
    torch.testing.assert_close(out, fallback, rtol=1e-5, atol=1e-5)


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
    ref = q.reference_linear(x.float(), None if b is None else b.float())
    assert out.dtype == x.dtype and out.shape == ref.shape
    tol = 1e-5 * (ref.abs() + 1)
    if dtype == torch.bfloat16:
        tol = tol + BF16_ULP * ref.abs()
    assert bool(((out.float() - ref).abs() <= tol).all())
    # and it is the dequantized weight's product up to the int8 activation rounding
    deq = F.linear(x.float(), q.dequantize(torch.float32), None if b is None else b.float())
    assert float((ref - deq).abs().max()) < 0.02 * float(deq.abs().max())


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
    monkeypatch.setattr(cpu_linear, "disabled", True)
    before = kernel_calls()
    out = linear_int4(x, q)
    assert kernel_calls() == before
    torch.testing.assert_close(out, q.reference_linear(x))


def test_build_lock_clears_a_killed_builds_torch_lock(tmp_path: Path) -> None:
    """torch's JIT build waits forever on a `lock` file a killed build left behind (this hung
    every later start once); under our process lock that file is stale and goes."""
    from quickdraft.kernels.cpu_linear import _build_lock

    directory = tmp_path / "ext"
    directory.mkdir()
    (directory / "lock").touch()
    with _build_lock(directory):
        assert not (directory / "lock").exists()


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
    from quickdraft.kernels import cpu_ops

    g = torch.Generator().manual_seed(rows)
    inter = 44  # not a multiple of 8: the scalar tail runs too
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturated exp both ways
    assert kernels_available()
    out = cpu_ops.silu_mul(gate_up)
    assert out.dtype == dtype and out.shape == (rows, inter)
    torch.testing.assert_close(out, cpu_ops.reference_silu_mul(gate_up), **fused_tol(dtype))


@needs_kernel
@FUSED_DTYPES
def test_gated_rms_norm_matches_reference_on_strided_z(dtype: torch.dtype) -> None:
    from quickdraft.kernels import cpu_ops

    g = torch.Generator().manual_seed(3)
    n, heads, d = 5, 3, 20  # d not a multiple of 8
    x = torch.randn(n, heads, d, generator=g) * 2
    proj = torch.randn(n, 7 + heads * d + 4, generator=g).to(dtype)
    z = proj[:, 7 : 7 + heads * d].view(n, heads, d)  # a view into a fused projection
    for w in (torch.randn(d, generator=g), torch.randn(d, generator=g).to(dtype)):
        out = cpu_ops.gated_rms_norm(x, w, z, 1e-6)
        assert out.dtype == dtype and out.shape == (n, heads, d)
        ref = cpu_ops.reference_gated_rms_norm(x, w, z, 1e-6)
        torch.testing.assert_close(out, ref, **fused_tol(dtype))


def test_fused_ops_fall_back_for_fp16() -> None:
    from quickdraft.kernels import cpu_ops

    gate_up = torch.randn(2, 16).half()
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), cpu_ops.reference_silu_mul(gate_up))
