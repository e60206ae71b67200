"""Small-M linear: quickdraft's CPU kernels vs torch F.linear (bf16), per weight shape and M.

For each weight [N, K] (bf16 in 16-row panels as `load()` runs it, with --layout rows in
nn.Linear layout, or with --layout Q4_K etc. in a GGUF block format as `--dtype gguf` runs it,
random blocks; --isa picks that kernel's tile, or the panel kernel's: avx512 = its
AVX512_BF16 tiles, which take bf16 x) and token count M: milliseconds per call and
weight-read bandwidth (weight bytes / time) for both, and ours' time(M) / time(M=1), the number
that decides whether a speculative verify pass over M tokens is nearly free. Each timing
rotates over enough weight copies (>= 320 MB and >= 3x this CPU's L3, which is 32 MB on the
EPYC hosts but 480 MB on some Xeon VMs) that every call streams its weight from DRAM as in a
real decode step; warm-up calls are excluded and the best repetition over
--rounds passes is reported. On a shared machine each measurement first waits (up to
--wait-idle seconds) for an idle CPU.
Prints a table, then one JSON object as the last line (--save also writes
bench/results/kernels.json, .md and .png: time(M) / time(M=1) and the speedup over F.linear
per weight, against M). The kernels: linear_panel.cpp (panels), linear_bf16.cpp (rows) and
linear_gguf.cpp (GGUF formats), through the extension quickdraft/kernels/build.py builds.

    python bench/kernels.py                             # all shapes, M in 1 2 5 9 17
    python bench/kernels.py --layout rows --shapes 17920x1536 --ms 1 9
    python bench/kernels.py --layout Q4_K --isa avx2 --ms 1 2 4 6 --no-torch
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from quickdraft.bench.report import RESULTS, machine, read_bandwidth_gbs, table, write
from quickdraft.kernels import PanelWeight
from quickdraft.kernels.build import extension
from quickdraft.kernels.linear_bf16 import streamed_empty
from quickdraft.kernels.linear_gguf import FORMATS, TILES, GGUFWeight, random_blocks, tile_name

# Qwen2.5-1.5B: q+k+v, o, gate+up, down, lm_head; SmolLM2-135M: q+k+v, lm_head, o...; and
# a [576, 1536] block (K > N, short output).
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
ROTATE_BYTES = 320 << 20


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy on huge pages, as a loaded model's weights are (`streamed_empty`)."""
    return streamed_empty(tuple(t.shape), t.dtype).copy_(t)


def rotate_bytes() -> int:
    """Bytes of weight copies to rotate over: 320 MB, or 3x the L3 where that is larger (a
    Xeon VM here reports 480 MB of L3: a 320 MB rotation measured its L3, ~2x DRAM's rate)."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        l3 = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
    except (OSError, ValueError):
        l3 = 0
    return max(ROTATE_BYTES, 3 * l3)


ISAS = {"best": -1, **TILES}  # --isa -> the extension's gguf_isa level
PANEL_ISAS = {"best": -1, "avx2": 0, "avx512": 1}  # --isa -> its panel_isa level


def busy_fraction(window_s: float = 0.05) -> float:
    """Share of all CPUs' time spent non-idle over a short window (0 when /proc is missing)."""

    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    try:
        t0, i0 = snap()
        time.sleep(window_s)
        t1, i1 = snap()
    except OSError:
        return 0.0
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_idle(limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and busy_fraction() > 0.1:
        time.sleep(0.2)


def time_call(
    fn: Callable[[Any], Any], weights: list[Any], budget_s: float, min_reps: int
) -> float:
    """Best seconds per call, cycling through `weights` so each call reads cold weights."""
    for w in weights[:3]:
        fn(w)  # warm-up: page-in, thread pool start, dispatch caches
    best = float("inf")
    start = time.perf_counter()
    reps = 0
    while reps < min_reps or time.perf_counter() - start < budget_s:
        w = weights[reps % len(weights)]
        t = time.perf_counter()
        fn(w)
        best = min(best, time.perf_counter() - t)
        reps += 1
    return best


def main() -> None:
    host = machine()  # at the start: the code recorded is the code measured
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--shapes", nargs="*", default=[f"{n}x{k}" for n, k in SHAPES], help="weights as NxK"
    )
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 2, 5, 9, 17])
    ap.add_argument("--budget", type=float, default=0.1, help="seconds per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="passes over each shape; best kept")
    ap.add_argument("--no-torch", action="store_true", help="skip the F.linear baseline")
    ap.add_argument(
        "--layout",
        choices=["panels", "rows", *FORMATS],
        default="panels",
        help="weight layout: 16-row panels (what load() runs bf16 models with, "
        "linear_panel.cpp), nn.Linear rows (linear_bf16.cpp) or a GGUF block format "
        "(linear_gguf.cpp)",
    )
    ap.add_argument(
        "--isa",
        choices=list(ISAS),
        default="best",
        help="the GGUF kernel's tile: the best this CPU runs, AVX2, AVX-512 VNNI or that with "
        "AVX512_VBMI; with --layout panels, the panel kernel's: AVX2 or AVX512_BF16",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--hot", action="store_true", help="no weight rotation: cache-resident")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=5.0,
        help="max seconds to wait for an idle machine before each measurement",
    )
    ap.add_argument("--save", action="store_true", help="also write bench/results/kernels.json")
    ap.add_argument(
        "--out", type=Path, default=RESULTS, help="where --save writes (default bench/results)"
    )
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    module = extension()
    if module is None:
        sys.exit("kernel unavailable (no AVX2/FMA/F16C or the build failed)")

    gguf = FORMATS.get(args.layout)
    isa = module.gguf_isa(ISAS[args.isa])
    if args.layout == "panels" and args.isa not in PANEL_ISAS:
        sys.exit(f"--isa {args.isa}: the panel kernel's tiles are {', '.join(PANEL_ISAS)}")
    panel_tile = module.panel_isa(PANEL_ISAS[args.isa]) if args.layout == "panels" else None

    def ours(x: torch.Tensor, w: torch.Tensor | PanelWeight | GGUFWeight) -> torch.Tensor:
        # linear_panel raises rather than fall back; `linear` falls back to
        # F.linear when not eligible, so the rows loop checks eligibility before timing it.
        if isinstance(w, PanelWeight):
            out: torch.Tensor = module.linear_panel(x, w.packed, w.out_features, None)
        elif isinstance(w, GGUFWeight):
            packed = [p.packed for p in w.parts]
            codes, ns = [p.fmt.code for p in w.parts], [p.n for p in w.parts]
            out = module.linear_gguf(x, packed, codes, ns, None)
        else:
            out = module.linear(x, w, None, sys.maxsize)
        return out

    wait_idle(args.wait_idle)
    bw = read_bandwidth_gbs(256, 3)
    print(f"DRAM read (torch fp32 sum): {bw:.1f} GB/s; threads {torch.get_num_threads()}")
    print(
        f"{'weight':>12} {'M':>3} {'ours ms':>8} {'GB/s':>6} {'xM=1':>5} "
        f"{'torch ms':>9} {'GB/s':>6} {'speedup':>7}"
    )
    rows: list[dict[str, Any]] = []
    torch.manual_seed(0)
    for spec in args.shapes:
        n, k = (int(v) for v in spec.split("x"))
        w0 = (torch.randn(n, k) * 0.05).bfloat16()
        copies = 1 if args.hot else max(1, -(-rotate_bytes() // w0.nbytes))
        weights = [w0] + [w0.clone() for _ in range(copies - 1)]
        operands: list[Any] = weights
        nbytes = w0.nbytes
        if args.layout == "panels":
            operands = [PanelWeight.pack(w) for w in weights]
        elif gguf is not None:
            first = GGUFWeight.from_raw(gguf.name, random_blocks(gguf, n, k, seed=0), k)
            nbytes = first.nbytes
            operands = [first] + [
                GGUFWeight(tuple(replace(p, packed=huge_copy(p.packed)) for p in first.parts), k)
                for _ in range(0 if args.hot else -(-rotate_bytes() // nbytes) - 1)
            ]
        xs = {m: torch.randn(m, k).bfloat16() for m in args.ms}
        best_ours: dict[int, float] = {}
        best_torch: dict[int, float] = {}
        # Rounds a few seconds apart: the best of them dodges bursts of load from other users.
        for _ in range(args.rounds):
            for m in args.ms:
                if args.layout == "rows" and not module.eligible(xs[m], w0, None, sys.maxsize):
                    sys.exit(f"{spec}, M={m}: not eligible for the rows kernel (K % 8 != 0?)")
                wait_idle(args.wait_idle)
                t = time_call(partial(ours, xs[m]), operands, args.budget, 5)
                best_ours[m] = min(best_ours.get(m, t), t)
                if not args.no_torch:
                    wait_idle(args.wait_idle)
                    t = time_call(partial(F.linear, xs[m]), weights, args.budget, 3)
                    best_torch[m] = min(best_torch.get(m, t), t)
        ours_m1 = best_ours.get(1)
        for m in args.ms:
            t_ours = best_ours[m]
            row: dict[str, Any] = {
                "weight": spec,
                "M": m,
                "ours_ms": round(t_ours * 1e3, 4),
                "ours_gbs": round(nbytes / t_ours / 1e9, 2),
                "ours_vs_m1": round(t_ours / ours_m1, 3) if ours_m1 else None,
            }
            line = f"{spec:>12} {m:>3} {t_ours * 1e3:8.3f} {row['ours_gbs']:6.1f} "
            line += f"{row['ours_vs_m1']:5.2f}" if ours_m1 else f"{'':>5}"
            if not args.no_torch:
                t_torch = best_torch[m]
                row |= {
                    "torch_ms": round(t_torch * 1e3, 4),
                    "torch_gbs": round(w0.nbytes / t_torch / 1e9, 2),
                    "speedup": round(t_torch / t_ours, 2),
                }
                line += f" {t_torch * 1e3:9.3f} {row['torch_gbs']:6.1f} {row['speedup']:7.2f}"
            rows.append(row)
            print(line, flush=True)
        del weights, operands, w0
    module.gguf_isa(-1)
    module.panel_isa(-1)
    result = {
        "bench": "kernels",
        "machine": host,
        "read_bandwidth_gbs": round(bw, 2),
        "rotate_bytes": 0 if args.hot else rotate_bytes(),
        "layout": args.layout,
        "gguf_tile": tile_name(isa) if gguf else None,
        "panel_tile": None if panel_tile is None else ("avx2", "avx512_bf16")[panel_tile],
        "rows": rows,
    }
    if args.save:
        write("kernels", result, markdown(result), plot(result), args.out, figsize=(12, 4))
    else:
        print(json.dumps(result))


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    torch_too = all("torch_ms" in r for r in rows)
    head = (
        f"Linear at small M, {result['layout']} layout"
        + (f" ({result['gguf_tile']} tile)" if result.get("gguf_tile") else "")
        + ": ms per call with the weight "
        f"streamed from DRAM, weight-read GB/s (DRAM read measured at "
        f"{result['read_bandwidth_gbs']} GB/s), time(M) / time(M=1)"
        + (", and torch F.linear for comparison" if torch_too else "")
        + ".\n\n"
    )
    header = ["weight NxK", "M", "ours ms", "ours GB/s", "x M=1"]
    if torch_too:
        header += ["torch ms", "torch GB/s", "speedup"]
    body = []
    for r in rows:
        line = [r["weight"], r["M"], r["ours_ms"], r["ours_gbs"], r["ours_vs_m1"] or "-"]
        if torch_too:
            line += [r["torch_ms"], r["torch_gbs"], f"{r['speedup']}x"]
        body.append(line)
    return head + table(header, body)


def plot(result: dict[str, Any]) -> Callable[[Any], None]:
    """Per weight, against M: ours' time(M) / time(M=1) (left) and the speedup over F.linear
    (right; ours' weight-read GB/s when F.linear was skipped)."""
    by_weight: dict[str, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        by_weight.setdefault(r["weight"], []).append(r)
    torch_too = all("torch_ms" in r for r in result["rows"])
    ms_all = sorted({r["M"] for r in result["rows"]})
    if torch_too:
        right_key, right_title, right_label = "speedup", "Speedup over F.linear", "F.linear / ours"
    else:
        right_key, right_title, right_label = "ours_gbs", "Weight read", "ours, GB/s"

    def draw(fig: Any) -> None:
        left, right = fig.subplots(1, 2)
        for weight, rows in by_weight.items():
            ms = [r["M"] for r in rows]
            if all(r["ours_vs_m1"] is not None for r in rows):
                left.plot(ms, [r["ours_vs_m1"] for r in rows], marker="o", label=weight)
            right.plot(ms, [r[right_key] for r in rows], marker="o", label=weight)
        no_m1 = "" if 1 in ms_all else " (M=1 not measured)"
        left.set_title(f"Cost of M rows over 1, {result['layout']}{no_m1}")
        left.set_ylabel("time(M) / time(M=1)")
        right.set_title(right_title)
        right.set_ylabel(right_label)
        for ax in (left, right):
            ax.set_xlabel("M (tokens)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ms_all, [str(m) for m in ms_all])
            ax.minorticks_off()
        right.legend(fontsize=7, title="weight NxK", title_fontsize=7)

    return draw


if __name__ == "__main__":
    with torch.inference_mode():
        main()
