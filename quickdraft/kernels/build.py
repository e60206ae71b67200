"""Build and load the C++ CPU extension (`quickdraft_cpu`), and the CPU features it may use.

Contract: `extension()` returns the compiled module, building it on first use (a JIT build with
torch's cpp_extension and ninja, ~1-2 min on 2 cores, cached under
`$QUICKDRAFT_HOME/torch_extensions`), or None where it cannot run: not x86-64 with AVX2 + FMA +
F16C (the baseline every source is compiled for), the build failed (one RuntimeWarning, then
the torch references for the whole process), or `QUICKDRAFT_NO_KERNELS=1` was set when this
module was imported (read once: an environment lookup per op cost ~8 us, 2-3 % of a decode
step; `disabled` holds it, tests patch it). Every op module (linear_bf16.py, linear_int.py,
pointwise.py, attention.py, gdn.py, dense_layer.py) calls its kernel only through `extension()`
and falls back to its plain torch reference otherwise, so a machine without a compiler still
runs.

CPU features are read at run time (`cpu_flags`, /proc/cpuinfo): a kernel that needs more than
the baseline (AVX-512, VNNI, AMX) checks for it before it runs, and never runs where it is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from quickdraft.config import cache_dir

log = logging.getLogger(__name__)

DISABLE_ENV = "QUICKDRAFT_NO_KERNELS"
disabled = os.environ.get(DISABLE_ENV) == "1"
# How far ahead the panel kernels prefetch their weight stream (panel_driver.h), in bytes; read
# once, like DISABLE_ENV. Unset: measured when a model loads (prefetch.py), and before that
# `PREFETCH_BYTES` by CPU vendor.
PREFETCH_ENV = "QUICKDRAFT_PREFETCH_BYTES"
_prefetch_setting = os.environ.get(PREFETCH_ENV)


@dataclasses.dataclass(frozen=True, slots=True)
class Tuned:
    """What kernels/prefetch.py's `tune` measured over a loaded model: the distances it set,
    each candidate's median GB/s (empty where the model had no operands of that group), and
    the operand bytes of the model it ran over."""

    distance: int
    distance_32: int
    gbs: dict[int, float]
    gbs_32: dict[int, float]
    model_bytes: int


# `tune`'s measurement, which then holds the distances; None until a model was tuned
_tuned: Tuned | None = None
# Before that (and for a model too small to tune), measured per vendor (docs/benchmarks.md,
# "Prefetch distance on the AMX Xeon"): on an Intel
# Xeon (AMX) VM 4 KiB streamed the 4-bit panels at 18-23 GB/s with 2 threads and 1.5 KiB at
# 25-28; 4 KiB is what the AMD EPYC hosts were tuned with, and stays theirs until measured.
PREFETCH_BYTES = {"GenuineIntel": 1536}
DEFAULT_PREFETCH_BYTES = 4096
# The GGUF formats of 32-value blocks (Q4_0 ... Q8_0, IQ4_NL, MXFP4) in one-row passes apart,
# where measured: on the AVX-512 EPYC (Zen 4) a decode step streamed them faster with no software
# prefetch (gpt-oss's MXFP4 experts + Q8_0 1.08-1.10x, Gemma 4's Q5_0 / Q8_0 experts 1.05x) while
# the K-quants lost 22 % without it, and so did passes of more rows (an MXFP4 GEMM of 5 rows 27 %,
# gpt-oss's 5-row forward 15 %): docs/benchmarks.md, "Prefetch distance on the AMX Xeon".
PREFETCH_BYTES_32 = {"AuthenticAMD": 0}

EXT_NAME = "quickdraft_cpu"
_HERE = Path(__file__).resolve().parent
SOURCES = [
    _HERE / f
    for f in (
        "bindings.cpp",
        "linear_bf16.cpp",
        "linear_panel.cpp",
        "linear_panel_avx512.cpp",
        "linear_i8.cpp",
        "linear_q4.cpp",
        "linear_gguf.cpp",
        "linear_gguf_avx512.cpp",
        "linear_gguf_avx512vbmi.cpp",
        "gguf_rows.cpp",
        "moe_gguf.cpp",
        "norm_rope.cpp",
        "gdn_ops.cpp",
        "gdn_delta.cpp",
        "pick.cpp",
        "attention.cpp",
        "attention_avx512.cpp",
        "dense_layer.cpp",
        "gemma4_layer.cpp",
        "hybrid_layer.cpp",
    )
]
BASELINE_FLAGS = frozenset({"avx2", "fma", "f16c"})  # what every source is compiled for
# the flags that decide which kernel path can run; benchmarks report them with every figure
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512vbmi",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
# -fopenmp: at::parallel_for is header-inline and runs serially unless compiled with OpenMP;
# the extension then shares torch's already-loaded libgomp pool (same soname).
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded = False
_ext: Any = None  # the compiled module once loaded; None if unsupported or the build failed


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo; empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == field:
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (avx2, avx512f, avx512_vnni, amx_int8...);
    empty where /proc/cpuinfo cannot be read."""
    return frozenset(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD...; empty where /proc/cpuinfo cannot be read."""
    return _cpuinfo("vendor_id")


def cpu_id() -> str:
    """The CPU's family, model and stepping ("6.207.2"), empty where /proc/cpuinfo does not
    say: two VMs of one model name and the same flags were different CPUs with different best
    prefetch distances (docs/benchmarks.md, "The prefetch distance, measured at load")."""
    fields = [_cpuinfo(f) for f in ("cpu family", "model", "stepping")]
    return ".".join(fields) if all(fields) else ""


def prefetch_setting() -> str | None:
    """`QUICKDRAFT_PREFETCH_BYTES` as it was when this module was imported (None: unset)."""
    return _prefetch_setting


def tuned() -> Tuned | None:
    """What `prefetch.tune` measured and set, or None."""
    return _tuned


def set_tuned(tuned: Tuned | None) -> None:
    """Record what prefetch.tune measured and set (its distances are now `prefetch_bytes()`'s
    and `prefetch_bytes_32()`'s); None forgets it."""
    global _tuned
    _tuned = tuned


def prefetch_bytes_32() -> int:
    """The distance of the GGUF formats of 32-value blocks in a one-row pass (a decode step's
    GEMV; more rows take `prefetch_bytes()`): `QUICKDRAFT_PREFETCH_BYTES` when set (it sets
    both), else what `tune` measured, else this CPU vendor's measured best for them, else
    `prefetch_bytes()`."""
    if _prefetch_setting is None and _tuned is not None:
        return _tuned.distance_32
    if _prefetch_setting is None and cpu_vendor() in PREFETCH_BYTES_32:
        return PREFETCH_BYTES_32[cpu_vendor()]
    return prefetch_bytes()


def prefetch_bytes() -> int:
    """The panel kernels' prefetch distance: `QUICKDRAFT_PREFETCH_BYTES` when set (a multiple
    of 64 in [0, 65536]; 0 turns software prefetch off), else what `prefetch.tune` measured over
    the loaded model, else this CPU vendor's measured best."""
    if _prefetch_setting is None and _tuned is not None:
        return _tuned.distance
    if _prefetch_setting is None:
        return PREFETCH_BYTES.get(cpu_vendor(), DEFAULT_PREFETCH_BYTES)
    try:
        value = int(_prefetch_setting)
    except ValueError:
        value = -1
    if not (0 <= value <= 65536 and value % 64 == 0):
        raise ValueError(
            f"{PREFETCH_ENV}={_prefetch_setting!r}: expected a multiple of 64 from 0 to 65536"
        )
    return value


def isa() -> list[str]:
    """This CPU's ISA_FLAGS, in that order."""
    flags = cpu_flags()
    return [f for f in ISA_FLAGS if f in flags]


def runnable(tile_flags: dict[str, frozenset[str]]) -> list[str]:
    """Of a kernel's tiles (name -> the CPU flags it needs, slowest first), those this CPU
    runs, in that order."""
    flags = cpu_flags()
    return [t for t, needs in tile_flags.items() if needs <= flags]


@functools.cache
def source_digest() -> str:
    """A hash of the kernel sources (C++ and headers): what the compiled code is."""
    h = hashlib.sha256()
    for f in sorted(_HERE.glob("*.cpp")) + sorted(_HERE.glob("*.h")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def cpu_supported() -> bool:
    """x86-64 with AVX2, FMA and F16C: the instruction sets the extension is compiled for."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo (not Linux): trust torch's own CPU dispatch level
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return flags >= BASELINE_FLAGS


def build_directory() -> Path:
    """Where the JIT build lives; per torch and Python version so upgrades never mix objects,
    and per source directory: torch rebuilds whenever the sources' paths differ from the last
    build's, so two checkouts sharing one directory rebuilt on every switch."""
    root = cache_dir()
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    where = hashlib.sha256(str(_HERE).encode()).hexdigest()[:8]
    tag = f"{EXT_NAME}-torch{torch.__version__}-py{py}-{where}".replace("+", "_")
    return root / "torch_extensions" / tag


def _ensure_ninja_on_path() -> None:
    # torch's JIT build runs `ninja` from PATH. Always the pip package's (a dependency; next to
    # the venv's python, which is not on PATH when that python is started by its full path),
    # ahead of a system ninja: ninja 1.12 changed how .ninja_log hashes command lines, so two
    # versions taking turns on one build directory ("command line changed") rebuilt every
    # kernel, minutes on 2 cores, at each start after the other one had built.
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # type: ignore[import-not-found,unused-ignore]

        candidates.insert(0, Path(ninja.BIN_DIR))
    except ImportError:
        pass
    for d in candidates:
        if (d / "ninja").exists():
            if shutil.which("ninja") != str(d / "ninja"):
                os.environ["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
            return


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Serialise builds across processes with a kernel lock (released when its holder dies),
    and clear torch's own `lock` file left by a build that was killed: torch waits for that
    file to vanish forever, which hung every later start."""
    with open(directory.with_name(directory.name + ".flock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)  # we hold the lock: nobody builds
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load() -> Any:
    """The compiled extension, building it on first use; None if unsupported or the build failed.
    Never raises: any build problem becomes one RuntimeWarning."""
    global _loaded, _ext
    with _lock:
        if _loaded:
            return _ext
        ext = None
        # a bad setting is the caller's error, not a failed build
        distance, distance_32 = prefetch_bytes(), prefetch_bytes_32()
        if cpu_supported():
            try:
                from torch.utils import cpp_extension

                _ensure_ninja_on_path()
                directory = build_directory()
                directory.mkdir(parents=True, exist_ok=True)
                log.info("building quickdraft CPU kernels in %s (first use only)", directory)
                with _build_lock(directory):
                    ext = cpp_extension.load(
                        name=EXT_NAME,
                        sources=[str(f) for f in SOURCES],
                        extra_cflags=_CFLAGS,
                        extra_ldflags=_LDFLAGS,
                        build_directory=str(directory),
                        verbose=False,
                    )
                ext.set_prefetch_bytes(distance, distance_32)
            except Exception as e:  # a missing compiler must never take the engine down
                warnings.warn(
                    f"quickdraft: building the CPU kernels failed ({type(e).__name__}: {e}); "
                    "using the torch reference ops instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
                ext = None
        _ext, _loaded = ext, True
        return ext


def extension() -> Any:
    """The extension if it may be used right now, else None."""
    if disabled:
        return None
    return _ext if _loaded else _load()


def kernels_available() -> bool:
    """True when the C++ kernels can run here (builds them on the first call)."""
    return extension() is not None


def kernel_calls() -> int:
    """How many calls have run a weight-GEMM kernel in this process (0 if it is not built)."""
    return int(_ext.kernel_calls()) if _ext is not None else 0
