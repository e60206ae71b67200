"""Weight GEMMs for decode and speculative verify: a small-M bf16 CPU kernel with safe fallback.

Contract:
    linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N] in x.dtype
computes x @ weight.T (+ bias) like `torch.nn.functional.linear`. It runs the C++ kernel in
`linear_bf16.cpp` (JIT-built on first use) when all of these hold, else calls F.linear:
  * x and weight on CPU, the CPU has AVX2 + FMA + F16C, `QUICKDRAFT_NO_KERNELS` is not "1";
  * weight is a contiguous 2-D bf16 tensor, K % 8 == 0;
  * x is bf16 or fp32 and M = x.numel() // K <= MAX_M (prefill-sized M goes to oneDNN, whose
    blocked GEMM wins once the weights are re-used enough);
  * no autograd is needed (no input requires grad while grad mode is on).
The kernel accumulates in fp32 and rounds once to x.dtype, so it is at least as accurate as the
reference `reference_linear`; results differ from F.linear only by summation order.
A build failure warns once and then falls back for the life of the process.

Why: decode streams every weight once per token, and a verify pass over k+1 tokens only pays if
it costs about the same as one token. Torch's bf16 CPU matmul without AVX-512 is 5-17 GB/s at
M=1 and grows ~linearly with M; the kernel reads each weight byte once per call for any M.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

MAX_M = 32  # largest token count routed to the kernel (see bench/kernels.py)
DISABLE_ENV = "QUICKDRAFT_NO_KERNELS"

_SOURCE = Path(__file__).with_name("linear_bf16.cpp")
_EXT_NAME = "quickdraft_linear_bf16"
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
# -fopenmp makes at::parallel_for use torch's (already loaded) OpenMP pool; without it the
# header-inline parallel_for silently runs single-threaded.
_LDFLAGS = ["-fopenmp"]

KernelFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "module": extension | None


def build_directory() -> Path:
    """Where the JIT build lives: per torch/Python version, so upgrades never mix objects."""
    root = Path(os.environ.get("QUICKDRAFT_HOME") or Path.home() / ".cache" / "quickdraft")
    tag = f"{_EXT_NAME}-torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
    return root / "torch_extensions" / tag.replace("+", "_")


def cpu_supported() -> bool:
    """x86-64 with AVX2, FMA and F16C (the kernel is compiled with exactly those)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        # No /proc (not Linux): trust torch's own dispatch level instead.
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    for line in text.splitlines():
        if line.startswith("flags"):
            return {"avx2", "fma", "f16c"} <= set(line.split(":", 1)[1].split())
    return False


def _ensure_ninja_on_path() -> None:
    # torch's JIT build runs `ninja` from PATH; the pip package installs it next to the venv's
    # python, which is not on PATH when python is run by full path.
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # type: ignore[import-not-found]

        candidates.insert(0, Path(ninja.BIN_DIR))
    except ImportError:
        pass
    for d in candidates:
        if (d / "ninja").exists():
            os.environ["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
            return


def _load() -> object | None:
    """The compiled extension, building it on first use; None if unsupported or the build failed."""
    with _lock:
        if _state.get("loaded"):
            return _state["module"]
        module: object | None = None
        if cpu_supported():
            try:
                from torch.utils import cpp_extension

                _ensure_ninja_on_path()
                directory = build_directory()
                directory.mkdir(parents=True, exist_ok=True)
                log.info("building quickdraft CPU kernels in %s (first use only)", directory)
                module = cpp_extension.load(
                    name=_EXT_NAME,
                    sources=[str(_SOURCE)],
                    extra_cflags=_CFLAGS,
                    extra_ldflags=_LDFLAGS,
                    build_directory=str(directory),
                    verbose=False,
                )
            except Exception as e:  # never crash the engine over a missing compiler
                warnings.warn(
                    f"quickdraft: building the CPU linear kernel failed ({type(e).__name__}: "
                    f"{e}); using torch.nn.functional.linear instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
                module = None
        _state["module"] = module
        _state["loaded"] = True
        return module


def _kernel() -> KernelFn | None:
    module = _state["module"] if _state.get("loaded") else _load()
    return None if module is None else module.linear_bf16  # type: ignore[attr-defined]


def kernels_available() -> bool:
    """True when `linear` can use the C++ kernel here (builds it on first call)."""
    return os.environ.get(DISABLE_ENV) != "1" and _kernel() is not None


def _select(x: Tensor, weight: Tensor, bias: Tensor | None) -> KernelFn | None:
    """The kernel if this call qualifies (see module docstring), else None for F.linear."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return None
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        return None
    if x.dtype not in (torch.bfloat16, torch.float32) or x.dim() == 0:
        return None
    k = weight.shape[1]
    if k == 0 or k % 8 != 0 or x.shape[-1] != k or x.numel() // k > MAX_M:
        return None
    if bias is not None and (bias.device.type != "cpu" or bias.shape != (weight.shape[0],)):
        return None
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return None  # the kernel has no backward
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    return _kernel()


def path_for(
    x: Tensor, weight: Tensor, bias: Tensor | None = None
) -> Literal["kernel", "fallback"]:
    """Which implementation `linear(x, weight, bias)` would run (for tests and debugging)."""
    return "fallback" if _select(x, weight, bias) is None else "kernel"


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> [..., N] in x.dtype (see module docstring)."""
    fn = _select(x, weight, bias)
    if fn is None:
        return F.linear(x, weight, bias)
    return fn(x, weight, bias)


def reference_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The plain fp32 reference the kernel is tested against."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), weight.float(), b).to(x.dtype)
