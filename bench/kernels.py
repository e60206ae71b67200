"""Small-M bf16 linear: quickdraft's CPU kernel vs torch F.linear, per weight shape and M.

For each weight [N, K] (bf16) and token count M: milliseconds per call, weight-read bandwidth
(weight bytes / time) for both, and ours' time(M) / time(M=1), the number that decides whether a
speculative verify pass over M tokens is nearly free. Each timing rotates over enough weight
copies (>= 96 MB) that every call streams its weight from DRAM as in a real decode step, not
from the 32 MB L3; warm-up calls are excluded and the best of the timed repetitions is reported.
Prints a table, then one JSON object as the last line (--save also writes
bench/results/kernels.json).

    python bench/kernels.py                       # all shapes, M in 1 2 5 9 17
    python bench/kernels.py --shapes 17920x1536 --ms 1 9 --knobs 4 2 5 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # works without `pip install -e`
from common import emit, machine, read_bandwidth_gbs

from quickdraft.kernels import cpu_linear

# Qwen2.5-1.5B (qkv, o, gate_up, down, lm_head) and SmolLM2-135M (qkv... see names) weights.
SHAPES: list[tuple[int, int]] = [
    (2048, 1536),
    (1536, 1536),
    (17920, 1536),
    (1536, 8960),
    (151936, 1536),
    (1728, 576),
    (49152, 576),
    (3072, 576),
    (576, 1536),
]
ROTATE_BYTES = 96 << 20


def time_call(fn: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor],
              budget_s: float, min_reps: int) -> float:
    """Best seconds per call, cycling through `weights` so each call reads cold weights."""
    for w in weights[: min(len(weights), 3)]:
        fn(w)  # warm-up: page-in, thread pool start, JIT dispatch caches
    best = float("inf")
    start = time.perf_counter()
    i = reps = 0
    while reps < min_reps or time.perf_counter() - start < budget_s:
        w = weights[i % len(weights)]
        t = time.perf_counter()
        fn(w)
        best = min(best, time.perf_counter() - t)
        i += 1
        reps += 1
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=[f"{n}x{k}" for n, k in SHAPES],
                    help="weights as NxK")
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 2, 5, 9, 17])
    ap.add_argument("--budget", type=float, default=0.15, help="seconds per measurement")
    ap.add_argument("--no-torch", action="store_true", help="skip the F.linear baseline")
    ap.add_argument("--knobs", nargs=8, type=int,
                    metavar=("R1", "RB1", "KB1", "R", "TMAX", "RB", "KB", "PF"),
                    help="kernel tuning: rows/tile, rows/block, k/block at M=1; the same and "
                    "tokens/tile at M>1; prefetch distance (elements)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--hot", action="store_true", help="no weight rotation: cache-resident")
    ap.add_argument("--save", action="store_true", help="also write bench/results/kernels.json")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    module = cpu_linear._load()
    if module is None:
        sys.exit("kernel unavailable (no AVX2/FMA or the build failed)")
    if args.knobs:
        knobs = list(args.knobs)
        ours: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            lambda x, w: module.linear_bf16_tuned(x, w, None, knobs)  # type: ignore[attr-defined]
        )
    else:
        ours = module.linear_bf16  # type: ignore[attr-defined]

    bw = read_bandwidth_gbs(256, 3)
    print(f"read bandwidth (torch sum, fp32): {bw:.1f} GB/s; threads {torch.get_num_threads()}")
    header = f"{'weight':>12} {'M':>3} {'ours ms':>8} {'GB/s':>6} {'x M=1':>6} {'torch ms':>9} {'GB/s':>6} {'speedup':>7}"
    print(header)
    rows = []
    torch.manual_seed(0)
    for spec in args.shapes:
        n, k = (int(v) for v in spec.split("x"))
        w0 = (torch.randn(n, k) * 0.05).bfloat16()
        copies = 1 if args.hot else max(1, -(-ROTATE_BYTES // w0.nbytes))
        weights = [w0] + [w0.clone() for _ in range(copies - 1)]
        ours_m1 = None
        for m in args.ms:
            x = torch.randn(m, k).bfloat16()
            t_ours = time_call(lambda w, x=x: ours(x, w), weights, args.budget, 5)
            ours_m1 = t_ours if m == 1 else ours_m1
            row: dict[str, float | int | str | None] = {
                "weight": spec, "M": m, "ours_ms": t_ours * 1e3,
                "ours_gbs": w0.nbytes / t_ours / 1e9,
                "ours_vs_m1": t_ours / ours_m1 if ours_m1 else None,
            }
            if not args.no_torch:
                t_torch = time_call(lambda w, x=x: F.linear(x, w), weights, args.budget, 3)
                row |= {"torch_ms": t_torch * 1e3, "torch_gbs": w0.nbytes / t_torch / 1e9,
                        "speedup": t_torch / t_ours}
            rows.append(row)
            ratio = f"{row['ours_vs_m1']:6.2f}" if row["ours_vs_m1"] else f"{'':>6}"
            line = f"{spec:>12} {m:>3} {t_ours * 1e3:8.3f} {row['ours_gbs']:6.1f} {ratio}"
            if not args.no_torch:
                line += f" {row['torch_ms']:9.3f} {row['torch_gbs']:6.1f} {row['speedup']:7.2f}"
            print(line, flush=True)
        del weights, w0
    result = {"bench": "kernels", "machine": machine(), "read_bandwidth_gbs": bw,
              "knobs": args.knobs, "rows": rows}
    if args.save:
        emit("kernels", result)
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
