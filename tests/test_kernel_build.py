"""Building and loading the C++ extension (kernels/build.py): it builds where the CPU allows,
`QUICKDRAFT_NO_KERNELS=1` and `disabled` turn it off, a failed build warns once and falls back,
an unsupported CPU never builds, and a killed build's lock never hangs the next one."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import make, needs_kernel

from quickdraft.kernels import (
    Int4Weight,
    Int8Weight,
    build,
    kernel_calls,
    kernels_available,
    linear,
    linear_int4,
    linear_int8,
)
from quickdraft.kernels.linear_bf16 import path_for
from quickdraft.kernels.linear_gguf import TILES, cpu_tiles

pytestmark = pytest.mark.usefixtures("kernels_enabled")


def test_kernel_builds_when_cpu_supports_it() -> None:
    if not build.cpu_supported():
        pytest.skip("CPU lacks AVX2/FMA/F16C: the kernel cannot run here")
    assert kernels_available(), "AVX2 CPU but the kernel did not build (see the warning)"


@needs_kernel
def test_env_var_disables_the_kernels_for_the_process() -> None:
    code = "from quickdraft.kernels import build; print(build.disabled, build.kernels_available())"
    env = {**os.environ, build.DISABLE_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


@needs_kernel
def test_linear_disabled_forces_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = make(4, 64, 64, True, torch.bfloat16)
    monkeypatch.setattr(build, "disabled", True)
    assert not kernels_available()
    assert path_for(x, w, b) == "fallback"
    before = kernel_calls()
    out = linear(x, w, b)
    assert kernel_calls() == before
    assert torch.equal(out, F.linear(x, w, b))


@pytest.fixture()
def _fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pretend the extension was never loaded; the real state is restored afterwards."""
    monkeypatch.setattr(build, "_loaded", False)
    monkeypatch.setattr(build, "_ext", None)
    yield


@pytest.mark.usefixtures("_fresh_loader")
def test_build_failure_warns_once_then_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    calls = []

    def broken_load(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "load", broken_load)
    monkeypatch.setattr(build, "cpu_supported", lambda: True)
    x, w, b = make(3, 8, 64, True, torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="building the CPU kernels failed"):
        out = linear(x, w, b)
    assert torch.equal(out, F.linear(x, w, b))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning (or a rebuild) would fail here
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))
        assert not kernels_available()
    assert len(calls) == 1


@pytest.mark.usefixtures("_fresh_loader")
def test_unsupported_cpu_never_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("tried to build on an unsupported CPU")

    monkeypatch.setattr(cpp_extension, "load", must_not_build)
    monkeypatch.setattr(build, "cpu_supported", lambda: False)
    x, w, b = make(2, 8, 64, False, torch.bfloat16)
    assert not kernels_available()
    assert path_for(x, w, b) == "fallback"
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_build_lock_clears_a_killed_builds_torch_lock(tmp_path: Path) -> None:
    """torch's JIT build waits forever on a `lock` file a killed build left behind (this hung
    every later start once); under our process lock that file is stale and goes."""
    from quickdraft.kernels.build import _build_lock

    directory = tmp_path / "ext"
    directory.mkdir()
    (directory / "lock").touch()
    with _build_lock(directory):
        assert not (directory / "lock").exists()


@needs_kernel
def test_prefetch_distance_never_changes_a_result() -> None:
    """Every panel kernel (int8, int4, GGUF on each tile, a K-quant and a 32-value format)
    gives the same bits with software prefetch off, at the default distances, far past the end
    of the weight (a prefetch never faults) and with the two distances apart, and the settings
    are restored."""
    from test_linear_gguf import random_blocks

    from quickdraft.kernels.linear_gguf import GGUFWeight, linear_gguf

    ext = build.extension()
    torch.manual_seed(0)
    k = 512
    w = torch.randn(40, k) * 0.05
    ops = [
        (linear_int8, Int8Weight.quantize(w)),
        (linear_int4, Int4Weight.quantize(w)),
        *(
            (linear_gguf, GGUFWeight.from_raw(f, random_blocks(f, 40, k, 0), k))
            for f in ("Q4_K", "Q4_0")
        ),
    ]
    tiles = [TILES[t] for t in cpu_tiles()]
    default, default_32 = build.prefetch_bytes(), build.prefetch_bytes_32()
    try:
        for m in (1, 6):
            x = torch.randn(m, k).bfloat16()
            for tile in tiles:
                ext.gguf_isa(tile)
                for fn, q in ops:
                    outs = []
                    for distance, distance_32 in (
                        (0, 0),
                        (64, 4096),
                        (default, default_32),
                        (65536, 64),
                        (4096, -1),
                    ):
                        assert ext.set_prefetch_bytes(distance, distance_32) == distance
                        outs.append(fn(x, q))
                    assert all(torch.equal(outs[0], o) for o in outs[1:]), (fn.__name__, m, tile)
    finally:
        ext.gguf_isa(-1)
        ext.set_prefetch_bytes(default, default_32)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ext.set_prefetch_bytes(100)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ext.set_prefetch_bytes(default, -2)


def test_prefetch_distance_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """QUICKDRAFT_PREFETCH_BYTES overrides the vendor's distance; a bad value is a clear error
    naming the variable, raised before any build."""
    monkeypatch.setattr(build, "_prefetch_setting", None)
    monkeypatch.setattr(build, "_tuned", None)  # what a model's load measured: prefetch.py
    vendor = build.cpu_vendor()
    assert build.prefetch_bytes() == build.PREFETCH_BYTES.get(vendor, build.DEFAULT_PREFETCH_BYTES)
    assert build.prefetch_bytes_32() == build.PREFETCH_BYTES_32.get(vendor, build.prefetch_bytes())
    for vendor, distance_32 in (("AuthenticAMD", 0), ("GenuineIntel", 1536), ("", 4096)):
        monkeypatch.setattr(build, "cpu_vendor", lambda vendor=vendor: vendor)
        assert build.prefetch_bytes_32() == distance_32
    monkeypatch.setattr(build, "_prefetch_setting", "0")
    assert build.prefetch_bytes() == build.prefetch_bytes_32() == 0
    monkeypatch.setattr(build, "_prefetch_setting", "8192")
    assert build.prefetch_bytes() == build.prefetch_bytes_32() == 8192
    for bad in ("100", "-64", "1e3", "131072", ""):
        monkeypatch.setattr(build, "_prefetch_setting", bad)
        with pytest.raises(ValueError, match=build.PREFETCH_ENV):
            build.prefetch_bytes()
        with pytest.raises(ValueError, match=build.PREFETCH_ENV):
            build.prefetch_bytes_32()
