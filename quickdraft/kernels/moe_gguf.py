"""The routed experts of one MoE layer as one kernel call (`grouped_experts`), over a GGUF
file's own block formats, beside the per-expert loop it must equal (`reference_experts`).

Contract: for x [N, H], top_idx / top_weight [N, k] (the router's choices, in slot order) and
per expert e its operands (gate_up_e [2I, H], down_e [H, I]),

    out[r] = sum over slots j in order of  w[r, j] * down_e(silu_mul(gate_up_e(x[r])))

with e = top_idx[r, j] and w = top_weight (in x's dtype): each projection's output rounded to
x's dtype as `project` rounds it, each product and the running sum in fp32, rounded once to
x's dtype at the end. `reference_experts` computes that with one `project` pair per chosen
expert; the extension's `MoEGGUF` (moe_gguf.cpp) computes the same bits in one call, with the
rows grouped by expert so that each chosen expert's weights are streamed once per forward.
A row's result depends on that row alone (its experts, in its slot order), so a decode step and
a verify pass give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from quickdraft.kernels.build import extension
from quickdraft.kernels.gemm import Weight, project
from quickdraft.kernels.linear_bf16 import MAX_M, PanelWeight
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.kernels.pointwise import silu_mul


def reference_experts(
    x: Tensor,  # [N, H]
    top_idx: Tensor,  # [N, k] int64
    top_weight: Tensor,  # [N, k] in x's dtype (or fp32)
    operands: Sequence[tuple[Weight, Weight]],  # per expert (gate_up [2I, H], down [H, I])
    act: Callable[[Tensor], Tensor] = silu_mul,  # [rows, 2I] -> [rows, I]
    biases: Sequence[tuple[Tensor, Tensor]] | None = None,  # per expert (gate_up's, down's)
) -> Tensor:
    """The module docstring's sum, one `project` pair per chosen expert -> [N, H] x.dtype
    (gpt-oss: its activation, and each expert's biases added by `project`)."""
    n, k = top_idx.shape
    ys = x.new_empty(n, k, x.shape[1])  # [N, k, H] each slot's expert output
    for e in torch.unique(top_idx).tolist():
        rows, slots = torch.where(top_idx == e)
        gate_up, down = operands[e]
        b_gate_up, b_down = (None, None) if biases is None else biases[e]
        ys[rows, slots] = project(act(project(x[rows], gate_up, b_gate_up)), down, b_down)
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    weight = top_weight.float()
    for j in range(k):  # slot order, fp32
        out += weight[:, j, None] * ys[:, j].float()
    return out.to(x.dtype)


def grouped_experts(
    operands: Sequence[tuple[Weight, Weight]],
    hidden: int,
    biases: tuple[Tensor, Tensor] | None = None,  # gate_up [E, 2I], down [E, H] (gpt-oss)
    swiglu: tuple[float, float] | None = None,  # gpt-oss's (alpha, limit) act, not silu_mul
    gelu: bool = False,  # Gemma 4's experts: pointwise.gelu_mul, not silu_mul
) -> Any:
    """The extension's MoEGGUF over these experts, or None where it cannot run them: no
    extension, an expert not in GGUF blocks (an unquantized file's tensors), or experts whose
    parts differ in format (one GGUF tensor holds every expert of a layer, so they never do)."""
    ext = extension()
    if ext is None or not operands:
        return None
    gate_up = [g for g, _ in operands if isinstance(g, GGUFWeight)]
    down = [d for _, d in operands if isinstance(d, GGUFWeight)]
    if len(gate_up) != len(operands) or len(down) != len(operands):
        return None

    def layout(ws: list[GGUFWeight]) -> tuple[list[int], list[int]] | None:
        first = ws[0].parts
        shape = ([p.fmt.code for p in first], [p.n for p in first])
        for w in ws[1:]:
            if ([p.fmt.code for p in w.parts], [p.n for p in w.parts]) != shape:
                return None
        return shape

    gu, dn = layout(gate_up), layout(down)
    if gu is None or dn is None or gate_up[0].in_features != hidden:
        return None
    alpha, limit = swiglu or (1.702, 7.0)
    return ext.MoEGGUF(
        gate_up=[[p.packed for p in w.parts] for w in gate_up],
        gate_up_fmts=gu[0],
        gate_up_ns=gu[1],
        down=[[p.packed for p in w.parts] for w in down],
        down_fmts=dn[0],
        down_ns=dn[1],
        hidden=hidden,
        gate_up_bias=None if biases is None else biases[0],
        down_bias=None if biases is None else biases[1],
        act=2 if gelu else 0 if swiglu is None else 1,
        alpha=alpha,
        limit=limit,
    )


def moe_block(
    experts: Any,  # grouped_experts' kernel
    router: Tensor,  # [E, H]
    top_k: int,
    norm_topk: bool,
    shared: tuple[Weight, Weight, Weight] | None,  # gate_up, down, shared gate [1, H]
    router_bias: Tensor | None = None,
    topk_first: bool = False,  # gpt-oss: top k of the logits, softmax over them (fp32 weights)
) -> Any:
    """The extension's MoEBlock: routing, the grouped experts and the gated shared expert as
    one call with the Python block's bits (models/families/moe.py), or None where some operand is
    not in a format it runs (the shared expert's projections must be GGUF blocks, the router a plain
    tensor, the shared gate a plain tensor or a PanelWeight)."""
    ext = extension()
    if ext is None or experts is None or not isinstance(router, Tensor):
        return None
    parts: list[list[Any]] = [[], [], [], [], [], []]
    gate: Tensor | None = None
    panel_n = -1  # the gate as a plain tensor
    if shared is not None:
        gate_up, down, gate_w = shared
        if not (isinstance(gate_up, GGUFWeight) and isinstance(down, GGUFWeight)):
            return None
        if isinstance(gate_w, PanelWeight):
            probe = torch.zeros(1, gate_w.shape[1], dtype=router.dtype)
            if not ext.eligible_panel(probe, gate_w.packed, gate_w.out_features, None):
                return None
            gate, panel_n = gate_w.packed, gate_w.out_features
        elif isinstance(gate_w, Tensor):
            gate = gate_w
        else:
            return None
        for at, w in ((0, gate_up), (3, down)):
            parts[at] = [p.packed for p in w.parts]
            parts[at + 1] = [p.fmt.code for p in w.parts]
            parts[at + 2] = [p.n for p in w.parts]
    return ext.MoEBlock(
        experts, router, top_k, norm_topk, MAX_M, *parts, gate, panel_n, router_bias, topk_first
    )
