"""GGUF block formats and the one-graph draft chain on an NVIDIA GPU, against bf16 in the same
run (docs/gpu.md). Random weights with the real configs, as bench/gpu.py (the GPU host has no
network and a 64 MiB carry limit): the GGUF stand-in is `random_q4_k_m_`, the formats
llama.cpp's Q4_K_M gives each tensor, made on the device.

Measured, in one process:
  * kernels: the Triton GGUF GEMM on the target's projection shapes at M = 1, 6, 16 (BN swept at
    M = 1), against cuBLAS bf16 and the batch-invariant triton_linear on the same shapes;
    microseconds and weight GB/s;
  * per model (target, draft): weight bytes on the GPU, bf16 and GGUF; step cost by rows (the
    bf16 target also on cuBLAS's GEMMs instead of the batch-invariant triton_linear); the
    draft's k - 1 chained steps as one replay (`greedy_chain`) against k - 1 one-row steps;
  * the bf16 target's decode / verify at 4k and 16k cached tokens, keys split or not;
  * single stream, greedy: plain decode bf16 (triton_linear, and cuBLAS) and GGUF;
    speculation with the draft (k forced, and adaptive) on the bf16 pair and on the GGUF
    pair; n-gram on GGUF;
  * with `--acceptance` (a real-weight `quickdraft bench` speculative.json): PROJECTED tok/s of
    each pair = real tokens per cycle / measured ms per forced cycle (labelled so).
Writes <out>/gpu-gguf.{json,md,png}.

    python bench/gpu_gguf.py --models DIR/qwen2.5-coder-1.5b DIR/qwen2.5-coder-0.5b \\
        --acceptance bench/results/X/speculative.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu import acceptance_lengths, ours, random_checkpoint, step_costs
from gpu import guarded as guarded_one

from quickdraft.bench.report import bars, machine, table, write
from quickdraft.bench.speculative import prompt_sets
from quickdraft.config import SpeculativeConfig
from quickdraft.kernels import triton_gguf, triton_linear, triton_ops
from quickdraft.loading import LoadedModel, load
from quickdraft.models.formats.gguf_gpu import random_q4_k_m_, weight_bytes
from quickdraft.models.graphs import GraphModel
from quickdraft.speculation.cost import measure_step_cost, settle
from quickdraft.speculation.factory import make_speculation

REPS = 20  # timings per measurement (--reps; a CPU dry run takes 1)


def timed(fn: Any, device: torch.device, reps: int | None = None) -> float:
    """Median seconds of `fn()` (after a warm-up), each call synced."""
    reps = reps or REPS
    fn()
    settle(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        settle(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kernels(cfg: Any, device: torch.device) -> dict[str, Any]:
    """The GGUF GEMM vs cuBLAS bf16 on the projection shapes of `cfg`."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    shapes = {
        "qkv": ("Q4_K", q + 2 * kv, h),
        "o": ("Q4_K", h, q),
        "gate_up": ("Q4_K", 2 * inter, h),
        "down_q6": ("Q6_K", h, inter),
        "down_q4": ("Q4_K", h, inter),
        "head": ("Q6_K", cfg.vocab_size, h),
    }
    out: dict[str, Any] = {}
    for name, (fmt, n, k) in shapes.items():
        if k % 256:
            continue
        w = triton_gguf.random_weight(fmt, n, k, device)
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        row: dict[str, Any] = {"format": fmt, "n": n, "k": k, "bytes": w.nbytes}
        for m in (1, 6, 16):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            g = timed(lambda x=x, w=w: triton_gguf.linear(x, w), device)
            b = timed(lambda x=x, dense=dense: x @ dense.T, device)
            inv = timed(lambda x=x, dense=dense: triton_linear.linear(x, dense), device)
            row[f"m{m}"] = {
                "gguf_us": round(g * 1e6, 1),
                "bf16_us": round(b * 1e6, 1),
                "bf16_invariant_us": round(inv * 1e6, 1),
                "gguf_gb_s": round(w.nbytes / g / 1e9, 1),
                "bf16_gb_s": round(2 * n * k / b / 1e9, 1),
            }
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        row["m1_by_bn_us"] = {
            bn: round(
                timed(lambda bn=bn, x=x, w=w: triton_gguf.linear(x, w, bn=bn), device) * 1e6, 1
            )
            for bn in (16, 32, 64, 128)
        }
        out[name] = row
        print(name, row, flush=True)
    return out


def quick_costs(lm: LoadedModel) -> dict[str, Any]:
    """A dry run's stand-in for step_costs: 1 and 2 rows after 8 cached tokens."""
    cost = measure_step_cost(lm.model, (1, 2), context=8, seqs=1)
    return {"rows_ms": {r: round(s * 1e3, 3) for r, s in zip((1, 2), cost.seconds, strict=True)}}


def long_context(lm: LoadedModel) -> dict[str, Any]:
    """Decode and 6-row verify cost at 4k and 16k cached tokens, the attention's keys split
    over programs (past SPLIT_KEYS) and not (SPLIT_KEYS out of reach)."""
    model = lm.model
    assert isinstance(model, GraphModel)
    default = triton_ops.SPLIT_KEYS
    out: dict[str, Any] = {}
    try:
        for context in (4096, 16384):
            for name, keys in (("split", default), ("single", 1 << 30)):
                triton_ops.SPLIT_KEYS = keys
                model._drop()
                cost = measure_step_cost(model, (1, 6), context=context, seqs=1)
                out[f"{context}_{name}_ms"] = [round(t * 1e3, 3) for t in cost.seconds]
    finally:
        triton_ops.SPLIT_KEYS = default
        model._drop()
    return out


def chain_cost(lm: LoadedModel, steps: int) -> dict[str, float]:
    """The draft's `steps` chained one-row forwards: one greedy_chain call (one replay) against
    `steps` one-row calls with the argmax fed back on the device."""
    model = lm.model
    assert isinstance(model, GraphModel)
    cache = model.new_cache(512)
    ids = torch.randint(0, model.config.vocab_size, (256,), device=model.device)
    model(ids, [cache], [256])
    cache.commit(256)
    first = ids[-1:].clone()

    def chained() -> None:
        model.greedy_chain(first, [cache], steps)

    def stepped() -> None:
        tok = first
        for _ in range(steps):
            tok = model(tok, [cache], [1]).logits.argmax(-1)
            cache.commit(cache.length + 1)
        cache.commit(256)

    return {
        "chain_ms": round(timed(chained, model.device) * 1e3, 3),
        "steps_ms": round(timed(stepped, model.device) * 1e3, 3),
    }


def graphed(model: Any) -> GraphModel:
    """The model behind GraphModel: on a GPU it already is; a CPU dry run (tiny configs, the
    kernels in Triton's interpreter) wraps it."""
    return model if isinstance(model, GraphModel) else GraphModel(model, fused=True)


def loaded(directory: Path, device: torch.device) -> LoadedModel:
    lm = load(str(directory), "bf16", str(device), progress=False)
    return LoadedModel(lm.name, lm.path, lm.dtype_name, graphed(lm.model), lm.tokenizer, lm.eos_ids)


def gguf_copy(directory: Path, device: torch.device, seed: int) -> LoadedModel:
    lm = loaded(directory, device)
    assert isinstance(lm.model, GraphModel)
    random_q4_k_m_(lm.model.inner, seed)
    lm.model._drop()
    return lm


def bench(
    args: argparse.Namespace, work: Path, device: torch.device, report: dict[str, Any]
) -> None:
    """Every measurement into `report`, which is saved to <out>/partial.json after each one (a
    run cut short by the device's time limit keeps all but its last; render it with
    quickdraft.bench.report.write)."""
    errors: dict[str, str] = {}
    report["errors"] = errors

    def guarded(name: str, fn: Any, _errors: Any = None) -> Any:
        result = guarded_one(name, fn, errors)
        (args.out / "partial.json").write_text(json.dumps(report, indent=1, default=str))
        return result

    target_dir, draft_dir = work / "target", work / "draft"
    random_checkpoint(args.models[0], target_dir, device, seed=0)
    random_checkpoint(args.models[1], draft_dir, device, seed=1)
    bf16 = loaded(target_dir, device)
    cfg = bf16.model.config
    if not args.quick:
        report["kernels"] = guarded("kernels", lambda: kernels(cfg, device), errors)
    gguf = gguf_copy(target_dir, device, seed=10)
    sets = prompt_sets()
    prompts = {
        s: [bf16.tokenizer.encode(p) for p in sets[s][: args.prompts]] for s in ("code", "prose")
    }
    everything = prompts["code"] + prompts["prose"]
    n, k = args.tokens, args.k
    models: dict[str, Any] = {}
    report["models"] = models
    single: dict[str, Any] = {}
    report["single_stream"] = single
    costs = quick_costs if args.quick else step_costs
    for name, lm in (("target_bf16", bf16), ("target_gguf", gguf)):
        models[name] = {
            "weight_bytes": weight_bytes(lm.model.inner),
            "step": guarded(f"{name}_step", lambda lm=lm: costs(lm), errors),
        }
    # bf16 GEMMs on cuBLAS (fastest kernel per shape, not batch-invariant) instead of
    # triton_linear (invariant: exact bf16 speculation)
    triton_linear.ENABLED = False
    bf16.model._drop()
    models["target_bf16_cublas"] = {
        "step": guarded("target_bf16_cublas_step", lambda: costs(bf16), errors)
    }
    if not args.quick:
        single["bf16_cublas_plain"] = guarded(
            "bf16_cublas_plain", lambda: ours(bf16, SpeculativeConfig(), everything, n), errors
        )
    triton_linear.ENABLED = True
    bf16.model._drop()
    if not args.quick:
        report["long_context"] = guarded("long_context", lambda: long_context(bf16), errors)
    off = SpeculativeConfig()
    forced = SpeculativeConfig(
        method="draft", num_draft_tokens=k, draft_model=str(draft_dir), adaptive=False
    )
    adaptive = SpeculativeConfig(method="draft", num_draft_tokens=k, draft_model=str(draft_dir))
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=k)
    for name, lm in (("bf16", bf16), ("gguf", gguf)):
        single[f"{name}_plain"] = guarded(
            f"{name}_plain", lambda lm=lm: ours(lm, off, everything, n), errors
        )
        runs = (
            (("draft_forced", forced),)
            if args.quick
            else (
                ("draft_forced", forced),
                ("draft_adaptive", adaptive),
            )
        )
        for tag, cfg_ in runs:
            spec = make_speculation(lm, cfg_)
            assert spec is not None
            drafter: Any = spec.drafter
            drafter.model = graphed(drafter.model)
            drafter.device_chain = True  # on a GPU it is; the dry run takes the same path
            if name == "gguf":  # the draft model in its GGUF stand-in too
                random_q4_k_m_(drafter.model.inner, seed=20)
                drafter.model._drop()
            if tag == "draft_forced":
                draft_lm = LoadedModel(
                    "draft", draft_dir, "bf16", drafter.model, bf16.tokenizer, bf16.eos_ids
                )
                models[f"draft_{name}"] = {
                    "weight_bytes": weight_bytes(drafter.model.inner),
                    "step": guarded(f"draft_{name}_step", lambda d=draft_lm: costs(d), errors),
                    "chain": guarded(
                        f"draft_{name}_chain", lambda d=draft_lm: chain_cost(d, k - 1), errors
                    ),
                }
            single[f"{name}_{tag}"] = guarded(
                f"{name}_{tag}", lambda lm=lm, s=spec: ours(lm, None, everything, n, spec=s), errors
            )
    single["gguf_ngram"] = guarded("gguf_ngram", lambda: ours(gguf, ngram, everything, n), errors)
    accept = acceptance_lengths(args.acceptance)
    projection: dict[str, Any] = {}
    for name in ("bf16", "gguf"):
        run, plain = single.get(f"{name}_draft_forced"), single.get(f"{name}_plain")
        if run and plain and accept and run.get("ms_per_cycle"):
            projection[name] = {
                s: {
                    "tokens_per_cycle_cpu_measured": a,
                    "projected_tok_s": round(1e3 * a / run["ms_per_cycle"], 1),
                    "projected_vs_plain": round(
                        1e3 * a / run["ms_per_cycle"] / plain["decode_tok_s"], 2
                    ),
                }
                for s, a in accept.items()
            }
    report["projection"] = projection
    # plain decode's weight stream: bytes per step x steps per second
    for name, model in (
        ("bf16", "target_bf16"),
        ("bf16_cublas", "target_bf16"),
        ("gguf", "target_gguf"),
    ):
        run = single.get(f"{name}_plain")
        if run:
            run["weight_gb_s"] = round(models[model]["weight_bytes"] * run["decode_tok_s"] / 1e9, 1)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GGUF formats and draft chains on {report['device']} (random weights)\n"]
    for name, row in (report.get("kernels") or {}).items():
        cells = [
            [
                m,
                row[m]["gguf_us"],
                row[m]["bf16_us"],
                row[m]["bf16_invariant_us"],
                row[m]["gguf_gb_s"],
                row[m]["bf16_gb_s"],
            ]
            for m in ("m1", "m6", "m16")
        ]
        lines.append(f"## {name}: {row['format']} [{row['n']} x {row['k']}]\n")
        heads = ["M", "GGUF us", "cuBLAS bf16 us", "invariant bf16 us", "GGUF GB/s", "bf16 GB/s"]
        lines.append(table(heads, cells))
        lines.append(f"M = 1 by BN (us): {row['m1_by_bn_us']}\n")
    rows = [
        [name, m.get("weight_bytes", ""), (m.get("step") or {}).get("rows_ms"), m.get("chain")]
        for name, m in report.get("models", {}).items()
    ]
    lines.append(table(["model", "weight bytes", "step ms by rows", "chain"], rows))
    s = report.get("single_stream", {})
    lines.append(
        table(
            ["run", "decode tok/s", "weight GB/s", "ms/cycle"],
            [
                [n, v["decode_tok_s"], v.get("weight_gb_s", ""), v.get("ms_per_cycle", "")]
                for n, v in s.items()
                if v
            ],
        )
    )
    if report.get("long_context"):
        lines.append(f"long context, bf16 target, [1, 6] rows (ms): {report['long_context']}\n")
    for name, p in report.get("projection", {}).items():
        lines.append(
            f"PROJECTION ({name} pair; not a measurement): real-weight tokens per cycle (CPU) / "
            "measured ms per forced cycle here\n"
        )
        lines.append(
            table(
                ["set", "tokens/cycle", "projected tok/s", "x plain"],
                [
                    [
                        k,
                        v["tokens_per_cycle_cpu_measured"],
                        v["projected_tok_s"],
                        v["projected_vs_plain"],
                    ]
                    for k, v in p.items()
                ],
            )
        )
    if report.get("errors"):
        lines.append(f"failed: {report['errors']}\n")
    return "\n".join(lines)


def plot(report: dict[str, Any]) -> Any:
    def draw(fig: Any) -> None:
        s = {n: v["decode_tok_s"] for n, v in report.get("single_stream", {}).items() if v}
        ax = fig.subplots()
        bars(ax, "single stream", "decode tok/s", list(s), {"tok/s": list(s.values())})
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)

    return draw


def main() -> None:
    host = machine()
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs=2, type=Path, required=True, help="target, draft configs")
    ap.add_argument("--acceptance", type=Path, default=None, help="a real-weight speculative.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2, help="per set (code, prose)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20, help="timings per kernel measurement")
    ap.add_argument("--quick", action="store_true", help="a dry run: fewer rows, no adaptive")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    global REPS
    REPS = args.reps
    device = torch.device(args.device)
    report: dict[str, Any] = {
        "bench": "gpu-gguf",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tokens": args.tokens,
        "k": args.k,
        "weights": "random (real configs, Q4_K_M's formats made on the device)",
        "machine": host,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        bench(args, Path(tmp), device, report)
    (args.out / "partial.json").write_text(json.dumps(report, indent=1, default=str))
    write("gpu-gguf", report, markdown(report), plot(report), args.out, figsize=(9, 4))


if __name__ == "__main__":
    main()
