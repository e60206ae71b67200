"""Gated DeltaNet math (Qwen3-Next / Qwen3.5 linear-attention layers), one sequence at a time.

Stage: inside a GDN layer's forward (models/families/qwen3_next.py), between the input projections
and the gated output norm. The state of a sequence is its conv window (the last K-1 conv inputs) and
its delta-rule state S [H, dk, dv]; every function here reads the committed state and never writes
it (a rejected draft must cost nothing):

  gates(a, b [T, H], A_log, dt_bias [H]) -> g (log decay), beta [T, H] fp32
  causal_conv1d(x [T, C], window [K-1, C], weight [C, K]) -> silu(conv) [T, C] fp32
      (the C++ kernel, gdn_ops.cpp, when it can run; else reference_causal_conv1d)
  conv_window(window, x) -> the window after the inputs x
  q, k [T, H, dk] (L2-normalised, q also scaled by dk^-0.5: `prepare_qk`), v [T, H, dv],
  g [T, H] log decay (<= 0), beta [T, H], state [H, dk, dv] fp32. Per token (all fp32):
      S = exp(g) S;  d = beta (v - S^T k);  S += k d^T;  out = S^T q
  gated_delta_rule_naive(..., state, dest) -> out [T, H, dv]; dest[t] <- S after token t.
      The recurrence token by token: the reference.
  gated_delta_rule_chunked(..., state, dest, chunk_size) -> the same, parallel within chunks
      (UT transform, as flash-linear-attention and transformers' torch_chunk_gated_delta_rule)
      and sequential across them; long forwards take it when the kernels cannot run.
  delta_rule_updates(..., state) -> out, DeltaUpdates(k, d, g): one chunk (a decode step or
      a verify) whose per-token updates are kept instead of per-token states, and
  advance_state(state, updates[:m]) applies the first m of them in place, token by token:
      S_j = exp(g_j) S_{j-1} + k_j d_j^T.
      The state after any token of a verify costs k + d (a few KB) to keep, not S (MBs):
      state_cache.py commits by remembering m and applies the updates at the next forward, in
      one pass over the state.
  recurrent_updates(y [T, C] conv output, g, beta, state, k_heads) -> out, DeltaUpdates:
      prepare_qk + delta_rule_updates in one C++ call (gdn_delta.cpp), which runs the recurrence
      token by token and builds each token's state with the very code advance_state's kernel
      (gdn_advance) commits with: a verify's rows equal decode steps' bit for bit (batch
      invariance). The torch functions are its reference and its fallback (no extension),
      which is not batch-invariant (its verify takes the chunk form).
  long_forward(y, g, beta, state, final, k_heads) -> out; final <- the state after the last
      token: a prompt chunk of any length, by the C++ kernel gdn_prefill (final advanced in
      place token by token, one pass over it a token) or on a GPU through recurrent_updates +
      advance_state per CHUNK_SIZE tokens (the same bits as decode steps), else the chunk form.
On a GPU where triton runs, `recurrent_updates` and `advance_state` are kernels/triton_ops.py's
gdn_delta and gdn_advance (token by token too, so long_forward takes the same chunk loop).
Unlike transformers, every multi-token path starts from the given state (a verify continues
the committed state). tests/test_gdn.py checks outputs and states of every path against the
naive form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.kernels import triton_ops
from quickdraft.kernels.build import extension

CHUNK_SIZE = 64


def prepare_qk(q: Tensor, k: Tensor, num_v_heads: int) -> tuple[Tensor, Tensor]:
    """fp32, L2-normalise over the head dim (eps as FLA / transformers), scale q by dk^-0.5,
    and repeat each key head for the value heads it serves: [T, Hk, dk] -> [T, Hv, dk]."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    group = num_v_heads // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q, k


def gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """The delta rule's per-token gates from the in-projection's a, b [N, H]: log decay
    g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), fp32 [N, H]. The C++ op on the
    CPU computes every element with the same scalar code wherever it sits (torch's elementwise
    kernels take a vector path or a scalar tail by position, which made a token's gates, and so
    the state, differ between a decode step and a verify); else `reference_gates`."""
    fast = (
        a.is_cpu
        and a.dim() == 2
        and a.dtype in (torch.bfloat16, torch.float32)
        and b.dtype == a.dtype
        and not (torch.is_grad_enabled() and a.requires_grad)
    )
    ext = extension() if fast else None
    if ext is None:
        return reference_gates(a, b, a_log, dt_bias)
    g, beta = ext.gdn_gates(a, b, a_log.float(), dt_bias.float())
    return g, beta


def reference_gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """`gates` in torch ops."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def causal_conv1d(
    x: Tensor,  # [T, C] new inputs
    window: Tensor,  # [K-1, C] the inputs before them (zeros at the start of a sequence)
    weight: Tensor,  # [C, K] depthwise taps, oldest first (HF conv1d.weight[:, 0])
) -> Tensor:
    """SiLU(causal depthwise conv) of the new inputs, in fp32 `[T, C]`: one C++ pass on the
    CPU (a decode step's conv is ~8 torch ops), else `reference_causal_conv1d`."""
    fast = (
        x.is_cpu
        and x.dim() == 2
        and x.stride(-1) == 1
        and x.dtype in (torch.bfloat16, torch.float32)
        and window.dtype == x.dtype
        and weight.dtype in (torch.bfloat16, torch.float32)
        and not (torch.is_grad_enabled() and x.requires_grad)
    )
    ext = extension() if fast else None
    if ext is None:
        return reference_causal_conv1d(x, window, weight)
    out: Tensor = ext.causal_conv_silu(x, window, weight)
    return out


def reference_causal_conv1d(x: Tensor, window: Tensor, weight: Tensor) -> Tensor:
    """`causal_conv1d` in torch ops (the reference)."""
    t_new, taps = x.shape[0], weight.shape[1]
    xx = torch.cat([window.to(x.dtype), x]).float()  # [K-1+T, C]
    w = weight.float()
    out = xx[0:t_new] * w[:, 0]
    for i in range(1, taps):
        out = out.addcmul_(xx[i : i + t_new], w[:, i])
    return F.silu(out)


def conv_window(window: Tensor, x: Tensor) -> Tensor:
    """The conv window after inputs x [T, C]: the last K-1 rows of [window ; x]."""
    return torch.cat([window, x.to(window.dtype)])[-window.shape[0] :]


def gated_delta_rule_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,  # [H, dk, dv] fp32, read only
    dest: Sequence[Tensor | None],
) -> Tensor:
    """The recurrence, token by token (reference; also the one-token decode path)."""
    t_len, heads, dv = v.shape
    out = torch.empty(t_len, heads, dv, dtype=torch.float32, device=v.device)
    s = state
    v, g, beta = v.float(), g.float(), beta.float()
    for t in range(t_len):
        target = dest[t]
        decayed = s * g[t].exp()[:, None, None]  # [H, dk, dv]
        kv_mem = torch.bmm(k[t, :, None, :], decayed)[:, 0]  # k^T S: [H, dv]
        delta = (v[t] - kv_mem) * beta[t, :, None]  # [H, dv]
        # S' = decayed + k delta^T, written straight into its checkpoint slot when it has one
        s = torch.baddbmm(decayed, k[t, :, :, None], delta[:, None, :], out=target)
        out[t] = torch.bmm(q[t, :, None, :], s)[:, 0]
    return out


def _chunk_terms(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, size: int
) -> tuple[Tensor, ...]:
    """Intra-chunk quantities, [H, n_chunks, size, ...] fp32 (zero padded to whole chunks:
    padded tokens have k = v = 0, beta = 0, g = 0 and leave the state unchanged)."""
    t_len, heads, dv = v.shape
    pad = (-t_len) % size
    n_chunks = (t_len + pad) // size

    def chunks(x: Tensor) -> Tensor:  # [T, H, ...] -> [H, n, size, ...]
        x = x.float().transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(heads, n_chunks, size, *x.shape[2:])

    qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    cum = gc.cumsum(-1)  # [H, n, size] log decay from the chunk start through token i
    cum_exp = cum.exp()
    # decay[i, j] = exp(c_i - c_j) for j <= i, else 0 (c falls with i: only j > i is clamped)
    decay = (cum[..., :, None] - cum[..., None, :]).clamp_(max=0.0).exp_().tril_()
    k_beta = kc * bc[..., None]
    # (I + strictly_lower(diag(beta) K K^T * decay)) [u | w] = [beta v | beta exp(c) k]
    system = (k_beta @ kc.transpose(-1, -2)).mul_(decay)  # [H, n, size, size]
    rhs = torch.cat([vc * bc[..., None], k_beta * cum_exp[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]  # [H, n, size, dv], [H, n, size, dk]
    intra = (qc @ kc.transpose(-1, -2)).mul_(decay)  # [H, n, size, size]
    q_decayed = qc * cum_exp[..., None]
    # With S_0 the chunk's starting state: d = u - w S_0 (the corrections d_j of the
    # recurrence) and out = q_decayed S_0 + intra d.
    return kc, cum, decay, u, w, intra, q_decayed


def gated_delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,  # [H, dk, dv] fp32, read only
    dest: Sequence[Tensor | None],
    chunk_size: int = CHUNK_SIZE,
) -> Tensor:
    """The same recurrence, parallel within chunks of `chunk_size` tokens (sequential across
    them). A sequence shorter than a chunk is one chunk of its own length (no padding)."""
    t_len, heads, dv = v.shape
    size = min(chunk_size, t_len)
    kc, cum, decay, u, w, intra, q_decayed = _chunk_terms(q, k, v, g, beta, size)
    n_chunks = kc.shape[1]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]  # decay from token j to chunk end
    out = torch.empty(heads, n_chunks, size, dv, dtype=torch.float32, device=q.device)
    s = state
    for c in range(n_chunks):
        d = u[:, c] - w[:, c] @ s  # [H, size, dv]
        out[:, c] = q_decayed[:, c] @ s + intra[:, c] @ d
        last = min((c + 1) * size, t_len) - 1  # the last real token of this chunk
        for t in range(c * size, last):  # states inside the chunk, only where asked for
            target = dest[t]
            if target is not None:
                i = t - c * size
                k_w = (kc[:, c] * decay[:, c, i, :, None]).transpose(-1, -2)  # [H, dk, size]
                torch.baddbmm(s * cum[:, c, i, None, None].exp(), k_w, d, out=target)
        end = s * cum[:, c, -1, None, None].exp()
        s = torch.baddbmm(end, k_to_end[:, c].transpose(-1, -2), d, out=dest[last])
    return out.reshape(heads, n_chunks * size, dv)[:, :t_len].transpose(0, 1)


@dataclass(slots=True)
class DeltaUpdates:
    """The per-token state updates of one chunk, head-major: token j adds k_j d_j^T."""

    k: Tensor  # [H, T, dk]
    d: Tensor  # [H, T, dv]
    g: Tensor  # [H, T] token j's log decay


def delta_rule_updates(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,  # [H, dk, dv] fp32, read only (read once)
) -> tuple[Tensor, DeltaUpdates]:
    """One chunk of T <= CHUNK_SIZE tokens: out [T, H, dv] fp32 and the updates that
    `advance_state` applies to reach the state after any of its tokens."""
    t_len = v.shape[0]
    assert t_len <= CHUNK_SIZE, f"{t_len} tokens: one chunk at most"
    if t_len == 1:  # a decode step: the same update without the chunk machinery (~4x fewer ops)
        k1, q1 = k.float().transpose(0, 1), q.float().transpose(0, 1)  # [H, 1, dk]
        decay = g.float()[0].exp()[:, None, None]  # [H, 1, 1]
        read = torch.cat([k1, q1], dim=1) @ state * decay  # [H, 2, dv]: (exp(g) S)^T [k, q]
        d = (v.float().transpose(0, 1) - read[:, :1]) * beta.float()[0, :, None, None]
        out = read[:, 1:] + (q1 * k1).sum(-1, keepdim=True) * d  # S_1^T q = read_q + (k.q) d
        return out.transpose(0, 1), DeltaUpdates(k1, d, g.float().transpose(0, 1))
    kc, _, _, u, w, intra, q_decayed = _chunk_terms(q, k, v, g, beta, t_len)
    # the one read of the state: [w ; q_decayed] S_0
    read = torch.cat([w[:, 0], q_decayed[:, 0]], dim=1) @ state  # [H, 2T, dv]
    d = u[:, 0] - read[:, :t_len]
    out = read[:, t_len:] + intra[:, 0] @ d  # [H, T, dv]
    return out.transpose(0, 1), DeltaUpdates(kc[:, 0], d, g.float().transpose(0, 1))


def advance_state(state: Tensor, k: Tensor, d: Tensor, g: Tensor) -> None:
    """In place: `state` (the chunk's starting state) becomes the state after the tokens of
    the updates k [H, m, dk], d [H, m, dv], g [H, m] (the first m of a chunk's), token by
    token: S <- exp(g_j) S + k_j d_j^T. The C++ kernel (gdn_advance, one pass over the state)
    where it runs, which gives the bits a verify's in-chunk states have; else torch ops."""
    fast = (
        state.is_cpu
        and state.dtype == k.dtype == d.dtype == g.dtype == torch.float32
        and state.is_contiguous()
        and state.shape[-1] % 8 == 0
        and g.shape[1] <= CHUNK_SIZE
    )
    ext = extension() if fast else None
    if ext is not None:
        ext.gdn_advance(state, k, d, g)
        return
    if _on_triton(state):
        triton_ops.gdn_advance(state, k, d, g)
        return
    for j in range(g.shape[1]):
        state.mul_(g[:, j].exp()[:, None, None]).add_(k[:, j, :, None] * d[:, j, None, :])


def recurrent_updates(
    y: Tensor,  # [T, C] fp32 conv output: [q (Hk dk) | k (Hk dk) | v (H dv)] per token
    g: Tensor,  # [T, H] log decay
    beta: Tensor,  # [T, H]
    state: Tensor,  # [H, dk, dv] fp32, read only unless `pending`
    k_heads: int,
    pending: DeltaUpdates | None = None,  # updates to advance `state` by first, in place
) -> tuple[Tensor, DeltaUpdates]:
    """prepare_qk + delta_rule_updates of one chunk (T <= CHUNK_SIZE): out [T, H, dv] fp32 and
    the per-token updates, by the C++ kernel when it can run, else by those torch functions.
    `pending`: the state is first advanced by them (`advance_state`'s bits); the kernel does it
    in the same pass over the state."""
    t_len, (_, dk, dv) = y.shape[0], state.shape
    assert t_len <= CHUNK_SIZE, f"{t_len} tokens: one chunk at most"
    fast = (
        y.is_cpu
        and y.dtype == state.dtype == g.dtype == beta.dtype == torch.float32
        and dk % 8 == 0
        and dv % 8 == 0
        and not (torch.is_grad_enabled() and y.requires_grad)
    )
    ext = extension() if fast else None
    if ext is not None and pending is not None and state.is_contiguous():
        out, k, d, cum = ext.gdn_delta(y, g, beta, state, k_heads, pending.k, pending.d, pending.g)
        return out, DeltaUpdates(k, d, cum)
    if pending is not None:
        advance_state(state, pending.k, pending.d, pending.g)
    if ext is None and _on_triton(state) and y.stride(1) == 1:
        g, beta = g.float().contiguous(), beta.float().contiguous()
        out, k, d = triton_ops.gdn_delta(y.float(), g, beta, state, k_heads)
        return out, DeltaUpdates(k, d, g.transpose(0, 1).contiguous())
    if ext is None:
        return reference_recurrent_updates(y, g, beta, state, k_heads)
    out, k, d, cum = ext.gdn_delta(y, g, beta, state, k_heads)
    return out, DeltaUpdates(k, d, cum)


def long_forward(
    y: Tensor,  # [T, C] fp32 conv output, any T
    g: Tensor,  # [T, H]
    beta: Tensor,  # [T, H]
    state: Tensor,  # [H, dk, dv] fp32, read only
    final: Tensor,  # [H, dk, dv] fp32: receives the state after the last token
    k_heads: int,
) -> Tensor:
    """A forward too long to keep every token's update (a prompt chunk): out [T, H, dv] fp32,
    and the state after its last token written to `final`. On the CPU: the C++ kernel
    `gdn_prefill` advances `final` token by token in place with decode steps' instructions (one
    pass over the state a token, reading S^T k and S^T q for the next token as it writes); on
    a GPU: chunks of CHUNK_SIZE tokens through `recurrent_updates`, each committed into `final`
    by `advance_state`. Both are what decode steps compute token by token, so a prompt
    prefilled in one forward, in several or token by token leaves the same bits (batch
    invariance: the scheduler chunks a prompt around other requests' rows). Without the
    kernels: the chunk form."""
    t_len, (heads, dk, dv) = y.shape[0], state.shape
    ext = extension() if y.is_cpu and dk % 8 == 0 and dv % 8 == 0 else None
    if ext is None and not _on_triton(state):
        kd = k_heads * dk
        q, k = prepare_qk(
            y[:, :kd].view(t_len, k_heads, dk), y[:, kd : 2 * kd].view(t_len, k_heads, dk), heads
        )
        v = y[:, 2 * kd :].view(t_len, heads, dv)
        dest: list[Tensor | None] = [None] * (t_len - 1) + [final]
        return gated_delta_rule_chunked(q, k, v, g.float(), beta.float(), state, dest)
    final.copy_(state)
    if ext is not None:
        return ext.gdn_prefill(y.float(), g.float(), beta.float(), final, k_heads)
    out = torch.empty(t_len, heads, dv, dtype=torch.float32, device=y.device)
    for c0 in range(0, t_len, CHUNK_SIZE):
        c1 = min(c0 + CHUNK_SIZE, t_len)
        out[c0:c1], updates = recurrent_updates(
            y[c0:c1], g[c0:c1].float(), beta[c0:c1].float(), final, k_heads
        )
        advance_state(final, updates.k, updates.d, updates.g)
    return out


def _on_triton(state: Tensor) -> bool:
    """The Triton kernels take this state: a GPU's, fp32, contiguous, dk a power of two and
    dv a multiple of their block."""
    _, dk, dv = state.shape
    return (
        triton_ops.available(state)
        and state.dtype == torch.float32
        and state.is_contiguous()
        and dk & (dk - 1) == 0
        and dv % triton_ops.GDN_BLOCK == 0
    )


def reference_recurrent_updates(
    y: Tensor, g: Tensor, beta: Tensor, state: Tensor, k_heads: int
) -> tuple[Tensor, DeltaUpdates]:
    """`recurrent_updates` in torch ops (the reference)."""
    t_len, (heads, dk, dv) = y.shape[0], state.shape
    kd = k_heads * dk
    q, k = prepare_qk(
        y[:, :kd].view(t_len, k_heads, dk), y[:, kd : 2 * kd].view(t_len, k_heads, dk), heads
    )
    v = y[:, 2 * kd :].view(t_len, heads, dv)
    return delta_rule_updates(q, k, v, g.float(), beta.float(), state)
