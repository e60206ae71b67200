"""A whole model's forward time against the rows it runs, per GGUF kernel tile: the table the
speculation policy times at start-up (speculation/cost.py `measure_step_cost`), here for each
tile this CPU runs, so issue 22's verify target (a 6-row verify <= 1.3x the 1-row step) is
read off the model rather than one weight shape. One sequence after 8 cached tokens, best of
three per row count. Writes bench/results/<name>.{json,md,png}.

    python bench/step_cost.py                                    # the 1.5B, every tile here
    python bench/step_cost.py --model smollm2-135m --tiles avx2
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from quickdraft.bench.report import RESULTS, machine, table, write
from quickdraft.config import DEFAULT_MODEL
from quickdraft.kernels.build import extension
from quickdraft.kernels.linear_gguf import TILES, cpu_tiles
from quickdraft.loading import load
from quickdraft.speculation.cost import measure_step_cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tiles", nargs="+", choices=list(TILES), default=list(TILES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 6, 8, 16])
    ap.add_argument("--name", default="step-cost")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    report: dict[str, Any] = {"bench": "step_cost", "machine": machine(), "model": args.model}
    lm = load(args.model, "gguf", progress=False)
    ext = extension()
    if ext is None:
        raise SystemExit("the C++ kernels are not available here")
    tiles = [t for t in args.tiles if t in cpu_tiles()]
    report["tiles"] = {}
    try:
        for tile in tiles:
            ext.gguf_isa(TILES[tile])
            cost = measure_step_cost(lm.model, rows=args.rows, seqs=1)
            report["tiles"][tile] = {
                "rows": list(cost.rows),
                "ms": [round(s * 1e3, 2) for s in cost.seconds],
                "over_one_row": [round(s / cost.seconds[0], 3) for s in cost.seconds],
            }
    finally:
        ext.gguf_isa(-1)
    header = ["tile", *[f"{r} rows (ms, x1)" for r in args.rows]]
    rows = [
        [tile, *[f"{ms} ({x}x)" for ms, x in zip(t["ms"], t["over_one_row"], strict=True)]]
        for tile, t in report["tiles"].items()
    ]
    md = f"`{args.model}` on its GGUF weights, forward time by rows\n\n" + table(header, rows)

    def plot(fig: Any) -> None:
        ax = fig.subplots()
        for tile, t in report["tiles"].items():
            ax.plot(t["rows"], t["over_one_row"], marker="o", label=tile)
        ax.axhline(1.3, ls="--", c="grey", label="issue 22: 6 rows <= 1.3x")
        ax.set(xlabel="rows", ylabel="forward time / 1-row forward", title=args.model)
        ax.legend()

    write(args.name, report, md, plot, args.out)


if __name__ == "__main__":
    main()
