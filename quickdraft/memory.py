"""The process's memory: handing freed heap pages back to the system after a conversion, and
keeping a served model's objects out of the garbage collector's way."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). A repack, a
    quantization or a tokenizer conversion frees GBs of temporaries (the GGUF's parsed
    vocabulary, dequantized rows, replaced operands) in blocks that glibc keeps for reuse, and a
    server would hold them as resident memory for good: 0.74 GB after the default pair's first
    start. A no-op off glibc."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


def freeze_loaded() -> None:
    """Move every object alive now (a loaded model's modules, tensors, tokenizer) out of the
    garbage collector's generations: they live as long as the process, and its full
    collections walked all ~200k of them every few hundred decode steps (Python's gc was 4 %
    of a 40-layer MoE step's samples at tiny widths, bench/moe.py --narrow). What the process
    allocates later is collected as before. For a process that serves one model; vLLM does
    the same after start-up."""
    gc.collect()
    gc.freeze()
