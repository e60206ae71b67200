"""How far ahead should the panel kernels prefetch their weight stream? A sweep, JSON last.

For each operand (the int4 draft format and GGUF block formats, at the shapes the default
pair runs) and token count M, and each prefetch distance (`set_prefetch_bytes`, the setting
`QUICKDRAFT_PREFETCH_BYTES` overrides): the weight-read GB/s of a sustained stream, the
weight bytes over the average time of one pass over enough weight copies (>= 3x this CPU's
L3, on huge pages, as bench/kernels.py rotates) that every call reads DRAM. Sustained, not
bench/kernels.py's best single call: a decode step streams one weight after another, and the
best call of a rotation can land where the previous pass left lines in the L3. The best of
--rounds passes per point; the distances are swept in rotation within each round, so a
burst of load from other users shifts them all alike.

    python bench/prefetch.py                        # all operands, M 1 and 6
    python bench/prefetch.py --distances 0 1536 4096 --ms 1 --isa avx2 --save --out DIR

Writes (--save) bench/results/prefetch.{json,md,png}: GB/s per operand and M against the
distance, the distance this CPU uses by default marked.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from kernels import huge_copy, rotate_bytes

from quickdraft.bench.report import RESULTS, machine, table, write
from quickdraft.kernels import Int4Weight, linear_int4
from quickdraft.kernels.build import extension, prefetch_bytes
from quickdraft.kernels.linear_gguf import (
    FORMATS,
    TILES,
    GGUFWeight,
    linear_gguf,
    random_blocks,
    tile_name,
)

# (format, N, K): the 0.5B int4 draft's gate/up, down and head; the 1.5B GGUF's gate/up (Q4_K),
# down and head (Q6_K); a Q4_0 and a Q8_0 panel for the other block formats.
OPERANDS = [
    ("int4", 4864, 896),
    ("int4", 896, 4864),
    ("int4", 151936, 896),
    ("Q4_0", 4864, 896),
    ("Q8_0", 4864, 896),
    ("Q4_K", 8960, 1536),
    ("Q4_K", 1536, 8960),
    ("Q6_K", 8960, 1536),
    ("Q6_K", 151936, 1536),
]
DISTANCES = [0, 512, 1024, 1536, 2048, 3072, 4096, 8192]


def copies_of(fmt: str, n: int, k: int) -> tuple[list[Any], Callable[[Any, Any], Any], int]:
    """Weight copies to rotate over, the op that runs one, and one copy's bytes."""
    if fmt == "int4":
        first = Int4Weight.quantize(torch.randn(n, k) * 0.05)
        nbytes = first.packed.nbytes
        count = max(2, -(-rotate_bytes() // nbytes))
        return (
            [Int4Weight(huge_copy(first.packed), n, k) for _ in range(count)],
            linear_int4,
            nbytes,
        )
    g = GGUFWeight.from_raw(fmt, random_blocks(FORMATS[fmt], n, k, seed=0), k)
    count = max(2, -(-rotate_bytes() // g.nbytes))
    copies = [
        GGUFWeight(tuple(replace(p, packed=huge_copy(p.packed)) for p in g.parts), k)
        for _ in range(count)
    ]
    return copies, linear_gguf, g.nbytes


def sustained_gbs(op: Callable[[Any, Any], Any], x: torch.Tensor, ws: list[Any], n: int) -> float:
    op(x, ws[0])
    start = time.perf_counter()
    for w in ws:
        op(x, w)
    return n * len(ws) / (time.perf_counter() - start) / 1e9


def main() -> None:
    host = machine()
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--distances", nargs="*", type=int, default=DISTANCES)
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 6])
    ap.add_argument("--formats", nargs="*", help="only these formats (int4, Q4_K, ...)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--isa",
        choices=["best", *TILES],
        default="best",
        help="the GGUF kernel's tile (int4 has one AVX2 kernel)",
    )
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    ext = extension()
    if ext is None:
        raise SystemExit("the CPU kernels are not available here (see the build warning)")
    default = prefetch_bytes()
    tile = ext.gguf_isa({"best": -1, **TILES}[args.isa])
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    print(f"{'operand':>18} {'M':>2} " + " ".join(f"{d:>6}" for d in args.distances))
    try:
        for fmt, n, k in OPERANDS:
            if args.formats and fmt not in args.formats:
                continue
            ws, op, nbytes = copies_of(fmt, n, k)
            for m in args.ms:
                x = torch.randn(m, k).bfloat16()
                best = dict.fromkeys(args.distances, 0.0)
                for _ in range(args.rounds):
                    for d in args.distances:
                        ext.set_prefetch_bytes(d)
                        best[d] = max(best[d], sustained_gbs(op, x, ws, nbytes))
                gbs = {str(d): round(v, 2) for d, v in best.items()}
                rows.append({"operand": f"{fmt} {n}x{k}", "M": m, "gbs": gbs})
                print(
                    f"{fmt + ' ' + str(n) + 'x' + str(k):>18} {m:>2} "
                    + " ".join(f"{v:6.1f}" for v in best.values()),
                    flush=True,
                )
            del ws
    finally:
        ext.set_prefetch_bytes(default)
        ext.gguf_isa(-1)
    result = {
        "bench": "prefetch",
        "machine": host,
        "default_bytes": default,
        "gguf_tile": tile_name(tile),
        "rotate_bytes": rotate_bytes(),
        "rounds": args.rounds,
        "rows": rows,
    }
    if args.save:
        write("prefetch", result, markdown(result), plot(result), args.out, figsize=(12, 4))


def markdown(result: dict[str, Any]) -> str:
    distances = list(result["rows"][0]["gbs"]) if result["rows"] else []
    head = (
        "Sustained weight-read GB/s of the panel kernels per prefetch distance (bytes ahead on "
        f"the stream; 0: none), best of {result['rounds']} passes over "
        f"{result['rotate_bytes'] >> 20} MiB of weight copies, GGUF operands on the "
        f"{result['gguf_tile']} tile; this CPU's default distance is {result['default_bytes']}.\n\n"
    )
    body = [[r["operand"], r["M"], *(r["gbs"][d] for d in distances)] for r in result["rows"]]
    return head + table(["operand", "M", *distances], body)


def plot(result: dict[str, Any]) -> Callable[[Any], None]:
    """GB/s against the distance, one line per operand, one panel per M."""
    ms = sorted({r["M"] for r in result["rows"]})

    def draw(fig: Any) -> None:
        axes = fig.subplots(1, len(ms), squeeze=False)[0]
        for ax, m in zip(axes, ms, strict=True):
            for r in (r for r in result["rows"] if r["M"] == m):
                ds = [int(d) for d in r["gbs"]]
                ax.plot(ds, list(r["gbs"].values()), marker="o", label=r["operand"])
            ax.axvline(result["default_bytes"], color="grey", linestyle=":")
            ax.set_xlabel("prefetch distance (bytes)")
            ax.set_ylabel("GB/s")
            ax.set_title(f"M = {m}")
        axes[0].legend(fontsize=7)

    return draw


if __name__ == "__main__":
    main()
