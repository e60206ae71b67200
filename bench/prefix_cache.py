"""Prefix cache benchmark (over 400 lines: four measures in one run, report and chart).

engine/prefix_cache.py: time to first token with a cached prefix vs cold, and
a multi-turn chat replay with the cache vs without, for a dense packaged model and a hybrid
(Gated DeltaNet) random-weight model of Qwen3.5-0.8B's shape (bench/hybrid.py's config).

Measured side by side in one run, on the engine core (no threads, no HTTP), speculation off,
warm-up excluded:
  ttft       a prompt of a --prefix-tokens prefix (the package's own source, so real text) and
             a short question: median TTFT over --repeats questions on a core without the
             cache (cold) vs on a core whose cache already holds the prefix (one earlier request
             with another question put it there), the matched blocks read in place (the
             default) and copied into the sequence's cache (models/caches/kv_cache.py `IN_PLACE`
             False, as before 2026-11-27); cold and cached runs interleaved
  step       a decode step (1 row) and a verify (17 rows) after the --prefix-tokens prefix
             taken from the cache (as a request with it left it), blocks in place vs copied
             in: the median of 9 interleaved forwards each, the price of reading keys through
             the page table
  held       --concurrent requests with the cached prefix and different questions, admitted
             together: the KV bytes their sequences' caches hold once each has its first
             token, blocks in place vs copied in (the prefix cache's own blocks not counted)
  multiturn  an --turns turn conversation replayed as a chat client does: each turn's prompt is
             the whole conversation so far (system prompt of --system-tokens of source, the
             questions, the model's own answers of --turn-tokens) plus the new question; total
             wall time without the cache vs with it, cached tokens per turn, and whether every
             answer is token-identical (greedy)
Writes bench/results/<name>.json, .md (tables) and .png (TTFT and replay time bars); prints the
tables, then the JSON as the last line.

    python bench/prefix_cache.py                                     # 1.5B gguf + hybrid
    python bench/prefix_cache.py --model smollm2-135m --prefix-tokens 200 --turns 2 \\
        --turn-tokens 8 --system-tokens 100 --repeats 1 --hybrid-layers 4 --out /tmp/pc
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from quickdraft.bench.report import RESULTS, bars, machine, peak_rss_mb, table, write
from quickdraft.bench.shapes import HYBRID_CONFIG, init_  # the random hybrid of bench/hybrid.py
from quickdraft.config import DEFAULT_DTYPE, DEFAULT_MODEL, PrefixCacheConfig, given
from quickdraft.engine.core import EngineCore
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.kernels import panels_apply
from quickdraft.loading import LoadedModel, load
from quickdraft.models.caches import kv_cache
from quickdraft.models.families.hybrid_config import HybridConfig
from quickdraft.models.families.qwen3_next import HybridLM
from quickdraft.request import SamplingParams

QUESTIONS = [
    "What does the scheduler do when the token budget runs out?",
    "Which function commits the accepted drafts?",
    "How is a rejected draft rolled back?",
    "Where is the prefix cache consulted?",
    "What happens when a request is cancelled?",
    "Which tensors does a forward write?",
    "How are prompt chunks sized?",
    "Summarise the step pipeline in one sentence.",
    "What would break if the cache were shared between models?",
    "Which numbers should a benchmark print?",
]


def source_text() -> str:
    root = Path(__file__).resolve().parent.parent / "quickdraft"
    return "\n\n".join(p.read_text() for p in sorted(root.rglob("*.py")))


def hybrid_model(like: LoadedModel, layers: int) -> LoadedModel:
    """The random hybrid as a LoadedModel, with `like`'s tokenizer (ids are kept below the
    hybrid's vocabulary by `fit`)."""
    cfg = dict(HYBRID_CONFIG, num_hidden_layers=layers)
    model = HybridLM(HybridConfig.from_dict(cfg), torch.bfloat16)
    init_(model, 0, 1.0)
    if panels_apply(model.dtype, model.device):
        model.pack_()
    name = f"hybrid-random-{layers}L"
    return LoadedModel(name, Path("."), "bf16", model, like.tokenizer, ())


def fit(lm: LoadedModel, ids: list[int]) -> list[int]:
    vocab = lm.model.config.vocab_size
    return [t % vocab for t in ids]


def first_token(core: EngineCore, lm: LoadedModel, ids: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first token, and the prompt tokens the cache served."""
    req = lm.new_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    seq = core.add(req, None)
    while not req.output_ids:
        core.step()
    seconds = time.perf_counter() - t
    while core.has_work:
        core.step()
    return seconds, seq.cached_tokens


def copied_in(on: bool) -> None:
    """Matched blocks copied into each sequence's cache (True) or read in place (False)."""
    kv_cache.IN_PLACE = not on


def ttft(
    lm: LoadedModel, prefix: list[int], questions: list[list[int]], cache: PrefixCacheConfig
) -> dict[str, Any]:
    cold_core = EngineCore(lm, SchedulerConfig(), PrefixCacheConfig(enabled=False))
    warm_core = EngineCore(lm, SchedulerConfig(), cache)
    first_token(cold_core, lm, prefix + questions[0])  # warm-up: kernels, allocator
    first_token(warm_core, lm, prefix + questions[0])  # ...and the cache now holds the prefix
    cold, cached, copied, served = [], [], [], []
    try:
        for q in questions[1:]:
            cold.append(first_token(cold_core, lm, prefix + q)[0])
            seconds, tokens = first_token(warm_core, lm, prefix + q)
            cached.append(seconds)
            served.append(tokens)
            copied_in(True)
            copied.append(first_token(warm_core, lm, prefix + q)[0])
            copied_in(False)
    finally:
        copied_in(False)
    cold_s, cached_s = statistics.median(cold), statistics.median(cached)
    copied_s = statistics.median(copied)
    return {
        "prompt_tokens": len(prefix) + len(questions[1]),
        "cached_tokens": served,
        "cold_s": [round(s, 4) for s in cold],
        "cached_s": [round(s, 4) for s in cached],
        "copied_s": [round(s, 4) for s in copied],
        "median_cold_s": round(cold_s, 4),
        "median_cached_s": round(cached_s, 4),
        "median_copied_s": round(copied_s, 4),
        "speedup": round(cold_s / cached_s, 2),
        "in_place_vs_copied": round(copied_s / cached_s, 2),
    }


def step(lm: LoadedModel, prefix: list[int], cache: PrefixCacheConfig) -> dict[str, Any]:
    """Forward times of 1 and 17 new rows after `prefix`, taken from the prefix cache (blocks
    as the engine stores them: a request with the prompt ran first) in place vs copied in."""
    model = lm.model
    core = EngineCore(lm, SchedulerConfig(), cache)
    first_token(core, lm, prefix)
    assert core.prefix is not None
    out: dict[str, Any] = {}
    caches = {}
    for mode in ("in_place", "copied"):
        copied_in(mode == "copied")
        try:
            caches[mode] = model.new_cache(len(prefix) + 32)
            cursor = core.prefix.admit(prefix, caches[mode], None)
        finally:
            copied_in(False)
        core.prefix.leave(cursor, None, failed=False)
        out["context"] = caches[mode].length
    for rows in (1, 17):
        ids, logit_rows = torch.tensor(prefix[:rows]), torch.arange(rows)
        times: dict[str, list[float]] = {mode: [] for mode in caches}
        for _ in range(9):  # interleaved: the host's speed drifts
            for mode, kv in caches.items():
                t = time.perf_counter()
                model(ids, [kv], [rows], logit_rows=logit_rows)
                times[mode].append(time.perf_counter() - t)
        for mode, ts in times.items():
            out[f"{mode}_{rows}_ms"] = round(1000 * statistics.median(ts), 2)
    return out


def held(
    lm: LoadedModel, prefix: list[int], questions: list[list[int]], cache: PrefixCacheConfig
) -> dict[str, Any]:
    """KV bytes of `len(questions) - 1` sequences sharing a cached prefix, at first token."""
    out: dict[str, Any] = {"requests": len(questions) - 1}
    for mode in ("in_place", "copied"):
        core = EngineCore(lm, SchedulerConfig(max_running=len(questions)), cache)
        first_token(core, lm, prefix + questions[0])  # the cache now holds the prefix
        copied_in(mode == "copied")
        try:
            params = SamplingParams(max_tokens=64, ignore_eos=True)  # none ends before all start
            reqs = [lm.new_request(prefix + q, params) for q in questions[1:]]
            seqs = [core.add(r, None) for r in reqs]
            while not all(r.output_ids for r in reqs):
                core.step()
            out[f"{mode}_bytes"] = sum(s.cache.nbytes() for s in seqs if s.cache is not None)
            assert all(s.cache is not None for s in seqs), "a request ended before all started"
            for seq in seqs:
                core.abort(seq)
            while core.has_work:
                core.step()
        finally:
            copied_in(False)
        out[f"{mode}_cached_tokens"] = [s.cached_tokens for s in seqs]
    out["ratio"] = round(out["copied_bytes"] / max(out["in_place_bytes"], 1), 2)
    return out


def replay(
    lm: LoadedModel,
    system: list[int],
    questions: list[list[int]],
    tokens: int,
    cache: PrefixCacheConfig,
) -> dict[str, Any]:
    """One conversation: each turn resends everything so far plus the next question."""
    core = EngineCore(lm, SchedulerConfig(), cache)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    history = list(system)
    answers, cached, prompts, ttfts = [], [], [], []
    t0 = time.perf_counter()
    for q in questions:
        history += q
        req = lm.new_request(list(history), params)
        seq = core.add(req, None)
        while core.has_work:
            core.step()
        answers.append(req.output_ids)
        cached.append(seq.cached_tokens)
        prompts.append(len(history))
        ttfts.append(req.timing.ttft)
        history += req.output_ids
    seconds = time.perf_counter() - t0
    stats = core.stats.prefix_cache
    return {
        "seconds": round(seconds, 3),
        "prompt_tokens": prompts,
        "cached_tokens": cached,
        "ttft_s": [round(t or 0.0, 4) for t in ttfts],
        "prefill_rows": core.stats.prefill_rows,
        "cache_bytes": 0 if stats is None else stats.bytes,
        "answers": answers,
    }


def multiturn(
    lm: LoadedModel,
    system: list[int],
    questions: list[list[int]],
    tokens: int,
    cache: PrefixCacheConfig,
) -> dict[str, Any]:
    no_cache = PrefixCacheConfig(enabled=False)
    replay(lm, system[:64], questions[:1], 2, no_cache)  # warm-up
    off = replay(lm, system, questions, tokens, no_cache)
    on = replay(lm, system, questions, tokens, cache)
    same = off.pop("answers") == on.pop("answers")
    return {
        "turns": len(questions),
        "off": off,
        "on": on,
        "speedup": round(off["seconds"] / on["seconds"], 2),
        "identical_outputs": same,
    }


def run_model(lm: LoadedModel, args: argparse.Namespace, text: str) -> dict[str, Any]:
    enc = lm.tokenizer.encode
    ids = fit(lm, enc(text, add_special_tokens=False))
    qs = [fit(lm, enc(f"\n\nUser: {q}\nAssistant:", add_special_tokens=False)) for q in QUESTIONS]
    assert len(ids) >= max(args.prefix_tokens, args.system_tokens), "not enough source text"
    turns = [qs[i % len(qs)] for i in range(args.turns)]
    cache = PrefixCacheConfig(
        **given(block_size=args.block_size, snapshot_every=args.snapshot_every)
    )
    print(f"[{lm.name}] ttft ({args.prefix_tokens}-token prefix) ...", flush=True)
    first = ttft(lm, ids[: args.prefix_tokens], qs[: args.repeats + 1], cache)
    print(f"[{lm.name}] steps over the cached prefix ...", flush=True)
    steps = step(lm, ids[: args.prefix_tokens], cache)
    print(f"[{lm.name}] {args.concurrent} requests sharing the prefix ...", flush=True)
    memory = held(lm, ids[: args.prefix_tokens], qs[: args.concurrent + 1], cache)
    print(f"[{lm.name}] {args.turns}-turn replay ...", flush=True)
    chat = multiturn(lm, ids[: args.system_tokens], turns, args.turn_tokens, cache)
    return {
        "model": lm.name,
        "dtype": lm.dtype_name,
        "ttft": first,
        "held": memory,
        "step": steps,
        "multiturn": chat,
    }


def markdown(report: dict[str, Any]) -> str:
    rows = []
    for r in report["models"]:
        t, m = r["ttft"], r["multiturn"]
        rows.append(
            [
                r["model"],
                t["prompt_tokens"],
                t["cached_tokens"][0],
                f"{t['median_cold_s']:.3f}",
                f"{t['median_cached_s']:.3f}",
                f"{t['median_copied_s']:.3f}",
                f"{t['speedup']}x",
                m["turns"],
                f"{m['off']['seconds']:.2f}",
                f"{m['on']['seconds']:.2f}",
                f"{m['speedup']}x",
                "yes" if m["identical_outputs"] else "NO",
            ]
        )
    header = [
        "model",
        "prompt",
        "cached",
        "TTFT cold s",
        "TTFT cached s",
        "TTFT copied in s",
        "TTFT gain",
        "turns",
        "replay off s",
        "replay on s",
        "replay gain",
        "identical",
    ]
    out = "## Prefix cache: TTFT with a cached prefix, multi-turn replay\n\n"
    out += table(header, rows)
    for r in report["models"]:
        on = r["multiturn"]["on"]
        out += f"\n{r['model']}: prompt tokens per turn {on['prompt_tokens']}, cached "
        out += f"{on['cached_tokens']}, prefill rows {r['multiturn']['off']['prefill_rows']} -> "
        out += f"{on['prefill_rows']}\n"
    out += "\n### KV held by requests sharing the cached prefix, at first token\n\n"
    rows = [
        [
            r["model"],
            r["held"]["requests"],
            f"{r['held']['in_place_bytes'] / 2**20:.1f}",
            f"{r['held']['copied_bytes'] / 2**20:.1f}",
            f"{r['held']['ratio']}x",
        ]
        for r in report["models"]
    ]
    out += table(["model", "requests", "in place MiB", "copied in MiB", "copied / in place"], rows)
    out += "\n### Forward after the cached prefix, blocks in place vs copied in (median of 9)\n\n"
    rows = [
        [
            r["model"],
            r["step"]["context"],
            r["step"]["in_place_1_ms"],
            r["step"]["copied_1_ms"],
            r["step"]["in_place_17_ms"],
            r["step"]["copied_17_ms"],
        ]
        for r in report["models"]
    ]
    header = ["model", "context", "1 row in place ms", "copied", "17 rows in place ms", "copied"]
    out += table(header, rows)
    return out


def plot(report: dict[str, Any]) -> Any:
    names = [r["model"] for r in report["models"]]

    def draw(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        cold = [r["ttft"]["median_cold_s"] for r in report["models"]]
        cached = [r["ttft"]["median_cached_s"] for r in report["models"]]
        bars(ax1, "TTFT, cached prefix vs cold", "seconds", names, {"cold": cold, "cached": cached})
        off = [r["multiturn"]["off"]["seconds"] for r in report["models"]]
        on = [r["multiturn"]["on"]["seconds"] for r in report["models"]]
        bars(ax2, "multi-turn replay, total", "seconds", names, {"no cache": off, "cache": on})

    return draw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the dense model (catalog name/path)")
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3, help="timed questions per TTFT figure")
    ap.add_argument("--concurrent", type=int, default=4, help="requests sharing the prefix")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=64, help="answer tokens per turn")
    ap.add_argument("--system-tokens", type=int, default=1000, help="replay system prompt")
    ap.add_argument("--hybrid-layers", type=int, default=24, help="0: no hybrid model")
    ap.add_argument("--block-size", type=int, default=None, help="prefix cache block (16)")
    ap.add_argument(
        "--snapshot-every", type=int, default=None, help="hybrid state snapshot, blocks (16)"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--name", default="prefix-cache")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"machine": machine(), "args": vars(args), "models": []}
    text = source_text()
    dense = load(args.model, args.dtype)
    report["models"].append(run_model(dense, args, text))
    if args.hybrid_layers:
        report["models"].append(run_model(hybrid_model(dense, args.hybrid_layers), args, text))
    report["peak_rss_mb"] = round(peak_rss_mb())
    write(args.name, report, markdown(report), plot(report), Path(args.out), figsize=(11, 4))


if __name__ == "__main__":
    main()
