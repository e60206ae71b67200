"""Gated DeltaNet math (Qwen3-Next / Qwen3.5 linear-attention layers), one sequence at a time.

Stage: inside a GDN layer's forward (models/qwen3_next.py), between the input projections and
the gated output norm. Two pieces, each reading the sequence's committed state and writing
the state after chosen tokens into caller-provided tensors (`dest[t]`, the checkpoint slots of
state_cache.py), never into the committed state itself, so a rejected suffix costs nothing:

  causal_conv1d(x [T, C], window [K-1, C], weight [C, K], dest) -> silu(conv) [T, C] fp32
      depthwise causal conv over [window ; x]; dest[t] <- the last K-1 inputs after token t.
  gated_delta_rule_naive / gated_delta_rule_chunked(q, k, v, g, beta, state, dest)
      q, k [T, H, dk] (L2-normalised; q also scaled by dk^-0.5, see `prepare_qk`),
      v [T, H, dv], g [T, H] log decay (<= 0), beta [T, H], state [H, dk, dv]
      -> out [T, H, dv] fp32; dest[t] [H, dk, dv] <- the state after token t.
      Per token: S = exp(g) S;  S += k (beta (v - k^T S))^T;  out = q^T S   (all fp32).

`gated_delta_rule_naive` is that recurrence token by token: the reference, and the decode path
(T = 1). `gated_delta_rule_chunked` is the parallel-within-chunk (UT transform / WY) form of the
same recurrence (as in flash-linear-attention and transformers' torch_chunk_gated_delta_rule),
used for prefill and multi-token verify. Unlike transformers it always starts from the given
state (a verify must continue the committed state) and it can produce the state after any
token inside a chunk: S_t = exp(c_t) S_0 + sum_{j<=t} exp(c_t - c_j) k_j u_j^T, where c is the
in-chunk cumulative log decay and u_j the corrected values (tests/test_gdn.py checks both
outputs and states against the naive form).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

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


def causal_conv1d(
    x: Tensor,  # [T, C] new inputs
    window: Tensor,  # [K-1, C] the inputs before them (zeros at the start of a sequence)
    weight: Tensor,  # [C, K] depthwise taps, oldest first (HF conv1d.weight[:, 0])
    dest: Sequence[Tensor | None],  # per token: where its window goes ([K-1, C]) or None
) -> Tensor:
    """SiLU(causal depthwise conv) of the new inputs, in fp32 `[T, C]`."""
    t_new, taps = x.shape[0], weight.shape[1]
    xx = torch.cat([window.to(x.dtype), x]).float()  # [K-1+T, C]
    w = weight.float()
    out = xx[0:t_new] * w[:, 0]
    for i in range(1, taps):
        out = out.addcmul_(xx[i : i + t_new], w[:, i])
    for t, d in enumerate(dest):
        if d is not None:
            d.copy_(xx[t + 1 : t + taps])
    return F.silu(out)


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
    pad = (-t_len) % size
    n_chunks = (t_len + pad) // size

    def chunks(x: Tensor) -> Tensor:  # [T, H, ...] -> [H, n, size, ...] fp32, zero padded
        x = x.float().transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(heads, n_chunks, size, *x.shape[2:])

    # Padded tokens have k = v = 0, beta = 0 and g = 0: they leave the state unchanged.
    qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    cum = gc.cumsum(-1)  # [H, n, size] log decay from the chunk start through token i
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(c_i - c_j) for j <= i, else 0
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = kc * bc[..., None]
    # (I + strictly_lower(diag(beta) K K^T * decay)) [u | w] = [beta v | beta exp(c) k]
    system = (k_beta @ kc.transpose(-1, -2)) * decay  # [H, n, size, size]
    rhs = torch.cat([vc * bc[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]  # [H, n, size, dv], [H, n, size, dk]
    intra = (qc @ kc.transpose(-1, -2)) * decay  # [H, n, size, size]
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]  # decay from token j to chunk end

    out = torch.empty(heads, n_chunks, size, dv, dtype=torch.float32, device=q.device)
    s = state
    for c in range(n_chunks):
        v_new = u[:, c] - w[:, c] @ s  # [H, size, dv]: the delta-rule corrections u_j
        out[:, c] = q_decayed[:, c] @ s + intra[:, c] @ v_new
        last = min((c + 1) * size, t_len) - 1  # the last real token of this chunk
        for t in range(c * size, last):  # states inside the chunk, only where asked for
            target = dest[t]
            if target is not None:
                i = t - c * size
                k_w = (kc[:, c] * decay[:, c, i, :, None]).transpose(-1, -2)  # [H, dk, size]
                torch.baddbmm(s * cum[:, c, i, None, None].exp(), k_w, v_new, out=target)
        end = s * cum[:, c, -1, None, None].exp()
        s = torch.baddbmm(end, k_to_end[:, c].transpose(-1, -2), v_new, out=dest[last])
    return out.reshape(heads, n_chunks * size, dv)[:, :t_len].transpose(0, 1)
