"""Weight GEMMs for decode and speculative verify: a small-M bf16 CPU kernel with safe fallback.

Contract:
    linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N] in x.dtype
computes x @ weight.T (+ bias), the same function as `torch.nn.functional.linear`, except that
a weight/bias of another floating dtype than x is used in x's dtype (the kernel takes fp32 x with
a bf16 weight, so every path does; F.linear itself would raise). It runs the
C++ kernel in `linear_bf16.cpp` (JIT-built on first CPU use, cached under
`$QUICKDRAFT_HOME/torch_extensions`) when all of these hold, and F.linear otherwise:
  * x and weight are on the CPU, the CPU has AVX2 + FMA + F16C, the build succeeded and the
    environment variable QUICKDRAFT_NO_KERNELS was not "1" when this module was imported (set it
    before starting the process to bisect a suspected kernel bug; `disabled` holds it);
  * weight is a contiguous 2-D bf16 tensor and K % 8 == 0;
  * x is bf16 or fp32 and M = x.numel() // K <= MAX_M (no limit on AVX2-only CPUs, where the
    kernel beats torch's bf16 matmul at every measured M; 64 where AVX-512 is present, see
    `default_max_m`);
  * nothing needs a gradient (the kernel has no backward).
The kernel accumulates in fp32 and rounds once to x.dtype, so it matches `reference_linear`
up to summation order. A build failure warns once, then F.linear is used for the process.

Why: decode streams every weight once per token, and a verify pass over k+1 tokens only pays
if it costs about the same as one token. Torch's bf16 CPU matmul without AVX-512 reads the
weights at 5-20 GB/s and its cost grows ~linearly with M; the kernel reads them once per call
at close to DRAM bandwidth for any M (numbers: bench/kernels.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import mmap
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

DISABLE_ENV = "QUICKDRAFT_NO_KERNELS"
# Read once: an os.environ lookup on every GEMM and fused op cost ~8 us each, 2-3 % of a
# speculative decode's wall time (cProfile, Qwen2.5-Coder-1.5B + 0.5B draft).
disabled = os.environ.get(DISABLE_ENV) == "1"

_SOURCES = [
    Path(__file__).with_name(f)
    for f in (
        "linear_bf16.cpp",
        "linear_panel.cpp",
        "linear_i8.cpp",
        "linear_q4.cpp",
        "norm_rope.cpp",
        "gdn_ops.cpp",
        "attention.cpp",
        "dense_layer.cpp",
    )
]
_EXT_NAME = "quickdraft_linear_bf16"
# -fopenmp: at::parallel_for is header-inline and runs serially unless compiled with OpenMP;
# the extension then shares torch's already-loaded libgomp pool (same soname).
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded = False
_ext: Any = None  # the compiled module once loaded; None if unsupported or the build failed


def build_directory() -> Path:
    """Where the JIT build lives; per torch and Python version so upgrades never mix objects,
    and per source directory: torch rebuilds whenever the sources' paths differ from the last
    build's, so two checkouts sharing one directory rebuilt on every switch (~1 min, which a
    server's first request then waited for)."""
    root = Path(os.environ.get("QUICKDRAFT_HOME") or Path.home() / ".cache" / "quickdraft")
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    where = hashlib.sha256(str(_SOURCES[0].resolve().parent).encode()).hexdigest()[:8]
    tag = f"{_EXT_NAME}-torch{torch.__version__}-py{py}-{where}".replace("+", "_")
    return root / "torch_extensions" / tag


def cpu_supported() -> bool:
    """x86-64 with AVX2, FMA and F16C: the instruction sets the kernel is compiled for."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = _cpu_flags()
    if not flags:  # no /proc/cpuinfo (not Linux): trust torch's own CPU dispatch level
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return {"avx2", "fma", "f16c"} <= flags


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def default_max_m() -> int:
    """Largest M routed to the kernel on this CPU.

    Measured on the AVX2-only target (bench/kernels.py): the kernel beats F.linear bf16 at every
    M tried, 1..2048 (1.5x at M=1, 6-7x at M=9..512, 2.3-6x at 2048; torch has no fast bf16
    GEMM without AVX-512), so there is no limit. With AVX-512 (and more so AVX512_BF16/AMX),
    oneDNN has real bf16 GEMMs that should win once weights are reused enough: there, only
    decode/verify-sized M is taken (64; not measured, no such CPU was available).
    """
    flags = _cpu_flags()
    return 64 if any(f.startswith(("avx512", "amx")) for f in flags) else sys.maxsize


MAX_M = default_max_m()  # read by `linear` at each call, so tests may monkeypatch it


def _ensure_ninja_on_path() -> None:
    # torch's JIT build runs `ninja` from PATH; pip installs it next to the venv's python, which
    # is not on PATH when that python is started by its full path.
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # type: ignore[import-not-found,unused-ignore]

        candidates.insert(0, Path(ninja.BIN_DIR))
    except ImportError:
        pass
    for d in candidates:
        if (d / "ninja").exists():
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
        if cpu_supported():
            try:
                from torch.utils import cpp_extension

                _ensure_ninja_on_path()
                directory = build_directory()
                directory.mkdir(parents=True, exist_ok=True)
                log.info("building quickdraft CPU kernels in %s (first use only)", directory)
                with _build_lock(directory):
                    ext = cpp_extension.load(
                        name=_EXT_NAME,
                        sources=[str(f) for f in _SOURCES],
                        extra_cflags=_CFLAGS,
                        extra_ldflags=_LDFLAGS,
                        build_directory=str(directory),
                        verbose=False,
                    )
            except Exception as e:  # a missing compiler must never take the engine down
                warnings.warn(
                    f"quickdraft: building the CPU linear kernel failed ({type(e).__name__}: "
                    f"{e}); using torch.nn.functional.linear instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
                ext = None
        _ext, _loaded = ext, True
        return ext


def _extension() -> Any:
    """The extension if it may be used right now, else None."""
    if disabled:
        return None
    return _ext if _loaded else _load()


def kernels_available() -> bool:
    """True when `linear` can use the C++ kernel here (builds it on the first call)."""
    return _extension() is not None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> [..., N] in x.dtype (see module docstring)."""
    if not x.is_cpu:
        return _fallback(x, weight, bias)  # CUDA etc.: torch's own kernels only
    ext = _extension()
    if ext is None:
        return _fallback(x, weight, bias)
    # One C++ call checks eligibility and runs the kernel or the same fallback as below.
    out: Tensor = ext.linear(x, weight, bias, MAX_M)
    return out


def _fallback(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear, with a weight/bias of another floating dtype cast to x's dtype first."""
    if x.dtype.is_floating_point:
        if weight.dtype != x.dtype and weight.dtype.is_floating_point:
            weight = weight.to(x.dtype)
        if bias is not None and bias.dtype != x.dtype and bias.dtype.is_floating_point:
            bias = bias.to(x.dtype)
    return F.linear(x, weight, bias)


def path_for(
    x: Tensor, weight: Tensor, bias: Tensor | None = None
) -> Literal["kernel", "fallback"]:
    """Which implementation `linear(x, weight, bias)` would run (tests, debugging)."""
    ext = _extension() if x.is_cpu else None
    return "kernel" if ext is not None and ext.eligible(x, weight, bias, MAX_M) else "fallback"


def kernel_calls() -> int:
    """How many calls have run the C++ kernel in this process (0 if it is not built)."""
    return int(_ext.kernel_calls()) if _ext is not None else 0


HUGE_PAGE = 2 << 20


def streamed_empty(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Tensor:
    """An uninitialized CPU tensor for a packed weight that every decode step streams: from
    2 MiB on, on its own anonymous mapping, 2 MiB-aligned and advised to use transparent huge
    pages (Linux, THP in "madvise" or "always" mode). With 4 KiB pages the stream costs a TLB
    miss per page and the hardware prefetcher stops at every page boundary: measured on the
    0.5B draft's int4 weights (40 interleaved rounds, one process), a pass took 8.98 ms (min)
    / 11.84 ms (median) on huge pages vs 10.49 / 13.37 ms. Costs up to 2 MiB of padding per
    weight. Elsewhere, off the CPU or for smaller tensors, plain `torch.empty`."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (
        nbytes < HUGE_PAGE
        or not hasattr(mmap, "MADV_HUGEPAGE")
        or torch.device(device).type != "cpu"
    ):
        return torch.empty(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then map huge pages
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


PANEL = 16  # weight rows per panel of a PanelWeight


@dataclass(frozen=True, slots=True)
class PanelWeight:
    """A bf16 weight [N, K] repacked in panels of 16 rows for `linear_panel.cpp`: `packed`
    [ceil(N / 16), K, 16] holds, for panel p and input k, rows 16p + j at position 2j and
    16p + 8 + j at 2j + 1 (j < 8; rows past N are zero). Each kernel thread then reads one
    sequential stream and up to 6 tokens share one pass over it: measured, a 5-token verify
    costs ~1.0-1.2x a decode step here against 1.3-1.7x with the nn.Linear layout, at the same
    decode speed (bench/kernels.py). Same bytes as the bf16 weight, same values."""

    packed: Tensor  # [P, K, 16] bf16
    out_features: int

    @classmethod
    def pack(cls, weight: Tensor) -> PanelWeight:
        weight = weight.detach()
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            shape = tuple(weight.shape)
            raise ValueError(f"panels hold 2-D bf16 weights, got {weight.dtype} {shape}")
        n, k = weight.shape
        p = (n + PANEL - 1) // PANEL
        padded = F.pad(weight, (0, 0, 0, p * PANEL - n)) if p * PANEL != n else weight
        packed = streamed_empty((p, k, PANEL // 2, 2), torch.bfloat16, weight.device)
        # [p, half, j, k] -> [p, k, j, half]: position 2j + half holds row 16p + 8 half + j
        packed.copy_(padded.reshape(p, 2, PANEL // 2, k).permute(0, 3, 2, 1))
        return cls(packed.view(p, k, PANEL), n)

    def unpack(self) -> Tensor:
        """The weight [N, K] in nn.Linear layout (a copy)."""
        p, k, _ = self.packed.shape
        rows = self.packed.view(p, k, PANEL // 2, 2).permute(0, 3, 2, 1).reshape(p * PANEL, k)
        return rows[: self.out_features].contiguous()

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return self.unpack().to(dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.packed.shape[1]))


def linear_panel(x: Tensor, weight: PanelWeight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x.dtype: the panel kernel when eligible,
    else (GPU, no compiler) the unpacked weight through `linear`'s fallback."""
    ext = _extension() if x.is_cpu else None
    if ext is not None and ext.eligible_panel(x, weight.packed, weight.out_features, bias):
        out: Tensor = ext.linear_panel(x, weight.packed, weight.out_features, bias)
        return out
    return _fallback(x, weight.unpack(), bias)


Q4_GROUP = 32  # weights per group of an Int4Weight; values per activation block (int8 kernels)


def quantize_activations(x: Tensor, k32: int) -> tuple[Tensor, Tensor]:
    """What the integer-dot kernels (quant.h) do to x [..., K]: zero-pad to k32 columns, then
    per block of 32 values xq = round(x / dx) (half to even) with dx = max|x| / 127. Returns
    xq [M, k32 / 32, 32] (integer-valued fp32) and dx [M, k32 / 32]."""
    xs = x.float().reshape(-1, x.shape[-1])
    if k32 != xs.shape[1]:
        xs = F.pad(xs, (0, k32 - xs.shape[1]))
    xs = xs.reshape(xs.shape[0], k32 // Q4_GROUP, Q4_GROUP)
    dx = xs.abs().amax(dim=2) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    return torch.round(xs * inv[..., None]), dx


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A weight [N, K] as int8 with one fp32 scale per output row (symmetric, absmax),
    w ~= q * scale[:, None], in 16-row panels of 4-column quads for `linear_i8.cpp`: `packed`
    [ceil(N / 16), K32 / 4, 64] (K32 = K rounded up to 32) holds packed[p, c, 4j + i] =
    q[16p + j, 4c + i], zero past N and K. The kernel multiplies it with activations quantized
    to int8 per 32 values (`reference_linear`). Half the bytes of bf16; for draft models, whose
    precision only moves the acceptance rate."""

    packed: Tensor  # [P, K32 / 4, 64] int8
    scale: Tensor  # [N] fp32
    in_features: int

    @classmethod
    def quantize(cls, weight: Tensor) -> Int8Weight:
        """Row blocks of ~1 MiB in fp32, each quantized while it is in cache: Qwen2.5-Coder-0.5B's
        `quantize_("int8")` takes 0.8 s instead of 10.2 s with whole-tensor ops, and no fp32
        copy of a whole weight is made; every row comes out exactly as by whole-tensor ops."""
        weight = weight.detach()
        n, k = weight.shape
        q = torch.empty((n, k), dtype=torch.int8, device=weight.device)
        scale = torch.empty(n, dtype=torch.float32, device=weight.device)
        rows = max(1, (1 << 18) // max(k, 1))
        for i in range(0, n, rows):
            w = weight[i : i + rows].float()
            s = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
            q[i : i + rows] = torch.round(w / s[:, None]).clamp_(-127, 127)  # w may alias weight
            scale[i : i + rows] = s
        return cls.from_rows(q, scale)

    @classmethod
    def from_rows(cls, qweight: Tensor, scale: Tensor) -> Int8Weight:
        """From int8 rows [N, K] (values in -127..127) and their fp32 scales [N]."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.shape != qweight.shape[:1]:
            raise ValueError(
                f"need int8 rows [N, K] and scales [N], got {qweight.dtype} "
                f"{tuple(qweight.shape)} and {tuple(scale.shape)}"
            )
        n, k = qweight.shape
        p, k32 = (n + PANEL - 1) // PANEL, (k + Q4_GROUP - 1) // Q4_GROUP * Q4_GROUP
        padded = F.pad(qweight, (0, k32 - k, 0, p * PANEL - n))
        packed = streamed_empty((p, k32 // 4, PANEL, 4), torch.int8, qweight.device)
        # [p, j, c, i] -> [p, c, j, i]: quad c of row 16p + j at bytes 4j..4j + 3
        packed.copy_(padded.reshape(p, PANEL, k32 // 4, 4).transpose(1, 2))
        return cls(packed.view(p, k32 // 4, 4 * PANEL), scale.float().contiguous(), k)

    @property
    def qweight(self) -> Tensor:
        """The int8 rows [N, K] (a copy)."""
        p, quads, _ = self.packed.shape
        rows = self.packed.view(p, quads, PANEL, 4).transpose(1, 2).reshape(p * PANEL, quads * 4)
        return rows[: self.out_features, : self.in_features].contiguous()

    @property
    def out_features(self) -> int:
        return int(self.scale.shape[0])

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def reference_linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """What the kernel computes, in plain torch (tests, fallback): per 32-value block an
        integer dot of the int8 activations with q, times dx, summed in fp32, times the row
        scale (+ bias)."""
        k32 = self.packed.shape[1] * 4
        xq, dx = quantize_activations(x, k32)  # [M, G, 32], [M, G]
        q = F.pad(self.qweight, (0, k32 - self.in_features)).float()
        dots = torch.einsum("mgj,ngj->mng", xq, q.reshape(q.shape[0], -1, Q4_GROUP))  # exact
        y = (dots * dx[:, None]).sum(dim=2) * self.scale
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def linear_int8(x: Tensor, weight: Int8Weight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x.dtype, activations quantized to int8 as
    `Int8Weight.reference_linear` says: the kernel when eligible, else that reference (slow,
    the same function up to summation order)."""
    ext = _extension() if x.is_cpu else None
    if ext is not None and ext.eligible_i8(x, weight.packed, weight.scale, bias):
        out: Tensor = ext.linear_i8(x, weight.packed, weight.scale, bias)
        return out
    return weight.reference_linear(x, bias)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A weight [N, K] in 4 bits: per group of 32 weights of a row, w ~= d * q + mn with q in
    0..15 and d, mn in fp16 (asymmetric min/max, as GGUF's Q4_1), in 16-row panels for
    `linear_q4.cpp`: `packed` [ceil(N / 16), K / 32, 320] uint8 holds per panel p and group g
    8 quads of 32 bytes (quad c, byte 4j + i = q[16p + j][32g + 4c + i] | q[16p + 8 + j][...]
    << 4 for j < 8, i < 4), then the panel's 16 fp16 d, then its 16 fp16 mn (rows past N: 0).
    ~0.63 bytes per weight (int8: 1, bf16: 2). The kernel multiplies it with activations
    quantized to int8 per 32 values (see `reference_linear`); for draft models, where
    precision only moves the acceptance rate."""

    packed: Tensor  # [P, K / 32, 320] uint8
    out_features: int
    in_features: int

    @classmethod
    def quantize(cls, weight: Tensor) -> Int4Weight:
        """Panels of rows in blocks of ~1 MiB of fp32, each quantized while it is in cache (no
        fp32 copy of the whole weight)."""
        weight = weight.detach()
        n, k = weight.shape
        if k % Q4_GROUP:
            raise ValueError(f"int4 weights need in_features % {Q4_GROUP} == 0, got {k}")
        groups, p = k // Q4_GROUP, (n + PANEL - 1) // PANEL
        shape = (p, groups, Q4_GROUP * PANEL // 2 + 4 * PANEL)
        packed = streamed_empty(shape, torch.uint8, weight.device)
        step = max(1, (1 << 18) // (k * PANEL))  # panels per block
        for p0 in range(0, p, step):
            w = weight[p0 * PANEL : (p0 + step) * PANEL].float()
            w = F.pad(w, (0, 0, 0, -w.shape[0] % PANEL)).reshape(-1, groups, Q4_GROUP)
            lo, hi = w.amin(dim=2), w.amax(dim=2)
            d, mn = ((hi - lo) / 15).half(), lo.half()
            # quantize against the fp16-rounded scale and min, the values the kernel will use
            d32 = d.float().clamp_min(torch.finfo(torch.float16).tiny)
            q = torch.round((w - mn.float()[..., None]) / d32[..., None]).clamp_(0, 15)
            q = q.to(torch.uint8).reshape(-1, 2, 8, groups, 8, 4)  # [p, half, j, g, c, i]
            nib = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 3, 1, 4)  # [p, g, c, j, i]
            scales = torch.cat([d.reshape(-1, PANEL, groups), mn.reshape(-1, PANEL, groups)], 1)
            packed[p0 : p0 + nib.shape[0]] = torch.cat(
                [
                    nib.reshape(nib.shape[0], groups, -1),
                    scales.transpose(1, 2).contiguous().view(torch.uint8),
                ],
                dim=2,
            )
        return cls(packed, n, k)

    def _parts(self) -> tuple[Tensor, Tensor, Tensor]:
        """d, mn [N, G] fp32 and q [N, G, 32] (values 0..15, float)."""
        p, groups, _ = self.packed.shape
        nib = self.packed[..., : Q4_GROUP * PANEL // 2].reshape(p, groups, 8, 8, 4)  # g c j i
        q = torch.stack([nib & 0x0F, nib >> 4], dim=1)  # [p, half, g, c, j, i]
        q = q.permute(0, 1, 4, 2, 3, 5).reshape(p * PANEL, groups, Q4_GROUP)
        scales = self.packed[..., Q4_GROUP * PANEL // 2 :].contiguous().view(torch.float16)
        scales = scales.float().reshape(p, groups, 2, PANEL).permute(2, 0, 3, 1)  # [2, p, j, g]
        n = self.out_features
        d, mn = scales.reshape(2, p * PANEL, groups)[:, :n]
        return d, mn, q[:n].float()

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        d, mn, q = self._parts()
        w = d[..., None] * q + mn[..., None]
        return w.reshape(self.out_features, self.in_features).to(dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def reference_linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """What the kernel computes, in plain torch (tests, fallback): x quantized per 32
        values to int8 with dx = max|x| / 127 (round half to even), integer dot with q per
        group, then d * dx * dot + mn * dx * sum(xq) per group, summed in fp32."""
        xq, dx = quantize_activations(x, self.in_features)  # [M, G, 32], [M, G]
        sx = dx * xq.sum(dim=2)  # [M, G]
        d, mn, q = self._parts()  # [N, G], [N, G, 32]
        dots = torch.einsum("mgj,ngj->mng", xq, q)  # exact: integers < 2^24
        y = (d[None] * dx[:, None] * dots + mn[None] * sx[:, None]).sum(dim=2)
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def linear_int4(x: Tensor, weight: Int4Weight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x.dtype, activations quantized to int8 as
    `Int4Weight.reference_linear` says: the kernel when eligible, else that reference (slow,
    the same function up to summation order)."""
    ext = _extension() if x.is_cpu else None
    if ext is not None and ext.eligible_q4(x, weight.packed, weight.out_features, bias):
        out: Tensor = ext.linear_q4(x, weight.packed, weight.out_features, bias)
        return out
    return weight.reference_linear(x, bias)


def reference_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The plain fp32 reference the kernel is tested against."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), weight.float(), b).to(x.dtype)
