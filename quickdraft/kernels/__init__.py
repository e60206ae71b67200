"""CPU compute kernels. `linear` is the one entry point for weight GEMMs (see cpu_linear.py)."""

from quickdraft.kernels.cpu_linear import (
    kernel_calls,
    kernels_available,
    linear,
    path_for,
    reference_linear,
)

__all__ = ["kernel_calls", "kernels_available", "linear", "path_for", "reference_linear"]
