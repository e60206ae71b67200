"""Fused per-token ops (RMSNorm, residual add + RMSNorm, rotate-half RoPE, the gated MLP's
silu(gate) * up, the GDN output's gated RMSNorm) with plain references.

Contract (each op = its `reference_*` function up to fp32 rounding; outputs in x's dtype):
    rms_norm(x [..., H], weight [H], eps, offset=0.0)
        -> x * rsqrt(mean(x^2) + eps) * (weight + offset)
    add_rms_norm(x, delta, weight, eps, offset=0.0) -> (s = x + delta, rms_norm(s))
    rope(x [N, heads, d], cos [N, rot], sin [N, rot]) -> rotate-half RoPE on the first `rot`
        dims of every head (the rest pass through); x may be a strided view (last dim contiguous)
    rope_rows(x, cos, signed_sin(sin)) -> rope with rot = d, in four torch ops (the GPU path)
    silu_mul(gate_up [N, 2I]) -> silu(gate_up[:, :I]) * gate_up[:, I:]   [N, I]
    gelu_mul(gate_up [N, 2I]) -> gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]   [N, I]
    gated_rms_norm(x [N, H, D] fp32, weight [D], z [N, H, D], eps)
        -> rms_norm(x) * weight * silu(z) in z's dtype (z may be a strided view)
    sigmoid(x) -> sigmoid(x) in x's dtype, every element through the same code (torch's own
        takes a vector path or a scalar tail by the element's position in the tensor, so a
        gate row alone got other bits than inside a verify: not batch-invariant)
    greedy_pick(logits [N, V], with_prob) -> (ids [N] int64: each row's argmax, the first
        index of its maximum as torch.argmax's; probs [N] fp32: that id's softmax probability
        up to fp32 rounding, or None without with_prob). torch's argmax reads a 248k-id fp32
        row at ~2 GB/s and its logsumexp of a row holding -inf (a cut draft vocabulary) took
        1.6 ms: ~7 ms of a full-size MoE verify step with 3 drafts (pick.cpp)
`offset=1.0` is the zero-centred (1 + w) RMSNorm of Qwen3-Next / Qwen3.5. The C++ versions
(norm_rope.cpp, gdn_ops.cpp, pick.cpp) run on CPU tensors in bf16 / fp32
with a matching weight dtype; anything else (CUDA, fp16, a failed build,
QUICKDRAFT_NO_KERNELS=1) runs the reference, which is the same math in a few torch ops.

Why: at decode time these tensors are a few KB and each torch op costs its dispatch overhead:
one fused pass replaces ~8 ops (RMSNorm) or ~6 per tensor (RoPE). The silu of a strided bf16
half of the fused gate/up output costs ~40 us in torch at 5 rows; here it is one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.kernels.build import extension


def _fast(x: Tensor, weight: Tensor | None = None) -> bool:
    return (
        x.is_cpu
        and x.dtype in (torch.bfloat16, torch.float32)
        and (weight is None or (weight.dtype == x.dtype and weight.is_cpu))
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def _gpu(x: Tensor, weight: Tensor, offset: float) -> bool:
    """Off the CPU (a GPU; also "meta", where tests count a forward's ops) a norm is torch's
    own one-launch rms_norm: its CUDA kernel (torch >= 2.8) computes in fp32 and rounds once,
    as the reference does in four launches."""
    return not x.is_cpu and not offset and weight.dtype == x.dtype


def reference_rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    w = weight.float() + offset if offset else weight
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    ext = extension() if _fast(x, weight) else None
    if ext is None:
        if _gpu(x, weight, offset):
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return reference_rms_norm(x, weight, eps, offset)
    out: Tensor = ext.rms_norm(x, weight, eps, offset)
    return out


def reference_add_rms_norm(
    x: Tensor, delta: Tensor, weight: Tensor, eps: float, offset: float = 0.0
) -> tuple[Tensor, Tensor]:
    s = x + delta
    return s, reference_rms_norm(s, weight, eps, offset)


def add_rms_norm(
    x: Tensor, delta: Tensor, weight: Tensor, eps: float, offset: float = 0.0
) -> tuple[Tensor, Tensor]:
    ext = extension() if _fast(x, weight) and delta.dtype == x.dtype else None
    if ext is None:
        if _gpu(x, weight, offset) and delta.dtype == x.dtype:
            s = x + delta
            return s, F.rms_norm(s, (s.shape[-1],), weight, eps)
        return reference_add_rms_norm(x, delta, weight, eps, offset)
    s, y = ext.add_rms_norm(x, delta, weight, eps, offset)
    return s, y


def reference_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rot = cos.shape[-1]
    half = rot // 2
    xf = x.float()
    head, tail = xf[..., :rot], xf[..., rot:]
    rotated = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
    out = head * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, tail), dim=-1).to(x.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    ext = extension() if _fast(x) and x.dim() == 3 and x.stride(-1) == 1 else None
    if ext is None:
        return reference_rope(x, cos, sin)
    out: Tensor = ext.rope(x, cos, sin)
    return out


def signed_sin(sin: Tensor) -> Tensor:
    """`sin` [N, d] of rotate-half RoPE with its first half negated: `rope_rows`' table."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_rows(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """`reference_rope` over whole heads (rot = d) in four elementwise ops, for a GPU, where
    each op is a launch: x [N, heads, d] (last dim contiguous), cos and `signed_sin(sin)`
    [N, d] fp32 -> x's dtype. rotate_half(x) * sin = roll(x, d / 2) * signed_sin."""
    c, s = cos[:, None, :], sin_signed[:, None, :]
    return torch.addcmul(x * c, x.roll(x.shape[-1] // 2, -1), s).to(x.dtype)


def reference_silu_mul(gate_up: Tensor) -> Tensor:
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of a fused [N, 2I] gate/up projection -> [N, I]."""
    fast = _fast(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1
    ext = extension() if fast else None
    if ext is None:
        return reference_silu_mul(gate_up)
    out: Tensor = ext.silu_mul(gate_up)
    return out


def gelu_tanh_rows(x: Tensor) -> Tensor:
    """gelu(x, tanh approximation) of `[N, I]`, one row at a time: torch's elementwise kernels
    pick a vector path or a scalar tail (and thread splits) by an element's place in the
    whole tensor, so a row computed inside a verify could get other bits than alone."""
    return torch.stack([F.gelu(row, approximate="tanh") for row in x.unbind(0)])


def reference_gelu_mul(gate_up: Tensor) -> Tensor:
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :inter].float(), gate_up[:, inter:].float()
    return (F.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


def gelu_mul(gate_up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up of a fused [N, 2I] gate/up projection -> [N, I] (Gemma's GeGLU):
    the C++ kernel (gdn_ops.cpp: x / (1 + exp(-2z)), every element through the same 8-lane
    code, one rounding; the grouped MoE kernel's act 2 and the Gemma 4 layer call it too), else
    `reference_gelu_mul`."""
    ext = extension() if _fast(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1 else None
    if ext is None:
        return reference_gelu_mul(gate_up)
    out: Tensor = ext.gelu_mul(gate_up)
    return out


def reference_gated_rms_norm(x: Tensor, weight: Tensor, z: Tensor, eps: float) -> Tensor:
    return (reference_rms_norm(x, weight.float(), eps) * F.silu(z.float())).to(z.dtype)


def gated_rms_norm(x: Tensor, weight: Tensor, z: Tensor, eps: float) -> Tensor:
    """rms_norm(x [N, H, D] fp32) * weight [D] * silu(z [N, H, D]) -> [N, H, D] in z's dtype
    (the gated output norm of a Gated DeltaNet layer; fp32 math, one rounding)."""
    fast = (
        _fast(z, None)
        and x.is_cpu
        and x.dtype == torch.float32
        and x.dim() == 3
        and z.shape == x.shape
        and z.stride(-1) == 1
        and weight.is_cpu
        and weight.dtype in (torch.bfloat16, torch.float32)
    )
    ext = extension() if fast else None
    if ext is None:
        return reference_gated_rms_norm(x, weight, z, eps)
    out: Tensor = ext.gated_rms_norm(x, weight, z, eps)
    return out


def sigmoid(x: Tensor) -> Tensor:
    """Elementwise sigmoid in x's dtype (fp32 math): the C++ op on the CPU, whose result for an
    element does not depend on where it sits in the tensor (batch invariance), else
    torch.sigmoid."""
    ext = extension() if _fast(x) else None
    if ext is None:
        return torch.sigmoid(x)
    out: Tensor = ext.sigmoid(x)
    return out


def reference_greedy_pick(logits: Tensor, with_prob: bool) -> tuple[Tensor, Tensor | None]:
    ids = logits.argmax(-1)
    if not with_prob:
        return ids, None
    probs = torch.softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]
    return ids, probs


def greedy_pick(logits: Tensor, with_prob: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per row of `logits` [N, V]: its argmax (int64, the first index of the maximum) and, with
    `with_prob`, that id's softmax probability (fp32), by the C++ op on the CPU (each row alone,
    batch-invariant), else the reference."""
    ext = extension() if _fast(logits) and logits.dim() == 2 and logits.shape[1] else None
    if ext is None:
        return reference_greedy_pick(logits, with_prob)
    ids, probs = ext.greedy_pick(logits, with_prob)
    return ids, probs if with_prob else None
