"""The attention kernel per tile (kernels/attention.py `TILES`): a layer's `attend` alone on the
1.5B's head shapes (12 query heads over 2 kv heads, head dim 128, bf16) by context and query
rows, and a whole model's forward by context and rows (what a verify at that context costs),
each tile this CPU runs side by side in one run. Median of `--repeats` calls per cell.
Writes bench/results/<name>.{json,md,png}.

    python bench/attention.py                        # kernel + the 1.5B's forward
    python bench/attention.py --no-model --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from quickdraft.bench.report import RESULTS, machine, table, write
from quickdraft.config import DEFAULT_MODEL
from quickdraft.kernels.attention import TILES, attend, cpu_tiles
from quickdraft.kernels.build import extension
from quickdraft.loading import load

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kernel_cells(
    ext: Any, tiles: list[str], contexts: list[int], rows: list[int], repeats: int
) -> list[dict[str, Any]]:
    out = []
    for ctx in contexts:
        for n in rows:
            g = torch.Generator().manual_seed(ctx + n)
            q = torch.randn(n, HEADS, HEAD_DIM, generator=g).bfloat16()
            k = torch.randn(KV_HEADS, ctx + n, HEAD_DIM, generator=g).bfloat16()
            v = torch.randn(KV_HEADS, ctx + n, HEAD_DIM, generator=g).bfloat16()
            cell: dict[str, Any] = {"context": ctx, "rows": n, "us": {}}
            for tile in tiles:
                ext.attend_isa(TILES[tile])
                s = median_s(partial(attend, q, k, v, ctx, HEAD_DIM**-0.5), repeats)
                cell["us"][tile] = round(s * 1e6, 1)
            out.append(cell)
    return out


def model_cells(
    ext: Any, model_name: str, tiles: list[str], contexts: list[int], rows: list[int], repeats: int
) -> list[dict[str, Any]]:
    model = load(model_name, "gguf", progress=False).model
    out = []
    for ctx in contexts:
        ids = torch.randint(
            0, 30000, (ctx + max(rows),), generator=torch.Generator().manual_seed(0)
        )
        cache = model.new_cache(ctx + max(rows))
        model(ids[:ctx], [cache], [ctx])
        cache.commit(ctx)
        for n in rows:
            cell: dict[str, Any] = {"context": ctx, "rows": n, "ms": {}}
            for tile in tiles:
                ext.attend_isa(TILES[tile])
                # a verify: logits for every row; the cache keeps its length (nothing commits)
                step = partial(model, ids[ctx : ctx + n], [cache], [n], logit_rows=torch.arange(n))
                s = median_s(step, repeats)
                cell["ms"][tile] = round(s * 1e3, 2)
            out.append(cell)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", nargs="+", type=int, default=[1000, 2000])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 6, 16, 64])
    ap.add_argument("--model-contexts", nargs="+", type=int, default=[8, 1000, 2000])
    ap.add_argument("--model-rows", nargs="+", type=int, default=[1, 6, 16])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--no-model", action="store_true", help="the kernel alone")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--name", default="attention")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ext = extension()
    if ext is None:
        raise SystemExit("the C++ kernels are not available here")
    tiles = cpu_tiles()
    report: dict[str, Any] = {"bench": "attention", "machine": machine(), "tiles": tiles}
    try:
        report["kernel"] = kernel_cells(ext, tiles, args.contexts, args.rows, args.repeats)
        if not args.no_model:
            report["model"] = args.model
            report["forward"] = model_cells(
                ext, args.model, tiles, args.model_contexts, args.model_rows, args.repeats
            )
    finally:
        ext.attend_isa(-1)
    base = tiles[0]

    def rows_of(cells: list[dict[str, Any]], unit: str) -> list[list[Any]]:
        return [
            [c["context"], c["rows"], *[c[unit][t] for t in tiles]]
            + [f"{c[unit][base] / c[unit][t]:.2f}x" for t in tiles[1:]]
            for c in cells
        ]

    faster = [f"{t} vs {base}" for t in tiles[1:]]
    md = (
        f"`attend` alone, {HEADS} heads / {KV_HEADS} kv heads / head dim {HEAD_DIM}, bf16, "
        f"{torch.get_num_threads()} threads (us per call)\n\n"
        + table(["context", "rows", *tiles, *faster], rows_of(report["kernel"], "us"))
    )
    if "forward" in report:
        md += f"\n`{args.model}` forward (GGUF weights), ms\n\n" + table(
            ["context", "rows", *tiles, *faster], rows_of(report["forward"], "ms")
        )

    def plot(fig: Any) -> None:
        ax = fig.subplots()
        for t in tiles:
            for ctx in args.contexts:
                cells = [c for c in report["kernel"] if c["context"] == ctx]
                ax.plot(
                    [c["rows"] for c in cells],
                    [c["us"][t] for c in cells],
                    marker="o",
                    label=f"{t}, context {ctx}",
                )
        ax.set(xscale="log", yscale="log", xlabel="query rows", ylabel="us per layer call")
        ax.set_title("attend, by tile")
        ax.legend()

    write(args.name, report, md, plot, args.out)


if __name__ == "__main__":
    main()
