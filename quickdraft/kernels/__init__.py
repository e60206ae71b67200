"""CPU compute kernels. `linear` is the single entry point for weight GEMMs (see cpu_linear.py)."""

from quickdraft.kernels.cpu_linear import (
    MAX_M,
    kernels_available,
    linear,
    path_for,
    reference_linear,
)

__all__ = ["MAX_M", "kernels_available", "linear", "path_for", "reference_linear"]
