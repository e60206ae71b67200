"""The Gemma 4 assistant drafter's step cost against its target's, and the speedup that cost
gives at the acceptance a published assistant reaches.

No Gemma 4 weights exist offline. The target is bench/moe.py's random-weight Gemma-4-26B-A4B
file (real per-layer widths, cut to 6 layers / 32 experts / a 32k vocabulary; Q4_K_M by
llama.cpp's quantizer) run on its own blocks; the assistant is a random one of the released
26B-A4B assistant's shape (4 query-only layers [local x 3, global] of hidden 1024, MLP 8192,
16 heads, k = v global layers; the tied 262144-row head cut to the target's 32k vocabulary),
in bf16 panels as the checkpoint ships and in int4 (`--draft-quantization`'s CPU default, as
draft models run). Measured, 2 threads, best of rounds:
  target step     one row at context 64 (`bench/moe.py`'s one-row step)
  verify          k + 1 rows at context 64
  assistant step  one chained step at context 64 (speculation/drafters/assistant.py)
Both heads are timed apart (one row). A full-size step is estimated from these: the target's
layers x 30 / 6 (its routed experts read top 8 of 128 as the cut's read top 8 of 32: the same
bytes a layer) and its head x 262144 / 32000; the assistant's layers as measured and its head
x 262144 / 32000. The report gives the ratio against the cut target as measured and against
that estimate, labelled so.
The speedup at acceptance rate a (per draft, the chain model) and k drafts is
  E[tokens / cycle] / (k * assistant / target + verify(k + 1) / target),
  E = (1 - a^(k + 1)) / (1 - a),
a figure computed from these measured costs, not a staged decode; the acceptance is the
community-reported 67-69 % of the 26B-A4B assistant at k = 4 (DGX Spark; vLLM's H100 run of
the same pair reported 1.78x), so a = 0.68.

    .venv/bin/python bench/assistant.py --files /work/moe-files
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from quickdraft.bench.report import bar_chart, machine, table, write
from quickdraft.bench.shapes import GEMMA4_ASSISTANT, init_
from quickdraft.bench.speculative import forward_seconds
from quickdraft.kernels.gemm import to_panels
from quickdraft.loading import load
from quickdraft.models.families.gemma4 import Gemma4LM, quantizer
from quickdraft.models.heads.gemma4_assistant import AssistantConfig, Gemma4Assistant
from quickdraft.models.layers import convert_operands_
from quickdraft.speculation.drafters.assistant import AssistantDrafter, assistant_step_seconds

ACCEPTANCE, K = 0.68, 4


def assistant_for(target: Gemma4LM, quantization: str) -> Gemma4Assistant:
    raw = {
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": target.config.hidden_size,
        "text_config": {**GEMMA4_ASSISTANT, "vocab_size": target.config.vocab_size},
    }
    cfg = AssistantConfig.from_dict(raw, {}, target.config)
    head = Gemma4Assistant(cfg, torch.bfloat16, "cpu", target)
    init_(head, 1, 1.0)
    head.lm_head.op = head.lm_head.weight.detach()
    convert = quantizer(quantization)  # as load_assistant: --draft-quantization, else panels
    convert_operands_(head, convert if convert is not None else to_panels)
    return head


def speedup(a: float, k: int, draft: float, verify: float) -> float:
    """Tokens a cycle over its cost in target steps (`draft`, `verify` relative to one)."""
    tokens = (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * draft + verify)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--files", type=Path, default=Path("/tmp/quickdraft-moe"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="assistant")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load(str(args.files / "gemma4-Q4_K_M-model"), "gguf", progress=False).model
    assert isinstance(model, Gemma4LM)
    forward_seconds(model, 1)  # warm
    step = forward_seconds(model, 1)
    verify = forward_seconds(model, K + 1)
    cfg = model.config
    grow = 262144 / cfg.vocab_size  # the real vocabulary over the cut one
    head_s = head_seconds(model._logits, cfg.hidden_size, model.dtype)
    full = (step - head_s) * 30 / cfg.num_hidden_layers + head_s * grow
    rows, drafts = [], {}
    for quantization in ("none", "int4"):  # bf16 panels as the checkpoint ships; the default
        drafter = AssistantDrafter(assistant_for(model, quantization))
        draft = min(assistant_step_seconds(drafter, 64) for _ in range(3))
        a_head = head_seconds(drafter.head.lm_head, 1024, torch.bfloat16)
        draft_full = draft - a_head + a_head * grow
        drafts[quantization] = {"step_ms": round(draft * 1e3, 2), "head_ms": round(a_head * 1e3, 2)}
        weights = "bf16" if quantization == "none" else quantization
        cases = (("cut (measured)", step, draft), ("full size (estimated)", full, draft_full))
        for name, target, assistant in cases:
            ratio = assistant / target
            rows.append(
                [
                    f"{weights}, {name}",
                    round(target * 1e3, 2),
                    round(assistant * 1e3, 2),
                    round(ratio, 3),
                    round(speedup(ACCEPTANCE, K, ratio, verify / step), 2),
                ]
            )
        del drafter
    report = {
        "machine": machine(),
        "threads": args.threads,
        "acceptance": ACCEPTANCE,
        "k": K,
        "target_step_ms": round(step * 1e3, 2),
        "verify_ms": round(verify * 1e3, 2),
        "assistant": drafts,
        "target_head_ms": round(head_s * 1e3, 2),
        "full_size_step_ms_estimate": round(full * 1e3, 2),
        "rows": rows,
    }
    md = (
        "# The Gemma 4 assistant's step cost (26B-A4B shapes)\n\n"
        f"{ACCEPTANCE:.0%} acceptance (the published figure), k = {K}; verify of {K + 1} rows "
        f"= {verify / step:.2f}x a target step (measured on the cut file).\n\n"
        + table(["target", "target step ms", "assistant step ms", "ratio", "speedup at a, k"], rows)
        + f"\n{report['machine']['cpu']}, commit {report['machine'].get('commit', '')}\n"
    )
    series = {"ratio": [r[3] for r in rows], "speedup": [r[4] for r in rows]}
    write(args.name, report, md, bar_chart("assistant", "x", [r[0] for r in rows], series))
    print(json.dumps(report))


def head_seconds(head: Any, width: int, dtype: torch.dtype, reps: int = 5) -> float:
    """Seconds of a head alone on one row (its share of a step)."""
    x = torch.randn(1, width, dtype=dtype)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        head(x)
        best = min(best, time.perf_counter() - t)
    return best


if __name__ == "__main__":
    main()
