"""Gated DeltaNet math (kernels/gdn.py): the chunked form against the naive recurrence, on
outputs AND on the state after every token, from a non-zero starting state, for lengths around
the chunk size; both against transformers' reference functions; the causal conv carried across
calls against one full convolution; the C++ delta rule and conv (gdn_ops.cpp) against their
torch references and the naive recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)

from quickdraft.kernels import build
from quickdraft.kernels.gdn import (
    DeltaUpdates,
    advance_state,
    causal_conv1d,
    conv_window,
    delta_rule_updates,
    gated_delta_rule_chunked,
    gated_delta_rule_naive,
    gates,
    long_forward,
    prepare_qk,
    recurrent_updates,
    reference_causal_conv1d,
    reference_gates,
    reference_recurrent_updates,
)

K_HEADS, V_HEADS, DK, DV = 2, 4, 16, 8  # two value heads per key head, as in Qwen3-Next


def inputs(t: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = prepare_qk(
        torch.randn(t, K_HEADS, DK, generator=gen),
        torch.randn(t, K_HEADS, DK, generator=gen),
        V_HEADS,
    )
    v = torch.randn(t, V_HEADS, DV, generator=gen)
    g = -2.0 * torch.rand(t, V_HEADS, generator=gen)  # log decay
    beta = torch.rand(t, V_HEADS, generator=gen)
    state = torch.randn(V_HEADS, DK, DV, generator=gen)
    return q, k, v, g, beta, state


def slots(t: int) -> list[torch.Tensor | None]:
    return [torch.full((V_HEADS, DK, DV), float("nan")) for _ in range(t)]


@pytest.mark.parametrize(
    ("t", "chunk"),
    [(1, 16), (2, 16), (5, 16), (15, 16), (16, 16), (17, 16), (40, 16), (63, 64), (65, 64)],
    ids=lambda x: str(x),
)
def test_gdn_chunked_matches_naive_outputs_and_states(t: int, chunk: int) -> None:
    q, k, v, g, beta, state = inputs(t, seed=t)
    before = state.clone()
    naive_states, chunk_states = slots(t), slots(t)
    out_naive = gated_delta_rule_naive(q, k, v, g, beta, state, naive_states)
    out_chunk = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_states, chunk)
    assert (out_naive - out_chunk).abs().max().item() < 1e-5
    for a, b in zip(naive_states, chunk_states, strict=True):
        assert a is not None and b is not None
        assert (a - b).abs().max().item() < 1e-5
    assert torch.equal(state, before), "the committed state is read only"


def test_gdn_chunked_writes_only_requested_states() -> None:
    t = 20
    q, k, v, g, beta, state = inputs(t, seed=3)
    every = slots(t)
    gated_delta_rule_naive(q, k, v, g, beta, state, every)
    final_only: list[torch.Tensor | None] = [None] * (t - 1) + [torch.empty(V_HEADS, DK, DV)]
    gated_delta_rule_chunked(q, k, v, g, beta, state, final_only, chunk_size=8)
    assert final_only[-1] is not None and every[-1] is not None
    assert (final_only[-1] - every[-1]).abs().max().item() < 1e-5


def test_gdn_matches_transformers_reference() -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    t = 23
    gen = torch.Generator().manual_seed(7)
    q_raw = torch.randn(1, t, K_HEADS, DK, generator=gen)
    k_raw = torch.randn(1, t, K_HEADS, DK, generator=gen)
    v = torch.randn(1, t, V_HEADS, DV, generator=gen)
    g = -torch.rand(1, t, V_HEADS, generator=gen)
    beta = torch.rand(1, t, V_HEADS, generator=gen)
    state = torch.randn(1, V_HEADS, DK, DV, generator=gen)
    q, k = prepare_qk(q_raw[0], k_raw[0], V_HEADS)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, ref_state = torch_chunk_gated_delta_rule(q_raw, k_raw, v, g, beta, 8, None, **kw)
    dest: list[torch.Tensor | None] = [None] * (t - 1) + [torch.empty(V_HEADS, DK, DV)]
    out = gated_delta_rule_chunked(q, k, v[0], g[0], beta[0], torch.zeros_like(state[0]), dest, 8)
    assert dest[-1] is not None
    assert (out - ref[0]).abs().max().item() < 1e-5
    assert (dest[-1] - ref_state[0]).abs().max().item() < 1e-5
    # from a given state (what a verify continues from), against the recurrent reference
    ref, ref_state = torch_recurrent_gated_delta_rule(q_raw, k_raw, v, g, beta, state, **kw)
    out = gated_delta_rule_chunked(q, k, v[0], g[0], beta[0], state[0], dest, 8)
    assert (out - ref[0]).abs().max().item() < 1e-5
    assert (dest[-1] - ref_state[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("t", [1, 2, 9])
def test_delta_rule_updates_reach_every_state(t: int) -> None:
    """A verify's kept updates: applying the first m of them to the starting state gives the
    naive state after token m - 1, for every m; outputs match too."""
    q, k, v, g, beta, state = inputs(t, seed=5)
    naive_states = slots(t)
    out_naive = gated_delta_rule_naive(q, k, v, g, beta, state, naive_states)
    out, updates = delta_rule_updates(q, k, v, g, beta, state)
    assert (out - out_naive).abs().max().item() < 1e-5
    for m in range(1, t + 1):
        s = state.clone()
        advance_state(s, updates.k[:, :m], updates.d[:, :m], updates.g[:, :m])
        expected = naive_states[m - 1]
        assert expected is not None
        assert (s - expected).abs().max().item() < 1e-5, m


def test_causal_conv1d_carried_window_matches_full_conv() -> None:
    """Split into calls of 1, 3, 7 and 13 tokens, each starting from the previous call's
    window, the conv equals one zero-padded causal conv; windows hold the last K-1 inputs."""
    gen = torch.Generator().manual_seed(0)
    channels, taps, t = 12, 4, 24
    x = torch.randn(t, channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    full = F.silu(F.conv1d(x.T[None], weight[:, None], padding=taps - 1, groups=channels))
    full = full[0, :, :t].T  # [T, C]
    window = torch.zeros(taps - 1, channels)
    outs, start = [], 0
    for n in (1, 3, 7, 13):
        outs.append(causal_conv1d(x[start : start + n], window, weight))
        window = conv_window(window, x[start : start + n])
        start += n
        assert torch.equal(
            window,
            x[start - (taps - 1) : start]
            if start >= taps - 1
            else torch.cat([torch.zeros(taps - 1 - start, channels), x[:start]]),
        )
    assert (torch.cat(outs) - full).abs().max().item() < 1e-5


needs_kernel = pytest.mark.skipif(
    not build.cpu_supported(), reason="CPU lacks AVX2/FMA/F16C: the kernel cannot run here"
)


@needs_kernel
@pytest.mark.parametrize("t", [1, 2, 5, 6, 11, 33])
@pytest.mark.parametrize(
    "dims", [(K_HEADS, V_HEADS, DK, DV), (2, 2, 32, 32), (1, 2, 16, 16)], ids=str
)
@pytest.mark.parametrize("threads", [1, 2])
def test_recurrent_updates_kernel_matches_naive(
    t: int, dims: tuple[int, int, int, int], threads: int
) -> None:
    """The C++ delta rule (gdn_ops.cpp) from the conv output: outputs, updates and, through
    advance_state, the state after every token against the naive recurrence and the torch
    reference; the starting state is left untouched."""
    k_heads, v_heads, dk, dv = dims
    gen = torch.Generator().manual_seed(t * 7 + dk)
    y = torch.randn(t, 2 * k_heads * dk + v_heads * dv, generator=gen)
    g = -2.0 * torch.rand(t, v_heads, generator=gen)
    beta = torch.rand(t, v_heads, generator=gen)
    state = torch.randn(v_heads, dk, dv, generator=gen)
    before = state.clone()
    assert build.kernels_available()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, upd = recurrent_updates(y, g, beta, state, k_heads)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(state, before)
    ref_out, ref = reference_recurrent_updates(y, g, beta, state, k_heads)
    kd = k_heads * dk
    q, k = prepare_qk(
        y[:, :kd].view(t, k_heads, dk), y[:, kd : 2 * kd].view(t, k_heads, dk), v_heads
    )
    naive_states = [torch.empty(v_heads, dk, dv) for _ in range(t)]
    v = y[:, 2 * kd :].view(t, v_heads, dv)
    out_naive = gated_delta_rule_naive(q, k, v, g, beta, state, naive_states)
    assert (out - out_naive).abs().max().item() < 1e-5
    assert (out - ref_out).abs().max().item() < 1e-5
    for name in ("k", "d", "g"):
        assert (getattr(upd, name) - getattr(ref, name)).abs().max().item() < 1e-5, name
    for m in range(1, t + 1):
        s = state.clone()
        advance_state(s, upd.k[:, :m], upd.d[:, :m], upd.g[:, :m])
        assert (s - naive_states[m - 1]).abs().max().item() < 1e-5, m


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("taps", [4, 3])  # 4: the transposed-tap load; 3: the generic one
@pytest.mark.parametrize("t", [1, 5])
def test_causal_conv1d_kernel_matches_reference(t: int, taps: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(t + taps)
    channels = 28  # not a multiple of 8: the scalar tail runs too
    proj = torch.randn(t, channels + 9, generator=gen).to(dtype)
    x = proj[:, 3 : 3 + channels]  # a strided view, as the GDN's slice of its in-projection
    window = torch.randn(taps - 1, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, taps, generator=gen).to(dtype)
    assert build.kernels_available()
    out = causal_conv1d(x, window, weight)
    assert out.dtype == torch.float32 and out.shape == (t, channels)
    ref = reference_causal_conv1d(x, window, weight)
    assert (out - ref).abs().max().item() < 1e-5


@needs_kernel
@pytest.mark.parametrize("t", [2, 5, 9, 33])
@pytest.mark.parametrize("dims", [(K_HEADS, V_HEADS, DK, DV), (2, 4, 128, 128)], ids=str)
def test_recurrent_updates_verify_equals_decode_steps_bitwise(
    t: int, dims: tuple[int, int, int, int]
) -> None:
    """Batch invariance of the C++ delta rule: token i of a t-token call (a verify) gives the
    bits of a one-token call (a decode step) from the state that i decode steps commit, one at
    a time, through advance_state; and committing m kept updates at once gives the bits of m
    one-token commits."""
    k_heads, v_heads, dk, dv = dims
    gen = torch.Generator().manual_seed(t + dk)
    y = torch.randn(t, 2 * k_heads * dk + v_heads * dv, generator=gen)
    g = -2.0 * torch.rand(t, v_heads, generator=gen)
    beta = torch.rand(t, v_heads, generator=gen)
    state = torch.randn(v_heads, dk, dv, generator=gen)
    out, upd = recurrent_updates(y, g, beta, state, k_heads)
    s = state.clone()
    for i in range(t):
        one, step = recurrent_updates(y[i : i + 1], g[i : i + 1], beta[i : i + 1], s, k_heads)
        assert torch.equal(one[0], out[i]), f"token {i}: output"
        assert torch.equal(step.d[:, 0], upd.d[:, i]), f"token {i}: correction"
        advance_state(s, step.k, step.d, step.g)
        at_once = state.clone()
        advance_state(at_once, upd.k[:, : i + 1], upd.d[:, : i + 1], upd.g[:, : i + 1])
        assert torch.equal(at_once, s), f"state after {i + 1} tokens"


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("t,m", [(1, 1), (1, 4), (3, 2), (5, 0)], ids=str)
@pytest.mark.parametrize("dims", [(K_HEADS, V_HEADS, DK, DV), (2, 4, 128, 128)], ids=str)
def test_recurrent_updates_with_pending_equals_advance_then_read(
    t: int, m: int, dims: tuple[int, int, int, int], kernel: bool
) -> None:
    """Pending kept updates applied inside recurrent_updates (the kernel's one pass over the
    state) give the bits of advance_state followed by recurrent_updates: outputs, updates and
    the advanced state."""
    if kernel and not build.kernels_available():
        pytest.skip("the C++ extension did not build or cannot run here")
    k_heads, v_heads, dk, dv = dims
    gen = torch.Generator().manual_seed(t + 10 * m + dk)
    y = torch.randn(t + m, 2 * k_heads * dk + v_heads * dv, generator=gen)
    g = -2.0 * torch.rand(t + m, v_heads, generator=gen)
    beta = torch.rand(t + m, v_heads, generator=gen)
    state = torch.randn(v_heads, dk, dv, generator=gen)
    disabled = build.disabled
    build.disabled = not kernel
    try:
        kept = (  # the last forward's kept updates (none: m = 0)
            recurrent_updates(y[:m], g[:m], beta[:m], state, k_heads)[1]
            if m
            else DeltaUpdates(torch.empty(v_heads, 0, dk), torch.empty(v_heads, 0, dv), g[:0].T)
        )
        separate = state.clone()
        advance_state(separate, kept.k, kept.d, kept.g)
        out, upd = recurrent_updates(y[m:], g[m:], beta[m:], separate, k_heads)
        fused = state.clone()
        out2, upd2 = recurrent_updates(y[m:], g[m:], beta[m:], fused, k_heads, kept)
    finally:
        build.disabled = disabled
    assert torch.equal(fused, separate)
    assert torch.equal(out2, out)
    assert torch.equal(upd2.k, upd.k) and torch.equal(upd2.d, upd.d) and torch.equal(upd2.g, upd.g)


@needs_kernel
@pytest.mark.parametrize(
    ("t", "shape"),
    [
        (34, (2, 4, 32, 32)),
        (64, (2, 4, 32, 32)),
        (150, (2, 4, 32, 32)),
        (1, (2, 4, 32, 32)),
        (70, (2, 4, 128, 128)),
        (33, (1, 3, 16, 24)),
        (20, (2, 2, 16, 48)),
    ],
)
def test_long_forward_equals_decode_steps_bitwise(t: int, shape: tuple[int, ...]) -> None:
    """A prompt chunk through long_forward (gdn_prefill: the state stepped in place, each
    step reading the next token's S^T k, S^T q as it writes): every output and the final state
    equal t decode steps' (one-token recurrent_updates, each committed by advance_state), bit
    for bit; the real head size (128 x 128), and dv taking each column block (32, 16, 8)."""
    k_heads, v_heads, dk, dv = shape
    gen = torch.Generator().manual_seed(t)
    y = torch.randn(t, 2 * k_heads * dk + v_heads * dv, generator=gen)
    g = -2.0 * torch.rand(t, v_heads, generator=gen)
    beta = torch.rand(t, v_heads, generator=gen)
    state = torch.randn(v_heads, dk, dv, generator=gen)
    before = state.clone()
    final = torch.empty_like(state)
    out = long_forward(y, g, beta, state, final, k_heads)
    assert torch.equal(state, before)
    s = state.clone()
    for i in range(t):
        one, step = recurrent_updates(y[i : i + 1], g[i : i + 1], beta[i : i + 1], s, k_heads)
        assert torch.equal(one[0], out[i]), f"token {i}"
        advance_state(s, step.k, step.d, step.g)
    assert torch.equal(final, s)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gates_match_reference(dtype: torch.dtype) -> None:
    """The decay / beta op against torch's softplus and sigmoid, including softplus's
    pass-through past 20 and saturated sigmoids."""
    gen = torch.Generator().manual_seed(4)
    a = (torch.randn(7, 12, generator=gen) * 8).to(dtype)
    b = (torch.randn(7, 12, generator=gen) * 8).to(dtype)
    a[0, 0], b[0, 1] = 60.0, -120.0
    a_log, dt_bias = torch.randn(12, generator=gen).to(dtype), torch.randn(12, generator=gen)
    g, beta = gates(a, b, a_log, dt_bias)
    g_ref, beta_ref = reference_gates(a, b, a_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == (7, 12)
    torch.testing.assert_close(g, g_ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(beta, beta_ref, rtol=2e-6, atol=1e-6)
