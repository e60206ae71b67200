"""How far can model-free drafting go on the bench prompts? A replay bound, JSON as the last line.

The n-gram drafter's speedup is capped by what it can guess: acceptance length (AL, tokens per
target forward) over what the verify rows cost. This replays the target's own greedy outputs
through drafters without running speculation, so every drafter shape sees the same tokens:

  1. generate each prompt's greedy output with speculation off (the tokens any lossless
     speculation must reproduce), then run the target once over prompt + output to get its
     top-`width` next tokens at every position (teacher forcing);
  2. replay each output step by step: a drafter proposes, the longest proposed path that
     matches the output is accepted, plus the target's own token (as in a verify);
  3. estimate the speedup as (tokens x the 1-row forward) / (sum over steps of the forward of
     1 + proposed nodes rows), with the target's step-cost table measured here
     (`measure_step_cost`, the one the adaptive policy uses).

Drafter shapes replayed:
  * `chain k=K`: the shipped `NgramDrafter` (one path of up to K tokens), K = 1..k_max: an
    upper bound on the adaptive policy, which picks one of these K per step and also pays
    for rows it guessed wrong.
  * `chain+tree W`: the same path plus a token tree from the target's own predictions (Token
    Recycling, Luo et al. 2024): every token the target has scored keeps the top-`width`
    tokens the target predicted after it, last sighting wins; from the newest token a tree
    of widths W = (w1, w2, ..) per depth follows those lists. All paths are verified in one
    forward (a tree attention mask), so it costs 1 + distinct nodes rows.
The tree is optimistic: it is fed the target's predictions at every prompt position (an
engine only scores the last prompt row) and its rows are priced as a causal verify's. It is
pessimistic in one way: rejected rows (scored by the target in an engine) do not feed it.
Nothing here is timed but the cost table: the bound moves with the host's row cost curve
(flat to ~5 rows on an AVX2-only CPU, where the kernel becomes compute-bound).
Writes bench/results/ngram-bounds.json, .md (a row per drafter shape) and .png (estimated
speedup per shape; the step-cost table); prints the table, then the JSON as the last line.

    python bench/ngram_bounds.py --sets code json --tokens 128
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from quickdraft.bench.report import machine, table, write
from quickdraft.bench.speculative import prompt_sets
from quickdraft.config import (
    BENCH_MAX_TOKENS,
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    DEFAULT_NUM_DRAFT_TOKENS,
)
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.speculation.cost import StepCost, measure_step_cost
from quickdraft.speculation.drafters.ngram import NgramDrafter

SET_ORDER = ("code", "prose", "json", "repetitive")  # the A/B bench's order (shared index)
TREES = ((2,), (3, 1), (4, 2, 1), (6, 3, 2, 1), (8, 4, 2, 1, 1))


@dataclass(slots=True)
class Sample:
    name: str  # "<set>/<index>"
    prompt: list[int]
    output: list[int]
    top: list[list[int]]  # top[p]: the target's top-width tokens after prefix seq[: p + 1]


def greedy_samples(lm: LoadedModel, sets: dict[str, list[str]], tokens: int, width: int):
    """Each prompt's greedy output (speculation off) and the target's teacher-forced top
    tokens at every position of prompt + output."""
    todo = [(name, i, p) for name in sets for i, p in enumerate(sets[name])]
    samples: list[Sample] = []
    for name, i, text in tqdm(todo, desc="greedy outputs", unit="prompt"):
        ids = lm.tokenizer.encode_chat([{"role": "user", "content": text}])
        request = lm.new_request(ids, SamplingParams(max_tokens=tokens))
        for _ in stream(lm, request):
            pass
        seq = ids + request.output_ids
        cache = lm.model.new_cache(len(seq))
        with torch.inference_mode():
            out = lm.model(
                torch.tensor(seq, device=lm.model.device),
                [cache],
                [len(seq)],
                logit_rows=torch.arange(len(seq), device=lm.model.device),
            )
        top = out.logits.topk(width, dim=-1).indices.tolist()
        samples.append(Sample(f"{name}/{i}", ids, list(request.output_ids), top))
    return samples


def tree_paths(successors: dict[int, list[int]], last: int, widths: tuple[int, ...]):
    """Root-to-leaf paths of the static-width tree grown from `last` through `successors`."""
    paths: list[list[int]] = []

    def grow(token: int, depth: int, prefix: list[int]) -> None:
        nxt = successors.get(token)
        if depth == len(widths) or nxt is None:
            if prefix:
                paths.append(prefix)
            return
        for child in nxt[: widths[depth]]:
            grow(child, depth + 1, [*prefix, child])

    grow(last, 0, [])
    return paths


def replay(samples: list[Sample], k: int, widths: tuple[int, ...], cost: StepCost):
    """Replay every sample in order through one drafter (its shared index learns across
    them, as in the bench); per set: acceptance length, rows per step, estimated speedup."""
    drafter = NgramDrafter()
    shared_successors: dict[int, list[int]] = {}
    per_set: dict[str, dict[str, float]] = {}
    for sample in samples:
        seq = sample.prompt + sample.output
        successors = dict(shared_successors)
        for p, token in enumerate(sample.prompt):
            successors[token] = sample.top[p]
        state = drafter.new_state(sample.prompt)
        pos = steps = rows = 0
        seconds = 0.0
        while pos < len(sample.output):
            committed = seq[: len(sample.prompt) + pos]
            drafter.commit(state, committed)
            paths = [drafter.lookup(state, committed, k).tokens]
            if widths:
                paths += tree_paths(successors, committed[-1], widths)
            nodes = {tuple(path[: i + 1]) for path in paths for i in range(len(path))}
            accepted = 0
            for path in paths:
                n = 0
                while n < len(path) and pos + n < len(sample.output):
                    if path[n] != sample.output[pos + n]:
                        break
                    n += 1
                accepted = max(accepted, n)
            # the verify scored the last committed token and the accepted drafts
            for p in range(len(committed) - 1, min(len(committed) + accepted, len(seq))):
                successors[seq[p]] = sample.top[p]
            steps += 1
            rows += 1 + len(nodes)
            seconds += cost.of_rows(1 + len(nodes))
            pos += accepted + 1
        drafter.commit(state, seq)
        drafter.free(state)
        shared_successors.update(successors)
        acc = per_set.setdefault(sample.name.split("/")[0], {})
        for key, value in (("tokens", pos), ("steps", steps), ("rows", rows), ("s", seconds)):
            acc[key] = acc.get(key, 0) + value
    one_row = cost.of_rows(1)
    return {
        name: {
            "acceptance_length": round(a["tokens"] / a["steps"], 3),
            "rows_per_step": round(a["rows"] / a["steps"], 2),
            "estimated_speedup": round(a["tokens"] * one_row / a["s"], 3),
        }
        for name, a in per_set.items()
    }


def main() -> None:
    host = machine()  # at the start: the code recorded is the code measured
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--tokens", type=int, default=BENCH_MAX_TOKENS)
    ap.add_argument("--sets", nargs="*", default=["code", "json"], choices=SET_ORDER)
    ap.add_argument("--per-set", type=int, default=None, help="default: all prompts")
    ap.add_argument(
        "-k", type=int, default=DEFAULT_NUM_DRAFT_TOKENS, help="longest n-gram chain replayed"
    )
    ap.add_argument("--width", type=int, default=8, help="target top tokens kept per position")
    a = ap.parse_args()
    if max(max(w) for w in TREES) > a.width:
        ap.error(f"--width must be >= {max(max(w) for w in TREES)}")
    lm = load(a.target, a.dtype)
    every = prompt_sets()
    sets = {s: every[s][: a.per_set] for s in SET_ORDER if s in a.sets}
    t0 = time.perf_counter()
    cost = measure_step_cost(lm.model)
    samples = greedy_samples(lm, sets, a.tokens, a.width)
    shapes: dict[str, Any] = {}
    for k in range(1, a.k + 1):
        shapes[f"chain k={k}"] = replay(samples, k, (), cost)
    for widths in TREES:
        shapes[f"chain k={a.k}+tree {list(widths)}"] = replay(samples, a.k, widths, cost)
    best = {s: max(shapes, key=lambda shape: shapes[shape][s]["estimated_speedup"]) for s in sets}
    result = {
        "bench": "ngram_bounds",
        "target": a.target,
        "dtype": a.dtype,
        "tokens": a.tokens,
        "prompts_per_set": {s: len(v) for s, v in sets.items()},
        "machine": host,
        "step_cost_ms": {r: round(cost.of_rows(r) * 1e3, 1) for r in cost.rows},
        "shapes": shapes,
        "best": {s: {"shape": b, **shapes[b][s]} for s, b in best.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write("ngram-bounds", result, markdown(result), plot(result), figsize=(13, 5))


def markdown(result: dict[str, Any]) -> str:
    sets = list(result["prompts_per_set"])
    prompts = ", ".join(f"{n} {s}" for s, n in result["prompts_per_set"].items())
    head = (
        f"Replay bound on model-free drafting: {result['target']} {result['dtype']} greedy "
        f"outputs ({result['tokens']} tokens; prompts: {prompts}) replayed through each drafter "
        f"shape; AL = tokens per target forward, speedup estimated from the measured step-cost "
        f"table (no speculation run).\n\n"
    )
    header = ["drafter shape"]
    for s in sets:
        header += [f"{s} AL", f"{s} rows/step", f"{s} est. speedup"]
    rows = []
    for shape, per_set in result["shapes"].items():
        row: list[Any] = [shape]
        for s in sets:
            f = per_set[s]
            row += [f["acceptance_length"], f["rows_per_step"], f"{f['estimated_speedup']}x"]
        rows.append(row)
    best = "; ".join(
        f"{s}: {b['shape']} ({b['estimated_speedup']}x)" for s, b in result["best"].items()
    )
    return head + table(header, rows) + f"\nBest per set: {best}.\n"


def plot(result: dict[str, Any]) -> Any:
    """Left: estimated speedup per drafter shape and prompt set; right: the target's step
    cost against the rows of one forward, which prices every shape's rows."""
    shapes = list(result["shapes"])
    sets = list(result["prompts_per_set"])
    cost = sorted((int(r), ms) for r, ms in result["step_cost_ms"].items())

    def draw(fig: Any) -> None:
        left, right = fig.subplots(1, 2, width_ratios=(3, 2))
        height = 0.8 / max(1, len(sets))
        for i, s in enumerate(sets):
            ys = [y + i * height for y in range(len(shapes))]
            speedups = [result["shapes"][shape][s]["estimated_speedup"] for shape in shapes]
            left.barh(ys, speedups, height, label=s)
        left.set_yticks([y + 0.4 - height / 2 for y in range(len(shapes))], shapes, fontsize=8)
        left.invert_yaxis()
        left.axvline(1.0, color="grey", linewidth=0.8)
        left.set_xlabel("estimated speedup over plain decode")
        left.set_title("Replay bound per drafter shape")
        left.legend(fontsize=8)
        right.plot([r for r, _ in cost], [ms for _, ms in cost], marker="o")
        right.set_xscale("log", base=2)
        ticks = [r for r, _ in cost if r & (r - 1) == 0]  # powers of two
        right.set_xticks(ticks, [str(t) for t in ticks])
        right.minorticks_off()
        right.set_xlabel("rows in one forward")
        right.set_ylabel("ms")
        right.set_title(f"{result['target']} step cost")

    return draw


if __name__ == "__main__":
    main()
