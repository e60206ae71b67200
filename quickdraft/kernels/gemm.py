"""The one entry point for weight GEMMs: `project(x, weight, bias)` over every operand format.

A projection's operand (`Weight`) is a plain bf16 / fp32 tensor in nn.Linear layout (linear_bf16
`linear`), bf16 in 16-row panels (`PanelWeight`), int8 with row scales (`Int8Weight`), 4-bit
groups (`Int4Weight`) or a GGUF file's own block formats (`GGUFWeight` on the CPU,
`DeviceGGUFWeight` on a GPU); `project` runs the
kernel of its format. Models hold operands of any of these and never branch on the format.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quickdraft.kernels import triton_linear
from quickdraft.kernels.build import kernels_available
from quickdraft.kernels.linear_bf16 import PANEL, PanelWeight, linear, linear_panel
from quickdraft.kernels.linear_gguf import GGUFPart, GGUFWeight, linear_gguf
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight, linear_int4, linear_int8
from quickdraft.kernels.triton_gguf import DeviceGGUFWeight
from quickdraft.kernels.triton_gguf import linear as linear_device_gguf
from quickdraft.kernels.triton_gguf import rows as rows_device_gguf

# a projection's GEMM operand: bf16/fp32, bf16 in 16-row panels, int8 + row scales, 4-bit, or
# a GGUF file's own block formats (on the CPU, or on a GPU in the Triton kernels' layout)
Weight = Tensor | PanelWeight | Int8Weight | Int4Weight | GGUFWeight | DeviceGGUFWeight


def project(x: Tensor, weight: Weight, bias: Tensor | None = None) -> Tensor:
    """The one entry point for weight GEMMs (fast bf16 / int8 / int4 kernels when they apply)."""
    if isinstance(weight, PanelWeight):
        return linear_panel(x, weight, bias)
    if isinstance(weight, Int8Weight):
        return linear_int8(x, weight, bias)
    if isinstance(weight, Int4Weight):
        return linear_int4(x, weight, bias)
    if isinstance(weight, GGUFWeight):
        return linear_gguf(x, weight, bias)
    if isinstance(weight, DeviceGGUFWeight):
        return linear_device_gguf(x, weight, bias)
    if triton_linear.applies(x, weight):  # a GPU's decode / verify rows: batch-invariant
        return triton_linear.linear(x, weight, bias)
    return linear(x, weight, bias)


def panels_apply(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 operands should become PanelWeights: bf16 on a CPU where the kernels run."""
    return dtype == torch.bfloat16 and device.type == "cpu" and kernels_available()


def to_panels(weight: Weight) -> Weight:
    """`convert` for convert_operands_: bf16 tensors become PanelWeights, anything else (fp32,
    already packed or quantized) stays as it is."""
    if isinstance(weight, Tensor) and weight.dtype == torch.bfloat16 and weight.dim() == 2:
        return PanelWeight.pack(weight)
    return weight


def panel_rows(weight: Weight, p0: int, p1: int, copy: bool = True) -> Weight:
    """Output rows [16 p0, 16 p1) (clipped to N) of an operand, in its own format: the packed
    formats store rows in panels of 16, so whole panels slice exactly. A copy, so the rest of
    the weight can be freed; `copy=False`: views of it, for a caller that keeps it anyway."""

    def cut(t: Tensor, lo: int, hi: int) -> Tensor:
        return t[lo:hi].clone() if copy else t[lo:hi]

    n = weight.shape[0]
    r0, r1 = p0 * PANEL, min(p1 * PANEL, n)
    if r0 >= r1:
        raise ValueError(f"rows [{r0}, {r1}) of a {n}-row weight")
    if isinstance(weight, Tensor):
        return cut(weight, r0, r1)
    if isinstance(weight, PanelWeight):
        return PanelWeight(cut(weight.packed, p0, p1), r1 - r0)
    if isinstance(weight, Int8Weight):
        scale = cut(weight.scale, r0, r1)
        return Int8Weight(cut(weight.packed, p0, p1), scale, weight.in_features)
    if isinstance(weight, Int4Weight):
        return Int4Weight(cut(weight.packed, p0, p1), r1 - r0, weight.in_features)
    if isinstance(weight, DeviceGGUFWeight):
        return weight.row_range(r0, r1, copy)
    if len(weight.parts) != 1:
        raise ValueError("rows of a fused GGUF operand (several formats) are not sliced")
    part = GGUFPart(weight.parts[0].fmt, cut(weight.parts[0].packed, p0, p1), r1 - r0)
    return GGUFWeight((part,), weight.in_features)


def dequantized_rows(weight: Weight, ids: list[int]) -> Tensor:
    """Rows `ids` of an operand's values, fp32 [len(ids), K]: each 16-row panel holding any of
    them dequantized once (no copy of the whole weight)."""
    if isinstance(weight, Tensor):
        return weight[ids].float()
    if isinstance(weight, DeviceGGUFWeight):
        picked = torch.tensor(ids, device=weight.device)
        return rows_device_gguf(weight, picked, torch.float32)  # on its device, as a tensor's rows
    by_panel: dict[int, list[int]] = {}
    for at, row in enumerate(ids):
        by_panel.setdefault(row // PANEL, []).append(at)
    out = torch.empty(len(ids), weight.shape[1])
    for p, where in by_panel.items():
        panel = panel_rows(weight, p, p + 1)
        assert not isinstance(panel, DeviceGGUFWeight)
        values = panel.float() if isinstance(panel, Tensor) else panel.dequantize(torch.float32)
        out[where] = values[[ids[at] % PANEL for at in where]]
    return out
