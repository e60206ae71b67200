"""CPU compute kernels. `linear` is the one entry point for weight GEMMs (see cpu_linear.py)."""

from quickdraft.kernels.cpu_linear import (
    Int4Weight,
    Int8Weight,
    PanelWeight,
    kernel_calls,
    kernels_available,
    linear,
    linear_int4,
    linear_int8,
    linear_panel,
    path_for,
    reference_linear,
)

__all__ = [
    "Int4Weight",
    "Int8Weight",
    "PanelWeight",
    "kernel_calls",
    "kernels_available",
    "linear",
    "linear_int4",
    "linear_int8",
    "linear_panel",
    "path_for",
    "reference_linear",
]
