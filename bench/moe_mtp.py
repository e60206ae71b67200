"""MTP end to end on the full-size qwen35moe file: plain decoding against MTP self-speculation
through the engine, with the acceptance staged as bench/hybrid.py stages it.

The file (bench/moe.py --full writes it: Qwen3.6-35B-A3B's shape, 40 layers, 256 experts top 8
+ a shared expert, vocabulary 248,320, random Q4_K_M blocks, its nextn block as the MTP head)
carries no language, so acceptance is staged in memory after loading, and only acceptance:
every weight is still read, every expert still routed, as a real step does.
  target   its token embeddings enter the residual stream times --gain (the lookup's rows
           multiplied): what the layers write (they read the stream through their norms, so
           they compute and route as before) becomes small beside the embedding, and the next
           token is mostly what the token's embedding alone predicts; the larger the gain, the
           more often. The head's rows past --keep are zeroed, so the staged text's tokens
           fall in the first --keep ids, as real text's mostly do in the frequent ids; the
           zeroed rows are still read every step. (Scaling the layers' norms instead cannot
           go low enough: bf16 (1 + w) weights step by 2^-8, and the random layers write ~20x
           the embeddings' RMS even at 2^-8.)
  MTP head its fc passes HEAD_GAIN x norm_e(embed(t)) through (Q8_0 blocks of [G I, 0]), so
           its layer (it runs, routes and reads its experts) adds little beside it, and its
           final norm is the target's: it predicts what the embedding predicts.
The head scores every id ("all") or, with --draft-vocab, the first --keep ids and the
end-of-generation ids (`--draft-vocab 65536`, as `quickdraft serve` takes it).

Measured in one process, 2 threads, methods alternating per round: output tok/s of --prompts
random prompts (--prompt-len ids each, then --tokens greedy tokens, prefills included) served
one at a time with speculation off, with MTP at a fixed k = 1..3, and with the cost model
choosing k (<= 3); then 4 at a time, off against the cost model. Acceptance rate (accepted /
drafted), target forwards per emitted token, and whether every output equals speculation
off. Writes bench/results/<name>.json, .md and .png; the JSON is also the last line printed.

    flock /tmp/quickdraft-bench.lock .venv/bin/python bench/moe_mtp.py \\
        --file /work/moe-files/qwen35moe-full-Q4_K_M.gguf --gain 2e4
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from quickdraft.bench.report import bar_chart, machine, read_bandwidth_gbs, write
from quickdraft.bench.speculative import (
    calibrated_temperature,
    compare,
    compare_table,
    serve_batch,
)
from quickdraft.config import SpeculativeConfig
from quickdraft.hub.convert import convert_gguf
from quickdraft.kernels import project
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.loading import load
from quickdraft.memory import freeze_loaded
from quickdraft.models.families.qwen3_next import HybridLM
from quickdraft.models.heads.mtp import MTPHead
from quickdraft.speculation.drafters.mtp import MTPDrafter
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import Speculation

# fc's pass-through gain (Q8_0 d = 7874, within fp16): the head's own layer adds next to nothing
HEAD_GAIN = 1e6


class GainEmbedding(torch.nn.Module):
    """The target's embedding lookup, rows times `gain` (the staged target)."""

    def __init__(self, inner: torch.nn.Module, gain: float) -> None:
        super().__init__()
        self.inner, self.gain = inner, gain

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = self.inner(ids)
        return rows * self.gain


def stage_target(model: HybridLM, gain: float, keep: int) -> None:
    """Token embeddings times `gain` into the residual stream; ids past `keep` score 0 (their
    head rows zeroed, still read). The MTP head keeps the plain lookup (it norms it anyway)."""
    head = model.head
    if not isinstance(head, GGUFWeight):
        raise SystemExit("the staged head expects the file's own blocks (--dtype gguf)")
    if keep % 16:
        raise SystemExit(f"--keep {keep}: a multiple of 16 (the head's panels)")
    inner = model.model.embed_tokens
    model.model.embed_tokens = GainEmbedding(inner, gain)  # type: ignore[assignment]
    row = 0
    with torch.no_grad():
        for part in head.parts:  # [panels, blocks, bytes]: 16 rows a panel
            first = max(0, keep - row)
            if first < part.n:
                part.packed[first // 16 :].zero_()
            row += part.n


def identity_fc(hidden: int, gain: float) -> GGUFWeight:
    """[gain I, 0] ([hidden, 2 hidden]) as Q8_0 blocks: fc passes its first half through."""
    eye = np.zeros((hidden, 2 * hidden), np.float32)
    eye[:, :hidden] = gain * np.eye(hidden, dtype=np.float32)
    raw = np.ascontiguousarray(quantize(eye, GGMLQuantizationType.Q8_0)).view(np.uint8)
    return GGUFWeight.from_raw("Q8_0", raw.reshape(hidden, -1), 2 * hidden)


def staged_agreement(model: HybridLM, keep: int, n: int = 64) -> tuple[float, torch.Tensor]:
    """How often the staged target's next token is what its embedding alone predicts (over
    `n` random ids < `keep`, one forward), and those embedding-only logits [n, keep] fp32."""
    ids = torch.randint(0, keep, (n,), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(n + 8)
    target = model(ids, [cache], [n], logit_rows=torch.arange(n)).logits.argmax(-1)
    inner = cast(GainEmbedding, model.get_submodule("model.embed_tokens")).inner
    rows = model.get_submodule("model.norm")(inner(ids))
    logits = project(rows, model.head).float()[:, :keep]
    return (target == logits.argmax(-1)).float().mean().item(), logits


def stage_head(head: MTPHead, model: HybridLM, temperature: float) -> None:
    """The head predicts what the token's embedding predicts through the target's final norm,
    its logits times `temperature` (its (1 + w) final norm scaled): the chain probabilities
    the cost model reads are then calibrated, where the random head's own were ~0."""
    with torch.no_grad():
        head.get_parameter("pre_fc_norm_embedding.weight").zero_()  # (1 + w) = 1
        final = head.get_parameter("norm.weight")
        final.copy_(model.get_parameter("model.norm.weight"))
        final.mul_(temperature).add_(temperature - 1.0)
    head.fc_weight = identity_fc(head.hidden_size, HEAD_GAIN)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--file", type=Path, required=True, help="the full-size qwen35moe GGUF")
    ap.add_argument("--gain", type=float, default=2e4, help="the staged embedding gain")
    ap.add_argument("--keep", type=int, default=65536, help="staged text's ids, and the cut")
    ap.add_argument("--draft-vocab", action="store_true", help="the head scores --keep ids")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--probe", action="store_true", help="acceptance at k = 2 only, 1 round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="moe-full-mtp-e2e")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"machine": machine(), "threads": args.threads}
    report["read_gbs"] = round(read_bandwidth_gbs(), 1)
    model_dir = args.file.with_name(f"{args.file.stem}-model")
    if not model_dir.exists():
        convert_gguf(args.file, model_dir, "gguf")
    t = time.perf_counter()
    lm = load(str(model_dir), "gguf", progress=False)
    report["load_s"] = round(time.perf_counter() - t, 1)
    freeze_loaded()  # as `quickdraft serve` does after loading
    model = lm.model
    assert isinstance(model, HybridLM)
    stage_target(model, args.gain, args.keep)
    k_max = max(args.ks)
    config = SpeculativeConfig(
        method="mtp", num_draft_tokens=k_max, draft_vocab=args.keep if args.draft_vocab else 0
    )
    policy = make_speculation(lm, config)
    assert isinstance(policy, Speculation)
    drafter = policy.drafter
    assert isinstance(drafter, MTPDrafter) and isinstance(drafter.head, MTPHead)
    head = drafter.head
    agreement, logits = staged_agreement(model, args.keep)
    temperature = calibrated_temperature(logits, agreement)
    stage_head(head, model, temperature)
    fixed = dataclasses.replace(config, adaptive=False)
    specs: dict[str, Speculation | None] = {"off": None}
    for k in [2] if args.probe else args.ks:
        specs[f"k={k}"] = Speculation(
            dataclasses.replace(fixed, num_draft_tokens=k), policy.drafter, None
        )
    if not args.probe:
        specs["cost model"] = policy
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, args.keep, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    serve_batch(lm, None, prompts[:1], 4, 1)  # warm
    report["setup"] = {
        "file": args.file.name,
        "file_gib": round(args.file.stat().st_size / 2**30, 2),
        "machine_memory_gib": round(
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1
        ),
        "gain": args.gain,
        "staged_agreement": round(agreement, 3),
        "head_temperature": round(temperature, 3),
        "keep": args.keep,
        "head_scores": args.keep if args.draft_vocab else "all",
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "tokens": args.tokens,
        "rounds": 1 if args.probe else args.rounds,
    }
    rounds = 1 if args.probe else args.rounds
    report["concurrency_1"] = compare(lm, specs, prompts, args.tokens, 1, rounds)
    if not args.probe:
        report["concurrency_4"] = compare(
            lm, {"off": None, "cost model": policy}, prompts, args.tokens, 4, rounds
        )
    report["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    write(args.name, report, markdown(report), plot(report))


def markdown(report: dict[str, Any]) -> str:
    s = report["setup"]
    out = [
        "# MTP end to end on the full-size qwen35moe file (acceptance staged)\n",
        f"{s['file']} ({s['file_gib']} GiB Q4_K_M, random blocks; {s['machine_memory_gib']} GiB "
        f"machine, nothing else running), {report['threads']} threads, loaded in "
        f"{report['load_s']} s, peak RSS {report['peak_rss_mib']} MiB; host read "
        f"{report['read_gbs']} GB/s (torch sum). Staged: embeddings x {s['gain']} (the "
        f"target's next token is the embedding's {s['staged_agreement']} of the time; the "
        f"head's logits x {s['head_temperature']}, so its mean top probability is that), the "
        f"staged text in the first {s['keep']} ids; the head scores {s['head_scores']} ids. "
        f"{s['prompts']} random prompts of {s['prompt_len']} ids, {s['tokens']} greedy tokens "
        f"each, {s['rounds']} rounds alternating (medians).\n",
    ]
    for key in ("concurrency_1", "concurrency_4"):
        if key not in report:
            continue
        out.append(f"## {key.replace('_', ' ')}\n")
        out.append(compare_table(report[key]))
    return "\n".join(out)


def plot(report: dict[str, Any]) -> Any:
    one = report["concurrency_1"]
    return bar_chart(
        "qwen35moe full size: MTP end to end (staged)",
        "x speculation off",
        list(one),
        {"concurrency 1": [r["speedup"] for r in one.values()]},
    )


if __name__ == "__main__":
    main()
