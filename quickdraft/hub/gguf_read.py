"""Reading a GGUF file's header with the gguf package, checked before any tensor is viewed.

Stage: the first read of every GGUF (hub/convert.py, models/formats/gguf_loader.py,
models/formats/gguf_vision.py). Contract: `read_gguf(path)` is the gguf package's `GGUFReader`,
except that a tensor whose data would run past the end of the file (a truncated download), whose
values are not whole blocks of its type, or whose type is unknown raises `GGUFDataError` naming that
tensor, its type and shape, instead of the reader's bare reshape error about some array; nothing has
been mapped into memory for the weights yet when it does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES


class GGUFDataError(ValueError):
    """A tensor of the file cannot be what its header says (message names it)."""


class _CheckedReader(GGUFReader):
    # The reader builds every tensor's view in `_build_tensors`; the check runs first, over
    # the same header fields (name, dims, type, offset), against the file's length.
    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            shape = tuple(int(d) for d in reversed(dims.tolist()))
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise GGUFDataError(
                    f"tensor {name}: unknown GGML type {int(raw_dtype[0])}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims))
            if count % block:
                raise GGUFDataError(
                    f"tensor {name} {shape}: {count} values are not whole {qtype.name} blocks "
                    f"of {block}"
                )
            end = start_offs + int(offset[0]) + count // block * type_size
            if end > size:
                raise GGUFDataError(
                    f"tensor {name} ({qtype.name} {shape}) ends at byte {end:,} but the file "
                    f"has {size:,} bytes: truncated (an incomplete download?)"
                )
        super()._build_tensors(start_offs, fields)


def gguf_fp32(t: Any) -> torch.Tensor:
    """Reader tensor `t` dequantized to fp32 in torch order (ggml lists dimensions fastest
    first); a copy only where the values would otherwise be the read-only mapping."""
    from gguf.quants import dequantize

    arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    if not arr.flags.writeable:  # unquantized tensors come back as the mapping itself
        arr = arr.copy()
    return torch.from_numpy(arr).reshape([int(d) for d in reversed(t.shape)])


def read_gguf(path: Path | str) -> GGUFReader:
    """The file's reader (module docstring); GGUFDataError names a tensor the file cannot hold."""
    return _CheckedReader(str(path))


# GGUF value types (gguf's GGUFValueType) -> fixed sizes in bytes; 8 is a string, 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_architecture(path: Path | str) -> str | None:
    """The file's `general.architecture`, read from the header's key-value pairs up to that
    key (the writers put it first), without the reader's pass over every field and tensor: that
    took ~7 s for a 151k-token vocabulary. None for a file that is not GGUF or lacks the key."""
    import struct

    def skip(f: Any, kind: int) -> None:
        if kind == 8:
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(n, 1)
        elif kind == 9:
            elem, count = struct.unpack("<IQ", f.read(12))
            if elem in _SIZES:
                f.seek(count * _SIZES[elem], 1)
            else:
                for _ in range(count):
                    skip(f, elem)
        elif kind in _SIZES:
            f.seek(_SIZES[kind], 1)
        else:
            raise ValueError(f"GGUF value type {kind}")

    try:
        with open(path, "rb") as f:
            magic, _version, _tensors, pairs = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF":
                return None
            for _ in range(pairs):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(n).decode("utf-8", errors="replace")
                (kind,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and kind == 8:
                    (n,) = struct.unpack("<Q", f.read(8))
                    return f.read(n).decode("utf-8", errors="replace")
                skip(f, kind)
    except (OSError, ValueError, struct.error):
        return None
    return None
