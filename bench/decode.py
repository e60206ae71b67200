"""Plain greedy decode speed: quickdraft vs Hugging Face transformers `generate`, side by side.

Same converted weights, dtype, prompt and token count for both. Decode tok/s is measured as
(N - 1) / (time(N tokens) - time(1 token)) for both engines, so prefill and the first token are
excluded symmetrically; one warm-up run each is excluded too. Writes bench/results/decode.json,
.md (a table) and .png (a bar chart); prints the table, then the JSON as the last line.

    python bench/decode.py --models smollm2-135m qwen2.5-coder-1.5b --tokens 128
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from quickdraft.bench.report import (
    bar_chart,
    machine,
    peak_rss_mb,
    read_bandwidth_gbs,
    table,
    write,
)
from quickdraft.config import BENCH_MAX_TOKENS, DEFAULT_DTYPE, parse_dtype
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams

PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime."


def ours_time(lm: LoadedModel, ids: list[int], n: int) -> float:
    req = lm.new_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
    t = time.perf_counter()
    for _ in stream(lm, req):
        pass
    assert len(req.output_ids) == n
    return time.perf_counter() - t


def hf_time(model: torch.nn.Module, ids: list[int], n: int) -> float:
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            x,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones_like(x),
        )
    assert out.shape[1] == len(ids) + n
    return time.perf_counter() - t


def decode_tps(timer, n: int, repeats: int) -> float:  # type: ignore[no-untyped-def]
    timer(8)  # warm-up
    one = min(timer(1) for _ in range(repeats))
    full = min(timer(n) for _ in range(repeats))
    return (n - 1) / (full - one)


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.nbytes
    return total


def main() -> None:
    host = machine()  # at the start: the code recorded is the code measured
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--tokens", type=int, default=BENCH_MAX_TOKENS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()
    bandwidth = read_bandwidth_gbs()
    rows = []
    for name in args.models:
        lm = load(name, args.dtype, progress=True)
        ids = lm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
        # bytes one decode step streams: every weight once (the embedding row read is tiny, but
        # the tied lm_head reads the whole table, so counting it once is right)
        wbytes = weight_bytes(lm.model)
        ours = decode_tps(
            lambda n, lm=lm, ids=ids: ours_time(lm, ids, n), args.tokens, args.repeats
        )
        row = {
            "model": name,
            "dtype": args.dtype,
            "prompt_tokens": len(ids),
            "tokens": args.tokens,
            "weight_gb": round(wbytes / 1e9, 3),
            "ours_tok_s": round(ours, 2),
            "ours_pct_roofline": round(100 * wbytes * ours / 1e9 / bandwidth, 1),
        }
        del lm
        if not args.no_hf:
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(load_path(name, args.dtype)), dtype=parse_dtype(args.dtype)
            ).eval()
            theirs = decode_tps(
                lambda n, hf=hf, ids=ids: hf_time(hf, ids, n), args.tokens, args.repeats
            )
            row["hf_tok_s"] = round(theirs, 2)
            row["speedup_vs_hf"] = round(ours / theirs, 2)
            del hf
        rows.append(row)
        print(row, file=sys.stderr)
    result = {
        "bench": "decode",
        "read_bandwidth_gbs": round(bandwidth, 1),
        "peak_rss_mb": round(peak_rss_mb()),
        "machine": host,
        "results": rows,
    }
    write("decode", result, markdown(result), plot(result))


def markdown(result: dict[str, Any]) -> str:
    rows = result["results"]
    tokens = rows[0]["tokens"] if rows else "?"
    head = (
        f"Greedy decode tok/s over {tokens} tokens (prefill and first token excluded), "
        f"quickdraft vs transformers `generate`; % roofline = weight bytes x tok/s / "
        f"{result['read_bandwidth_gbs']} GB/s measured DRAM read.\n\n"
    )
    return head + table(
        ["model", "dtype", "weights GB", "ours tok/s", "% roofline", "HF tok/s", "speedup"],
        [
            [
                r["model"],
                r["dtype"],
                r["weight_gb"],
                r["ours_tok_s"],
                r["ours_pct_roofline"],
                r.get("hf_tok_s", "-"),
                f"{r['speedup_vs_hf']}x" if "speedup_vs_hf" in r else "-",
            ]
            for r in rows
        ],
    )


def plot(result: dict[str, Any]) -> Callable[[Any], None]:
    rows = result["results"]
    series = {"quickdraft": [r["ours_tok_s"] for r in rows]}
    if all("hf_tok_s" in r for r in rows):
        series["transformers"] = [r["hf_tok_s"] for r in rows]
    return bar_chart("Greedy decode", "tok/s", [r["model"] for r in rows], series)


def load_path(name: str, dtype: str) -> Path:
    from quickdraft import hub

    return hub.resolve(name, dtype, progress=False)


if __name__ == "__main__":
    main()
