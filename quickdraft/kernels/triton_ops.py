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

    return {
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
