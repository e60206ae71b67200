"""Perplexity and greedy agreement of one model run three ways: quickdraft on the GGUF's own
quantized weights (`--dtype gguf`), quickdraft on the same file dequantized to bf16, and
llama.cpp on the file (the `peers` extra; skipped with a note when it is not installed).

The text is fixed: every prompt of quickdraft/prompts/spec_bench.json, joined by blank lines,
cut to --tokens tokens of the model's tokenizer; every engine scores the same token ids. For
each engine: perplexity over tokens 2..n (each predicted from all before it), and the share of
positions whose argmax agrees with each other engine's (how often greedy decoding from the same
prefix would pick the same next token). Writes bench/results/perplexity.{json,md,png}.

    python bench/perplexity.py                          # Qwen2.5-Coder-1.5B, 1024 tokens
    python bench/perplexity.py --model smollm2-135m --tokens 512
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from typing import Any

import numpy as np
import torch

from quickdraft import hub
from quickdraft.bench.peers import LlamaCpp, PeerUnavailableError
from quickdraft.bench.report import bar_chart, machine, table, write
from quickdraft.config import DEFAULT_MODEL
from quickdraft.loading import load

CHUNK = 256  # tokens per forward: bounds the logits held at once


def fixed_text() -> str:
    sets = json.loads(resources.files("quickdraft.prompts").joinpath("spec_bench.json").read_text())
    return "\n\n".join(p for prompts in sets.values() for p in prompts)


def ours(model: str, dtype: str, ids: list[int]) -> np.ndarray:
    """Argmax and log-prob of the actual next token at every position: [n - 1, 2]."""
    lm = load(model, dtype, progress=False)
    net = lm.model
    cache = net.new_cache(len(ids))
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), CHUNK):
            chunk = torch.tensor(ids[start : start + CHUNK])
            n = len(chunk)
            cache.reserve(n)
            logits = net(chunk, [cache], [n], logit_rows=torch.arange(n)).logits
            cache.commit(cache.length + n)
            out.append(score(logits.float().numpy(), ids, start))
    return np.concatenate(out)[: len(ids) - 1]


def score(logits: np.ndarray, ids: list[int], start: int) -> np.ndarray:
    """Rows of `logits` predict ids[start + 1 ...]: (argmax, log p(next)) per row that has a
    next token."""
    rows = min(len(logits), len(ids) - 1 - start)
    logits = logits[:rows].astype(np.float64)
    logp = logits - logits.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    nxt = np.array(ids[start + 1 : start + 1 + rows])
    return np.stack([logits.argmax(axis=1), logp[np.arange(rows), nxt]], axis=1)


def llama_cpp(model: str, ids: list[int], threads: int) -> np.ndarray:
    peer = LlamaCpp(hub.gguf_file(model, progress=False), threads, len(ids), logits_all=True)
    return score(peer.prompt_logits(ids), ids, 0)


def main() -> None:
    host = machine()
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    lm = load(args.model, "gguf", progress=False)
    ids = lm.tokenizer.encode(fixed_text())[: args.tokens]
    del lm
    runs: dict[str, np.ndarray] = {
        "quickdraft gguf": ours(args.model, "gguf", ids),
        "quickdraft bf16 (dequantized)": ours(args.model, "bf16", ids),
    }
    note = ""
    try:
        runs["llama.cpp"] = llama_cpp(args.model, ids, torch.get_num_threads())
    except PeerUnavailableError as e:
        note = f"llama.cpp not run: {e}"
    names = list(runs)
    report: dict[str, Any] = {
        "bench": "perplexity",
        "machine": host,
        "model": args.model,
        "tokens": len(ids),
        "perplexity": {k: round(float(np.exp(-v[:, 1].mean())), 4) for k, v in runs.items()},
        "argmax_agreement": {
            f"{a} vs {b}": round(float((runs[a][:, 0] == runs[b][:, 0]).mean()), 4)
            for i, a in enumerate(names)
            for b in names[i + 1 :]
        },
        "note": note,
    }
    md = (
        f"Perplexity of {args.model} on a fixed text ({len(ids)} tokens: the benchmark "
        "prompts), and how often two engines' argmax agree at a position.\n\n"
        + table(["engine", "perplexity"], list(report["perplexity"].items()))
        + "\n"
        + table(["engines", "argmax agreement"], list(report["argmax_agreement"].items()))
        + (f"\n{note}\n" if note else "")
    )
    plot = bar_chart(
        f"Perplexity, {args.model}",
        "perplexity",
        ["perplexity"],
        {k: [v] for k, v in report["perplexity"].items()},
    )
    write("perplexity", report, md, plot)


if __name__ == "__main__":
    main()
