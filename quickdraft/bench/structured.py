"""Structured-output benchmark (`quickdraft bench --structured`): JSON-schema and tool-call
decoding with speculation off, n-gram and the draft model, in ONE run.

Sets (quickdraft/prompts/structured.json): `json_schema` (extract / describe / review, each with
its schema, as `response_format` json_schema would send it) and `tool_call` (a coding agent's and
a weather assistant's tool requests, `tool_choice: required`, as the server renders them). Every
request is greedy, decoded under its grammar (grammar.py, xgrammar), prefill included.

Per set and engine: tok/s (prefill included) and decode tok/s (after the first token; the tool
set's prompts carry ~500 tokens of tool definitions), each vs speculation off, mean acceptance
length, parity with
speculation off (greedy: the output must be identical), and how many outputs are valid (the JSON
validates against its schema / the text parses as tool calls). The grammar's own cost is
measured apart: each output is replayed through a fresh matcher (mask + advance per token), in
ms per token, and set against the plain decode step (`decode ms/token` of speculation off).
Warm-up excluded. Writes structured-<model>.{json,md,png}.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from quickdraft.bench.report import RESULTS, bar_chart, machine, table, write
from quickdraft.config import (
    DEFAULT_DRAFT_QUANTIZATION,
    DEFAULT_DRAFTS,
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    DEFAULT_NUM_DRAFT_TOKENS,
    SpeculativeConfig,
)
from quickdraft.engine import stream
from quickdraft.grammar import Grammar
from quickdraft.loading import LoadedModel, load
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import AnySpeculation

SETS = ("json_schema", "tool_call")
ENGINES = ("none", "ngram", "draft")


def structured_sets() -> dict[str, list[dict[str, Any]]]:
    text = resources.files("quickdraft.prompts").joinpath("structured.json").read_text()
    data: dict[str, list[dict[str, Any]]] = json.loads(text)
    return data


@dataclass(frozen=True, slots=True)
class StructuredBench:
    target: str = DEFAULT_MODEL
    draft: str | None = None  # default: the target's packaged draft model
    dtype: str = DEFAULT_DTYPE
    tokens: int = 256  # output ceiling; grammars end most outputs earlier
    per_set: int | None = None
    sets: tuple[str, ...] = SETS
    k: int = DEFAULT_NUM_DRAFT_TOKENS
    draft_quantization: str = DEFAULT_DRAFT_QUANTIZATION
    out_dir: Path = RESULTS
    device: str = "auto"  # loading.resolve_device


@dataclass(slots=True)
class Cell:
    tokens: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0  # after the first token (prefill excluded)
    cycles: int = 0
    accepted: int = 0
    valid: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, req: Request, seconds: float, valid: bool) -> None:
        self.tokens += len(req.output_ids)
        self.seconds += seconds
        ttft = req.timing.ttft
        self.decode_seconds += seconds - (ttft if ttft is not None else seconds)
        self.cycles += req.spec.cycles
        self.accepted += req.spec.accepted
        self.valid += valid
        self.outputs.append(list(req.output_ids))

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        after_first = self.tokens - len(self.outputs)
        return after_first / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.cycles if self.cycles else 1.0


def requests(
    lm: LoadedModel, name: str, items: list[dict[str, Any]]
) -> list[tuple[list[int], Grammar]]:
    """The set's prompts as token ids with their grammars, rendered as the server renders them."""
    from quickdraft.server.tools import hermes_messages

    out = []
    for item in items:
        if name == "json_schema":
            messages = [{"role": "user", "content": item["prompt"]}]
            ids = lm.tokenizer.encode_chat(messages)
            grammar = Grammar("json_schema", json.dumps(item["schema"]))
        else:
            messages, tools = item["messages"], item["tools"]
            if not lm.tokenizer.renders_tools:
                messages, tools = hermes_messages(messages, tools), None
            ids = lm.tokenizer.encode_chat(messages, tools)
            grammar = Grammar.tool_calls(item["tools"], "required", True)
        out.append((ids, grammar))
    return out


def valid(name: str, text: str, item: dict[str, Any]) -> bool:
    if name == "tool_call":
        from quickdraft.server.tools import parse_tool_calls

        return bool(parse_tool_calls(text)[1])
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), item["schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def mask_ms_per_token(lm: LoadedModel, grammar: Grammar, tokens: list[int]) -> float:
    """Replay `tokens` through a fresh matcher: the mask fill + advance cost per token."""
    matcher = lm.grammar_matcher(grammar)
    mask = matcher.bitmask(1)
    t0 = time.perf_counter()
    for tok in tokens:
        matcher.fill(mask, 0)
        if not matcher.accept(tok):
            break
    return 1e3 * (time.perf_counter() - t0) / max(1, len(tokens))


def run(bench: StructuredBench) -> dict[str, Any]:
    report: dict[str, Any] = {"machine": machine()}  # recorded first: the code that ran
    lm = load(bench.target, bench.dtype, bench.device)
    draft = bench.draft or DEFAULT_DRAFTS.get(bench.target)
    configs: dict[str, SpeculativeConfig] = {
        "none": SpeculativeConfig(),
        "ngram": SpeculativeConfig(method="ngram", num_draft_tokens=bench.k),
    }
    if draft is not None:
        configs["draft"] = SpeculativeConfig(
            method="draft",
            num_draft_tokens=bench.k,
            draft_model=draft,
            draft_quantization=bench.draft_quantization,
        )
    specs: dict[str, AnySpeculation | None] = {
        e: make_speculation(lm, c) for e, c in configs.items()
    }
    data = structured_sets()
    results: dict[str, Any] = {}
    for name in bench.sets:
        items = data[name][: bench.per_set]
        reqs = requests(lm, name, items)
        # warm-up: compile the grammars and run each engine once (excluded)
        for spec in specs.values():
            _decode(lm, *reqs[0], 8, spec)
        cells = {e: Cell() for e in specs}
        mask_ms: list[float] = []
        for (ids, grammar), item in zip(reqs, items, strict=True):
            for engine, spec in specs.items():  # engines interleaved per prompt: same load
                req, seconds = _decode(lm, ids, grammar, bench.tokens, spec)
                cells[engine].add(req, seconds, valid(name, req.text, item))
            mask_ms.append(mask_ms_per_token(lm, grammar, cells["none"].outputs[-1]))
        base = cells["none"]
        results[name] = {
            "prompts": len(items),
            "mask_ms_per_token": sum(mask_ms) / len(mask_ms),
            "decode_ms_per_token_spec_off": 1e3 * base.seconds / max(1, base.tokens),
            "engines": {
                e: {
                    "tokens": c.tokens,
                    "seconds": round(c.seconds, 3),
                    "tok_s": round(c.tok_s, 2),
                    "speedup": round(c.tok_s / base.tok_s, 3) if base.tok_s else None,
                    "decode_tok_s": round(c.decode_tok_s, 2),
                    "decode_speedup": round(c.decode_tok_s / base.decode_tok_s, 3)
                    if base.decode_tok_s
                    else None,
                    "acceptance_length": round(c.acceptance_length, 3),
                    "valid": c.valid,
                    "identical_to_off": sum(
                        a == b for a, b in zip(c.outputs, base.outputs, strict=True)
                    ),
                }
                for e, c in cells.items()
            },
        }
    report.update(target=bench.target, draft=draft, dtype=bench.dtype, k=bench.k)
    report["results"] = results
    rows = []
    for name, r in results.items():
        for e, c in r["engines"].items():
            rows.append(
                [
                    name,
                    e,
                    c["tok_s"],
                    f"{c['speedup']:.2f}x",
                    c["decode_tok_s"],
                    f"{c['decode_speedup']:.2f}x",
                    c["acceptance_length"],
                    f"{c['valid']}/{r['prompts']}",
                    f"{c['identical_to_off']}/{r['prompts']}",
                ]
            )
    md = f"# Structured outputs under speculation: {bench.target} ({bench.dtype})\n\n"
    header = ["set", "engine", "tok/s", "vs off", "decode tok/s", "vs off", "AL", "valid", "= off"]
    md += table(header, rows)
    md += "\n" + table(
        ["set", "grammar mask ms/token", "decode ms/token (off)", "mask share"],
        [
            [
                n,
                f"{r['mask_ms_per_token']:.3f}",
                f"{r['decode_ms_per_token_spec_off']:.1f}",
                f"{100 * r['mask_ms_per_token'] / r['decode_ms_per_token_spec_off']:.2f} %",
            ]
            for n, r in results.items()
        ],
    )
    series: dict[str, Sequence[float]] = {
        e: [results[n]["engines"][e]["tok_s"] for n in results] for e in specs
    }
    plot = bar_chart("structured decoding (greedy)", "tok/s", list(results), series)
    slug = bench.target.replace("/", "_")
    write(f"structured-{slug}", report, md, plot, bench.out_dir)
    return report


def _decode(
    lm: LoadedModel, ids: list[int], grammar: Grammar, tokens: int, spec: AnySpeculation | None
) -> tuple[Request, float]:
    req = lm.new_request(ids, SamplingParams(max_tokens=tokens, grammar=grammar))
    t0 = time.perf_counter()
    for _ in stream(lm, req, spec):
        pass
    return req, time.perf_counter() - t0
