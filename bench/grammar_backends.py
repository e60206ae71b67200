"""Grammar engines for structured outputs: xgrammar vs llguidance, per-token mask cost on this CPU.

For each JSON schema of quickdraft/prompts/structured.json (and the builtin "any JSON object"),
a valid JSON document is tokenized with the model's tokenizer and replayed through each
engine's matcher: compile time, then per token the next-token bitmask fill and the advance by
the token, in milliseconds (mean and max over all tokens). The mask is what a speculative verify
computes at every verified position, so its cost per token is the figure that decided which
engine quickdraft uses (grammar.py). llguidance is optional (`pip install llguidance`).
Writes bench/results/structured/grammar-backends.{json,md,png}.

    python bench/grammar_backends.py                      # the 1.5B's Qwen2.5 vocabulary
    python bench/grammar_backends.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from quickdraft import hub
from quickdraft.bench.report import RESULTS, bar_chart, table, write
from quickdraft.bench.structured import structured_sets
from quickdraft.config import DEFAULT_MODEL
from quickdraft.tokenizer import Tokenizer

# one valid document per schema of the json_schema set, in the set's order
DOCS = [
    {"name": "Ada Lovelace", "age": 36, "city": "London", "languages": ["English", "French"]},
    {"name": "Linus Torvalds", "age": 55, "city": "Portland", "languages": ["Finnish"]},
    {
        "order_id": "A-1042",
        "items": [{"sku": "SKU-RED-7", "qty": 2, "price": 19.99}],
        "total": 39.98,
        "status": "shipped",
    },
    {"order_id": "B-77", "items": [], "total": 0.0, "status": "pending"},
    {
        "name": "read_config",
        "parameters": [{"name": "path", "type": "str"}],
        "returns": "dict",
        "raises": ["FileNotFoundError"],
    },
    {"name": "parse_port", "parameters": [], "returns": "int", "raises": []},
    {
        "file": "utils.py",
        "issues": [{"line": 5, "severity": "high", "message": "off by one"}],
        "approve": False,
    },
    {"file": "net.py", "issues": [], "approve": True},
]


def timed_replay(fill: Any, accept: Any, ids: list[int]) -> list[float]:
    out = []
    for t in ids:
        t0 = time.perf_counter()
        fill()
        out.append(time.perf_counter() - t0)
        if not accept(t):
            raise AssertionError(f"the engine refused token {t} of a valid document")
    return out


def xgrammar_case(
    tok: Tokenizer, vocab: int, schema: dict[str, Any], ids: list[int]
) -> dict[str, float]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    info = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tok.backend), vocab_size=vocab
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = timed_replay(lambda: m.fill_next_token_bitmask(mask, 0), m.accept_token, ids)
    return summary(compile_s, times)


def llguidance_case(
    tok: Tokenizer, vocab: int, schema: dict[str, Any], ids: list[int]
) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt
    from transformers import PreTrainedTokenizerFast

    lt = llguidance.hf.from_tokenizer(
        PreTrainedTokenizerFast(tokenizer_object=tok.backend), n_vocab=vocab
    )
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(schema))
    compile_s = time.perf_counter() - t0
    mask = lgt.allocate_token_bitmask(1, lt.vocab_size)
    times = timed_replay(lambda: lgt.fill_next_token_bitmask(m, mask, 0), m.consume_token, ids)
    return summary(compile_s, times)


def summary(compile_s: float, times: list[float]) -> dict[str, float]:
    return {
        "compile_ms": round(1e3 * compile_s, 3),
        "mask_ms_mean": round(1e3 * sum(times) / len(times), 4),
        "mask_ms_max": round(1e3 * max(times), 4),
        "tokens": len(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    path = hub.resolve(args.model, "gguf")
    tok = Tokenizer(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    schemas = [item["schema"] for item in structured_sets()["json_schema"]]
    engines = {"xgrammar": xgrammar_case, "llguidance": llguidance_case}
    results: dict[str, list[dict[str, float]]] = {}
    for name, case in engines.items():
        try:
            results[name] = [
                case(tok, vocab, schema, tok.encode(json.dumps(doc), add_special_tokens=False))
                for schema, doc in zip(schemas, DOCS, strict=True)
            ]
        except ImportError as exc:
            print(f"{name}: not installed ({exc}); skipped")
    agg = {
        name: {
            "mask_ms_mean": sum(r["mask_ms_mean"] * r["tokens"] for r in rs)
            / sum(r["tokens"] for r in rs),
            "mask_ms_max": max(r["mask_ms_max"] for r in rs),
            "compile_ms_mean": sum(r["compile_ms"] for r in rs) / len(rs),
        }
        for name, rs in results.items()
    }
    rows = [
        [n, f"{a['mask_ms_mean']:.4f}", f"{a['mask_ms_max']:.3f}", f"{a['compile_ms_mean']:.1f}"]
        for n, a in agg.items()
    ]
    md = f"# Grammar engines, JSON schema masks ({args.model} vocabulary, {vocab} ids)\n\n"
    md += table(["engine", "mask ms/token (mean)", "max", "compile ms (mean)"], rows)
    report = {"model": args.model, "vocab": vocab, "per_schema": results, "summary": agg}
    series = {"mask ms/token (mean)": [a["mask_ms_mean"] for a in agg.values()]}
    plot = bar_chart("grammar mask cost per token", "ms", list(agg), series)
    write("grammar-backends", report, md, plot, RESULTS / "structured")


if __name__ == "__main__":
    main()
