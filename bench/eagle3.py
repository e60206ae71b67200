"""EAGLE-3 on the CPU: what a head's step costs against its target's, and the speedup that buys
at published acceptance lengths.

Target: the packaged Qwen2.5-Coder-1.5B, Q4_K_M GGUF run in its own blocks (real weights).
Head: random weights of the EAGLE-3 size published for Qwen-class targets, at this target's
width: one layer of hidden 1536 (12 query / 2 KV heads of 128, MLP 8960), fc over 3 taps, a
32,000-token draft vocabulary (`d2t`), the target's embedding; saved in the `speculators`
layout and loaded by the engine's own path (`eagle3_drafter`), as bf16 panels and as int4.

Measured (best of --reps, warm-up excluded, 2 threads unless told):
  target         forward of 1..8 rows of one sequence (speculation/cost.py measure_step_cost)
  head           a chained draft step (1 row) and a catch-up (n rows incl. the fc over taps)
  end to end     plain greedy decode vs the random head at fixed k (nothing is accepted: the
                 cost floor of a head that never pays) vs the adaptive policy, same prompts;
                 outputs must be identical
Modelled from those costs (no EAGLE-3 head for this target exists offline): per cycle of k
drafts, one catch-up of (accepted + 1) rows, k - 1 chained steps and a verify of k + 1 rows;
tokens per cycle AL(k) = (1 - a^(k+1)) / (1 - a), with the per-draft acceptance a fitted to a
published AL: 2.85 at k = 5 (Qwen3-8B EAGLE-3 heads, 2.8-2.9; ../shared/REFERENCE.md section 13)
and 1.45 (a small head trained briefly, the speculators example). speedup(k) = AL(k) x t(1) /
(t(k + 1) + catch-up + (k - 1) x head step); the best k is reported.

    flock /tmp/quickdraft-bench.lock .venv/bin/python bench/eagle3.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from quickdraft.bench.report import bars, machine, peak_rss_mb, table, write
from quickdraft.config import DEFAULT_MODEL, SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.speculation.cost import StepCost, measure_step_cost
from quickdraft.speculation.drafters.eagle3 import Eagle3Drafter, eagle3_drafter
from quickdraft.speculation.drafters.mtp import head_step_seconds
from quickdraft.speculation.factory import make_speculation

HEAD = dict(hidden=1536, heads=12, kv_heads=2, head_dim=128, inter=8960, draft_vocab=32000)
PUBLISHED = {"Qwen3-8B EAGLE-3 (AL 2.85 at k=5)": (2.85, 5), "briefly trained (AL 1.45)": (1.45, 5)}
PROMPTS = [
    "def quicksort(items):\n    ",
    "Write a Python function that parses an ISO date and returns the weekday.",
    "class LRUCache:\n    def __init__(self, capacity):\n",
]


def write_head(directory: Path, target: Any, seed: int = 0) -> Path:
    """A random EAGLE-3 head of HEAD's shape for `target` (speculators layout, bf16)."""
    cfg = target.config
    h, q, kv = HEAD["hidden"], HEAD["heads"] * HEAD["head_dim"], HEAD["kv_heads"] * HEAD["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def mat(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=torch.bfloat16)

    p = "layers.0."
    tensors = {
        "fc.weight": mat(h, 3 * cfg.hidden_size),
        "norm.weight": ones(),
        "lm_head.weight": mat(HEAD["draft_vocab"], h),
        "d2t": torch.zeros(HEAD["draft_vocab"], dtype=torch.long),  # the first 32k ids
        p + "input_layernorm.weight": ones(),
        p + "hidden_norm.weight": ones(),
        p + "post_attention_layernorm.weight": ones(),
        p + "self_attn.q_proj.weight": mat(q, 2 * h),
        p + "self_attn.k_proj.weight": mat(kv, 2 * h),
        p + "self_attn.v_proj.weight": mat(kv, 2 * h),
        p + "self_attn.o_proj.weight": mat(h, q),
        p + "mlp.gate_proj.weight": mat(HEAD["inter"], h),
        p + "mlp.up_proj.weight": mat(HEAD["inter"], h),
        p + "mlp.down_proj.weight": mat(h, HEAD["inter"]),
    }
    layer = {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": h,
        "intermediate_size": HEAD["inter"],
        "num_hidden_layers": 1,
        "num_attention_heads": HEAD["heads"],
        "num_key_value_heads": HEAD["kv_heads"],
        "head_dim": HEAD["head_dim"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
    }
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": HEAD["draft_vocab"],
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def catch_up_seconds(drafter: Eagle3Drafter, rows: int, context: int = 16, reps: int = 3) -> float:
    """One catch-up head forward of `rows` rows (the fc over their taps included)."""
    head = drafter.eagle
    width = len(drafter.hidden_layers) * head.cfg.target_hidden_size
    cache = head.new_cache(context + rows + 1)
    taps = torch.randn(context + rows, width)
    ids = torch.randint(0, head.vocab_size, (context + rows,))
    head(ids[:context], head.fuse(taps[:context]), [cache], [context], torch.tensor([0]))
    cache.commit(context)
    best = float("inf")
    for _ in range(reps + 1):
        t = time.perf_counter()
        head(ids[context:], head.fuse(taps[context:]), [cache], [rows], torch.tensor([rows - 1]))
        best = min(best, time.perf_counter() - t)
    return best


def decode(lm: LoadedModel, spec: Any, tokens: int) -> tuple[list[list[int]], float, Any]:
    outs, seconds, stats = [], 0.0, []
    for prompt in PROMPTS:
        req = lm.new_request(
            lm.tokenizer.encode(prompt), SamplingParams(max_tokens=tokens, ignore_eos=True)
        )
        t = time.perf_counter()
        for _ in stream(lm, req, spec):
            pass
        seconds += time.perf_counter() - t
        outs.append(req.output_ids)
        stats.append(req.spec)
    return outs, seconds, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"bench": "eagle3", "machine": machine(), "model": args.model}
    lm = load(args.model, "gguf", progress=False)
    target_cost = measure_step_cost(lm.model, rows=(1, 2, 3, 4, 5, 6, 7, 8))
    t1 = target_cost.seconds[0]
    report["target_ms_by_rows"] = {
        r: round(1e3 * s, 2) for r, s in zip(target_cost.rows, target_cost.seconds, strict=True)
    }
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-head-"))
    head_dir = write_head(tmp, lm.model)
    report["head"] = dict(HEAD, taps=3)
    formats: dict[str, Any] = {}
    for fmt in ("none", "int4"):
        drafter = eagle3_drafter(lm.model, head_dir, fmt)
        step = min(head_step_seconds(drafter.eagle) for _ in range(args.reps))
        catch = {n: catch_up_seconds(drafter, n, reps=args.reps) for n in (1, 2, 4, 6)}
        formats["bf16" if fmt == "none" else fmt] = {
            "chained_step_ms": round(1e3 * step, 3),
            "chained_step_over_target_step": round(step / t1, 4),
            "catch_up_ms_by_rows": {n: round(1e3 * s, 3) for n, s in catch.items()},
        }
        modelled = {}
        for label, (al5, k5) in PUBLISHED.items():
            a = fit_alpha(al5, k5)
            cost = {k: cycle_speedup(a, k, target_cost, catch, step) for k in range(1, 8)}
            k_best = max(cost, key=lambda k: cost[k])
            modelled[label] = {
                "alpha": round(a, 3),
                "best_k": k_best,
                "speedup": round(cost[k_best], 3),
            }
        formats["bf16" if fmt == "none" else fmt]["modelled"] = modelled
    report["formats"] = formats
    plain, plain_s, _ = decode(lm, None, args.tokens)
    runs = {"plain": (plain_s, None)}
    for name, adaptive in (("eagle3 fixed k", False), ("eagle3 adaptive", True)):
        spec = make_speculation(
            lm,
            SpeculativeConfig(
                method="eagle3",
                num_draft_tokens=args.k,
                adaptive=adaptive,
                draft_model=str(head_dir),
                draft_quantization="int4",
            ),
        )
        outs, secs, stats = decode(lm, spec, args.tokens)
        assert outs == plain, f"{name}: output differs from plain decoding"
        runs[name] = (secs, stats)
    n = args.tokens * len(PROMPTS)
    report["end_to_end"] = {
        name: {
            "tok_s": round(n / s, 2),
            "vs_plain": round(plain_s / s, 3),
            "drafted": None if st is None else sum(x.drafted for x in st),
            "accepted": None if st is None else sum(x.accepted for x in st),
        }
        for name, (s, st) in runs.items()
    }
    report["identical_outputs"] = True
    report["peak_rss_mb"] = round(peak_rss_mb())
    write("eagle3", report, markdown(report), plot(report))


def cycle_speedup(
    a: float, k: int, target: StepCost, catch: dict[int, float], step: float
) -> float:
    """Tokens per second over plain decoding for k drafts at per-draft acceptance `a`: AL(k)
    tokens per cycle of a verify of k + 1 rows, a catch-up of ~AL rows, k - 1 chained steps."""
    al = al_of(a, k)
    rows = min(catch, key=lambda n: abs(n - al))
    return al * target.seconds[0] / (target(k + 1) + catch[rows] + (k - 1) * step)


def fit_alpha(al: float, k: int) -> float:
    """The per-draft acceptance a with (1 - a^(k+1)) / (1 - a) = al (bisection)."""
    lo, hi = 0.0, 0.9999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if al_of(mid, k) < al else (lo, mid)
    return (lo + hi) / 2


def al_of(a: float, k: int) -> float:
    return sum(a**i for i in range(k + 1))


def markdown(r: dict[str, Any]) -> str:
    rows = [
        [
            fmt,
            v["chained_step_ms"],
            f"{v['chained_step_over_target_step']:.3f}",
            v["catch_up_ms_by_rows"][4],
        ]
        for fmt, v in r["formats"].items()
    ]
    out = "## EAGLE-3 head cost on the 1.5B target\n\n"
    out += f"Target {r['model']} Q4_K_M, one step {r['target_ms_by_rows'][1]} ms; by rows: "
    out += ", ".join(f"{k}: {v}" for k, v in r["target_ms_by_rows"].items()) + " ms.\n\n"
    out += table(
        ["head format", "chained step (ms)", "over a target step", "catch-up 4 rows (ms)"], rows
    )
    mod = [
        [fmt, label, m["alpha"], m["best_k"], f"{m['speedup']:.2f}x"]
        for fmt, v in r["formats"].items()
        for label, m in v["modelled"].items()
    ]
    out += "\n### Modelled speedup at published acceptance (from the costs above)\n\n"
    out += table(["head", "published", "per-draft acceptance", "best k", "speedup"], mod)
    e2e = [
        [name, v["tok_s"], f"{v['vs_plain']:.3f}x", v["drafted"], v["accepted"]]
        for name, v in r["end_to_end"].items()
    ]
    out += (
        "\n### End to end, the random head (never accepted: the cost floor), identical outputs\n\n"
    )
    out += table(["run", "tok/s", "vs plain", "drafted", "accepted"], e2e)
    return out


def plot(r: dict[str, Any]) -> Any:
    def draw(fig: Any) -> None:
        a, b = fig.subplots(1, 2)
        fmts = list(r["formats"])
        labels = list(PUBLISHED)
        bars(
            a,
            "modelled speedup",
            "x plain",
            labels,
            {f: [r["formats"][f]["modelled"][lab]["speedup"] for lab in labels] for f in fmts},
        )
        runs = list(r["end_to_end"])
        bars(
            b,
            "end to end (random head)",
            "tok/s",
            runs,
            {"": [r["end_to_end"][n]["tok_s"] for n in runs]},
        )

    return draw


if __name__ == "__main__":
    main()
