"""One Gated DeltaNet decoder layer of a hybrid model (models/qwen3_next.py, Qwen3.5 /
Qwen3.5-MoE layout) as a single C++ call, for the decode and verify rows of one sequence or of
several packed in one step.

Contract: `gdn_layer(...)` returns the extension's `GDNLayer` (gdn_layer.cpp) for a layer's
norms, operands, conv and gate parameters and MoE block, or None where it cannot run them: no
extension, a dtype other than bf16 / fp32, norm weights in another dtype than the
activations, head sizes the delta-rule kernel does not take (% 8), an operand format without
a kernel here (kernels/dense_layer.py `layer_operand`), or a MoE block that is not one call
(experts not in GGUF blocks). Its `forward(x, counts, convs, ssms, committed, pending,
cp_inputs, cp_k, cp_d, cp_g)` returns exactly what the Python layer returns on a forward that
keeps every token's checkpoint, and leaves each HybridCache as the Python layer does except
for its pending count of this layer, which the caller sets to 0. The caller keeps to that
path: CPU tensors, caches whose forward keeps checkpoints.

Why: a Gated DeltaNet layer is ~20 Python-level calls around 2 GEMMs and one MoE call, ~0.2
ms a layer (bench/moe.py --narrow: a 40-layer step at tiny widths took 11.7 ms).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from quickdraft.kernels.build import extension
from quickdraft.kernels.dense_layer import layer_operand
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
    if conv_weight.dtype not in (torch.bfloat16, torch.float32) or norm.dtype not in (
        torch.bfloat16,
        torch.float32,
    ):
        return None
    ops = {name: layer_operand(ext, w, dtype) for name, w in operands.items()}
    if any(op is None for op in ops.values()) or (moe is None) != ("gate_up" in ops):
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
