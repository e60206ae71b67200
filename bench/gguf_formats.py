"""Each GGUF block format's GEMM against llama.cpp's on the same shape, type and thread count.

llama.cpp's side is its own operator benchmark, `test-backend-ops perf -o MUL_MAT` (built
from the llama.cpp source llama-cpp-python vendors: `cmake -DLLAMA_BUILD_TESTS=ON`, target
test-backend-ops): a [4096, 14336] weight (Llama-3-8B's ffn_down) times M = 1, 2, 3, 4, 5, 8
fp32 columns, random values, timed on the same tensor call after call, on its CPU backend
with hardware_concurrency / 2 threads. quickdraft's side is linear_gguf on random blocks of
the same format and shape, also one tensor call after call, with as many threads (set here
from the peer's rule, 1 on a 2-core host). The same weight bytes either way: GB/s is the
GGUF file's bytes of the weight over the time, for both. M = 6 (a 5-token verify) runs only
on our side: the peer's perf set has no 6.

    python bench/gguf_formats.py --peer /path/to/test-backend-ops --save
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from quickdraft.bench.report import machine, table, write
from quickdraft.kernels.build import extension
from quickdraft.kernels.linear_gguf import FORMATS, GGUFWeight, linear_gguf, random_blocks

N, K = 4096, 14336  # the weight of test-backend-ops perf's MUL_MAT cases
PEER_MS = (1, 2, 3, 4, 5, 8)  # the token counts its perf set runs
NAMES = ["Q4_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"]


def ggml_type(name: str) -> str:
    """The type as ggml prints it: q4_K, iq4_xs, mxfp4."""
    low = name.lower()
    return low[:-1] + "K" if low.endswith("_k") else low


def peer_times(peer: Path, name: str) -> dict[int, float]:
    """test-backend-ops' microseconds per MUL_MAT of `name` at each of PEER_MS (its console
    lines: "MUL_MAT(type_a=...,n=5,k=14336,...): 84 runs - 11989.58 us/run - ...")."""
    pattern = f"type_a={ggml_type(name)},type_b=f32,m={N},n=({'|'.join(map(str, PEER_MS))}),k={K},"
    out = subprocess.run(
        [str(peer), "perf", "-b", "CPU", "-o", "MUL_MAT", "-p", pattern],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = re.compile(
        rf"MUL_MAT\(type_a={ggml_type(name)},type_b=f32,m={N},n=(\d+),k={K},.*?"
        r"\s(\d+) runs -\s+([\d.]+) us/run"
    )
    return {int(m[1]): float(m[3]) for m in line.finditer(out) if int(m[1]) in PEER_MS}


def best_seconds(fn: Callable[[], Any], budget_s: float) -> float:
    for _ in range(3):
        fn()  # warm-up: page-in, thread pool, dispatch caches
    best, start, reps = float("inf"), time.perf_counter(), 0
    while reps < 10 or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return best


def main() -> None:
    host = machine()
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--peer", type=Path, help="llama.cpp's test-backend-ops binary")
    ap.add_argument("--formats", nargs="*", default=NAMES, choices=list(FORMATS))
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 5, 6, 8])
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    ap.add_argument("--save", action="store_true", help="write bench/results/gguf-formats.*")
    args = ap.parse_args()
    if extension() is None:
        sys.exit("the C++ extension is not available here: nothing to measure")
    threads = max(1, (os.cpu_count() or 2) // 2)  # the peer's CPU backend: hardware / 2
    torch.set_num_threads(threads)
    rows: list[dict[str, Any]] = []
    for name in args.formats:
        fmt = FORMATS[name]
        file_bytes = N * K // fmt.block * fmt.block_bytes
        w = GGUFWeight.from_raw(name, random_blocks(fmt, N, K, seed=0), K)
        theirs = peer_times(args.peer, name) if args.peer else {}
        for m in sorted(set(args.ms) | (set(theirs) & set(args.ms))):
            x = torch.randn(m, K)
            ours = best_seconds(partial(linear_gguf, x, w), args.budget)
            peer = theirs.get(m)
            rows.append(
                {
                    "format": name,
                    "M": m,
                    "ours_us": round(ours * 1e6, 1),
                    "ours_gbs": round(file_bytes / ours / 1e9, 2),
                    "llama_us": None if peer is None else round(peer, 1),
                    "llama_gbs": None if peer is None else round(file_bytes / peer / 1e3, 2),
                    "speedup": None if peer is None else round(peer / (ours * 1e6), 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "shape": [N, K],
        "threads": threads,
        "peer": str(args.peer) if args.peer else None,
        "rows": rows,
        "machine": host,
    }
    if args.save:
        write("gguf-formats", result, markdown(result), plot(result))
    else:
        print(json.dumps(result))


def markdown(result: dict[str, Any]) -> str:
    n, k = result["shape"]
    head = (
        f"GGUF block formats: one [{n}, {k}] weight (the GEMM of llama.cpp's `test-backend-ops "
        f"perf -o MUL_MAT`) times M fp32 rows, {result['threads']} thread(s) on both sides, the "
        "same tensor call after call; GB/s = the weight's GGUF bytes / time. speedup = "
        "llama.cpp's time / ours.\n\n"
    )
    cols = ["format", "M", "ours_us", "ours_gbs", "llama_us", "llama_gbs", "speedup"]
    body = table(cols, [[r[c] if r[c] is not None else "-" for c in cols] for r in result["rows"]])
    return head + body + "\n"


def plot(result: dict[str, Any]) -> Callable[[Any], None]:
    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        names = list(dict.fromkeys(r["format"] for r in result["rows"]))
        for m in sorted({r["M"] for r in result["rows"] if r["speedup"] is not None}):
            ys = [
                next((r["speedup"] for r in result["rows"] if r["format"] == nm and r["M"] == m), 0)
                for nm in names
            ]
            ax.plot(names, ys, marker="o", label=f"M={m}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("llama.cpp time / ours")
        ax.set_title(f"GGUF GEMM [{result['shape'][0]}x{result['shape'][1]}] vs llama.cpp")
        ax.legend()

    return draw


if __name__ == "__main__":
    main()
