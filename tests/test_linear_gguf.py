# ~500 lines on purpose: every GGUF format through decode, layout, kernel tiles and fallback,
# one file so a format added to FORMATS is covered by every check at once.
"""A GGUF file's own block formats as GEMM operands (kernels/linear_gguf.py): decoding against
the gguf package's dequantization, the panel layout and its round trip, and the AVX2 kernel
against `GGUFWeight.reference_linear` (same activation quantization) and against x @ the
dequantized weight (up to that quantization). `random_blocks` is shared with
test_gguf_loader.py, which writes whole model files from it."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from kernel_checks import BF16_ULP, needs_kernel
from torch import Tensor

from quickdraft import hub
from quickdraft.kernels import build, kernel_calls
from quickdraft.kernels.build import extension
from quickdraft.kernels.linear_gguf import (
    FORMATS,
    TILE_FLAGS,
    TILES,
    GGUFWeight,
    cpu_tiles,
    decode,
    dequantize_parts,
    linear_gguf,
    pack,
    unpack,
)

pytestmark = pytest.mark.usefixtures("kernels_enabled")

# byte offsets of every fp16 field (d, and dmin / min where the format has one) in one block
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "MXFP4": (),  # an E8M0 exponent byte at 0 instead (E8M0_FIELDS)
    "IQ2_XXS": (0,),  # no kernel: test_gguf_loader.py's unsupported-type file
    "IQ3_S": (0,),  # no kernel either
}
E8M0_FIELDS = {"MXFP4": 0}
# |d| per format for weights of roughly 0.05-0.1 (Q6_K's 1e-4 makes some d fp16 subnormals)
SCALES = {
    "Q4_0": 0.02,
    "Q4_1": 0.02,
    "Q5_0": 0.01,
    "Q5_1": 0.01,
    "Q8_0": 1e-3,
    "Q4_K": 5e-4,
    "Q5_K": 2.5e-4,
    "Q6_K": 1e-4,
    "Q2_K": 5e-3,
    "Q3_K": 1e-3,
    "IQ4_NL": 1e-3,
    "IQ4_XS": 5e-5,
    "MXFP4": 2**-7,
    "IQ2_XXS": 1e-3,
    "IQ3_S": 1e-3,
}
NAMES = list(FORMATS)
N, K = 37, 512  # N: a partial last panel; K: 2 super-blocks, 16 blocks of 32


def random_blocks(name: str, n: int, k: int, seed: int, scale: float | None = None) -> np.ndarray:
    """Valid GGUF bytes [n, k / block * block_bytes] of type `name`: random bytes (every bit
    pattern of the quants and sub-block scales is legal) with finite fp16 d / dmin fields of
    magnitude ~`scale` and random sign."""
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        size = rng.uniform(0.5, 1.5, (n, k // block)) * (scale or SCALES[name])
        d = (size * rng.choice([-1.0, 1.0], size.shape)).astype(np.float16)
        raw[..., at : at + 2] = d[..., None].view(np.uint8)
    if name in E8M0_FIELDS:  # powers of two 2^(e - 128) around `scale`
        e = 128 + np.log2(scale or SCALES[name]) + rng.integers(-2, 3, (n, k // block))
        raw[..., E8M0_FIELDS[name]] = e.astype(np.uint8)
    return raw.reshape(n, -1)


def gguf_dequantized(name: str, raw: np.ndarray) -> Tensor:
    """The gguf package's dequantization of `raw` [n, row bytes] -> [n, K] fp32."""
    w = dequantize(raw, GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(raw.shape[0], -1)


@functools.cache
def weight(name: str, n: int = N, k: int = K, seed: int = 0) -> tuple[np.ndarray, GGUFWeight]:
    raw = random_blocks(name, n, k, seed)
    return raw, GGUFWeight.from_raw(name, raw, k)


@functools.cache
def mixed(names: tuple[str, ...]) -> tuple[GGUFWeight, Tensor]:
    """A fused operand of `names` (21, 37, 53... rows each) and its gguf dequantization."""
    raws = [random_blocks(name, 21 + 16 * i, K, seed=i) for i, name in enumerate(names)]
    w = GGUFWeight.concat(
        [GGUFWeight.from_raw(nm, r, K) for nm, r in zip(names, raws, strict=True)]
    )
    return w, torch.cat([gguf_dequantized(nm, r) for nm, r in zip(names, raws, strict=True)])


def inputs(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    """x [m, k]; the last row (when m > 1) has a zero super-block: the dx = 0 path."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 100 * m))
    if m > 1:
        x[-1, :256] = 0
    return x.to(dtype)


def assert_matches_reference(out: Tensor, ref: Tensor) -> None:
    """Kernel vs reference: the same integer sums, fp32 block terms rounded differently
    (fused multiply-add): 1e-5 of the output's scale, plus one bf16 ulp for a bf16 result."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ref32 = ref.float()
    tol = torch.full_like(ref32, 1e-5 * float(ref32.abs().max()) + 1e-30)
    if out.dtype == torch.bfloat16:
        tol = tol + BF16_ULP * ref32.abs()
    err = (out.float() - ref32).abs()
    assert bool((err <= tol).all()), f"max error {float(err.max()):.3g}"


def assert_near_dequantized(out: Tensor, x: Tensor, w: Tensor, bias: Tensor | None) -> None:
    """out vs x @ w.T with the gguf package's own weights: only the activations' int8
    rounding differs (llama.cpp's Q8 activations do the same), ~1e-2 of the output's scale.
    Catches a layout both pack and unpack got wrong in the same way."""
    deq = x.float() @ w.T + (0 if bias is None else bias.float())
    assert float((out.float() - deq).abs().max()) < 3e-2 * float(deq.abs().max())


def needs_extension() -> None:
    if not build.kernels_available():
        pytest.skip("the C++ extension did not build or cannot run here")


# --- decoding and layout ---------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_decode_equals_gguf_dequantize(name: str) -> None:
    """Bitwise in fp32: dequantize_parts is exact in float64 and every gguf dequantization
    is one fp32 rounding of that exact value (d * sc fits fp32; d * sc * u and dm * m too)."""
    fmt = FORMATS[name]
    raw = random_blocks(name, 7, K, seed=1)
    parts = decode(fmt, raw, K)
    assert parts.u.shape == (7, K) and parts.d.shape == (7, K // fmt.block)
    ours = dequantize_parts(fmt, parts)
    assert ours.dtype == torch.float64
    ref = gguf_dequantized(name, raw)
    torch.testing.assert_close(ours, ref.double(), rtol=1e-6, atol=0)
    assert torch.equal(ours.float(), ref)


@pytest.mark.parametrize("name", NAMES)
def test_decode_rejects_rows_of_the_wrong_size(name: str) -> None:
    fmt = FORMATS[name]
    raw = random_blocks(name, 3, K, seed=2)
    with pytest.raises(ValueError, match=name):
        decode(fmt, raw[:, : -fmt.block_bytes], K)
    with pytest.raises(ValueError, match=name):
        decode(fmt, raw, K + fmt.block)


@pytest.mark.parametrize("name", NAMES)
def test_pack_unpack_round_trip(name: str) -> None:
    fmt = FORMATS[name]
    raw, w = weight(name)
    parts = decode(fmt, raw, K)
    packed = pack(fmt, parts)
    assert packed.shape == (3, K // fmt.block, fmt.panel_block_bytes())
    assert torch.equal(packed, w.parts[0].packed)  # from_raw packs the same bytes
    back = unpack(fmt, packed, N)
    for field in ("u", "sc", "m", "d", "dm"):
        ours, theirs = getattr(back, field), getattr(parts, field)
        assert (ours is None) == (theirs is None), field
        if ours is not None:
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), field
    padded = unpack(fmt, packed, 48)  # rows 37..47 of the last panel are zero
    assert not padded.u[N:].any() and not padded.d[N:].astype(np.float32).any()


def documented_u(name: str, packed: np.ndarray, row: int, col: int) -> int:
    """u[row][col] read from `packed` by the module docstring's layout, byte by byte."""
    fmt = FORMATS[name]
    p, j16 = divmod(row, 16)
    h, j = divmod(j16, 8)
    b, within = divmod(col, fmt.block)
    g, r = divmod(within, 32)
    c, i = divmod(r, 4)
    blk = packed[p, b]
    if fmt.bits == 8:
        return int(blk[g * 512 + c * 64 + h * 32 + 4 * j + i])
    if fmt.bits <= 3:  # a 2-bit plane of the low bits, then a 1-bit plane of the third
        lb = int(blk[g * 128 + (c // 2) * 32 + 4 * j + i])
        u = (lb >> (2 * (2 * (c % 2) + h))) & 3
        if fmt.bits == 3:
            hb = int(blk[16 * fmt.block // 4 + g * 64 + (c // 4) * 32 + 4 * j + i])
            u |= ((hb >> (2 * (c % 4) + h)) & 1) << 2
        return u
    u = (int(blk[g * 256 + c * 32 + 4 * j + i]) >> (4 * h)) & 15
    low = 16 * fmt.block // 2  # bytes of 4-bit low parts per panel block
    if fmt.bits == 5:
        hb = int(blk[low + g * 64 + (c // 4) * 32 + 4 * j + i])
        u |= ((hb >> (2 * (c % 4) + h)) & 1) << 4
    elif fmt.bits == 6:
        hb = int(blk[low + g * 128 + (c // 2) * 32 + 4 * j + i])
        u |= ((hb >> (2 * (2 * (c % 2) + h))) & 3) << 4
    return u


@pytest.mark.parametrize("name", NAMES)
def test_panel_layout_is_the_documented_one(name: str) -> None:
    """Every u of a 20 x 256 weight read from the bytes as the docstring (and the kernel)
    places it, and each row's d at the end of its block: a layout pack and unpack share
    cannot hide here."""
    fmt = FORMATS[name]
    raw = random_blocks(name, 20, 256, seed=3)
    parts = decode(fmt, raw, 256)
    packed = pack(fmt, parts)
    as_np = packed.numpy()
    got = np.array([[documented_u(name, as_np, r, c) for c in range(256)] for r in range(20)])
    assert np.array_equal(got, parts.u.astype(np.int64))
    width, kind = (16, torch.uint8) if fmt.e8m0 else (32, torch.float16)
    d_at = fmt.panel_block_bytes() - width * (2 if fmt.has_dm else 1)
    d = packed[..., d_at : d_at + width].contiguous().view(kind)  # [P, blocks, 16]
    ours = d.permute(0, 2, 1).reshape(32, -1)[:20]
    assert torch.equal(ours, torch.from_numpy(parts.d))


def test_from_raw_in_slices_equals_one_pack() -> None:
    """600 x 8192: from_raw packs in slices of 512 rows; the seam must not show."""
    raw = random_blocks("Q4_0", 600, 8192, seed=4)
    w = GGUFWeight.from_raw("Q4_0", raw, 8192)
    fmt = FORMATS["Q4_0"]
    assert torch.equal(w.parts[0].packed, pack(fmt, decode(fmt, raw, 8192)))


def test_weight_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="IQ2_XXS has no kernel"):
        GGUFWeight.from_raw("IQ2_XXS", random_blocks("IQ2_XXS", 16, 256, seed=0), 256)
    a = GGUFWeight.from_raw("Q8_0", random_blocks("Q8_0", 16, 256, seed=0), 256)
    b = GGUFWeight.from_raw("Q8_0", random_blocks("Q8_0", 16, 512, seed=0), 512)
    with pytest.raises(ValueError, match="one in_features"):
        GGUFWeight.concat([a, b])


@pytest.mark.parametrize(
    "names", [("Q4_K", "Q6_K"), ("Q8_0", "Q5_0"), ("Q4_K", "Q8_0", "Q4_1")], ids="+".join
)
def test_concat_dequantizes_to_the_files_rows(names: tuple[str, ...]) -> None:
    w, deq = mixed(names)
    assert w.shape == deq.shape and [p.fmt.name for p in w.parts] == list(names)
    assert torch.equal(w.dequantize(torch.float32), deq)


@pytest.mark.parametrize("names", [("Q4_K", "Q6_K"), ("Q8_0", "Q5_0", "Q4_1")], ids="+".join)
def test_rows_are_the_dequantized_rows(names: tuple[str, ...]) -> None:
    """Any row range, across part boundaries and off the 16-row panels, as the whole weight
    dequantized gives it (what Int4Weight / Int8Weight.quantize read a block at a time)."""
    w, _ = mixed(names)
    whole = w.dequantize(torch.bfloat16)
    n = w.out_features
    for start, stop in [(0, n), (0, 1), (5, 37), (n // 2 - 3, n // 2 + 19), (n - 7, n + 40)]:
        assert torch.equal(w.rows(start, stop), whole[start:stop]), (start, stop)
    assert w.rows(n, n + 4).shape == (0, w.in_features)


# --- the kernel ------------------------------------------------------------------------------

BIASES = {"nobias": None, "bias32": torch.float32, "bias16": torch.bfloat16}


@needs_kernel
@pytest.mark.parametrize("bias", list(BIASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["xfp32", "xbf16"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 17], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_reference(
    name: str, m: int, dtype: torch.dtype, bias: str, gguf_tile: str
) -> None:
    """M 1-4: one token pass; 5-17: several passes over blocks re-read from L1."""
    needs_extension()
    raw, w = weight(name)
    x = inputs(m, K, dtype)
    bdt = BIASES[bias]
    b = None if bdt is None else torch.randn(N, generator=torch.Generator().manual_seed(m)).to(bdt)
    before = kernel_calls()
    out = linear_gguf(x, w, b)
    assert kernel_calls() == before + 1  # the kernel ran, not the reference fallback
    assert_matches_reference(out, w.reference_linear(x, b))
    assert_near_dequantized(out, x, gguf_dequantized(name, raw), b)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["xfp32", "xbf16"])
@pytest.mark.parametrize("m", [1, 3, 5, 17], ids=lambda m: f"M{m}")
@pytest.mark.parametrize(
    "names",
    [("Q4_K", "Q5_K"), ("Q4_0", "Q5_1"), ("Q4_K", "Q6_K"), ("Q8_0", "Q5_0"), ("Q4_K", "Q8_0")],
    ids="+".join,
)
def test_kernel_on_fused_parts_matches_reference(
    names: tuple[str, ...], m: int, dtype: torch.dtype, gguf_tile: str
) -> None:
    """A fused q/k/v or gate/up operand whose parts have different formats, of the same or of
    different block sizes (the kernel quantizes x once per block size); bias over all rows."""
    needs_extension()
    w, deq = mixed(names)
    x = inputs(m, K, dtype, seed=1)
    b = torch.randn(w.out_features, generator=torch.Generator().manual_seed(5)).bfloat16()
    before = kernel_calls()
    out = linear_gguf(x, w, b)
    assert kernel_calls() == before + 1
    assert out.shape == (m, w.out_features)
    assert_matches_reference(out, w.reference_linear(x, b))
    assert_near_dequantized(out, x, deq, b)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["xfp32", "xbf16"])
@pytest.mark.parametrize("name", [*NAMES, "Q4_K+Q6_K+Q8_0"])
def test_kernel_rows_are_batch_invariant(name: str, dtype: torch.dtype, gguf_tile: str) -> None:
    """Each row of an M-row call has the bits that row gets alone, for every M up to 17: a
    decode step and a verify pass agree exactly."""
    needs_extension()
    w = mixed(tuple(name.split("+")))[0] if "+" in name else weight(name)[1]
    x = inputs(17, K, dtype, seed=2)
    alone = torch.cat([linear_gguf(x[i : i + 1], w) for i in range(17)])
    for m in range(1, 18):
        assert torch.equal(linear_gguf(x[:m], w), alone[:m]), f"M={m}"


@needs_kernel
@pytest.mark.parametrize("name", [*NAMES, "Q4_K+Q6_K+Q8_0"])
@pytest.mark.parametrize("wide", [t for t in TILES if t != "avx2"])
def test_wide_tiles_equal_avx2_tile(name: str, wide: str) -> None:
    """The AVX-512 VNNI tile gives the AVX2 tile's bits (the same integer sums, the same fp32
    ops), at every token count a pass or several passes take."""
    needs_extension()
    ext = build.extension()
    if wide not in cpu_tiles():
        with pytest.raises(RuntimeError, match="lacks"):
            ext.gguf_isa(TILES[wide])
        pytest.skip(f"this CPU lacks {sorted(TILE_FLAGS[wide])}: only narrower tiles run here")
    w = mixed(tuple(name.split("+")))[0] if "+" in name else weight(name)[1]
    x = inputs(40, K, torch.float32, seed=3)
    ms = (1, 2, 4, 6, 8, 9, 16, 17, 40)
    try:
        outs = []
        for level in (0, TILES[wide]):
            assert ext.gguf_isa(level) == level
            outs.append([linear_gguf(x[:m], w) for m in ms])
    finally:
        ext.gguf_isa(-1)
    for m, a, b in zip(ms, *outs, strict=True):
        assert torch.equal(a, b), f"M={m}"


@needs_kernel
@pytest.mark.parametrize("wide", [t for t in TILES if t != "avx2"])
def test_wide_tile_q4_k_at_its_largest_sums_keeps_the_bits(wide: str) -> None:
    """Q4_K on the AVX-512 tile sums its scaled runs in fp32, exact only while every half
    block stays below 2^24: at the format's largest values (q 15, scales and mins 63, every
    activation +-127 after quantization) it still gives the AVX2 tile's bits and the
    reference's values."""
    needs_extension()
    ext = build.extension()
    if wide not in cpu_tiles():
        pytest.skip(f"this CPU lacks {sorted(TILE_FLAGS[wide])}: only narrower tiles run here")
    n, k = 32, 1024
    raw = np.zeros((n, k // 256, 144), np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # d
    raw[..., 2:4] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)  # dmin
    raw[..., 4:] = 0xFF  # every 6-bit scale and min 63, every nibble 15
    w = GGUFWeight.from_raw("Q4_K", raw.reshape(n, -1), k)
    for sign in (1.0, -1.0):
        x = sign * torch.linspace(0.995, 1.0, k).repeat(16, 1)  # quantizes to +-127
        try:
            outs = []
            for level in (0, TILES[wide]):
                ext.gguf_isa(level)
                outs.append([linear_gguf(x[:m], w) for m in (1, 6, 16)])
        finally:
            ext.gguf_isa(-1)
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, w.reference_linear(x[: a.shape[0]]), rtol=1e-5, atol=0)


@needs_kernel
def test_mxfp4_every_exponent_keeps_the_bits() -> None:
    """MXFP4's d = 2^(e - 128) for every E8M0 byte from 0 (2^-128: the block's terms are fp32
    subnormals) to 230: every tile gives the same bits (AVX-512 makes d by vscalefps, 2^-128
    and 2^-127 subnormal, AVX2 otherwise), and the reference's values."""
    needs_extension()
    ext = build.extension()
    n, k = 231 * 2, 64  # two blocks a row, each row one exponent
    raw = random_blocks("MXFP4", n, k, seed=5).reshape(n, k // 32, 17)
    raw[..., 0] = np.repeat(np.arange(231, dtype=np.uint8), 2)[:, None]
    w = GGUFWeight.from_raw("MXFP4", raw.reshape(n, -1), k)
    x = inputs(6, k, torch.float32, seed=4)
    outs = []
    try:
        for tile in cpu_tiles():
            ext.gguf_isa(TILES[tile])
            outs.append([linear_gguf(x[:m], w) for m in (1, 6)])
    finally:
        ext.gguf_isa(-1)
    for same in zip(*outs, strict=True):
        assert all(torch.equal(same[0], o) for o in same[1:])
        assert bool(same[0][:, :4].eq(0).logical_not().any())  # the subnormal rows are not 0
        ref = w.reference_linear(x[: same[0].shape[0]])
        # each weight row has its own scale: 1e-5 of the sum of its terms' magnitudes
        dense = gguf_dequantized("MXFP4", raw.reshape(n, -1))
        tol = 1e-5 * (x[: ref.shape[0]].abs() @ dense.abs().T) + 1e-44
        assert bool(((same[0] - ref).abs() <= tol).all())


# every quant and scale byte at the value that makes the format's integer sums largest:
# Q2_K u 3, sc and m 15; Q3_K u 7, sc 31; IQ4 index 0 (-127), IQ4_XS's ls 0 (sc -32); MXFP4
# index 7 (12)
EXTREME_BYTES = {"Q2_K": 0xFF, "Q3_K": 0xFF, "IQ4_NL": 0x00, "IQ4_XS": 0x00, "MXFP4": 0x77}


@needs_kernel
@pytest.mark.parametrize("name", list(EXTREME_BYTES))
def test_new_formats_at_their_largest_sums_keep_the_bits(name: str) -> None:
    """The 16-bit runs each tile adds before widening (IQ4: one quad, |v| 127 x 127 a pair;
    MXFP4: eight; Q2_K / Q3_K: a sub-block's four) at the format's extremes, activations
    +-127 after quantization: every tile gives the reference's values and the same bits."""
    needs_extension()
    ext = build.extension()
    n, k = 32, 1024
    raw = np.full((n, k), EXTREME_BYTES[name], np.uint8)
    fmt = FORMATS[name]
    raw = raw[:, : k // fmt.block * fmt.block_bytes].reshape(n, k // fmt.block, -1)
    if fmt.e8m0:
        raw[..., 0] = 120
    else:
        for at in FP16_FIELDS[name]:
            raw[..., at : at + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    if name == "IQ4_XS":  # ls 0 in every sub-block: scales_h and scales_l zero
        raw[..., 2:8] = 0
    w = GGUFWeight.from_raw(name, raw.reshape(n, -1), k)
    for sign in (1.0, -1.0):
        x = sign * torch.linspace(0.995, 1.0, k).repeat(16, 1)  # quantizes to +-127
        outs = []
        try:
            for tile in cpu_tiles():
                ext.gguf_isa(TILES[tile])
                outs.append([linear_gguf(x[:m], w) for m in (1, 6, 16)])
        finally:
            ext.gguf_isa(-1)
        for same in zip(*outs, strict=True):
            assert all(torch.equal(same[0], o) for o in same[1:])
            ref = w.reference_linear(x[: same[0].shape[0]])
            torch.testing.assert_close(same[0], ref, rtol=1e-5, atol=0)


@needs_kernel
def test_kernel_takes_any_leading_shape_and_empty_batches() -> None:
    needs_extension()
    _, w = weight("Q5_K")
    x = inputs(6, K, torch.bfloat16)
    out = linear_gguf(x.reshape(2, 3, K), w)
    assert out.shape == (2, 3, N) and torch.equal(out.reshape(6, N), linear_gguf(x, w))
    assert linear_gguf(x[:0], w).shape == (0, N)


def test_linear_gguf_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = mixed(("Q4_K", "Q8_0"))
    x = inputs(5, K, torch.bfloat16)
    b = torch.randn(w.out_features)
    fast = linear_gguf(x, w, b)
    monkeypatch.setattr(build, "disabled", True)
    before = kernel_calls()
    slow = linear_gguf(x, w, b)
    assert kernel_calls() == before
    assert torch.equal(slow, w.reference_linear(x, b))
    assert_matches_reference(fast, slow)


@needs_kernel
def test_linear_gguf_ineligible_input_falls_back_to_the_reference() -> None:
    needs_extension()
    _, w = weight("Q6_K")
    x = inputs(3, K, torch.float16)  # the kernel takes fp32 and bf16 activations only
    before = kernel_calls()
    out = linear_gguf(x, w)
    assert kernel_calls() == before
    assert out.dtype == torch.float16 and torch.equal(out, w.reference_linear(x))


@needs_kernel
def test_eligibility_refusals() -> None:
    needs_extension()
    ext = extension()
    w, _ = mixed(("Q4_K", "Q8_0"))
    packed = [p.packed for p in w.parts]
    codes = [p.fmt.code for p in w.parts]
    ns = [p.n for p in w.parts]
    n = w.out_features
    x = torch.randn(2, K)
    assert ext.eligible_gguf(x, packed, codes, ns, torch.zeros(n))
    assert ext.eligible_gguf(x, packed, codes, ns, None)
    strided = torch.zeros(*packed[1].shape[:2], 2 * packed[1].shape[2], dtype=torch.uint8)
    strided = strided[..., : packed[1].shape[2]]  # the right shape, not contiguous
    refused = {
        "K": (torch.randn(2, K + 256), packed, codes, ns, None),
        "N beyond the panels": (x, packed, codes, [ns[0], ns[1] + 16], None),
        "N zero": (x, packed, codes, [0, ns[1]], None),
        "codes short": (x, packed, codes[:1], ns, None),
        "ns long": (x, packed, codes, [*ns, 16], None),
        "no parts": (x, [], [], [], None),
        "format swapped": (x, packed, codes[::-1], ns, None),
        "unknown format": (x, packed, [codes[0], 99], ns, None),
        "non-contiguous": (x, [packed[0], strided], codes, ns, None),
        "not bytes": (x, [packed[0].view(torch.int8), packed[1]], codes, ns, None),
        "bias size": (x, packed, codes, ns, torch.zeros(n + 1)),
        "bias 2-D": (x, packed, codes, ns, torch.zeros(1, n)),
        "bias integer": (x, packed, codes, ns, torch.zeros(n, dtype=torch.int32)),
        "x fp16": (x.half(), packed, codes, ns, None),
        "x grad": (x.clone().requires_grad_(), packed, codes, ns, None),
    }
    for why, args in refused.items():
        assert not ext.eligible_gguf(*args), why
    with pytest.raises(RuntimeError, match="not eligible"):
        ext.linear_gguf(*refused["bias size"])


# --- a real file -----------------------------------------------------------------------------


@pytest.mark.real
@needs_kernel
@pytest.mark.parametrize(
    ("tensor", "rows", "qtype"),
    [("blk.0.ffn_down.weight", None, "Q4_1"), ("token_embd.weight", 1000, "Q8_0")],
)
def test_smollm2_tensors(tensor: str, rows: int | None, qtype: str) -> None:
    """The packaged SmolLM2's own tensors (its Q4_1 projections, its Q8_0 embedding table,
    first 1000 rows): decode == the gguf package; kernel == reference."""
    needs_extension()
    from gguf import GGUFReader

    reader = GGUFReader(str(hub.fetch_gguf("smollm2-135m", progress=False)))
    t = next(t for t in reader.tensors if t.name == tensor)
    assert t.tensor_type.name == qtype
    raw = np.asarray(t.data)[:rows]
    k = int(t.shape[0])
    fmt = FORMATS[qtype]
    ref = gguf_dequantized(qtype, raw)
    assert torch.equal(dequantize_parts(fmt, decode(fmt, raw, k)).float(), ref)
    w = GGUFWeight.from_raw(qtype, raw, k)
    for m in (1, 3, 6):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        out = linear_gguf(x, w)
        assert_matches_reference(out, w.reference_linear(x))
        assert_near_dequantized(out, x, ref, None)


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_rows_equal_the_gguf_package(qtype: str) -> None:
    """Embedding rows dequantized by the kernel (any bytes: d may be inf or NaN) have the
    gguf package's bits, in the order the ids ask for them."""
    ext = extension()
    t = GGMLQuantizationType[qtype]
    assert int(t) in ext.gguf_rows_formats()
    values, size = GGML_QUANT_SIZES[t]
    dim = 2 * 256
    raw = np.random.default_rng(int(t)).integers(0, 256, (40, dim // values * size), np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = np.asarray(dequantize(raw, t), np.float32).reshape(40, dim)
    ids = torch.tensor([7, 0, 39, 7, 12])
    got = ext.gguf_rows(torch.from_numpy(raw), ids, int(t), dim).numpy()
    assert np.array_equal(got.view(np.uint32), ref[ids.numpy()].view(np.uint32))


@needs_kernel
def test_gguf_rows_refuse_what_they_cannot_read() -> None:
    ext = extension()
    raw = torch.zeros(4, 144, dtype=torch.uint8)  # one Q4_K block a row
    with pytest.raises(RuntimeError, match="id 4 outside"):
        ext.gguf_rows(raw, torch.tensor([4]), int(GGMLQuantizationType.Q4_K), 256)
    with pytest.raises(RuntimeError, match="is not 512 values"):
        ext.gguf_rows(raw, torch.tensor([0]), int(GGMLQuantizationType.Q4_K), 512)
    with pytest.raises(RuntimeError, match="not one of gguf_rows_formats"):
        ext.gguf_rows(raw, torch.tensor([0]), int(GGMLQuantizationType.IQ4_XS), 256)
