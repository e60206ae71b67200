"""The Triton kernels of kernels/triton_gguf.py (its docstring is their contract). A module of
its own, imported on first use: triton's jit resolves the helpers a kernel calls among the
module's globals, and a machine without triton never imports it."""

# mypy: ignore-errors

import triton
import triton.language as tl


@triton.jit
def _round_even(v):
    # round half to even in fp32, as torch.round: v - floor(v) is exact for |v| < 2^23
    r = tl.floor(v)
    f = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def _values(q_ptr, hb_ptr, rows, rmask, k0, sq, shb, lane, BITS: tl.constexpr):
    # the 64 values at k0 of rows `rows` as two [BN, 32] int8 operands (k0 .. +31, +32 .. +63)
    if BITS == 8:
        lo = tl.load(q_ptr + rows[:, None] * sq + k0 + lane[None, :], mask=rmask[:, None])
        hi = tl.load(q_ptr + rows[:, None] * sq + k0 + 32 + lane[None, :], mask=rmask[:, None])
    else:
        byte = tl.load(q_ptr + rows[:, None] * sq + k0 // 2 + lane[None, :], mask=rmask[:, None])
        byte = byte.to(tl.int32)
        lo = byte & 15
        hi = byte >> 4
        if BITS == 5:
            w0 = tl.load(hb_ptr + rows * shb + k0 // 32, mask=rmask)
            w1 = tl.load(hb_ptr + rows * shb + k0 // 32 + 1, mask=rmask)
            lo = lo | (((w0[:, None] >> lane[None, :]) & 1) << 4)
            hi = hi | (((w1[:, None] >> lane[None, :]) & 1) << 4)
        if BITS == 6:
            at = rows[:, None] * shb + (k0 + lane[None, :]) // 16
            sh = 2 * (lane[None, :] % 16)
            w0 = tl.load(hb_ptr + at, mask=rmask[:, None])
            w1 = tl.load(hb_ptr + at + 2, mask=rmask[:, None])
            lo = lo | (((w0 >> sh) & 3) << 4)
            hi = hi | (((w1 >> sh) & 3) << 4)
        lo = lo.to(tl.int8)
        hi = hi.to(tl.int8)
    return lo, hi


@triton.jit
def _group(
    isum, msum, u, x_ptr, toks, tmask, sx, kg, K, inv, lane, rows, rmask,
    sc_ptr, ssc, m_ptr, sm, SUB: tl.constexpr, HAS_SC: tl.constexpr, HAS_M: tl.constexpr,
    M_CONST: tl.constexpr, Q6: tl.constexpr,
):  # fmt: skip
    # one 32-value group at kg: its int8 dots (x quantized with its block's 1 / dx) added
    # to the block's integer sums, times the sub-block scales; the activation sums times
    # the mins
    xg = tl.load(
        x_ptr + toks[:, None] * sx + kg + lane[None, :],
        mask=tmask[:, None] & (kg + lane[None, :] < K),
        other=0.0,
    ).to(tl.float32)
    xq = _round_even(xg * inv[:, None]).to(tl.int32)
    if Q6:  # sub-blocks of 16: two dots, each over its half of the 32 (int8 dots take 32)
        xa = tl.where(lane[None, :] < 16, xq, 0)
        xb = xq - xa
        da = tl.dot(xa.to(tl.int8), tl.trans(u), out_dtype=tl.int32)
        db = tl.dot(xb.to(tl.int8), tl.trans(u), out_dtype=tl.int32)
        sa = tl.load(sc_ptr + rows * ssc + kg // 16, mask=rmask).to(tl.int32)
        sb = tl.load(sc_ptr + rows * ssc + kg // 16 + 1, mask=rmask).to(tl.int32)
        isum += da * sa[None, :] + db * sb[None, :]
        ba = tl.sum(xa, axis=1)
        bb = tl.sum(xb, axis=1)
        msum += 32 * (ba[:, None] * sa[None, :] + bb[:, None] * sb[None, :])
    else:
        dot = tl.dot(xq.to(tl.int8), tl.trans(u), out_dtype=tl.int32)
        bs = tl.sum(xq, axis=1)
        if HAS_SC:
            s = tl.load(sc_ptr + rows * ssc + kg // SUB, mask=rmask).to(tl.int32)
            isum += dot * s[None, :]
        else:
            isum += dot
        if HAS_M:
            mm = tl.load(m_ptr + rows * sm + kg // 32, mask=rmask).to(tl.int32)
            msum += bs[:, None] * mm[None, :]
        else:
            msum += bs[:, None] * M_CONST
    return isum, msum


# fmt: off
@triton.jit
def _block_term(
    q_ptr, hb_ptr, sc_ptr, m_ptr, d_ptr, dm_ptr, sq, shb, ssc, sm, sd,
    x_ptr, toks, tmask, sx, K, b, kb, dx, inv, rows, rmask, lane,
    BM: tl.constexpr, BN: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    SUB: tl.constexpr, HAS_SC: tl.constexpr, HAS_M: tl.constexpr, HAS_DM: tl.constexpr,
    M_CONST: tl.constexpr, Q6: tl.constexpr,
):
    # block b's fp32 term [BM, BN] of one weight: its integer sums times d dx (minus dm dx
    # times the activation sums times the mins)
    isum = tl.zeros((BM, BN), dtype=tl.int32)
    msum = tl.zeros((BM, BN), dtype=tl.int32)
    if BLOCK == 32:  # a block is one half of a 64-value chunk
        lo, hi = _values(q_ptr, hb_ptr, rows, rmask, kb // 64 * 64, sq, shb, lane, BITS)
        u = tl.where(b % 2 == 0, lo, hi)
        isum, msum = _group(isum, msum, u, x_ptr, toks, tmask, sx, kb, K, inv, lane, rows,
                            rmask, sc_ptr, ssc, m_ptr, sm, SUB, HAS_SC, HAS_M, M_CONST, Q6)
    else:
        for c in tl.static_range(BLOCK // 64):
            k0 = kb + 64 * c
            lo, hi = _values(q_ptr, hb_ptr, rows, rmask, k0, sq, shb, lane, BITS)
            isum, msum = _group(isum, msum, lo, x_ptr, toks, tmask, sx, k0, K, inv, lane, rows,
                                rmask, sc_ptr, ssc, m_ptr, sm, SUB, HAS_SC, HAS_M, M_CONST, Q6)
            isum, msum = _group(isum, msum, hi, x_ptr, toks, tmask, sx, k0 + 32, K, inv, lane,
                                rows, rmask, sc_ptr, ssc, m_ptr, sm, SUB, HAS_SC, HAS_M,
                                M_CONST, Q6)
    d = tl.load(d_ptr + rows * sd + b, mask=rmask, other=0.0).to(tl.float32)
    if HAS_DM:
        dm = tl.load(dm_ptr + rows * sd + b, mask=rmask, other=0.0).to(tl.float32)
        term = isum.to(tl.float32) * (d[None, :] * dx[:, None])
        term -= msum.to(tl.float32) * (dm[None, :] * dx[:, None])
    else:
        term = (isum - msum).to(tl.float32) * (d[None, :] * dx[:, None])
    return term


@triton.jit
def gguf_linear_kernel(
    x_ptr, o_ptr, b_ptr, q_ptr, hb_ptr, sc_ptr, m_ptr, d_ptr, dm_ptr,
    q2_ptr, hb2_ptr, sc2_ptr, m2_ptr, d2_ptr, dm2_ptr,
    M, N, K, NB, sx, so, sq, shb, ssc, sm, sd,
    BITS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, HAS_SC: tl.constexpr,
    HAS_M: tl.constexpr, HAS_DM: tl.constexpr, M_CONST: tl.constexpr, Q6: tl.constexpr,
    HAS_BIAS: tl.constexpr, GLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    # GLU: a second weight (the up rows, in the gate's format and layout) whose output
    # multiplies silu of the first's, each rounded to the output dtype first: the bits of the
    # two projections followed by triton_ops.silu_mul, in one launch
    # weight rows (outputs), 64-bit: rows x row bytes passes 2^31 in large tables
    rows = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    toks = tl.program_id(1) * BM + tl.arange(0, BM)  # activation rows
    rmask = rows < N
    tmask = toks < M
    lane = tl.arange(0, 32)
    span = tl.arange(0, BLOCK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    for b in range(NB):
        kb = b * BLOCK
        xs = tl.load(x_ptr + toks[:, None] * sx + kb + span[None, :],
                     mask=tmask[:, None] & (kb + span[None, :] < K), other=0.0).to(tl.float32)
        dx = tl.max(tl.abs(xs), axis=1) / 127.0
        inv = tl.where(dx > 0, 1.0 / tl.where(dx > 0, dx, 1.0), 0.0)
        acc += _block_term(q_ptr, hb_ptr, sc_ptr, m_ptr, d_ptr, dm_ptr, sq, shb, ssc, sm, sd,
                           x_ptr, toks, tmask, sx, K, b, kb, dx, inv, rows, rmask, lane,
                           BM, BN, BITS, BLOCK, SUB, HAS_SC, HAS_M, HAS_DM, M_CONST, Q6)
        if GLU:
            acc2 += _block_term(q2_ptr, hb2_ptr, sc2_ptr, m2_ptr, d2_ptr, dm2_ptr, sq, shb, ssc,
                                sm, sd, x_ptr, toks, tmask, sx, K, b, kb, dx, inv, rows, rmask,
                                lane, BM, BN, BITS, BLOCK, SUB, HAS_SC, HAS_M, HAS_DM, M_CONST,
                                Q6)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
    if GLU:
        g = acc.to(o_ptr.dtype.element_ty).to(tl.float32)
        u = acc2.to(o_ptr.dtype.element_ty).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * u
    out = o_ptr + toks[:, None] * so + rows[None, :]
    tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=tmask[:, None] & rmask[None, :])
# fmt: on


@triton.jit
def gguf_rows_kernel(
    ids_ptr, o_ptr, q_ptr, hb_ptr, sc_ptr, m_ptr, d_ptr, dm_ptr,
    start, N, K, so, sq, shb, ssc, sm, sd,
    BITS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, HAS_SC: tl.constexpr,
    HAS_M: tl.constexpr, HAS_DM: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    k0 = tl.program_id(1) * 64  # 64 values per program
    row = tl.load(ids_ptr + t) - start
    if (row >= 0) & (row < N):
        lane = tl.arange(0, 32)
        rows = tl.zeros((1,), dtype=tl.int64) + row
        ok = rows >= 0
        lo, hi = _values(q_ptr, hb_ptr, rows, ok, k0, sq, shb, lane, BITS)
        for h in tl.static_range(2):
            kg = k0 + 32 * h
            u = (lo if h == 0 else hi).to(tl.float32)
            col = kg + lane[None, :]
            d = tl.load(d_ptr + row * sd + kg // BLOCK).to(tl.float32)
            s = tl.load(sc_ptr + row * ssc + col // SUB).to(tl.float32) if HAS_SC else 1.0
            if HAS_DM:
                dm = tl.load(dm_ptr + row * sd + kg // BLOCK).to(tl.float32)
                mm = tl.load(m_ptr + row * sm + kg // 32).to(tl.float32) if HAS_M else 1.0
                w = (d * s) * u - dm * mm
            else:
                w = (d * s) * (u - C)
            tl.store(o_ptr + t * so + col, w.to(o_ptr.dtype.element_ty), mask=col < K)
