"""Decode / verify attention (kernels/attention.py `attend`) against the SDPA
reference: values, causal limits, row independence, and which path runs, on every tile this
CPU has."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from quickdraft.kernels import build
from quickdraft.kernels.attention import (
    TILE_FLAGS,
    TILES,
    Paged,
    attend,
    cpu_tiles,
    page_table,
    reference_attend,
)

needs_kernel = pytest.mark.skipif(
    not build.cpu_supported(), reason="CPU lacks AVX2/FMA/F16C: the kernel cannot run here"
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def inputs(
    n: int, heads: int, kv_heads: int, d: int, start: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q as a strided view of a fused projection, k / v as views of a cache with spare room,
    as the models pass them."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q = qkv[:, : heads * d].view(n, heads, d)
    cache = torch.randn(2, kv_heads, start + n + 5, d, generator=g).to(dtype)
    return q, cache[0, :, : start + n], cache[1, :, : start + n]


def ext() -> object:
    e = build.extension()
    assert e is not None, "the kernel must build on this CPU"
    return e


@pytest.fixture(params=list(TILES))
def tile(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test on each tile of the kernel this CPU has (AVX-512 skips where absent)."""
    if not build.cpu_supported():
        pytest.skip("CPU lacks AVX2/FMA/F16C: the kernel cannot run here")
    if request.param not in cpu_tiles():
        pytest.skip(f"this CPU lacks {sorted(TILE_FLAGS[request.param])}: no {request.param} tile")
    e = ext()
    assert e.attend_isa(TILES[request.param]) == TILES[request.param]  # type: ignore[attr-defined]
    yield request.param
    e.attend_isa(-1)  # type: ignore[attr-defined]


SHAPES = [  # n, heads, kv_heads, head_dim, start
    (1, 12, 2, 128, 300),  # Qwen2.5-1.5B decode
    (5, 12, 2, 128, 300),  # ... verify of k = 4
    (6, 14, 2, 64, 17),  # Qwen2.5-0.5B, group of 7
    (3, 8, 2, 256, 0),  # hybrid gated attention, empty cache before the chunk
    (1, 4, 4, 32, 1),  # no grouping
    (16, 9, 1, 64, 5),  # one kv head, a verify of k = 15
    (70, 12, 2, 128, 0),  # a prompt chunk: more rows than a task's block of 8
    (2, 3, 3, 96, 40),  # head_dim 96: a 32-multiple that is not a 64-multiple
]


@needs_kernel
@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, tile: str) -> None:
    n, heads, kv_heads, d, start = shape
    q, k, v = inputs(n, heads, kv_heads, d, start, dtype)
    assert ext().attend_eligible(q, k, v, start)  # type: ignore[attr-defined]
    out = attend(q, k, v, start, d**-0.5)
    assert out.dtype == dtype and out.shape == (n, heads * d)
    # fp32 math in both; bf16 output is one rounding away from the fp32 result
    ref = reference_attend(q.float(), k.float(), v.float(), start, d**-0.5)
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(out.float(), ref, **tol)


@needs_kernel
@DTYPES
def test_verify_rows_equal_decode_rows_bit_for_bit(dtype: torch.dtype, tile: str) -> None:
    """Row i of an n-query call == the 1-query call of query i over keys 0..start+i: a verify
    computes what the decode steps would have."""
    n, heads, kv_heads, d, start = 7, 14, 2, 64, 30
    q, k, v = inputs(n, heads, kv_heads, d, start, dtype, seed=1)
    out = attend(q, k, v, start, d**-0.5)
    for i in range(n):
        keys = start + i + 1
        one = attend(q[i : i + 1], k[:, :keys], v[:, :keys], start + i, d**-0.5)
        assert torch.equal(one[0], out[i]), f"row {i}"


@needs_kernel
@DTYPES
def test_prompt_in_one_call_equals_prompt_in_chunks_bit_for_bit(
    dtype: torch.dtype, tile: str
) -> None:
    """A prompt attended in one call gives every row the bits it gets when the prompt goes in
    chunks (the scheduler chunks a prompt around other requests' rows) or row by row."""
    n, heads, kv_heads, d = 45, 12, 2, 128
    q, k, v = inputs(n, heads, kv_heads, d, 0, dtype, seed=3)
    whole = attend(q, k, v, 0, d**-0.5)
    for chunks in ([16, 16, 13], [1, 30, 14], [7] * 6 + [3]):
        start = 0
        for c in chunks:
            part = attend(
                q[start : start + c], k[:, : start + c], v[:, : start + c], start, d**-0.5
            )
            assert torch.equal(part, whole[start : start + c]), f"chunks {chunks} at {start}"
            start += c


@needs_kernel
@DTYPES
def test_causal_limit_and_first_position(dtype: torch.dtype, tile: str) -> None:
    n, heads, kv_heads, d = 4, 4, 2, 32
    q, k, v = inputs(n, heads, kv_heads, d, 0, dtype, seed=2)
    out = attend(q, k, v, 0, d**-0.5)
    # query 0 at position 0 sees only key 0: its output is v[0] of its kv head, exactly
    for h in range(heads):
        assert torch.equal(out[0, h * d : (h + 1) * d], v[h // 2, 0])
    # keys after a query's position do not move it
    k2, v2 = k.clone(), v.clone()
    k2[:, 2:] += 5
    v2[:, 2:] -= 3
    out2 = attend(q, k2, v2, 0, d**-0.5)
    assert torch.equal(out2[:2], out[:2])
    assert not torch.equal(out2[2:], out[2:])


@needs_kernel
def test_ineligible_inputs_take_the_reference() -> None:
    e = ext()
    # head_dim not a multiple of 32
    q, k, v = inputs(2, 4, 2, 16, 3, torch.float32)
    assert not e.attend_eligible(q, k, v, 3)  # type: ignore[attr-defined]
    assert torch.equal(attend(q, k, v, 3, 0.25), reference_attend(q, k, v, 3, 0.25))
    # mixed dtypes, and keys that do not end at the last query
    q, k, v = inputs(2, 4, 2, 32, 3, torch.float32)
    assert not e.attend_eligible(q.bfloat16(), k, v, 3)  # type: ignore[attr-defined]
    assert not e.attend_eligible(q, k, v, 2)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="quickdraft attend"):
        e.attend(q, k, v, 2, 0.2)  # type: ignore[attr-defined]


@needs_kernel
def test_disable_switch_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = inputs(3, 12, 2, 128, 20, torch.bfloat16)
    monkeypatch.setattr(build, "disabled", True)
    assert torch.equal(attend(q, k, v, 20, 0.1), reference_attend(q, k, v, 20, 0.1))


@needs_kernel
@DTYPES
@pytest.mark.parametrize("window", [1, 5, 8, 13, 33])
def test_sliding_window_matches_reference_and_rows_are_independent(
    window: int, dtype: torch.dtype, tile: str
) -> None:
    """A sliding-window call (a Gemma 3 local layer): each row sees its last `window` keys, as
    the masked reference computes, and row i of an n-query call equals the one-query call at
    its position bit for bit (a verify across the window's edge is what decode computes)."""
    n, heads, kv_heads, d, start = 11, 4, 1, 64, 29
    q, k, v = inputs(n, heads, kv_heads, d, start, dtype, seed=window)
    out = attend(q, k, v, start, d**-0.5, window)
    ref = reference_attend(q.float(), k.float(), v.float(), start, d**-0.5, window)
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(out.float(), ref, **tol)
    full = reference_attend(q.float(), k.float(), v.float(), start, d**-0.5)
    assert not torch.allclose(ref, full, atol=1e-3)  # the window changes the result
    for i in range(n):
        keys = start + i + 1
        one = attend(q[i : i + 1], k[:, :keys], v[:, :keys], start + i, d**-0.5, window)
        assert torch.equal(one[0], out[i]), f"row {i}"
    chunks, at = [], 0
    for size in (3, 1, 7):  # the same rows in chunks
        chunks.append(
            attend(
                q[at : at + size],
                k[:, : start + at + size],
                v[:, : start + at + size],
                start + at,
                d**-0.5,
                window,
            )
        )
        at += size
    assert torch.equal(torch.cat(chunks), out)


@needs_kernel
@DTYPES
@pytest.mark.parametrize("window", [0, 5])
def test_two_way_block_rows_see_their_block(window: int, dtype: torch.dtype, tile: str) -> None:
    """`ends` (Gemma 4's image rows): rows 3..9 of a call see keys to the block's end, on top of
    their window; they match the masked reference, every other row keeps its causal bits,
    and a block row's bits do not depend on which rows share its call (rows 3..9 and the rows
    after them, in one call or two)."""
    n, heads, kv_heads, d, start = 14, 4, 2, 64, 21
    q, k, v = inputs(n, heads, kv_heads, d, start, dtype, seed=7 + window)
    ends = torch.arange(n) + start + 1
    ends[3:10] = start + 10
    out = attend(q, k, v, start, d**-0.5, window, ends=ends)
    ref = reference_attend(q.float(), k.float(), v.float(), start, d**-0.5, window, ends=ends)
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(out.float(), ref, **tol)
    causal = attend(q, k, v, start, d**-0.5, window)
    plain = [i for i in range(n) if not 3 <= i < 9]  # row 9's block ends at itself
    assert torch.equal(out[plain], causal[plain])
    assert not torch.allclose(out[3:9].float(), causal[3:9].float(), atol=1e-3)
    tail = attend(q[3:], k, v, start + 3, d**-0.5, window, ends=ends[3:])
    assert torch.equal(tail, out[3:])
    with pytest.raises(RuntimeError, match="ends"):  # a key end before the row's own key
        attend(q, k, v, start, d**-0.5, window, ends=ends - 1)


def paged(
    cache: torch.Tensor, shared: int, block: int, layer: int, end: int, runs: int = 1
) -> tuple[list[torch.Tensor], Paged]:
    """Keys 0 .. end of `cache [layers, kv_heads, S, d]` at `layer` as the prefix cache hands
    them over: its first `shared` tokens copied out in pieces of `runs` blocks (each block a
    token range of its piece: other strides than a lone block's), the rest a view of a
    sequence's own rows (with spare room past `end`)."""
    blocks = []
    for i in range(0, shared, runs * block):
        piece = cache[:, :, i : min(i + runs * block, shared)].clone()
        blocks += [piece[:, :, j : j + block] for j in range(0, piece.shape[2], block)]
    own = cache[:, :, shared:].clone()[layer, :, : end - shared]
    return blocks, Paged(blocks, page_table(blocks), block, layer, own)


@needs_kernel
@DTYPES
@pytest.mark.parametrize(
    ("n", "heads", "kv_heads", "d", "block", "pages", "extra", "window"),
    [
        (1, 12, 2, 128, 16, 5, 7, 0),  # decode after 5 shared blocks and 7 own tokens
        (5, 12, 2, 128, 16, 3, 0, 0),  # a verify right after the shared prefix
        (9, 4, 1, 32, 8, 4, 3, 0),  # more rows than a task's block of 8
        (4, 4, 2, 256, 16, 6, 10, 20),  # a sliding window that starts inside the blocks
        (3, 6, 2, 64, 4, 1, 0, 0),  # one block of 4
    ],
)
def test_paged_keys_equal_one_tensor_bit_for_bit(
    n: int,
    heads: int,
    kv_heads: int,
    d: int,
    block: int,
    pages: int,
    extra: int,
    window: int,
    dtype: torch.dtype,
    tile: str,
) -> None:
    """Keys read in place from shared blocks (lone ones, and token ranges of larger pieces) give
    the bits of the same keys in one tensor, at every layer of the blocks, and the reference
    gathers them to the same result."""
    g = torch.Generator().manual_seed(n + d)
    shared = pages * block
    start = shared + extra
    layers = 3
    k = torch.randn(layers, kv_heads, start + n + 4, d, generator=g).to(dtype)
    v = torch.randn(layers, kv_heads, start + n + 4, d, generator=g).to(dtype)
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    for layer, runs in itertools.product(range(layers), (1, 3)):
        want = attend(q, k[layer, :, : start + n], v[layer, :, : start + n], start, 0.1, window)
        _, pk = paged(k, shared, block, layer, start + n, runs)
        _, pv = paged(v, shared, block, layer, start + n, runs)
        assert torch.equal(pk.dense(), k[layer, :, : start + n])
        assert torch.equal(attend(q, pk, pv, start, 0.1, window), want)
        ref = reference_attend(q, pk.dense(), pv.dense(), start, 0.1, window)
        torch.testing.assert_close(want.float(), ref.float(), atol=2e-2, rtol=2e-2)


@needs_kernel
def test_paged_inputs_the_kernel_refuses_are_errors() -> None:
    """Pages that do not fit the keys are refused with a message, never read out of bounds."""
    e = ext()
    q, k, v = inputs(2, 4, 2, 32, 30, torch.float32)
    _, pk = paged(torch.stack([k, k]), 16, 8, 0, 32)
    _, pv = paged(torch.stack([v, v]), 16, 8, 0, 32)
    with pytest.raises(RuntimeError, match="start \\+ n - shared"):  # own rows do not add up
        e.attend_paged(q, k, v, pk.addresses, pv.addresses, 8, 0, 30, 0.1)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="k_pages, v_pages"):  # one page table short
        e.attend_paged(  # type: ignore[attr-defined]
            q, pk.own, pv.own, pk.addresses, pv.addresses[:1], 8, 0, 30, 0.1
        )
    assert not e.attend_eligible(q, pk.own, pv.own, 30, 31)  # type: ignore[attr-defined]


@needs_kernel
def test_tiles_agree_and_a_missing_tile_is_refused() -> None:
    """Every tile this CPU runs gives the AVX2 tile's result within fp32 rounding (the sums run
    in another order); asking for a tile the CPU lacks is an error, not a crash."""
    e = ext()
    q, k, v = inputs(9, 12, 2, 128, 250, torch.float32, seed=5)
    try:
        outs = {}
        for name in cpu_tiles():
            e.attend_isa(TILES[name])  # type: ignore[attr-defined]
            outs[name] = attend(q, k, v, 250, 128**-0.5)
        for name, out in outs.items():
            torch.testing.assert_close(out, outs["avx2"], atol=2e-6, rtol=1e-5, msg=name)
        if "avx512" not in cpu_tiles():
            with pytest.raises(RuntimeError, match="lacks AVX512F"):
                e.attend_isa(1)  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="attend_isa"):
            e.attend_isa(2)  # type: ignore[attr-defined]
    finally:
        e.attend_isa(-1)  # type: ignore[attr-defined]
