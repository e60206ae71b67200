"""CPU compute kernels, one module per op family, each with its plain torch reference beside
the kernel: weight GEMMs (gemm.py dispatches over linear_bf16.py and linear_int.py), per-token
ops (pointwise.py), attention (attention.py), Gated DeltaNet (gdn.py), a fused dense layer
(dense_layer.py). build.py builds the one C++ extension they share (bindings.cpp) and reads the
CPU's features."""

from quickdraft.kernels.build import kernel_calls, kernels_available
from quickdraft.kernels.gemm import Weight, panels_apply, project, to_panels
from quickdraft.kernels.linear_bf16 import PanelWeight, linear, linear_panel, reference_linear
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight, linear_int4, linear_int8

__all__ = [
    "Int4Weight",
    "Int8Weight",
    "PanelWeight",
    "Weight",
    "kernel_calls",
    "kernels_available",
    "linear",
    "linear_int4",
    "linear_int8",
    "linear_panel",
    "panels_apply",
    "project",
    "reference_linear",
    "to_panels",
]
