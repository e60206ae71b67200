"""In-process engine throughput: concurrency 1, 4, 8 x speculation off / n-gram / draft model.

Closed-loop load on the Engine API (no HTTP): `c` client threads each submit a request, read
its stream to the end and submit the next, until `--requests-per-slot * c` requests are done;
`--rounds` repeats that with the methods interleaved (off, ngram, draft, off, ngram, ...) and
sums the rounds, so drift on a shared machine hits every method alike.
Per cell: output tok/s (all output tokens / wall time of the cell), speedup over speculation
off at the same concurrency, mean acceptance length (tokens per target forward after prefill),
acceptance rate, drafts per cycle, median TTFT, and how many greedy outputs equal the
speculation-off outputs (bf16: a multi-token verify can flip near-tie argmaxes). At concurrency
1 it also runs `quickdraft.engine.stream` (the single-stream path) with the same speculation, so
the engine's one-request overhead shows. Warm-up requests are excluded. Writes
bench/results/<name>.json, .md (a table per cell) and .png (tok/s per cell; step cost vs rows);
prints the table, then the JSON as the last line.

    python bench/engine.py                                          # 1.5B + 0.5B draft, bf16
    python bench/engine.py --model smollm2-135m --methods none ngram --name engine-smollm2
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from quickdraft.bench.report import bars, machine, peak_rss_mb, table, write
from quickdraft.bench.speculative import prompt_sets
from quickdraft.config import (
    DEFAULT_DRAFT_QUANTIZATION,
    DEFAULT_DRAFTS,
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    DEFAULT_NUM_DRAFT_TOKENS,
    QUANTIZATIONS,
    SpeculativeConfig,
)
from quickdraft.engine import Engine, ServedModel, stream
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.speculation.cost import StepCost, model_cost
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import Speculation


@dataclass(slots=True)
class Done:
    prompt: int  # index into the prompt list
    tokens: list[int]
    ttft: float
    cycles: int
    drafted: int
    accepted: int


@dataclass(slots=True)
class Cell:
    seconds: float = 0.0
    done: list[Done] = field(default_factory=list)
    steps: int = 0
    max_batch: int = 0

    def add(self, other: Cell) -> None:
        self.seconds += other.seconds
        self.done += other.done
        self.steps += other.steps
        self.max_batch = max(self.max_batch, other.max_batch)

    def summary(self, base: Cell | None) -> dict[str, Any]:
        tokens = sum(len(d.tokens) for d in self.done)
        cycles = sum(d.cycles for d in self.done)
        drafted = sum(d.drafted for d in self.done)
        accepted = sum(d.accepted for d in self.done)
        out: dict[str, Any] = {
            "requests": len(self.done),
            "output_tokens": tokens,
            "seconds": round(self.seconds, 2),
            "tok_s": round(tokens / self.seconds, 2),
            "mean_acceptance_length": round(1 + accepted / cycles, 3) if cycles else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "drafts_per_cycle": round(drafted / cycles, 3) if cycles else None,
            "ttft_p50_s": round(statistics.median(d.ttft for d in self.done), 3),
        }
        if self.steps:
            out["steps"] = self.steps
            out["max_batch"] = self.max_batch
        if base is not None:
            out["speedup"] = round(out["tok_s"] / (base.tokens_per_s()), 3)
            ref = {(d.prompt, len(d.tokens)): d.tokens for d in base.done}
            out["identical_to_off"] = sum(
                ref.get((d.prompt, len(d.tokens))) == d.tokens for d in self.done
            )
        return out

    def tokens_per_s(self) -> float:
        return sum(len(d.tokens) for d in self.done) / self.seconds


def run_engine(
    lm: LoadedModel,
    spec_config: SpeculativeConfig,
    spec: Speculation | None,
    prompts: list[list[int]],
    concurrency: int,
    per_slot: int,
    params: SamplingParams,
    first: int,
) -> Cell:
    served = ServedModel(lm, spec_config, spec)
    engine = Engine({"m": served}, scheduler=SchedulerConfig(max_running=max(concurrency, 1)))
    engine.start()
    cell = Cell()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(slot: int) -> None:
        try:
            for r in range(per_slot):
                idx = (first + slot + r * concurrency) % len(prompts)
                handle = engine.submit("m", prompts[idx], params)
                outs = list(handle)
                last = outs[-1]
                assert last.finished
                s = last.spec
                req = handle.request
                done = Done(
                    idx, req.output_ids, req.timing.ttft or 0.0, s.cycles, s.drafted, s.accepted
                )
                with lock:
                    cell.done.append(done)
        except BaseException as exc:  # surfaced after the join
            errors.append(exc)

    try:
        warm = engine.submit("m", prompts[0][:16], SamplingParams(max_tokens=8))
        for _ in warm:
            pass
        stats = engine.step_stats["m"]
        steps0 = stats.steps
        threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cell.seconds = time.perf_counter() - t0
        cell.steps = stats.steps - steps0
        cell.max_batch = stats.max_batch
    finally:
        engine.stop()
    if errors:
        raise errors[0]
    return cell


def run_stream(
    lm: LoadedModel,
    spec: Speculation | None,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    first: int,
) -> Cell:
    cell = Cell()
    warm = lm.new_request(prompts[0][:16], SamplingParams(max_tokens=8))
    for _ in stream(lm, warm, spec):
        pass
    t0 = time.perf_counter()
    for r in range(n):
        idx = (first + r) % len(prompts)
        req = lm.new_request(prompts[idx], params)
        for _ in stream(lm, req, spec):
            pass
        s = req.spec
        cell.done.append(
            Done(idx, req.output_ids, req.timing.ttft or 0.0, s.cycles, s.drafted, s.accepted)
        )
    cell.seconds = time.perf_counter() - t0
    return cell


def cost_ms(cost: StepCost) -> dict[str, Any]:
    """A step-cost table in milliseconds (quickdraft/policy.py `StepCost`)."""
    return {
        "rows_ms": {r: round(x * 1e3, 2) for r, x in zip(cost.rows, cost.seconds, strict=True)},
        "per_seq_ms": round(cost.per_seq * 1e3, 3),
        "per_masked_seq_ms": round(cost.per_masked * 1e3, 3),
    }


def main() -> None:
    host = machine()  # at the start: the code recorded is the code measured
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--draft", default=DEFAULT_DRAFTS[DEFAULT_MODEL])
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram", "draft"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--requests-per-slot", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repetitions")
    ap.add_argument("--tokens", type=int, default=64, help="max output tokens per request")
    ap.add_argument("-k", type=int, default=DEFAULT_NUM_DRAFT_TOKENS, help="draft length ceiling")
    ap.add_argument(
        "--draft-quantization", default=DEFAULT_DRAFT_QUANTIZATION, choices=QUANTIZATIONS
    )
    ap.add_argument("--sets", nargs="*", default=None, help="prompt sets (default: all)")
    ap.add_argument(
        "--no-stream", action="store_true", help="skip the quickdraft.engine.stream rows"
    )
    ap.add_argument("--name", default="engine")
    a = ap.parse_args()
    assert a.methods[0] == "none", "speculation off first: it is every cell's baseline"

    lm = load(a.model, a.dtype)
    sets = prompt_sets()
    chosen = a.sets or list(sets)
    texts = [p for i in range(10) for s in chosen for p in sets[s][i : i + 1]]
    prompts = [lm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    configs = {
        "none": SpeculativeConfig(),
        "ngram": SpeculativeConfig(method="ngram", num_draft_tokens=a.k),
        "draft": SpeculativeConfig(
            method="draft",
            num_draft_tokens=a.k,
            draft_model=a.draft,
            draft_quantization=a.draft_quantization,
        ),
    }
    specs = {m: make_speculation(lm, configs[m]) for m in a.methods}
    params = SamplingParams(max_tokens=a.tokens)
    results: dict[str, Any] = {}
    for c in a.concurrency:
        cells: dict[str, Cell] = {}
        for r in range(a.rounds):
            first = r * c * a.requests_per_slot  # each round serves the next prompts
            for m in a.methods:
                cell = run_engine(
                    lm, configs[m], specs[m], prompts, c, a.requests_per_slot, params, first
                )
                cells.setdefault(m, Cell()).add(cell)
                if c == 1 and not a.no_stream and m != "none":
                    n = a.requests_per_slot
                    cell = run_stream(lm, specs[m], prompts, n, params, first)
                    cells.setdefault(f"stream_{m}", Cell()).add(cell)
        row = {m: cell.summary(None if m == "none" else cells["none"]) for m, cell in cells.items()}
        results[f"c{c}"] = row
        print(f"concurrency {c}:", row, flush=True)
    cost = model_cost(lm.model)
    report = {
        "bench": "engine",
        "model": a.model,
        "draft": a.draft if "draft" in a.methods else None,
        "dtype": a.dtype,
        "max_tokens": a.tokens,
        "k_max": a.k,
        "requests_per_slot": a.requests_per_slot,
        "rounds": a.rounds,
        "prompt_sets": chosen,
        "results": results,
        "step_cost": cost_ms(cost),
        # per drafter with a cost: its start-up table and what the run calibrated it by
        "draft_cost": {
            m: {**cost_ms(s.draft_cost.table), "measured_over_table": round(s.draft_cost.ratio, 3)}
            for m, s in specs.items()
            if s is not None and s.draft_cost is not None
        },
        "peak_rss_mb": round(peak_rss_mb()),
        "machine": host,
    }
    write(a.name, report, markdown(report), plot(report), figsize=(12, 4))


def markdown(report: dict[str, Any]) -> str:
    def show(value: Any) -> Any:
        return "-" if value is None else value

    draft = f" + draft {report['draft']}" if report["draft"] else ""
    head = (
        f"Engine throughput, in process, closed loop: {report['model']}{draft}, "
        f"{report['dtype']}, up to {report['max_tokens']} tokens per request, k <= "
        f"{report['k_max']}, {report['rounds']} interleaved rounds; speedup over speculation "
        f"off at the same concurrency (stream_*: the single-stream path).\n\n"
    )
    rows = [
        [
            c.removeprefix("c"),
            method,
            s["tok_s"],
            f"{s['speedup']}x" if "speedup" in s else "-",
            show(s["mean_acceptance_length"]),
            show(s["acceptance_rate"]),
            show(s["drafts_per_cycle"]),
            s["ttft_p50_s"],
            f"{s['identical_to_off']}/{s['requests']}" if "identical_to_off" in s else "-",
        ]
        for c, cell in report["results"].items()
        for method, s in cell.items()
    ]
    header = ["concurrency", "method", "tok/s", "speedup", "AL", "acceptance", "drafts/cycle"]
    header += ["TTFT p50 s", "identical to off"]
    return head + table(header, rows)


def plot(report: dict[str, Any]) -> Any:
    """Left: tok/s per concurrency and method; right: the step-cost tables (ms vs rows)."""
    results = report["results"]
    methods = list(dict.fromkeys(m for cell in results.values() for m in cell))
    series = {  # a method missing at a concurrency (stream_*: only at 1) draws no bar there
        "off" if m == "none" else m: [
            cell[m]["tok_s"] if m in cell else 0.0 for cell in results.values()
        ]
        for m in methods
    }
    groups = [f"concurrency {c[1:]}" for c in results]
    costs = {"target": report["step_cost"]} | {
        f"drafter ({m})": c for m, c in report["draft_cost"].items()
    }

    def draw(fig: Any) -> None:
        left, right = fig.subplots(1, 2)
        bars(left, "Engine throughput", "output tok/s", groups, series)
        for label, cost in costs.items():
            rows = sorted((int(r), ms) for r, ms in cost["rows_ms"].items())
            right.plot([r for r, _ in rows], [ms for _, ms in rows], marker="o", label=label)
        right.set_xscale("log", base=2)
        ticks = sorted(
            {int(r) for c in costs.values() for r in c["rows_ms"] if int(r) & (int(r) - 1) == 0}
        )
        right.set_xticks(ticks, [str(t) for t in ticks])
        right.minorticks_off()
        right.set_xlabel("rows in one forward")
        right.set_ylabel("ms")
        right.set_title("Step cost (start-up tables)")
        right.legend(fontsize=8)

    return draw


if __name__ == "__main__":
    main()
