"""The decoder layers of a hybrid model (models/families/qwen3_next.py, Qwen3.5 / Qwen3.5-MoE
layout) as single C++ calls, for the decode and verify rows of one sequence or of several packed in
one step: Gated DeltaNet layers (`gdn_layer`) and gated full-attention layers (`attention_layer`).

Contract: each builder returns the extension's layer (hybrid_layer.cpp) for a layer's norms,
operands (and the GDN's conv and gate parameters) and MLP, or None where it cannot run them:
no extension, a dtype other than bf16 / fp32, norm weights in another dtype than the
activations, head sizes the kernels do not take (GDN % 8, attention % 32), an operand format
without a kernel here (kernels/dense_layer.py `layer_operand`), or a MoE block that is not one
call (experts not in GGUF blocks). `GDNLayer.forward(x, counts, convs, ssms, committed,
pending, cp_inputs, cp_k, cp_d, cp_g)` returns exactly what the Python layer returns on a
forward that keeps every token's checkpoint, and leaves each HybridCache as the Python layer
does except for its pending count of this layer, which the caller sets to 0.
`HybridAttentionLayer.forward(x, cos, sin, k_caches, v_caches, starts, counts, k_pages,
v_pages, blocks)` returns what the Python layer returns, the new KV rows written. The caller
keeps to that path: CPU tensors, caches whose forward keeps checkpoints.

Why: a hybrid layer is ~15-20 Python-level calls around 2-3 GEMMs and one MoE call, ~0.2 ms a
layer (bench/moe.py --narrow: a 40-layer step at tiny widths took 11.7 ms).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from quickdraft.kernels.build import extension
from quickdraft.kernels.dense_layer import layer_operands
from quickdraft.kernels.gemm import Weight


def gdn_layer(
    *,
    slot: int,  # the layer's index among the GDN layers (its HybridCache slot)
    k_heads: int,
    v_heads: int,
    key_dim: int,
    value_dim: int,
    eps: float,
    norms: tuple[Tensor, Tensor],  # the input and post-attention (1 + w) norms' weights
    conv_weight: Tensor,  # [C, K]
    a_log: Tensor,
    dt_bias: Tensor,
    norm: Tensor,  # the gated output norm's weight [dv]
    out_heads: Tensor | None,  # the value heads' order `out` expects; None: HF's
    operands: dict[str, Weight],  # inp, out [, gate_up, down without a MoE block]
    moe: Any,  # the layer's MoE block as one call (kernels/moe_gguf.py), None: a dense MLP
    dtype: torch.dtype,
) -> Any:
    """The C++ layer for these parts, or None (module docstring)."""
    ext = extension()
    if ext is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    if key_dim % 8 or value_dim % 8 or any(w.dtype != dtype for w in norms):
        return None
    if any(t.dtype not in (torch.bfloat16, torch.float32) for t in (conv_weight, norm)):
        return None
    ops = layer_operands(ext, operands, dtype, {})
    if ops is None or (moe is None) != ("gate_up" in ops):
        return None
    tensors = {
        "input_norm": norms[0],
        "post_norm": norms[1],
        "conv_weight": conv_weight,
        "a_log": a_log.float(),
        "dt_bias": dt_bias.float(),
        "norm": norm,
    }
    if out_heads is not None:
        tensors["out_heads"] = out_heads
    return ext.GDNLayer(
        slot=slot,
        k_heads=k_heads,
        v_heads=v_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        eps=eps,
        tensors=tensors,
        ops=ops,
        moe=moe,
    )


def attention_layer(
    *,
    layer: int,  # its KV slot among the attention layers
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
    norms: tuple[Tensor, Tensor, Tensor, Tensor],  # input, post-attention, q, k (1 + w)
    operands: dict[str, Weight],  # qkv, o [, gate_up, down without a MoE block]
    qkv_bias: Tensor | None,
    moe: Any,  # the layer's MoE block as one call (kernels/moe_gguf.py), None: a dense MLP
    dtype: torch.dtype,
) -> Any:
    """The C++ gated-attention layer for these parts, or None (module docstring)."""
    ext = extension()
    if ext is None or dtype not in (torch.bfloat16, torch.float32) or head_dim % 32:
        return None
    if any(w.dtype != dtype for w in norms):
        return None
    ops = layer_operands(ext, operands, dtype, {"qkv": qkv_bias})
    if ops is None or (moe is None) != ("gate_up" in ops):
        return None
    names = ("input_norm", "post_norm", "q_norm", "k_norm")
    return ext.HybridAttentionLayer(
        layer=layer,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        eps=eps,
        scale=scale,
        tensors=dict(zip(names, norms, strict=True)),
        ops=ops,
        qkv_bias=qkv_bias,
        moe=moe,
    )
