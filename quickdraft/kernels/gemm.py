"""The one entry point for weight GEMMs: `project(x, weight, bias)` over every operand format.

A projection's operand (`Weight`) is a plain bf16 / fp32 tensor in nn.Linear layout (linear_bf16
`linear`), bf16 in 16-row panels (`PanelWeight`), int8 with row scales (`Int8Weight`), 4-bit
groups (`Int4Weight`) or a GGUF file's own block formats (`GGUFWeight`); `project` runs the
kernel of its format. Models hold operands of any of these and never branch on the format.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quickdraft.kernels.build import kernels_available
from quickdraft.kernels.linear_bf16 import PanelWeight, linear, linear_panel
from quickdraft.kernels.linear_gguf import GGUFWeight, linear_gguf
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight, linear_int4, linear_int8

# a projection's GEMM operand: bf16/fp32, bf16 in 16-row panels, int8 + row scales, 4-bit, or
# a GGUF file's own block formats
Weight = Tensor | PanelWeight | Int8Weight | Int4Weight | GGUFWeight


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
