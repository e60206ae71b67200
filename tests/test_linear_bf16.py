"""bf16 weight GEMMs (kernels/linear_bf16.py): the nn.Linear-layout kernel and the 16-row
panel kernel against the fp32 reference, that the fast path is really taken where it should be,
and that every other case falls back to F.linear correctly."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import assert_close_to_reference, make, needs_kernel

from quickdraft.kernels import (
    Int4Weight,
    Int8Weight,
    PanelWeight,
    build,
    kernel_calls,
    linear,
    linear_bf16,
    linear_panel,
    reference_linear,
)
from quickdraft.kernels.linear_bf16 import PANEL_TILE_FLAGS, PANEL_TILES, panel_tiles, path_for

pytestmark = pytest.mark.usefixtures("kernels_enabled")


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
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9, 17], ids=lambda m: f"M{m}")
def test_fp16_weights_are_widened_exactly(m: int, dtype: torch.dtype) -> None:
    """A GGUF file's F16 tensor as the operand (fp16 weights): integer weights up to 1500
    (exact in fp16, not in bf16's 8-bit mantissa) give torch's fp32 result bit for bit, every
    order and tail included; random ones match the fp32 reference; a row's bits do not depend
    on the other rows."""
    g = torch.Generator().manual_seed(m)
    k, n = 8 * 13 + 16 * 5, 37  # K % 16 == 8: the 8-wide tail too
    x = torch.randint(-3, 4, (m, k), generator=g).to(dtype)
    w = torch.randint(-1500, 1501, (n, k), generator=g).half()
    assert not torch.equal(w.bfloat16().float(), w.float())  # bf16 would round these
    b = torch.randint(-5, 6, (n,), generator=g).float()
    before = kernel_calls()
    out = linear(x, w, b)
    assert kernel_calls() == before + 1
    assert torch.equal(out, F.linear(x.float(), w.float(), b).to(dtype))
    x, _, b2 = make(m, 64, 1536, True, dtype)
    w2 = torch.randn(64, 1536, generator=g).half()
    assert_close_to_reference(linear(x, w2, b2), x, w2, b2)
    rows = torch.cat([linear(x[i : i + 1], w2, b2) for i in range(m)])
    assert torch.equal(linear(x, w2, b2), rows)


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
    assert path_for(x, w, b) == "kernel"
    assert_close_to_reference(linear(x, w, b), x, w, b)


def test_linear_m_above_limit_falls_back_and_stays_correct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(linear_bf16, "MAX_M", 8)
    x, w, b = make(9, 200, 64, True, torch.bfloat16)
    assert path_for(x, w, b) == "fallback"
    before = kernel_calls()
    out = linear(x, w, b)
    assert kernel_calls() == before
    assert torch.equal(out, F.linear(x, w, b))
    assert_close_to_reference(out, x, w, b)


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


def test_reference_linear_is_fp32_math_in_x_dtype() -> None:
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    w = torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16)
    b = torch.tensor([0.5], dtype=torch.bfloat16)
    out = reference_linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.tolist() == [[11.5]]


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


needs_thp = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists()
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="needs Linux with transparent huge pages",
)


@needs_thp
@pytest.mark.parametrize("kind", ["panel", "int8", "int4"])
def test_big_packed_weights_sit_on_huge_page_eligible_aligned_memory(kind: str) -> None:
    """Each format's packed weight, from 2 MiB on, is on its own 2 MiB-aligned huge pages of
    a mapping the kernel reports as THP-eligible; smaller ones share such a mapping (`_Arena`),
    each aligned, never inside the big one's huge pages (the kernel may merge two adjacent
    mappings of the same flags into one entry, so entries are not compared). Values survive."""
    w = torch.randn(16000, 896, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    make = {"panel": PanelWeight.pack, "int8": Int8Weight.quantize, "int4": Int4Weight.quantize}
    big, small, other = make[kind](w), make[kind](w[:48]), make[kind](w[48:96])
    assert linear_bf16.own_mapping(big.packed.numel() * big.packed.element_size())
    assert big.packed.data_ptr() % linear_bf16.HUGE_PAGE == 0
    smaps = _smaps_entry(big.packed.data_ptr())
    assert re.search(r"THPeligible:\s+1", smaps) and re.search(r"VmFlags:.* hg", smaps), smaps
    # mappings compared by their address range (an entry's first line): its counters (Rss,
    # AnonHugePages...) may move between two reads while khugepaged or another thread works
    mapping = smaps.split("\n", 1)[0]
    end = _smaps_entry(big.packed.data_ptr() + big.packed.nbytes - 1).split("\n", 1)[0]
    assert end == mapping  # its own
    page = linear_bf16.HUGE_PAGE
    own = range(
        big.packed.data_ptr(), -(-(big.packed.data_ptr() + big.packed.nbytes) // page) * page
    )
    for t in (small.packed, other.packed):
        assert t.nbytes < page and t.data_ptr() % 256 == 0
        assert t.data_ptr() not in own and t.data_ptr() + t.nbytes - 1 not in own
        assert re.search(r"VmFlags:.* hg", _smaps_entry(t.data_ptr()))
    if small.packed.untyped_storage().data_ptr() == other.packed.untyped_storage().data_ptr():
        first = _smaps_entry(small.packed.data_ptr()).split("\n", 1)[0]
        assert first == _smaps_entry(other.packed.data_ptr()).split("\n", 1)[0]
    torch.testing.assert_close(
        other.dequantize(torch.float32), make[kind](w[48:96]).dequantize(torch.float32)
    )
    torch.testing.assert_close(big.dequantize(torch.float32)[:48], small.dequantize(torch.float32))
    torch.testing.assert_close(
        big.dequantize(torch.float32), w.float(), rtol=0, atol=float(w.abs().max()) / 6
    )


@needs_thp
def test_weights_mostly_padding_on_their_own_pages_share_the_arena() -> None:
    """A packed weight just over 2 MiB (Gemma-4-26B-A4B's expert gate / up rows are 2.3 MB)
    would hold 4 MiB on its own huge pages: it goes to the arena, the next such weight right
    after it in the same mapping; weights of whole huge pages keep their own."""
    page = linear_bf16.HUGE_PAGE
    assert not linear_bf16.own_mapping(page + page // 8)  # 2.25 MiB: 1.75 MiB of padding
    assert not linear_bf16.own_mapping(4849664)  # a 35B-A3B projection part: 4.6 of 6 MiB
    assert linear_bf16.own_mapping(2 * page) and linear_bf16.own_mapping(3 * page - page // 4)
    assert linear_bf16.own_mapping(linear_bf16.ARENA_BYTES // 4 + 1)  # big: own whatever
    w = torch.randn(4000, 896, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    a, b = Int4Weight.quantize(w), Int4Weight.quantize(w)
    n = a.packed.nbytes
    assert n > page and not linear_bf16.own_mapping(n)
    if a.packed.untyped_storage().data_ptr() == b.packed.untyped_storage().data_ptr():
        assert b.packed.data_ptr() == a.packed.data_ptr() + -(-n // 256) * 256
    assert re.search(r"VmFlags:.* hg", _smaps_entry(a.packed.data_ptr()))
    torch.testing.assert_close(a.dequantize(torch.float32), b.dequantize(torch.float32))


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


@pytest.fixture(params=list(PANEL_TILES))
def panel_tile(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test on each panel tile this CPU has (AVX512_BF16 skips where absent)."""
    ext = build.extension()
    if ext is None:
        pytest.skip("the C++ kernels are not built here")
    if request.param not in panel_tiles():
        needs = sorted(PANEL_TILE_FLAGS[request.param])
        pytest.skip(f"this CPU lacks {needs}: no {request.param} panel tile")
    ext.panel_isa(PANEL_TILES[request.param])
    yield request.param
    ext.panel_isa(-1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k", [1, 7, 64, 904, 1100], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 17, 70, 130], ids=lambda m: f"M{m}")
def test_linear_panel_matches_reference(
    m: int, k: int, bias: bool, dtype: torch.dtype, panel_tile: str
) -> None:
    # N = 37: three panels, the last one partial; K 1100 > the 512-k blocks of M > 6; M 70 and
    # 130 span several token groups of 64; M 7, 13 and 17 need several token chunks per panel;
    # odd K: the AVX512_BF16 tiles' last k alone.
    x, w, b = make(m, 37, k, bias, dtype)
    before = kernel_calls()
    out = linear_panel(x, PanelWeight.pack(w), b)
    assert kernel_calls() == before + 1  # the panel kernel ran, not the unpacking fallback
    assert_close_to_reference(out, x, w, b)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["xfp32", "xbf16"])
@pytest.mark.parametrize("m", [1, 5, 6, 9, 20], ids=lambda m: f"M{m}")
def test_linear_panel_exact_on_small_integers(m: int, dtype: torch.dtype, panel_tile: str) -> None:
    # integer x and w: every partial sum is exact, so any lane/row/panel mix-up shows
    g = torch.Generator().manual_seed(m)
    x = torch.randint(-3, 4, (m, 41), generator=g).to(dtype)
    w = torch.randint(-50, 51, (45, 41), generator=g).bfloat16()
    b = torch.randint(-9, 10, (45,), generator=g).float()
    out = linear_panel(x, PanelWeight.pack(w), b)
    assert torch.equal(out, (x.float() @ w.float().T + b).to(dtype))


@needs_kernel
@pytest.mark.parametrize("k", [7, 512, 1100, 3584], ids=lambda k: f"K{k}")
def test_panel_bf16_tiles_equal_the_avx2_tile_bit_for_bit(k: int) -> None:
    """vdpbf16ps adds (x[k] w[k], then x[k + 1] w[k + 1]) with one rounding each: the AVX2
    FMA chain's bits, for every M (so batch invariance carries over: a row alone equals the
    row in any batch)."""
    ext = build.extension()
    if "avx512_bf16" not in panel_tiles():
        pytest.skip(f"this CPU lacks {sorted(PANEL_TILE_FLAGS['avx512_bf16'])}")
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(70, k, generator=g) * 0.05).bfloat16()
    p = PanelWeight.pack(w)
    x = torch.randn(40, k, generator=g).bfloat16()
    outs = {}
    try:
        for tile, level in PANEL_TILES.items():
            ext.panel_isa(level)
            outs[tile] = [linear_panel(x[:m], p) for m in (1, 2, 7, 16, 17, 40)]
    finally:
        ext.panel_isa(-1)
    for a, b in zip(outs["avx2"], outs["avx512_bf16"], strict=True):
        assert torch.equal(a, b)
    full = outs["avx512_bf16"][-1]
    for part in outs["avx512_bf16"]:
        assert torch.equal(part, full[: part.shape[0]])


def test_linear_panel_keeps_leading_dims_and_falls_back_off_cpu_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, w, b = make(6, 20, 32, True, torch.float32)
    p = PanelWeight.pack(w)
    out = linear_panel(x.view(2, 3, 32), p, b)
    assert out.shape == (2, 3, 20)
    monkeypatch.setattr(build, "disabled", True)  # no kernel: the unpacked weight, F.linear
    before = kernel_calls()
    fallback = linear_panel(x.view(2, 3, 32), p, b)
    assert kernel_calls() == before
    torch.testing.assert_close(fallback, F.linear(x, w.float(), b.float()).view(2, 3, 20))
    torch.testing.assert_close(out, fallback, rtol=1e-5, atol=1e-5)
