"""Embeddings throughput (/v1/embeddings' engine path) beside llama.cpp's on the same GGUF.

The inputs are cut from this repository's own source (deterministically): --inputs texts of
about --tokens tokens each. quickdraft: an Engine (no prefix cache: every round recomputes)
runs them as embedding requests (`SamplingParams(pooling="last")`), all submitted at once (the
engine packs their prefill chunks into steps, as a server does with a batch request) and one
after the other. llama.cpp two ways, on the same file and texts, last-token pooling, the same
threads: llama-cpp-python's `Llama.embed` (`embedding=True`; it marks every token an output,
so llama.cpp also runs the vocabulary head on every row), and, with --llama-server, a
`llama-server --embeddings` (4 slots, one /v1/embeddings request of all the texts), what a
llama.cpp server user gets. Interleaved rounds, medians; tok/s counts each side's own tokens.
The vectors are checked against llama-cpp-python's (cosine; both round the activations their
own ways on a quantized file).

    flock /tmp/quickdraft-bench.lock .venv/bin/python bench/embeddings.py --rounds 3 \
        --llama-server /work/peers/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from quickdraft.bench.report import bar_chart, machine, table, write
from quickdraft.bench.serving import served
from quickdraft.config import PrefixCacheConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.hub.catalog import gguf_file
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams

SOURCE = Path(__file__).resolve().parent.parent / "quickdraft"


def texts(lm: LoadedModel, count: int, tokens: int) -> list[str]:
    """`count` pieces of the package's source of ~`tokens` tokens, in path order."""
    out: list[str] = []
    for path in sorted(SOURCE.rglob("*.py")):
        ids = lm.tokenizer.encode(path.read_text(), add_special_tokens=False)
        for start in range(0, len(ids) - tokens, tokens):
            out.append(lm.tokenizer.decode(ids[start : start + tokens]))
            if len(out) == count:
                return out
    return out


def ours(engine: Engine, inputs: list[list[int]], together: bool) -> tuple[float, list[Any]]:
    params = SamplingParams(max_tokens=1, pooling="last")
    t = time.perf_counter()
    if together:
        handles = [engine.submit("m", ids, params) for ids in inputs]
        outs = [list(h)[-1] for h in handles]
    else:
        outs = [list(engine.submit("m", ids, params))[-1] for ids in inputs]
    return time.perf_counter() - t, [o.embedding for o in outs]


def llama_server_argv(binary: str, gguf: Path, threads: int, port: int) -> list[str]:
    """`llama-server --embeddings` on `gguf`: last-token pooling, 4 slots."""
    argv = [binary, "-m", str(gguf), "--embeddings", "--pooling", "last", "-t", str(threads)]
    return [*argv, "-c", "8192", "-np", "4", "-b", "2048", "-ub", "2048", "--port", str(port)]


def server_embed(url: str, texts: list[str]) -> tuple[float, int]:
    """Seconds for one /v1/embeddings request of `texts` to `url`, and its prompt tokens."""
    t = time.perf_counter()
    r = httpx.post(url + "/v1/embeddings", json={"input": texts}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t, int(r.json()["usage"]["prompt_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (a second peer)")
    ap.add_argument("--name", default="embeddings")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import llama_cpp

    report: dict[str, Any] = {"bench": "embeddings", "machine": machine(), "args": vars(args)}
    lm = load(args.model, "gguf", progress=False)
    docs = texts(lm, args.inputs, args.tokens)
    inputs = [lm.tokenizer.encode(d, parse_special=False) for d in docs]
    engine = Engine({"m": ServedModel(lm)}, prefix_cache=PrefixCacheConfig(enabled=False))
    engine.start()
    peer = llama_cpp.Llama(
        model_path=str(gguf_file(args.model, progress=False)),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST,
        n_ctx=4096,
        n_batch=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    peer_tokens = sum(len(peer.tokenize(d.encode(), special=False)) for d in docs)
    ours_tokens = sum(map(len, inputs))
    stack = ExitStack()
    server = None
    if args.llama_server:  # the bench package's server launcher (waits for /health)
        gguf = gguf_file(args.model, progress=False)

        def argv(port: int, *_: Any) -> list[str]:
            return llama_server_argv(args.llama_server, gguf, args.threads, port)

        server = stack.enter_context(served(argv, 120, "llama-server"))
    names: tuple[str, ...] = ("ours, together", "ours, one by one", "llama.cpp")
    names += ("llama-server",) if server else ()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    server_tokens = 0
    vectors: list[Any] = []
    theirs: Any = None
    try:
        ours(engine, inputs[:2], True)  # warm
        peer.embed(docs[:2])
        for r in range(args.rounds):
            s, vectors = ours(engine, inputs, True)
            seconds["ours, together"].append(s)
            s, _ = ours(engine, inputs, False)
            seconds["ours, one by one"].append(s)
            t = time.perf_counter()
            theirs = peer.embed(docs, normalize=True)
            seconds["llama.cpp"].append(time.perf_counter() - t)
            if server is not None:
                s, server_tokens = server_embed(server.url, docs)
                seconds["llama-server"].append(s)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1]:.2f} s" for k, v in seconds.items()), flush=True)  # fmt: skip
    finally:
        engine.stop()
        stack.close()
    a = np.asarray(vectors, dtype=np.float64)
    b = np.asarray(theirs, dtype=np.float64)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    results: dict[str, dict[str, Any]] = {}
    for name, ss in seconds.items():
        med = statistics.median(ss)
        tokens = {"llama.cpp": peer_tokens, "llama-server": server_tokens}.get(name, ours_tokens)
        results[name] = {
            "seconds": [round(x, 3) for x in ss],
            "inputs_per_s": round(len(docs) / med, 2),
            "tok_s": round(tokens / med, 1),
        }
    best_ours = max(results[k]["tok_s"] for k in ("ours, together", "ours, one by one"))
    report["results"] = results
    peers = [n for n in results if n.startswith("llama")]
    best_peer = max(results[n]["tok_s"] for n in peers)
    report["vs_best_peer"] = round(best_ours / best_peer, 3)
    report["tokens"] = {
        "ours": ours_tokens,
        "llama.cpp": peer_tokens,
        "llama-server": server_tokens,
    }
    report["cosine_vs_llama_cpp"] = {"min": round(float(cos.min()), 5), "median": round(
        float(np.median(cos)), 5)}  # fmt: skip
    write(args.name, report, markdown(report), plot(report))


def markdown(r: dict[str, Any]) -> str:
    a = r["args"]
    out = (
        f"## Embeddings ({a['model']} GGUF, {a['inputs']} inputs of ~{a['tokens']} tokens, "
        f"last-token pooling, {a['threads']} threads, median of {a['rounds']} rounds)\n\n"
    )
    rows = [
        [name, f"{v['inputs_per_s']:.2f}", f"{v['tok_s']:.1f}"] for name, v in r["results"].items()
    ]
    out += table(["engine", "inputs/s", "tok/s"], rows)
    cos = r["cosine_vs_llama_cpp"]
    out += (
        f"\nquickdraft's best over the best peer: **{r['vs_best_peer']:.2f}x** tok/s; "
        f"cosine of the vectors against llama.cpp's: median {cos['median']}, min {cos['min']}\n"
    )
    return out


def plot(r: dict[str, Any]) -> Any:
    names = list(r["results"])
    series: dict[str, Sequence[float]] = {"tok/s": [r["results"][n]["tok_s"] for n in names]}
    return bar_chart("embeddings", "tok/s", names, series)


if __name__ == "__main__":
    main()
