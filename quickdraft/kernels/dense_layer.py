"""One decoder layer of the Llama family (Llama / Qwen2 / Qwen3 with a dense MLP; Qwen3-MoE and
gpt-oss with their MoE block's one call, gpt-oss's o bias, windows and sinks) as a single C++
call, for the decode, verify and prompt rows of one sequence or of several packed in one
batched step.

Contract: `dense_layer(...)` returns the extension's `DenseLayer` (dense_layer.cpp) for a
layer's norms and operands, or None where it cannot run them: no extension, an operand format
without a kernel here (plain bf16 / fp32 tensors: pack them first), a head size the attention
kernel does not take (% 32), or a shape or dtype some kernel refuses. Its
`forward(h, residual, cos, sin, k_cache, v_cache, start)` returns exactly what the Python
layer (models/families/llama.py `DecoderLayer.forward_residual`) returns when every op there takes
its kernel: the same kernels in the same order on the same operands, so the outputs are bitwise
equal. `forward_many(h, residual, cos, sin, k_caches, v_caches, starts, counts, k_pages, v_pages,
blocks)` does the same for several sequences' rows packed in order, as the Python layer's loop over
them does. The caller keeps to that path: KV-cache sequences.

Why: a 0.5B int4 draft step spent ~5.5 ms of its ~18 ms in Python and torch dispatch around
its GEMMs (24 layers x ~13 ops); one call per layer removes most of it. In a batched step the
Python layer also wrote each sequence's cache and called attention once per sequence per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from quickdraft.kernels.build import extension
from quickdraft.kernels.gemm import Weight
from quickdraft.kernels.linear_bf16 import MAX_M, PanelWeight
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight

# operand kinds dense_layer.cpp takes
_PANEL, _INT8, _INT4, _GGUF, _ROWS = 1, 2, 3, 4, 5

# (kind, packed per part, scale, out_features per part, format per part)
Operand = tuple[int, list[Tensor], Tensor, list[int], list[int]]


def layer_operand(
    ext: Any, weight: Weight, dtype: torch.dtype, bias: Tensor | None = None
) -> Operand | None:
    """The operand as the C++ layer takes it, if it can run it, else None (eligibility
    depends on dtypes and shapes only: one zero row stands for any rows)."""
    x = torch.zeros(1, weight.shape[1], dtype=dtype)
    none = torch.empty(0)
    op: Operand
    if isinstance(weight, PanelWeight):
        op = _PANEL, [weight.packed], none, [weight.out_features], []
        ok = ext.eligible_panel(x, weight.packed, weight.out_features, bias)
    elif isinstance(weight, Int8Weight):
        op = _INT8, [weight.packed], weight.scale, [weight.out_features], []
        ok = ext.eligible_i8(x, weight.packed, weight.scale, bias)
    elif isinstance(weight, Int4Weight):
        op = _INT4, [weight.packed], none, [weight.out_features], []
        ok = ext.eligible_q4(x, weight.packed, weight.out_features, bias)
    elif isinstance(weight, GGUFWeight):
        packed = [p.packed for p in weight.parts]
        ns, fmts = [p.n for p in weight.parts], [p.fmt.code for p in weight.parts]
        op = _GGUF, packed, none, ns, fmts
        ok = ext.eligible_gguf(x, packed, fmts, ns, bias)
    elif isinstance(weight, Tensor) and weight.dtype == torch.float16:  # a file's F16 tensor
        op = _ROWS, [weight], none, [weight.shape[0]], []
        ok = ext.eligible(x, weight, bias, MAX_M)
    else:
        return None
    return op if ok else None


def layer_operands(
    ext: Any, operands: dict[str, Weight], dtype: torch.dtype, biases: dict[str, Tensor | None]
) -> dict[str, Operand] | None:
    """`layer_operand` of each named operand (with its bias from `biases`, if any), or None
    where any one cannot run (the C++ layers take their operands by name)."""
    ops = {name: layer_operand(ext, w, dtype, biases.get(name)) for name, w in operands.items()}
    return None if any(op is None for op in ops.values()) else ops  # type: ignore[return-value]


def dense_layer(
    layer: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
    norms: tuple[Tensor, Tensor, Tensor | None, Tensor | None],  # input, post, q, k
    operands: tuple[Weight, ...],  # qkv, o, gate_up, down; qkv, o with a MoE block
    qkv_bias: Tensor | None,
    dtype: torch.dtype,
    o_bias: Tensor | None = None,
    window: int = 0,  # a local layer's window (gpt-oss), 0: none
    sinks: Tensor | None = None,  # fp32 [heads] (gpt-oss)
    moe: Any = None,  # the layer's MoE block as one call (kernels/moe_gguf.py moe_block)
) -> Any:
    """The C++ layer for these norms and operands, or None (module docstring)."""
    ext = extension()
    if ext is None or dtype not in (torch.bfloat16, torch.float32) or head_dim % 32:
        return None
    biases = (qkv_bias, o_bias)
    ops = [
        layer_operand(ext, w, dtype, biases[i] if i < 2 else None) for i, w in enumerate(operands)
    ]
    if any(op is None for op in ops):
        return None
    kinds, packed, scales, ns, fmts = zip(*ops, strict=True)
    input_norm, post_norm, q_norm, k_norm = norms
    return ext.DenseLayer(
        layer=layer,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        eps=eps,
        scale=scale,
        input_norm=input_norm,
        post_norm=post_norm,
        q_norm=q_norm,
        k_norm=k_norm,
        kinds=list(kinds),
        packed=list(packed),
        scales=list(scales),
        ns=list(ns),
        fmts=list(fmts),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        window=window,
        sinks=sinks,
        moe=moe,
    )
