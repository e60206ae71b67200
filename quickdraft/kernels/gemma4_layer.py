"""One Gemma 4 decoder layer (models/families/gemma4.py `DecoderLayer`) as a single C++ call, for
the rows of one sequence or of several packed in one step.

Contract: `gemma4_layer(...)` returns the extension's `Gemma4Layer` (gemma4_layer.cpp) for a
layer's norms, operands and grouped experts, or None where it cannot run them: no extension,
a dtype other than bf16 / fp32, a head size the attention kernel does not take (% 32), a norm
weight in another dtype than the activations (the norm kernel's condition), an operand
format without a kernel here (kernels/dense_layer.py `layer_operand`), or MoE experts without
the grouped kernel (kernels/moe_gguf.py: GGUF blocks). Its `forward(h, ple, cos, sin, k_groups,
v_groups, starts, counts)` returns exactly what the Python layer returns when every op there
takes its kernel, bit for bit: the same kernels and ATen ops in the same order. The caller
keeps to that path: CPU tensors, KV caches whose rows start at token 0 (no shared blocks).

Why: a Gemma 4 layer is ~40 Python-level ops around its GEMMs and grouped experts; measured
on the 26B-A4B widths (bench/moe.py --arch gemma4) they were ~3.9 ms of a 17.5 ms token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from quickdraft.kernels.build import extension
from quickdraft.kernels.dense_layer import layer_operands
from quickdraft.kernels.gemm import Weight

# the norm weights the layer runs through the norm kernel (in the activations' dtype)
_KERNEL_NORMS = frozenset(
    {
        "input",
        "q",
        "k",
        "unit",
        "post_attention",
        "pre_feedforward",
        "post_feedforward",
        "post_feedforward_1",
        "post_feedforward_2",
        "pre_feedforward_2",
        "router_unit",
        "post_per_layer_input",
    }
)


def gemma4_layer(
    *,
    slot: int,  # the layer's KV slot in its group (its source layer's, if it reads another's)
    own: bool,  # it computes and writes its keys / values
    shares_v: bool,  # its values are its keys' projection
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int,
    eps: float,
    norms: dict[str, Tensor],  # gemma4_layer.cpp's names
    operands: dict[str, Weight],  # qkv, o, gate_up, down [, router] [, ple_gate, ple_projection]
    experts: Any,  # the grouped experts' kernel (kernels/moe_gguf.py), None: not a MoE layer
    top_k: int,
    router_root: float,
    dtype: torch.dtype,
) -> Any:
    """The C++ layer for these parts, or None (module docstring)."""
    ext = extension()
    if ext is None or dtype not in (torch.bfloat16, torch.float32) or head_dim % 32:
        return None
    if any(w.dtype != dtype for name, w in norms.items() if name in _KERNEL_NORMS):
        return None
    if ("router" in operands) != (experts is not None):
        return None  # a MoE layer whose experts have no grouped kernel
    ops = layer_operands(ext, operands, dtype, {})
    if ops is None:
        return None
    return ext.Gemma4Layer(
        slot=slot,
        own=own,
        shares_v=shares_v,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        window=window,
        eps=eps,
        norms=norms,
        ops=ops,
        experts=experts,
        top_k=top_k,
        router_root=router_root,
    )
