"""GPU kernels in Triton for the dense forward of models/graphs.py, each tested against the
torch reference in pointwise.py. A GPU step at batch 1 costs about one launch per op,
whatever the op does, so these fuse chains that torch launches one op at a time.

Contract (outputs in the input's dtype, fp32 math inside, one rounding per output):
    add_rms_norm(x, delta, weight, eps) -> (x + delta, rms_norm(x + delta) * weight)
        [N, H] rows; one launch (torch: 2). `delta=None`: rms_norm(x) * weight alone.
    silu_mul(gate_up [N, 2I]) -> silu(gate) * up [N, I]; one launch (torch: 2)
    rope_store(qkv, cos, sin, heads, kv_heads, pool_k, pool_v, row_slot, row_pos)
        -> q [N, heads, d] rotated. It also writes k rotated and v into the pools at
        (row_slot, :, row_pos): one launch (torch: the rotation, then two index writes, 6).
        qkv [N, (heads + 2 kv_heads) * d] is the fused projection. cos and sin [N, d] are
        fp32, rotate-half; d is a power of two. Each pool is one layer's
        [slots, kv_heads, capacity, d].
    slot_attention(q [B * rows, heads, d], pool_k, pool_v, seq_slot, row_pos, rows, scale)
        -> [B * rows, heads * d]: causal GQA of each row over its sequence's slot, read in
        place; one launch (torch: a gather of keys and of values, then SDPA, 3).
    gdn_delta(y, g, beta, state, k_heads) -> out, k, d and gdn_advance(state, k, d, g): the
        Gated DeltaNet recurrence of kernels/gdn.py (`recurrent_updates`, `advance_state`),
        token by token, one launch each (torch: ~10 ops a decode step, 2 per token to advance).
`available(x)` says whether they run: a CUDA tensor, triton importable, and
QUICKDRAFT_NO_TRITON unset. Triton is imported, and the kernels are built, on first use, so a
machine without triton (a CPU host) never loads it. tests/test_triton_ops.py runs them in
Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) where triton is installed, and on a GPU
for real.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch
from torch import Tensor


def installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(x: Tensor) -> bool:
    off = os.environ.get("QUICKDRAFT_NO_TRITON", "") not in ("", "0")
    return x.is_cuda and not off and installed()


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(
        x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, sx, sd, ss, sy, H, eps,
        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * sd + cols, mask=m, other=0.0)
            # the residual stream rounded as torch's x + delta rounds it
            s = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
            tl.store(s_ptr + row * ss + cols, s, mask=m)
        else:
            s = x
        sf = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + cols, (sf * inv * w).to(x.dtype), mask=m)

    @triton.jit
    def silu_mul_kernel(g_ptr, o_ptr, sg, so, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        gate = tl.load(g_ptr + row * sg + cols, mask=m, other=0.0)
        up = tl.load(g_ptr + row * sg + inter + cols, mask=m, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        tl.store(o_ptr + row * so + cols, (g / (1.0 + tl.exp(-g)) * up).to(gate.dtype), mask=m)

    @triton.jit
    def rope_store_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr,
        s_qkv, s_cs, s_q_row, s_q_head, pk0, pk1, pk2, pv0, pv1, pv2, heads, kv_heads,
        HALF: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        h = tl.program_id(1)  # q heads, then k heads, then v heads
        cols = tl.arange(0, HALF)
        base = qkv_ptr + row * s_qkv + h * 2 * HALF
        x1 = tl.load(base + cols)
        x2 = tl.load(base + HALF + cols)
        if h < heads + kv_heads:
            c1 = tl.load(cos_ptr + row * s_cs + cols)
            c2 = tl.load(cos_ptr + row * s_cs + HALF + cols)
            n1 = tl.load(sin_ptr + row * s_cs + cols)
            n2 = tl.load(sin_ptr + row * s_cs + HALF + cols)
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            o1 = (f1 * c1 - f2 * n1).to(x1.dtype)  # rotate_half: (-x2, x1)
            o2 = (f2 * c2 + f1 * n2).to(x1.dtype)
            if h < heads:
                out = q_ptr + row * s_q_row + h * s_q_head
            else:
                slot = tl.load(slot_ptr + row)
                pos = tl.load(pos_ptr + row)
                out = k_ptr + slot * pk0 + (h - heads) * pk1 + pos * pk2
            tl.store(out + cols, o1)
            tl.store(out + HALF + cols, o2)
        else:
            slot = tl.load(slot_ptr + row)
            pos = tl.load(pos_ptr + row)
            out = v_ptr + slot * pv0 + (h - heads - kv_heads) * pv1 + pos * pv2
            tl.store(out + cols, x1)
            tl.store(out + HALF + cols, x2)

    @triton.jit
    def slot_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, acc_ptr, best_ptr, total_ptr, seq_slot_ptr, pos_ptr, scale,
        s_q_row, s_q_head, pk0, pk1, pk2, pv0, pv1, pv2, s_o_row, s_o_head, rows, groups,
        heads_all, D: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    ):  # fmt: skip
        # program (row, kv head, s): the online softmax of the query heads sharing kv head
        # `kv` over range s of the row's keys. SPLITS = 1: every key, the output normalised
        # into o; else the unnormalised output, max and sum, for the merge kernel
        row = tl.program_id(0)
        kv = tl.program_id(1)
        s = tl.program_id(2)
        slot = tl.load(seq_slot_ptr + row // rows)
        last = tl.load(pos_ptr + row)  # keys 0 .. last are visible to this row
        used = tl.minimum(SPLITS, (last + SPLIT_KEYS) // SPLIT_KEYS)  # from the row alone
        chunk = ((last + used) // used + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = s * chunk
        hi = tl.minimum(lo + chunk, last + 1)
        if s < used:
            g = tl.arange(0, G)
            dims = tl.arange(0, D)
            g_ok = g < groups
            heads = kv * groups + g  # the query heads sharing kv head `kv`
            q_at = q_ptr + row * s_q_row + heads[:, None] * s_q_head + dims[None, :]
            q = tl.load(q_at, mask=g_ok[:, None], other=0.0).to(tl.float32) * scale
            best = tl.full((G,), float("-inf"), tl.float32)
            total = tl.zeros((G,), tl.float32)
            acc = tl.zeros((G, D), tl.float32)
            keys = tl.arange(0, BLOCK_N)
            for start in range(lo, hi, BLOCK_N):
                n = start + keys
                seen = n < hi
                k_at = k_ptr + slot * pk0 + kv * pk1 + n[:, None] * pk2 + dims[None, :]
                k = tl.load(k_at, mask=seen[:, None], other=0.0).to(tl.float32)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G, BLOCK_N]
                scores = tl.where(seen[None, :], scores, float("-inf"))
                new_best = tl.maximum(best, tl.max(scores, axis=1))
                p = tl.exp(scores - new_best[:, None])
                fade = tl.exp(best - new_best)
                v_at = v_ptr + slot * pv0 + kv * pv1 + n[:, None] * pv2 + dims[None, :]
                v = tl.load(v_at, mask=seen[:, None], other=0.0).to(tl.float32)
                acc = acc * fade[:, None] + tl.dot(p, v, input_precision="ieee")
                total = total * fade + tl.sum(p, axis=1)
                best = new_best
            if SPLITS == 1:
                out = acc / total[:, None]
                o_at = o_ptr + row * s_o_row + heads[:, None] * s_o_head + dims[None, :]
                tl.store(o_at, out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])
            else:
                at = (row * heads_all + heads) * SPLITS + s
                tl.store(acc_ptr + at[:, None] * D + dims[None, :], acc, mask=g_ok[:, None])
                tl.store(best_ptr + at, best, mask=g_ok)
                tl.store(total_ptr + at, total, mask=g_ok)

    @triton.jit
    def slot_attention_merge_kernel(
        acc_ptr, best_ptr, total_ptr, pos_ptr, o_ptr, s_o_row, s_o_head, heads_all,
        D: tl.constexpr, SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    ):  # fmt: skip
        # the splits of one (row, head) merged in split order; one split: acc / total, the
        # single kernel's bits
        row = tl.program_id(0)
        head = tl.program_id(1)
        last = tl.load(pos_ptr + row)
        used = tl.minimum(SPLITS, (last + SPLIT_KEYS) // SPLIT_KEYS)
        base = (row * heads_all + head) * SPLITS
        dims = tl.arange(0, D)
        best = tl.load(best_ptr + base)
        for s in range(1, used):
            best = tl.maximum(best, tl.load(best_ptr + base + s))
        acc = tl.zeros((D,), tl.float32)
        total = 0.0
        for s in range(0, used):
            w = tl.exp(tl.load(best_ptr + base + s) - best)
            acc += tl.load(acc_ptr + (base + s) * D + dims) * w
            total += tl.load(total_ptr + base + s) * w
        out = acc / total
        tl.store(o_ptr + row * s_o_row + head * s_o_head + dims, out.to(o_ptr.dtype.element_ty))

    @triton.jit
    def gdn_delta_kernel(
        y_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, k_out_ptr, d_ptr, T, sy, sg, s_out, group,
        KD: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    ):  # fmt: skip
        h = tl.program_id(0)  # value head
        blk = tl.program_id(1)  # block of BV value dims
        kh = h // group  # the key head it reads (repeat_interleave)
        dk = tl.arange(0, DK)
        dv = blk * BV + tl.arange(0, BV)
        s = tl.load(state_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :])  # [DK, BV] fp32
        for t in range(0, T):
            row = y_ptr + t * sy
            q = tl.load(row + kh * DK + dk).to(tl.float32)
            k = tl.load(row + KD + kh * DK + dk).to(tl.float32)
            v = tl.load(row + 2 * KD + h * DV + dv).to(tl.float32)
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) / tl.sqrt(DK * 1.0)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
            g = tl.load(g_ptr + t * sg + h).to(tl.float32)
            beta = tl.load(beta_ptr + t * sg + h).to(tl.float32)
            s = s * tl.exp(g)
            d = beta * (v - tl.sum(s * k[:, None], axis=0))  # [BV]
            s = s + k[:, None] * d[None, :]
            tl.store(out_ptr + t * s_out + h * DV + dv, tl.sum(s * q[:, None], axis=0))
            tl.store(d_ptr + (h * T + t) * DV + dv, d)
            if blk == 0:
                tl.store(k_out_ptr + (h * T + t) * DK + dk, k)

    @triton.jit
    def gdn_advance_kernel(
        state_ptr, k_ptr, d_ptr, g_ptr, m, T, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr,
    ):  # fmt: skip
        h = tl.program_id(0)
        dk = tl.arange(0, DK)
        dv = tl.program_id(1) * BV + tl.arange(0, BV)
        at = state_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :]
        s = tl.load(at)
        for j in range(0, m):
            k = tl.load(k_ptr + (h * T + j) * DK + dk)
            d = tl.load(d_ptr + (h * T + j) * DV + dv)
            s = s * tl.exp(tl.load(g_ptr + h * T + j)) + k[:, None] * d[None, :]
        tl.store(at, s)

    return {
        "gdn_delta": gdn_delta_kernel,
        "gdn_advance": gdn_advance_kernel,
        "slot_attention": slot_attention_kernel,
        "slot_attention_merge": slot_attention_merge_kernel,
        "add_rms_norm": add_rms_norm_kernel,
        "silu_mul": silu_mul_kernel,
        "rope_store": rope_store_kernel,
        "next_power_of_2": triton.next_power_of_2,
    }


def add_rms_norm(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(x + delta, its rms_norm * weight) for rows `[N, H]` (last dim contiguous); with
    `delta` None, (x, rms_norm(x) * weight)."""
    k = _kernels()
    n, h = x.shape
    y = torch.empty_like(x)
    s = torch.empty_like(x) if delta is not None else x
    d = delta if delta is not None else x
    k["add_rms_norm"][(n,)](
        x, d, weight, s, y, x.stride(0), d.stride(0), s.stride(0), y.stride(0), h, eps,
        HAS_DELTA=delta is not None, BLOCK=k["next_power_of_2"](h),
    )  # fmt: skip
    return s, y


SILU_BLOCK = 1024


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] -> [N, I]."""
    k = _kernels()
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = gate_up.new_empty(n, inter)
    grid = (n, -(-inter // SILU_BLOCK))
    k["silu_mul"][grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=SILU_BLOCK)
    return out


def rope_store(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    heads: int,
    kv_heads: int,
    pool_k: Tensor,
    pool_v: Tensor,
    row_slot: Tensor,
    row_pos: Tensor,
) -> Tensor:
    """q rotated `[N, heads, d]`; k rotated and v written into `pool_k` / `pool_v` (one
    layer's `[slots, kv_heads, capacity, d]`) at each row's (slot, position)."""
    k = _kernels()
    n = qkv.shape[0]
    d = pool_k.shape[-1]
    assert d & (d - 1) == 0 and qkv.stride(1) == 1 and pool_k.stride(-1) == 1
    assert cos.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    q = qkv.new_empty(n, heads, d)
    k["rope_store"][(n, heads + 2 * kv_heads)](
        qkv, cos, sin, q, pool_k, pool_v, row_slot, row_pos,
        qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2),
        pool_v.stride(0), pool_v.stride(1), pool_v.stride(2),
        heads, kv_heads, HALF=d // 2,
    )  # fmt: skip
    return q


ATTENTION_BLOCK = 64  # keys per step of the online softmax
SPLITS = 16  # key ranges per row at most, with `split`
SPLIT_KEYS = 1024  # keys per range at least (a multiple of ATTENTION_BLOCK)


def slot_attention(
    q: Tensor,
    pool_k: Tensor,
    pool_v: Tensor,
    seq_slot: Tensor,
    row_pos: Tensor,
    rows: int,
    scale: float,
    split: bool = False,
) -> Tensor:
    """Causal grouped-query attention of padded query rows over their slots: q `[B * rows,
    heads, d]`, row r of sequence r // rows at position `row_pos[r]` sees that sequence's slot
    keys 0 .. row_pos[r] in `pool_k` / `pool_v` (one layer's `[slots, kv_heads, capacity, d]`)
    -> `[B * rows, heads * d]`. One program per (row, kv head) runs an online softmax over
    blocks of keys, reading the slot in place: no gather, no mask, and the number of keys is
    read on the device, so one captured graph serves every length.

    `split` (long contexts): a row's keys are cut into up to SPLITS ranges of >= SPLIT_KEYS,
    one program each, merged by a second launch (flash decoding): at batch 1 the single
    kernel runs kv_heads programs, each over every key. The number of ranges comes from the
    row's own key count, and a row of <= SPLIT_KEYS keys (one range) gets the single
    kernel's bits: either way a row's result depends on that row alone."""
    k = _kernels()
    n, heads, d = q.shape
    kv_heads = pool_k.shape[1]
    groups = heads // kv_heads
    assert d & (d - 1) == 0 and q.stride(2) == 1 and pool_k.stride(-1) == 1
    out = q.new_empty(n, heads, d)
    g = max(16, k["next_power_of_2"](groups))  # tl.dot wants >= 16 rows
    splits = SPLITS if split else 1
    acc = best = total = out  # unused with one range
    if split:
        acc = torch.empty(n, heads, splits, d, dtype=torch.float32, device=q.device)
        best = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
        total = torch.empty_like(best)
    k["slot_attention"][(n, kv_heads, splits)](
        q, pool_k, pool_v, out, acc, best, total, seq_slot, row_pos, scale,
        q.stride(0), q.stride(1), pool_k.stride(0), pool_k.stride(1), pool_k.stride(2),
        pool_v.stride(0), pool_v.stride(1), pool_v.stride(2), out.stride(0), out.stride(1),
        rows, groups, heads, D=d, G=g, BLOCK_N=ATTENTION_BLOCK, SPLITS=splits,
        SPLIT_KEYS=SPLIT_KEYS,
    )  # fmt: skip
    if not split:
        return out.view(n, heads * d)
    k["slot_attention_merge"][(n, heads)](
        acc, best, total, row_pos, out, out.stride(0), out.stride(1), heads,
        D=d, SPLITS=SPLITS, SPLIT_KEYS=SPLIT_KEYS,
    )  # fmt: skip
    return out.view(n, heads * d)


GDN_BLOCK = 16  # value dims per program of the delta-rule kernels (the state's dv % 16 == 0)


def gdn_delta(
    y: Tensor, g: Tensor, beta: Tensor, state: Tensor, k_heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    """gdn.recurrent_updates of one chunk (T tokens): y [T, C] fp32 conv output (q, k of
    `k_heads` heads, then v), g and beta [T, H], state [H, dk, dv] fp32 (read only) -> out
    [T, H, dv] fp32 and the updates: k [H, T, dk] (L2-normalised), d [H, T, dv]. The recurrence
    runs token by token (one program per value head and block of value dims), so a verify's
    rows equal decode steps' (batch invariance)."""
    k = _kernels()
    t_len = y.shape[0]
    heads, dk, dv = state.shape
    assert dk & (dk - 1) == 0 and dv % GDN_BLOCK == 0 and y.stride(1) == 1
    assert state.is_contiguous() and g.stride() == beta.stride() and g.stride(1) == 1
    out = y.new_empty(t_len, heads, dv)
    k_out = y.new_empty(heads, t_len, dk)
    d = y.new_empty(heads, t_len, dv)
    k["gdn_delta"][(heads, dv // GDN_BLOCK)](
        y, g, beta, state, out, k_out, d, t_len, y.stride(0), g.stride(0), out.stride(0),
        heads // k_heads, KD=k_heads * dk, DK=dk, DV=dv, BV=GDN_BLOCK,
    )  # fmt: skip
    return out, k_out, d


def gdn_advance(state: Tensor, k_upd: Tensor, d: Tensor, g: Tensor) -> None:
    """gdn.advance_state in one launch: `state` [H, dk, dv] fp32 becomes the state after the
    first m = g.shape[1] updates (k [H, T, dk], d [H, T, dv], g [H, T], T >= m)."""
    k = _kernels()
    heads, dk, dv = state.shape
    m = g.shape[1]
    k_upd, d, g = k_upd[:, :m].contiguous(), d[:, :m].contiguous(), g.contiguous()
    k["gdn_advance"][(heads, dv // GDN_BLOCK)](
        state, k_upd, d, g, m, m, DK=dk, DV=dv, BV=GDN_BLOCK
    )  # fmt: skip
