"""The Triton kernels of the GPU forward (kernels/triton_ops.py) against the torch references
they replace, and the static forward on them against the model's own. Without a GPU they run
in Triton's interpreter on CPU tensors (conftest.py turns it on; it rounds fp32 -> bf16
toward zero, so there bf16 is checked to two ulps); where triton is not installed (xgrammar
pulls it in here) the module is skipped with that reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_models import random_hybrid

from quickdraft.kernels import gdn, pointwise, triton_linear, triton_ops
from quickdraft.kernels.attention import reference_attend
from quickdraft.models.families.llama import CausalLM
from quickdraft.models.formats.gguf_gpu import random_q4_k_m_
from quickdraft.models.formats.loader import load_model
from quickdraft.models.graphs import GraphModel

pytestmark = pytest.mark.skipif(
    not triton_ops.installed(), reason="needs triton (CUDA torch wheels ship it)"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    # one bf16 rounding apart; two under the interpreter (it truncates the inputs it rounds too)
    return {"atol": 1e-2, "rtol": 8e-3} if DEVICE == "cuda" else {"atol": 4e-2, "rtol": 1.6e-2}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@DTYPES
@pytest.mark.parametrize("hidden", [64, 1536, 96])
def test_add_rms_norm_is_the_reference(dtype: torch.dtype, hidden: int) -> None:
    x, delta = randn(3, hidden, dtype=dtype), randn(3, hidden, dtype=dtype, seed=1)
    w = (1 + 0.1 * randn(hidden, seed=2)).to(dtype)
    s, y = triton_ops.add_rms_norm(x, delta, w, 1e-6)
    s_ref, y_ref = pointwise.reference_add_rms_norm(x, delta, w, 1e-6)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(s, s_ref)  # the residual stream rounded exactly as torch's add
    else:  # the interpreter rounds fp32 -> bf16 toward zero (numpy has no bf16)
        torch.testing.assert_close(s, s_ref, **tol(dtype))
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    same, alone = triton_ops.add_rms_norm(x, None, w, 1e-6)
    assert same is x
    torch.testing.assert_close(alone, pointwise.reference_rms_norm(x, w, 1e-6), **tol(dtype))


@DTYPES
def test_silu_mul_is_the_reference(dtype: torch.dtype) -> None:
    gate_up = randn(4, 2 * 1500, dtype=dtype)  # not a multiple of the block: masked tail
    out = triton_ops.silu_mul(gate_up)
    torch.testing.assert_close(out, pointwise.reference_silu_mul(gate_up), **tol(dtype))


@DTYPES
def test_rope_store_rotates_q_and_writes_k_v_into_their_slots(dtype: torch.dtype) -> None:
    n, heads, kv_heads, d = 3, 4, 2, 32
    qkv = randn(n, (heads + 2 * kv_heads) * d, dtype=dtype)
    angles = torch.rand(n, d // 2, generator=torch.Generator().manual_seed(3)) * 6
    cos = torch.cat((angles.cos(),) * 2, -1).to(DEVICE)
    sin = torch.cat((angles.sin(),) * 2, -1).to(DEVICE)
    pool_k = torch.zeros(5, kv_heads, 16, d, dtype=dtype, device=DEVICE)
    pool_v = torch.zeros_like(pool_k)
    slots = torch.tensor([1, 4, 1], device=DEVICE)
    positions = torch.tensor([7, 0, 8], device=DEVICE)
    q = triton_ops.rope_store(qkv, cos, sin, heads, kv_heads, pool_k, pool_v, slots, positions)
    q_ref = pointwise.reference_rope(qkv[:, : heads * d].view(n, heads, d), cos, sin)
    k_ref = pointwise.reference_rope(
        qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d), cos, sin
    )
    v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    for row, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        torch.testing.assert_close(pool_k[slot, :, pos], k_ref[row], **tol(dtype))
        assert torch.equal(pool_v[slot, :, pos], v[row])  # a copy: exact
    written = pool_k.abs().sum(-1) > 0  # [slot, head, pos]: only the three rows' places
    assert int(written.sum()) == n * kv_heads


@DTYPES
@pytest.mark.parametrize("groups", [6, 1, 3], ids=lambda g: f"groups{g}")
def test_slot_attention_is_the_reference_per_sequence(dtype: torch.dtype, groups: int) -> None:
    """Two sequences of 3 padded rows in slots 2 and 0 (the second with 2 real rows, its
    third padded at position 0), 130 and 9 keys: each real row equals `reference_attend` over
    its own sequence's keys 0 .. its position."""
    kv_heads, d, rows = 2, 32, 3
    heads = kv_heads * groups
    pool_k = randn(4, kv_heads, 256, d, dtype=dtype, seed=4)
    pool_v = randn(4, kv_heads, 256, d, dtype=dtype, seed=5)
    q = randn(2 * rows, heads, d, dtype=dtype, seed=6)
    seq_slot = torch.tensor([2, 0], device=DEVICE)
    row_pos = torch.tensor([127, 128, 129, 7, 8, 0], device=DEVICE)
    out = triton_ops.slot_attention(q, pool_k, pool_v, seq_slot, row_pos, rows, d**-0.5)
    for b, slot, start, n in ((0, 2, 127, 3), (1, 0, 7, 2)):
        keys, values = pool_k[slot, :, : start + n], pool_v[slot, :, : start + n]
        mine = q[b * rows : b * rows + n]
        ref = reference_attend(mine, keys, values, start, d**-0.5)
        torch.testing.assert_close(out[b * rows : b * rows + n], ref, **tol(dtype))


def test_split_attention_is_the_reference_and_short_rows_keep_their_bits() -> None:
    """Keys split over programs (`split`, long contexts): rows of 3,000 and 2,100 keys (3 and
    3 ranges) equal `reference_attend` over their sequence; a row of <= SPLIT_KEYS keys gets
    the single kernel's bits; a row's result alone equals its result among the others."""
    kv_heads, groups, d = 2, 3, 32
    heads = kv_heads * groups
    pool_k = randn(3, kv_heads, 3072, d, seed=11)
    pool_v = randn(3, kv_heads, 3072, d, seed=12)
    q = randn(4, heads, d, seed=13)
    seq_slot = torch.tensor([1, 0, 2, 1], device=DEVICE)
    row_pos = torch.tensor([2999, 2099, 1023, 10], device=DEVICE)
    out = triton_ops.slot_attention(q, pool_k, pool_v, seq_slot, row_pos, 1, d**-0.5, True)
    for r in range(4):
        slot, last = int(seq_slot[r]), int(row_pos[r])
        keys, values = pool_k[slot, :, : last + 1], pool_v[slot, :, : last + 1]
        ref = reference_attend(q[r : r + 1], keys, values, last, d**-0.5)
        torch.testing.assert_close(out[r : r + 1], ref, atol=1e-5, rtol=1e-5)
    single = triton_ops.slot_attention(q, pool_k, pool_v, seq_slot, row_pos, 1, d**-0.5)
    assert torch.equal(out[2:], single[2:])  # one range: the single kernel's bits
    assert not torch.equal(out[:1], single[:1])  # three ranges: merged in another order
    alone = triton_ops.slot_attention(
        q[:1], pool_k, pool_v, seq_slot[:1], row_pos[:1], 1, d**-0.5, True
    )
    assert torch.equal(alone, out[:1])


def test_static_forward_on_the_kernels_equals_the_model(tiny_model_dir: Path) -> None:
    """Prefill of two sequences, then a packed verify of 4 and 3 rows: the forward on the
    Triton kernels gives the torch ops' logits (fp32)."""
    model = load_model(tiny_model_dir, torch.float32, DEVICE)
    assert isinstance(model, CausalLM)
    ids = torch.arange(3, 40, device=DEVICE)
    rows = torch.arange(7, device=DEVICE)
    logits = []
    for fused in (True, False):
        static = GraphModel(model, graphs=False, fused=fused)
        caches = [static.new_cache(64), static.new_cache(64)]
        static(ids[:30], caches, [20, 10])
        for cache, n in zip(caches, (20, 10), strict=True):
            cache.commit(n)
        logits.append(static(ids[30:], caches, [4, 3], rows).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_long_context_forward_splits_keys_and_keeps_rows_invariant(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past SPLIT_KEYS (lowered to 64 here) the static forward splits each row's keys: a
    4-row verify gives the torch path's logits, and (on GGUF weights, whose GEMMs are
    batch-invariant too) each row the bits of its decode step."""
    monkeypatch.setattr(triton_ops, "SPLIT_KEYS", 64)
    model = load_model(tiny_model_dir, torch.float32, DEVICE)
    assert isinstance(model, CausalLM)
    random_q4_k_m_(model, seed=5)
    ids = torch.arange(300, device=DEVICE) % 250 + 3
    rows = torch.arange(4, device=DEVICE)
    static = GraphModel(model, graphs=False, fused=False)
    cache = static.new_cache(512)
    static(ids[:290], [cache], [290])  # the prompt on torch's ops (quick in the interpreter)
    cache.commit(290)
    torch_ops = static(ids[290:294], [cache], [4], rows).logits
    static.use_kernels(True)
    calls = []
    real = triton_ops.slot_attention
    monkeypatch.setattr(triton_ops, "slot_attention", lambda *a: calls.append(a[-1]) or real(*a))
    verify = static(ids[290:294], [cache], [4], rows).logits
    assert calls and all(calls)  # every layer split its keys
    torch.testing.assert_close(verify, torch_ops, atol=1e-4, rtol=1e-4)
    for j in range(4):
        step = static(ids[290 + j : 291 + j], [cache], [1]).logits[-1]
        cache.commit(291 + j)
        assert torch.equal(step, verify[j]), f"row {j}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_invariant_linear_is_the_gemm_and_a_rows_bits_are_its_own(dtype: torch.dtype) -> None:
    """triton_linear: x @ w.T + bias to the dtype's rounding (K = 200: a partial block), and
    row 2's bits the same at M = 1, 5, 33, 100 (cuBLAS's are not)."""
    w, bias = randn(70, 200, dtype=dtype, seed=14), randn(70, dtype=dtype, seed=15)
    x = randn(100, 200, dtype=dtype, seed=16)
    out = triton_linear.linear(x, w, bias)
    ref = (x.float() @ w.float().T + bias.float()).to(dtype)
    torch.testing.assert_close(out, ref, **tol(torch.bfloat16))
    alone = triton_linear.linear(x[2:3], w, bias)
    for m in (*range(3, 17), 33, 100):
        assert torch.equal(triton_linear.linear(x[:m], w, bias)[2:3], alone), m


def test_bf16_forward_on_invariant_gemms_gives_each_verify_row_its_decode_bits(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model behind GraphModel with every GEMM on triton_linear (as `project` routes
    them on a GPU): a 5-row verify's rows are its decode steps' bits, and its logits the
    model's own up to bf16 rounding."""
    monkeypatch.setattr(triton_linear, "FORCE", True)
    model = load_model(tiny_model_dir, torch.bfloat16, DEVICE)
    assert isinstance(model, CausalLM)
    static = GraphModel(model, graphs=False, fused=True)
    ids = torch.arange(3, 40, device=DEVICE)
    rows = torch.arange(5, device=DEVICE)
    cache = static.new_cache(64)
    static(ids[:30], [cache], [30])
    cache.commit(30)
    verify = static(ids[30:35], [cache], [5], rows).logits
    for j in range(5):
        step = static(ids[30 + j : 31 + j], [cache], [1]).logits[-1]
        cache.commit(31 + j)
        assert torch.equal(step, verify[j]), f"row {j}"
    monkeypatch.setattr(triton_linear, "FORCE", False)
    own = model.new_cache(64)
    model(ids[:30], [own], [30])
    own.commit(30)
    theirs = model(ids[30:35], [own], [5], logit_rows=rows).logits
    torch.testing.assert_close(verify, theirs, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("t_len", [1, 5])
@pytest.mark.parametrize("k_heads", [2, 1])
def test_gdn_delta_and_advance_are_the_reference(t_len: int, k_heads: int) -> None:
    """The Gated DeltaNet recurrence of a decode step (1 token) and a verify (5), with 2 value
    heads per key head or 1: outputs, updates and the advanced state against kernels/gdn.py's
    torch functions."""
    heads, dk, dv = 2, 16, 64
    y = randn(t_len, 2 * k_heads * dk + heads * dv, seed=7)
    g = -torch.rand(t_len, heads, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    beta = torch.rand(t_len, heads, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    state = 0.1 * randn(heads, dk, dv, seed=10)
    out, k, d = triton_ops.gdn_delta(y, g, beta, state, k_heads)
    ref_out, ref = gdn.reference_recurrent_updates(y, g, beta, state, k_heads)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(k, ref.k, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(d, ref.d, atol=1e-5, rtol=1e-4)
    for m in range(1, t_len + 1):  # the state after each token
        mine, theirs = state.clone(), state.clone()
        triton_ops.gdn_advance(mine, k, d, ref.g[:, :m])
        for j in range(m):
            theirs.mul_(ref.g[:, j].exp()[:, None, None]).add_(
                ref.k[:, j, :, None] * ref.d[:, j, None, :]
            )
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


def test_hybrid_forward_on_the_gdn_kernels_equals_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A random Qwen3-Next model through prefill, a verify of 4 rows keeping 2 (the rollback
    commits 2 of the kernel's updates), then a decode step: logits on the Triton recurrence
    (routed as on a GPU) equal the torch functions'."""
    monkeypatch.setattr(gdn, "extension", lambda: None)  # no C++ path: torch or Triton
    calls = {"gdn_delta": 0, "gdn_advance": 0}
    for name in calls:
        kernel = getattr(triton_ops, name)

        def counted(*args: Any, name: str = name, kernel: Any = kernel) -> Any:
            calls[name] += 1
            return kernel(*args)

        monkeypatch.setattr(triton_ops, name, counted)
    logits = []
    for on in (True, False):
        monkeypatch.setattr(triton_ops, "available", lambda x, on=on: on)
        model = random_hybrid("qwen3_next", seed=1)
        cache = model.new_cache(64)
        ids = torch.arange(5, 40)
        steps = []
        for chunk, keep in ((ids[:20], 20), (ids[20:24], 2), (ids[24:25], 1)):
            n = len(chunk)
            out = model(chunk, [cache], [n], logit_rows=torch.arange(n))
            cache.commit(cache.length + keep)
            steps.append(out.logits)
        logits.append(torch.cat(steps))
        if on:  # the kernels ran: every GDN layer, every forward, and the commits
            assert calls["gdn_delta"] > 0 and calls["gdn_advance"] > 0, calls
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_a_rows_bits_do_not_depend_on_the_other_rows() -> None:
    """Batch invariance: each kernel gives row 2 of a 5-row call the bits it gives that row
    alone (every program reads its own row; the GEMMs between them are cuBLAS's, which are
    not invariant: docs/gpu.md)."""
    dtype = torch.bfloat16
    x, delta = randn(5, 96, dtype=dtype), randn(5, 96, dtype=dtype, seed=1)
    w = randn(96, dtype=dtype, seed=2)
    both = triton_ops.add_rms_norm(x, delta, w, 1e-6)
    alone = triton_ops.add_rms_norm(x[2:3], delta[2:3], w, 1e-6)
    assert all(torch.equal(b[2:3], a) for b, a in zip(both, alone, strict=True))
    gate_up = randn(5, 2 * 80, dtype=dtype, seed=3)
    assert torch.equal(triton_ops.silu_mul(gate_up)[2:3], triton_ops.silu_mul(gate_up[2:3]))
    pool_k, pool_v = randn(3, 2, 64, 32, dtype=dtype, seed=4), randn(3, 2, 64, 32, dtype=dtype)
    q = randn(5, 4, 32, dtype=dtype, seed=5)
    slots, pos = torch.tensor([1], device=DEVICE), torch.tensor([40, 41, 42, 43, 44], device=DEVICE)
    rows = triton_ops.slot_attention(q, pool_k, pool_v, slots, pos, 5, 0.2)
    row = triton_ops.slot_attention(q[2:3], pool_k, pool_v, slots, pos[2:3], 1, 0.2)
    assert torch.equal(rows[2:3], row)
