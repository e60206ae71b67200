"""Code completion in the middle (llama-server's /infill prompt) with speculation on and off.

An editor asks for the code between the text before and after the cursor. The cases are cut
from this repository's own source (deterministically): for each of --cases functions, the text
before its body (its last --prefix-lines lines) is the prefix, the text after the body (its
first --suffix-lines) the suffix, and the model writes the body; the prompt is llama-server's
/infill layout (quickdraft/infill.py), the answer greedy, at most --tokens tokens, ended by the
end of text or a FIM end token. One process, interleaved rounds (every configuration runs each
case in a shuffled order before the next case); a configuration's figure is its tok/s over
decode time (first token to last: the prompts are prefilled once, then served by the prefix
cache) over speculation off's in the same round, the median over rounds. Every
configuration's tokens must equal speculation off's (greedy is lossless).

    flock /tmp/quickdraft-bench.lock .venv/bin/python bench/infill.py --rounds 3
"""

from __future__ import annotations

import argparse
import ast
import random
import statistics
from pathlib import Path
from typing import Any

import torch

from quickdraft.bench.report import bars, machine, table, write
from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.engine.core import EngineCore
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.infill import FimTokens, infill_ids
from quickdraft.loading import load
from quickdraft.request import SamplingParams, SpecStats
from quickdraft.speculation.factory import make_speculation

SOURCE = Path(__file__).resolve().parent.parent / "quickdraft"


def cases(
    count: int, before: int, after: int, max_body_lines: int = 24
) -> list[tuple[str, str, str]]:
    """(name, prefix, suffix) for `count` functions of the package's source whose body has
    4 to `max_body_lines` lines, spread over the files in path order."""
    found: list[tuple[str, str, str]] = []
    for path in sorted(SOURCE.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef) or not node.body:
                continue
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if len(node.body) == 1:
                    continue
                first = node.body[1]  # the docstring stays in the prefix
            start, end = first.lineno - 1, node.end_lineno or first.lineno
            if 4 <= end - start <= max_body_lines:
                prefix = "".join(lines[max(0, start - before) : start]) + " " * first.col_offset
                found.append(
                    (
                        f"{path.relative_to(SOURCE.parent)}:{node.name}",
                        prefix,
                        "".join(lines[end : end + after]),
                    )
                )
                break  # one function a file
    step = max(1, len(found) // count)
    return found[::step][:count]


def run(
    core: EngineCore, ids: list[int], tokens: int, spec: Any, stops: tuple[int, ...]
) -> tuple[list[int], float, SpecStats]:
    """One greedy answer on `core` (whose prefix cache holds the case's prompt after its first
    run) and its decode seconds, from its first token to its last."""
    req = core.lm.new_request(ids, SamplingParams(max_tokens=tokens, stop_token_ids=stops))
    for _ in stream(core.lm, req, spec, core):
        pass
    first = req.timing.first_token
    assert first is not None and req.timing.finished is not None
    return req.output_ids, req.timing.finished - first, req.spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prefix-lines", type=int, default=80)
    ap.add_argument("--suffix-lines", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="infill")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load(args.model, "gguf", progress=False)
    fim = FimTokens.of(lm.tokenizer)
    todo = [
        (name, infill_ids(lm.tokenizer, fim, prefix, suffix, context=lm.context_length))
        for name, prefix, suffix in cases(args.cases, args.prefix_lines, args.suffix_lines)
    ]
    configs: dict[str, SpeculativeConfig | None] = {
        "off": None,
        "ngram": SpeculativeConfig(method="ngram"),
        "suffix": SpeculativeConfig(method="suffix"),
        "draft": SpeculativeConfig(method="draft", draft_model=args.draft_model),
        # the draft model made to draft (the cost model above judges whether its catch-up over
        # the prompt pays)
        "draft, k = 5 forced": SpeculativeConfig(
            method="draft", draft_model=args.draft_model, adaptive=False
        ),
    }
    core = EngineCore(lm, SchedulerConfig(max_running=1), prefix_cache=PrefixCacheConfig())
    for _, ids in todo:  # warm-up: kernels, cost tables, the draft model, the cached prompts
        for c in configs.values():
            run(core, ids, 4, None if c is None else make_speculation(lm, c), fim.stops)
    rng = random.Random(0)
    totals = {n: [[0.0, 0] for _ in range(args.rounds)] for n in configs}
    drafts = {n: [0, 0, 0] for n in configs}  # drafted, accepted, cycles
    outputs: dict[str, dict[str, list[int]]] = {n: {} for n in configs}
    for r in range(args.rounds):
        # fresh drafters every round: the shared n-gram index and suffix trees would otherwise
        # hold the previous rounds' answers to the same cases
        specs = {n: None if c is None else make_speculation(lm, c) for n, c in configs.items()}
        for name, ids in todo:
            order = list(configs)
            rng.shuffle(order)
            for c in order:
                out, seconds, stats = run(core, ids, args.tokens, specs[c], fim.stops)
                totals[c][r][0] += seconds
                totals[c][r][1] += len(out)
                outputs[c][name] = out
                drafts[c][0] += stats.drafted
                drafts[c][1] += stats.accepted
                drafts[c][2] += stats.cycles
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    off = [tokens / seconds for seconds, tokens in totals["off"]]
    results: dict[str, Any] = {}
    for c in configs:
        speeds = [tokens / seconds for seconds, tokens in totals[c]]
        results[c] = {
            "tok_s": [round(v, 2) for v in speeds],
            "vs_off": round(statistics.median(v / b for v, b in zip(speeds, off, strict=True)), 3),
            "same_tokens_as_off": outputs[c] == outputs["off"],
            "drafted": drafts[c][0],
            "accepted": drafts[c][1],
            "tokens_per_cycle": round(sum(t for _, t in totals[c]) / max(drafts[c][2], 1), 2),
        }
    report = {
        "bench": "infill",
        "machine": machine(),
        "args": vars(args),
        "cases": [name for name, _ in todo],
        "prompt_tokens": [len(ids) for _, ids in todo],
        "answer_tokens": {name: len(out) for name, out in outputs["off"].items()},
        "results": results,
    }
    write(args.name, report, markdown(report), plot(report))


def markdown(r: dict[str, Any]) -> str:
    a = r["args"]
    out = (
        f"## Code completion in the middle ({a['model']}, llama-server's /infill prompt, "
        f"{len(r['cases'])} functions of quickdraft's source, <= {a['tokens']} tokens, greedy, "
        f"median of {a['rounds']} interleaved rounds)\n\n"
    )
    rows = [
        [
            c,
            f"{res['accepted']} / {res['drafted']}",
            res["tokens_per_cycle"],
            " / ".join(f"{v:.1f}" for v in res["tok_s"]),
            f"{res['vs_off']:.3f}",
            res["same_tokens_as_off"],
        ]
        for c, res in r["results"].items()
    ]
    out += table(
        [
            "speculation",
            "accepted / drafted",
            "tokens a cycle",
            "tok/s by round",
            "vs off",
            "tokens equal off's",
        ],
        rows,
    )
    return out


def plot(r: dict[str, Any]) -> Any:
    def draw(fig: Any) -> None:
        ax = fig.subplots(1, 1)
        names = list(r["results"])
        bars(
            ax,
            "code completion in the middle",
            "x speculation off",
            names,
            {"": [r["results"][n]["vs_off"] for n in names]},
        )

    return draw


if __name__ == "__main__":
    main()
