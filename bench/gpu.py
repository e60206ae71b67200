# ~450 lines on purpose: one run measures ours and every peer on the same GPU, and device time
# is too scarce to spread a comparison over several scripts and calls.
"""quickdraft on an NVIDIA GPU against transformers on the same GPU, in one run.

Per model (a directory with config.json and the tokenizer; `--models` lists them, the first
pair being target and draft): a random bf16 checkpoint of that exact shape is written once and
both engines load it, so they stream the same bytes. Step speed does not depend on the weight
values; acceptance does, so the draft runs here measure the cost of a cycle (what a cycle
spends on the GPU and outside it) and the tokens per cycle come from a real-weight run of the
same pair (`--acceptance`, a `quickdraft bench` speculative.json): projected tok/s = tokens
per cycle / seconds per cycle, labelled as a projection in every table.

Measured, each alone in one process:
  * single stream, greedy, `--tokens` output tokens per prompt (code and prose prompts): ours
    with CUDA graphs, ours eager (graphs off), ours + draft model (k forced, and adaptive),
    transformers eager `generate`, transformers with a static cache + torch.compile
    (`--compile`), transformers assisted generation with the same draft model;
  * the target's and the draft's step cost by rows (1 row = decode, 1 + k = a verify);
  * concurrency 1 / 4 / 8 through the engine (speculation off, draft forced, draft adaptive)
    and transformers eager `generate` on a batch of the same size;
  * `--hybrid full`: a random Gated-DeltaNet target of Qwen3.5-0.8B-like dimensions, its
    decode and 6-row verify cost with the Triton delta-rule kernels and with torch's ops.
Writes <out>/gpu.{json,md,png}.

    python bench/gpu.py --models DIR/qwen2.5-coder-1.5b DIR/qwen2.5-coder-0.5b \\
        --single DIR/smollm2-135m --acceptance bench/results/X/speculative.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from engine import run_engine

from quickdraft.bench.report import bars, machine, table, write
from quickdraft.bench.speculative import prompt_sets
from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.models.graphs import GraphModel
from quickdraft.request import SamplingParams
from quickdraft.speculation.cost import measure_step_cost, settle
from quickdraft.speculation.factory import make_speculation
from quickdraft.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9)


def random_checkpoint(src: Path, out: Path, device: torch.device, seed: int) -> Any:
    """A transformers model of `src`'s config with random bf16 weights (its own init), saved
    to `out` with `src`'s tokenizer; returns the model (on `device`)."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(src)
    torch.manual_seed(seed)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.eval()
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return model


def decode_rate(n: int, total: float, first: float) -> float:
    """Output tokens after the first / the time after the first token."""
    return (n - 1) / (total - first) if n > 1 and total > first else float("nan")


def ours(
    lm: LoadedModel,
    spec_cfg: SpeculativeConfig | None,
    prompts: list[list[int]],
    n: int,
    spec: Any = None,
) -> dict:
    """Single-stream greedy runs of `prompts` (`spec_cfg`'s speculation, or a prepared `spec`)."""
    if spec_cfg is not None:
        spec = make_speculation(lm, spec_cfg)
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    warm = lm.new_request(prompts[0], SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in stream(lm, warm, spec):  # captures the graphs this run uses
        pass
    rates, cycles, drafted, accepted, ttfts, seconds = [], 0, 0, 0, [], 0.0
    for ids in prompts:
        req = lm.new_request(ids, params)
        for _ in stream(lm, req, spec):
            pass
        t = req.timing
        assert t.finished is not None and t.first_token is not None and t.ttft is not None
        rates.append(decode_rate(len(req.output_ids), t.finished - t.created, t.ttft))
        ttfts.append(t.ttft)
        seconds += t.finished - t.first_token
        cycles += req.spec.cycles
        drafted += req.spec.drafted
        accepted += req.spec.accepted
    out = {"decode_tok_s": round(statistics.mean(rates), 1), "ttft_s": round(min(ttfts), 4)}
    if spec is not None and cycles:
        out.update(
            cycles=cycles,
            drafted=drafted,
            accepted=accepted,
            ms_per_cycle=round(1e3 * seconds / cycles, 3),
        )
    return out


def engine_rate(
    lm: LoadedModel,
    cfg: SpeculativeConfig,
    prompts: list[list[int]],
    c: int,
    params: SamplingParams,
) -> dict[str, Any]:
    """`c` closed-loop clients on the engine, 2 requests each (bench/engine.py)."""
    cell = run_engine(lm, cfg, make_speculation(lm, cfg), prompts, c, 2, params, 0)
    return {"tok_s": round(cell.tokens_per_s(), 1), "max_batch": cell.max_batch}


def hf_rate(
    model: Any, prompts: list[list[int]], n: int, batch: int = 1, **kw: Any
) -> dict[str, float]:
    """transformers `generate`, greedy, exactly `n` new tokens; decode tok/s per sequence x
    batch (the prefill measured apart by a 1-token generate)."""
    device = next(model.parameters()).device
    rates = []
    for i, ids in enumerate([prompts[0], *prompts]):  # the first: warm-up / compile
        x = torch.tensor([ids] * batch, device=device)
        times = []
        for new in (1, n):
            settle(device)
            t = time.perf_counter()
            model.generate(
                x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw
            )
            settle(device)
            times.append(time.perf_counter() - t)
        if i:
            rates.append(batch * (n - 1) / (times[1] - times[0]))
    return {"decode_tok_s": round(statistics.mean(rates), 1)}


def step_costs(lm: LoadedModel) -> dict[str, Any]:
    cost = measure_step_cost(lm.model, ROWS, context=256, seqs=1)
    out: dict[str, Any] = {
        "rows_ms": {r: round(s * 1e3, 3) for r, s in zip(ROWS, cost.seconds, strict=True)}
    }
    model = lm.model
    if isinstance(model, GraphModel) and model.graphs:
        model.graphs = False
        eager = measure_step_cost(model, (1, 6), context=256, seqs=1)
        model.graphs = True
        out["eager_rows_ms"] = {
            1: round(eager.seconds[0] * 1e3, 3),
            6: round(eager.seconds[1] * 1e3, 3),
        }
    if isinstance(model, GraphModel) and model.fused:  # the same graphs on torch's ops
        model.use_kernels(False)
        torch_ops = measure_step_cost(model, (1, 6), context=256, seqs=1)
        model.use_kernels(True)
        out["torch_ops_rows_ms"] = {
            1: round(torch_ops.seconds[0] * 1e3, 3),
            6: round(torch_ops.seconds[1] * 1e3, 3),
        }
    return out


def guarded(name: str, run: Callable[[], dict], errors: dict[str, str]) -> dict | None:
    """One measurement, printed as it lands; a failure is recorded with its reason, not fatal
    to the run."""
    try:
        result = run()
    except Exception as exc:  # one failure (a peer's compile, say) must not lose the rest
        errors[name] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"{name}: {errors[name]}", flush=True)
        return None
    print(f"{name}: {result}", flush=True)
    return result


def hf_compiled(directory: Path, device: torch.device, prompt: list[int], n: int) -> dict:
    """transformers with a static cache and torch.compile("reduce-overhead") on the checkpoint
    in `directory`; one prompt, so one prefill shape is compiled."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16)
    model = model.to(device).eval()
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    t = time.perf_counter()
    out = hf_rate(model, [prompt], n)
    return {**out, "compile_and_run_s": round(time.perf_counter() - t, 1)}


def acceptance_lengths(path: Path | None) -> dict[str, float]:
    """Tokens per target forward of the draft engine per prompt set, from a speculative.json."""
    if path is None:
        return {}
    results = json.loads(path.read_text())["results"]
    return {s: r["draft"]["mean_acceptance_length"] for s, r in results.items() if "draft" in r}


def bench_pair(args: argparse.Namespace, work: Path, device: torch.device) -> dict[str, Any]:
    errors: dict[str, str] = {}
    report: dict[str, Any] = {"errors": errors}
    target_dir, draft_dir = work / "target", work / "draft"
    hf_target = random_checkpoint(args.models[0], target_dir, device, seed=0)
    hf_draft = (
        random_checkpoint(args.models[1], draft_dir, device, seed=1) if args.models[1:] else None
    )
    lm = load(str(target_dir), "bf16", str(device), progress=False)
    sets = prompt_sets()
    prompts = {
        s: [lm.tokenizer.encode(p) for p in sets[s][: args.prompts]] for s in ("code", "prose")
    }
    everything = prompts["code"] + prompts["prose"]
    n, k = args.tokens, args.k
    report["target"] = {"config": str(args.models[0]), "step": step_costs(lm)}
    single: dict[str, Any] = {}
    report["single_stream"] = single
    single["ours"] = guarded("ours", lambda: ours(lm, SpeculativeConfig(), everything, n), errors)
    if isinstance(lm.model, GraphModel) and lm.model.graphs:
        lm.model.graphs = False
        single["ours_eager"] = guarded(
            "ours_eager", lambda: ours(lm, SpeculativeConfig(), everything[:1], n), errors
        )
        lm.model.graphs = True
    if isinstance(lm.model, GraphModel) and lm.model.fused:
        lm.model.use_kernels(False)
        single["ours_torch_ops"] = guarded(
            "ours_torch_ops", lambda: ours(lm, SpeculativeConfig(), everything[:2], n), errors
        )
        lm.model.use_kernels(True)
    forced = SpeculativeConfig(
        method="draft", num_draft_tokens=k, draft_model=str(draft_dir), adaptive=False
    )
    adaptive = SpeculativeConfig(method="draft", num_draft_tokens=k, draft_model=str(draft_dir))
    if hf_draft is not None:
        draft_lm = load(str(draft_dir), "bf16", str(device), progress=False)
        report["draft"] = {"config": str(args.models[1]), "step": step_costs(draft_lm)}
        del draft_lm
        for name, cfg in (("ours_draft_forced", forced), ("ours_draft_adaptive", adaptive)):
            single[name] = guarded(name, lambda c=cfg: ours(lm, c, everything, n), errors)
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=k)
    single["ours_ngram"] = guarded("ours_ngram", lambda: ours(lm, ngram, everything, n), errors)
    peer_prompts = [prompts["code"][0], prompts["prose"][0]]
    single["hf_eager"] = guarded("hf_eager", lambda: hf_rate(hf_target, peer_prompts, n), errors)
    if hf_draft is not None:
        single["hf_assisted"] = guarded(
            "hf_assisted",
            lambda: hf_rate(hf_target, peer_prompts, n, assistant_model=hf_draft),
            errors,
        )
    # concurrency: the engine (closed loop, 2 requests per client) vs a transformers batch
    conc: dict[str, Any] = {}
    report["concurrency"] = conc
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    methods = {"none": SpeculativeConfig()}
    if hf_draft is not None:
        methods |= {"draft_forced": forced, "draft_adaptive": adaptive}
    for c in args.concurrency:
        row: dict[str, Any] = {}
        for name, cfg in methods.items():
            row[name] = guarded(
                f"engine_{name}_{c}",
                lambda c=c, cfg=cfg: engine_rate(lm, cfg, everything, c, params),
                errors,
            )
        row["hf_eager_batch"] = guarded(
            f"hf_eager_batch_{c}", lambda c=c: hf_rate(hf_target, peer_prompts[:1], n, c), errors
        )
        conc[str(c)] = row
    # the projection: CPU-measured tokens per cycle of this pair on real weights / our cycle
    forced_run = single.get("ours_draft_forced")
    accept = acceptance_lengths(args.acceptance)
    if forced_run and accept and single.get("ours") and report.get("draft"):
        plain = single["ours"]["decode_tok_s"]
        t_rows, d_rows = report["target"]["step"]["rows_ms"], report["draft"]["step"]["rows_ms"]
        gpu_ms = d_rows[2] + (k - 1) * d_rows[1] + t_rows[k + 1]
        report["cycle"] = {
            "ms_per_cycle": forced_run["ms_per_cycle"],
            "steps_ms": round(gpu_ms, 3),  # the k draft steps and the verify, timed alone
            "outside_steps_ms": round(forced_run["ms_per_cycle"] - gpu_ms, 3),
            "verify_vs_decode": round(t_rows[k + 1] / t_rows[1], 3),
        }
        report["projection"] = {
            s: {
                "tokens_per_cycle_cpu_measured": a,
                "projected_tok_s": round(1e3 * a / forced_run["ms_per_cycle"], 1),
                "projected_speedup": round(1e3 * a / forced_run["ms_per_cycle"] / plain, 2),
            }
            for s, a in accept.items()
        }
    return report


def bench_single(args: argparse.Namespace, work: Path, device: torch.device) -> dict[str, Any]:
    errors: dict[str, str] = {}
    out_dir = work / "single"
    hf = random_checkpoint(args.single, out_dir, device, seed=2)
    lm = load(str(out_dir), "bf16", str(device), progress=False)
    prompts = [lm.tokenizer.encode(p) for p in prompt_sets()["code"][: args.prompts]]
    single = {
        "ours": guarded(
            "ours", lambda: ours(lm, SpeculativeConfig(), prompts, args.tokens), errors
        ),
        "hf_eager": guarded("hf_eager", lambda: hf_rate(hf, prompts[:1], args.tokens), errors),
    }
    return {
        "config": str(args.single),
        "step": step_costs(lm),
        "single_stream": single,
        "errors": errors,
    }


# A hybrid (Gated DeltaNet) target of Qwen3.5-0.8B-like dimensions, random weights: not that
# model's exact config, a shape to time the GDN layers at (`--hybrid full`); `tiny` for a dry run
HYBRID_TEXT: dict[str, dict[str, Any]] = {
    "full": dict(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        intermediate_size=3584,
        vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        intermediate_size=96,
        vocab_size=320,
    ),
}


def bench_hybrid(size: str, device: torch.device) -> dict[str, Any]:
    """Decode-step and 6-row verify cost of a random hybrid target, eager (hybrid models run
    without graphs), with the Triton delta-rule kernels and with torch's ops."""
    import os

    from quickdraft.models.families.hybrid_config import HybridConfig
    from quickdraft.models.families.qwen3_next import HybridLM

    dims = HYBRID_TEXT[size]
    layers = dims["num_hidden_layers"]
    text = dict(
        model_type="qwen3_5_text",
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        linear_conv_kernel_dim=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        eos_token_id=2,
        **dims,
    )
    raw = dict(model_type="qwen3_5", text_config=text, vision_config=dict(depth=1))
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_dict(raw), torch.bfloat16, device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    ids = torch.randint(0, dims["vocab_size"], (300,), device=device)

    def step_ms(rows: int) -> float:
        cache = model.new_cache(512)
        model(ids[:256], [cache], [256])
        cache.commit(256)
        best = float("inf")
        for i in range(5):
            settle(device)
            t = time.perf_counter()
            model(ids[256 + i : 256 + i + rows], [cache], [rows], logit_rows=torch.arange(rows))
            settle(device)
            best = min(best, time.perf_counter() - t)
            cache.commit(cache.length + 1)
        return round(best * 1e3, 3)

    out: dict[str, Any] = {"dims": dims}
    for name, off in (("triton", ""), ("torch", "1")):
        os.environ["QUICKDRAFT_NO_TRITON"] = off
        out[f"{name}_decode_ms"], out[f"{name}_verify6_ms"] = step_ms(1), step_ms(6)
    os.environ.pop("QUICKDRAFT_NO_TRITON")
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# quickdraft on {report['device']} vs transformers (random weights, real shapes)\n"]
    for key in ("pair", "single"):
        part = report.get(key)
        if not part:
            continue
        s = part["single_stream"]
        lines.append(f"## {key}: single stream, greedy, {report['tokens']} tokens\n")
        rows = [
            [name, v["decode_tok_s"], v.get("ttft_s", ""), v.get("ms_per_cycle", "")]
            for name, v in s.items()
            if v
        ]
        lines.append(table(["engine", "decode tok/s", "TTFT s", "ms/cycle"], rows))
        step = part.get("target", part).get("step", {})
        if step:
            lines.append(
                f"step cost by rows (ms): {step['rows_ms']}; eager: {step.get('eager_rows_ms')}; "
                f"torch ops instead of the Triton kernels: {step.get('torch_ops_rows_ms')}\n"
            )
        if "draft" in part:
            lines.append(f"draft step cost by rows (ms): {part['draft']['step']['rows_ms']}\n")
        if part.get("concurrency"):
            crow = []
            for c, row in part["concurrency"].items():
                hf = row.get("hf_eager_batch") or {}
                crow.append(
                    [
                        c,
                        *[
                            (row[m] or {}).get("tok_s", "failed")
                            for m in row
                            if m != "hf_eager_batch"
                        ],
                        hf.get("decode_tok_s", ""),
                    ]
                )
            names = [m for m in next(iter(part["concurrency"].values())) if m != "hf_eager_batch"]
            lines.append(table(["concurrency", *names, "hf eager batch"], crow))
        if part.get("cycle"):
            lines.append(f"speculative cycle (k forced): {part['cycle']}\n")
        if part.get("projection"):
            prow = [
                [
                    s,
                    p["tokens_per_cycle_cpu_measured"],
                    p["projected_tok_s"],
                    p["projected_speedup"],
                ]
                for s, p in part["projection"].items()
            ]
            lines.append(
                "PROJECTION (not a measurement): real-weight tokens per cycle (CPU run) / "
                "our measured ms per forced-k cycle on this GPU\n"
            )
            lines.append(table(["set", "tokens/cycle", "projected tok/s", "x plain"], prow))
        if part.get("errors"):
            lines.append(f"failed: {part['errors']}\n")
    if report.get("hybrid"):
        lines.append(f"## hybrid (random weights, eager): step costs\n\n{report['hybrid']}\n")
    return "\n".join(lines)


def plot(report: dict[str, Any]) -> Callable[[Any], None]:
    def draw(fig: Any) -> None:
        parts = [k for k in ("pair", "single") if report.get(k)]
        hybrid = report.get("hybrid")
        if not parts and hybrid:  # a hybrid-only run: its step costs
            costs = {k: v for k, v in hybrid.items() if k.endswith("_ms")}
            bars(
                fig.subplots(), "hybrid step cost", "ms", list(costs), {"ms": list(costs.values())}
            )
            return
        axes = fig.subplots(1, max(1, len(parts)), squeeze=False)[0]
        for ax, key in zip(axes, parts, strict=True):
            s = {n: v["decode_tok_s"] for n, v in report[key]["single_stream"].items() if v}
            bars(ax, f"{key}: single stream", "decode tok/s", list(s), {"tok/s": list(s.values())})
            ax.tick_params(axis="x", labelrotation=30, labelsize=7)

    return draw


def main() -> None:
    host = machine()
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", type=Path, default=[], help="target [draft] config dirs")
    ap.add_argument("--single", type=Path, default=None, help="a model run plain only")
    ap.add_argument("--hybrid", choices=sorted(HYBRID_TEXT), default=None, help="GDN step costs")
    ap.add_argument("--acceptance", type=Path, default=None, help="a real-weight speculative.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2, help="per set (code, prose)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--concurrency", nargs="*", type=int, default=[1, 4, 8])
    ap.add_argument("--compile", action="store_true", help="also transformers static + compile")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--render", type=Path, default=None, help="write the report of a run's partial.json"
    )
    args = ap.parse_args()
    if args.render is not None:  # a run cut short: its tables and chart from what it left
        report = json.loads(args.render.read_text())
        report["cut_short"] = "the run ended before its last measurement; missing ones are absent"
        write("gpu", report, markdown(report), plot(report), args.out, figsize=(11, 4))
        return
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict[str, Any] = {
        "bench": "gpu",
        "device": name,
        "tokens": args.tokens,
        "k": args.k,
        "weights": "random (real configs): no network and a 64 MiB carry limit on the GPU host",
        "machine": host,
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def partial() -> None:  # what a run cut short still leaves
        (args.out / "partial.json").write_text(json.dumps(report, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.models:
            report["pair"] = bench_pair(args, work / "pair", device)
            partial()
        if args.single:
            report["single"] = bench_single(args, work, device)
            partial()
        if args.hybrid:
            errors: dict[str, str] = {}
            report["hybrid"] = guarded("hybrid", lambda: bench_hybrid(args.hybrid, device), errors)
            report["hybrid_errors"] = errors
            partial()
        # last: the slowest peer (minutes of compiling), so a cut-short run loses only it; the
        # small model first (on the H100 the 1.5B's compile outlasted the device time)
        for key, directory in (("single", work / "single"), ("pair", work / "pair" / "target")):
            if args.compile and key in report:
                part = report[key]
                code = prompt_sets()["code"][0]
                ids = Tokenizer(directory).encode(code)
                part["single_stream"]["hf_static_compile"] = guarded(
                    "hf_static_compile",
                    lambda d=directory, i=ids: hf_compiled(d, device, i, args.tokens),
                    part["errors"],
                )
                partial()
    write("gpu", report, markdown(report), plot(report), args.out, figsize=(11, 4))


if __name__ == "__main__":
    main()
