"""The panel kernels' prefetch distance, measured on this machine over the model it loads.

How far ahead the int8 / int4 / GGUF panel kernels prefetch their weight stream
(panel_driver.h) decides how much of the host's read bandwidth a decode step gets, and the best
distance belongs to the host, not to its vendor: two 2-core Intel Xeon VMs with the same CPU
flags ranked the distances in opposite orders (docs/benchmarks.md, "The prefetch distance,
measured at load"). `tune` times decode-sized passes (one row, M = 1) over a spread of the
loaded model's own operands at each candidate distance, the candidates in rotation within each
round, and sets the distance whose median rate is highest; the formats of 32-value blocks in
one-row passes (`build.prefetch_bytes_32`) get their own, where the model has such operands.
The distance changes no result bits (tests/test_kernel_build.py), only time.

Not tuned: a model whose panel operands are under MIN_BYTES (it decodes from cache, where the
distance matters little and a pass is too short to time), `QUICKDRAFT_PREFETCH_BYTES` set (the
user's choice), and a model no larger than one tuned before in this process (a draft model
loaded after its target keeps the target's distance: the target's stream is the larger part of
a step).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from quickdraft.kernels import build
from quickdraft.kernels.build import Tuned
from quickdraft.kernels.gemm import Weight, project
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight

log = logging.getLogger(__name__)

CANDIDATES = (1024, 1536, 2048, 3072, 4096, 6144)
# 32-value GGUF formats in one-row passes: no prefetch at all won on the AVX-512 EPYC
CANDIDATES_32 = (0, 1024, 2048, 4096, 6144)
PASS_BYTES = 384 << 20  # operand bytes one timed pass streams, at most
MIN_BYTES = 64 << 20
# the operands whose kernels prefetch at these distances (bf16 panels keep their own scheme)
Panel = GGUFWeight | Int4Weight | Int8Weight
ROUNDS = 3


def operand_bytes(w: Weight) -> int:
    """Bytes of a panel operand's packed tensors (0 for any other operand)."""
    if isinstance(w, GGUFWeight):
        return w.nbytes
    if isinstance(w, Int4Weight):
        return w.packed.numel()
    if isinstance(w, Int8Weight):
        return w.packed.numel() + w.scale.numel() * w.scale.element_size()
    return 0


def _is_32(w: Panel) -> bool:
    return isinstance(w, GGUFWeight) and all(p.fmt.block == 32 for p in w.parts)


def _spread(ops: list[tuple[Panel, int]]) -> list[tuple[Panel, int]]:
    """Every n-th operand (with its bytes), n chosen so that a pass streams at most
    PASS_BYTES: a spread over the layers and operand kinds (a MoE layer's experts sit
    together in the list)."""
    total = sum(n for _, n in ops)
    return ops[:: max(1, math.ceil(total / PASS_BYTES))]


def _rates(
    ops: list[tuple[Panel, int]], candidates: Sequence[int], setter: Any, rounds: int
) -> dict[int, float]:
    """Median GB/s of one-row passes over `ops` at each candidate distance (set by
    `setter(distance)`), the candidates rotated within each round; one untimed pass first
    (a mapped file's pages come in there)."""
    xs = {k: torch.randn(1, k).bfloat16() for k in {w.in_features for w, _ in ops}}
    nbytes = sum(n for _, n in ops)

    def one_pass() -> float:
        t = time.perf_counter()
        for w, _ in ops:
            project(xs[w.in_features], w)
        return time.perf_counter() - t

    one_pass()
    seconds: dict[int, list[float]] = {d: [] for d in candidates}
    for r in range(rounds):
        for i in range(len(candidates)):
            d = candidates[(i + r) % len(candidates)]
            setter(d)
            seconds[d].append(one_pass())
    return {d: round(nbytes / statistics.median(s) / 1e9, 2) for d, s in seconds.items()}


def tune(ops: Sequence[Weight], rounds: int = ROUNDS, min_bytes: int | None = None) -> Tuned | None:
    """Measure and set this machine's prefetch distances over a model's GEMM operands
    (module docstring; `min_bytes` None: MIN_BYTES); None where nothing was tuned."""
    ext = build.extension()
    sized = [(w, operand_bytes(w)) for w in ops if isinstance(w, Panel)]
    model_bytes = sum(n for _, n in sized)
    before = build.tuned()
    if (
        ext is None
        or build.prefetch_setting() is not None
        or model_bytes < (MIN_BYTES if min_bytes is None else min_bytes)
        or (before is not None and before.model_bytes >= model_bytes)
    ):
        return None
    t = time.perf_counter()
    distance, distance_32 = build.prefetch_bytes(), build.prefetch_bytes_32()
    main = _spread([(w, n) for w, n in sized if not _is_32(w)])
    short = _spread([(w, n) for w, n in sized if _is_32(w)])
    gbs: dict[int, float] = {}
    gbs_32: dict[int, float] = {}
    try:
        if main:
            gbs = _rates(main, CANDIDATES, lambda d: ext.set_prefetch_bytes(d, distance_32), rounds)
            distance = max(gbs, key=lambda d: gbs[d])
        if short:
            gbs_32 = _rates(
                short, CANDIDATES_32, lambda d: ext.set_prefetch_bytes(distance, d), rounds
            )
            distance_32 = max(gbs_32, key=lambda d: gbs_32[d])
        else:  # no such operands: they follow the vendor's rule from the distance found
            distance_32 = build.PREFETCH_BYTES_32.get(build.cpu_vendor(), distance)
    finally:
        ext.set_prefetch_bytes(distance, distance_32)
    got = Tuned(distance, distance_32, gbs, gbs_32, model_bytes)
    build.set_tuned(got)
    log.info(
        "prefetch distance %d bytes (GB/s by distance %s), 32-value formats %d (%s); "
        "measured in %.1f s",
        distance,
        gbs,
        distance_32,
        gbs_32,
        time.perf_counter() - t,
    )
    return got
