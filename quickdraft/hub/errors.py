"""The hub's errors: each message names the file, part or model at fault."""

from __future__ import annotations


class HubError(Exception):
    """Base class: fetching, assembling or converting a model failed."""


class UnknownModelError(HubError):
    """The model argument is neither a catalog name, an HF directory nor a .gguf file."""


class ChecksumError(HubError):
    """An assembled file does not have the expected sha256."""


class UnsupportedArchitectureError(HubError):
    """The GGUF holds an architecture our converter/model code cannot handle."""
