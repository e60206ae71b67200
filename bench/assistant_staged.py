"""The Gemma 4 assistant end to end: plain decoding against the assistant drafting through the
engine, with acceptance staged as bench/moe_mtp.py stages MTP's, on the cut Gemma-4-26B-A4B file,
on it whole (`--shape 26b-a4b-full`) or on Gemma 4 E2B whole (`--shape e2b`).

No Gemma 4 or assistant weights exist offline. `--shape 26b-a4b`: the target is bench/moe.py's
random-weight Gemma-4-26B-A4B file (6 layers, 32 experts top 8, vocabulary 32k; Q4_K_M by
llama.cpp's quantizer) run on its own blocks; the assistant a random one of the released
26B-A4B assistant's shape (bench/assistant.py: 4 query-only layers of hidden 1024 over the
target's KV). `--shape 26b-a4b-full`: the same assistant over Gemma-4-26B-A4B whole (every
layer, expert and id; random Q4_K_M blocks streamed to --files once, 16.8 GB, typed as below).
`--shape e2b`: the target is Gemma 4 E2B's whole language model
(quickdraft/bench/shapes.py GEMMA4_E2B: 35 layers, per-layer embeddings, 20 KV-sharing layers,
vocabulary 262,144), random Q4_K_M blocks typed as llama.cpp's quantizer types a tied Gemma 4,
streamed to --files once (3.5 GB); the assistant one of the released E2B assistant's shape
(GEMMA4_E2B_ASSISTANT: 4 layers of hidden 256) with its centroid-masked head: 2048 clusters of
128 ids, the top 32 scored. Either assistant in int4 as `--draft-quantization` has it by
default on the CPU (the masked head reads its rows by id, as loaded). Acceptance, and only
acceptance, is staged in memory after loading: every weight is still read, every expert routed.
  target     its embedding lookup returns the table's row pi(t) for token t (pi a random
             permutation of the ids other than the end-of-generation ones) times --gain, so
             what the layers write is small beside it, and the next token is mostly pi(t):
             the head is the same table, and row pi(t) scores itself highest through the
             final norm once that norm's random weights are made positive (|w|). The layers'
             output scalars are made positive too (their product's sign would flip the
             stream). Values only: a step reads and computes what it did.
  assistant  its pre-projection passes the embedding half through (the hidden half is zero)
             as P e, a random P [1024, 2816] times --assistant-gain, so its layers (they run
             over the target's KV) add little beside it; its head rows (tied) are P e_j, the
             target's table projected alike, so it predicts pi(t) as well; the head rows of a
             random share 1 - a / g of the ids are negated, so it never drafts those. Per
             position it then agrees with the target about a of the time (--accept; g is the
             target's own agreement with pi, measured), independently from one position of
             the text to the next (pi's cycle; over the few hundred positions a run visits
             the share moves by a few hundredths, so each row reports the rate it measured).
             Its final norm is a temperature calibrated so that its mean top probability is
             a: the cost model reads its chain probabilities. E2B's masked head: the
             clusters are what trained centroids give, each id in a cluster whose centroid
             points its way: random unit centroids, each id (its head row) placed in the
             best of its 8 nearest with room (ids in random order), then each centroid the
             mean of its ids' rows; the report gives how often an id's own cluster is among
             the 32 its row scores highest.
Which a: the released 26B-A4B assistant's reported draft acceptance is 67-69 % at k = 4
(community runs on a DGX Spark; bench/assistant.py). Read as vLLM's acceptance rate (accepted
/ drafted) that is a = 0.85 per position; read as the chance of each chained draft, a = 0.68.
Both are run (--accept 0.68 0.85); each row reports the rate it measured. The released E2B
assistant's published figures are fewer: llama-server accepted 21 of its 25 drafts at k = 1
(0.84) and a fused engine 12 of 28 (0.43) (both on an M4 Max, elizaOS/eliza#9033 and #9273):
run with --accept 0.43 0.84.

Measured in one process, 2 threads, methods alternating per round: output tok/s of --prompts
random prompts (--prompt-len ids, then --tokens greedy tokens each, prefills included) one at a
time with speculation off, the assistant at a fixed k = 1..4, and the cost model choosing k;
then 4 at a time, off against the cost model; acceptance rate, rows emitted a step, whether
every output equals speculation off; the assistant's step and a 5-row verify against a target
step. Writes bench/results/<name>.json, .md and .png; the JSON is also the last line printed.

    flock /tmp/quickdraft-bench.lock .venv/bin/python bench/assistant_staged.py \\
        --files /work/moe-files [--shape e2b --accept 0.43 0.84]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from quickdraft.bench.report import bar_chart, machine, write
from quickdraft.bench.shapes import (
    GEMMA4_ASSISTANT,
    GEMMA4_E2B_ASSISTANT,
    init_,
    write_gemma4_26b_a4b,
    write_gemma4_e2b,
)
from quickdraft.bench.speculative import (
    calibrated_temperature,
    compare,
    compare_table,
    forward_seconds,
    serve_batch,
)
from quickdraft.config import SpeculativeConfig
from quickdraft.loading import load
from quickdraft.memory import freeze_loaded
from quickdraft.models.families.gemma4 import Gemma4LM, quantizer
from quickdraft.models.heads.gemma4_assistant import AssistantConfig, Gemma4Assistant
from quickdraft.models.layers import convert_operands_
from quickdraft.speculation.cost import DraftCost, model_cost
from quickdraft.speculation.drafters.assistant import AssistantDrafter, assistant_step_seconds
from quickdraft.speculation.factory import assistant_costs
from quickdraft.speculation.state import Speculation

ROWS = 4096  # table rows a chunk when projecting the target's table
# per shape: the assistant's text config and its head (centroid-masked for E2B)
ASSISTANTS: dict[str, dict[str, Any]] = {
    "26b-a4b": {"text_config": GEMMA4_ASSISTANT},
    "26b-a4b-full": {"text_config": GEMMA4_ASSISTANT},
    "e2b": {
        "text_config": GEMMA4_E2B_ASSISTANT,
        "use_ordered_embeddings": True,
        "num_centroids": 2048,
        "centroid_intermediate_top_k": 32,
    },
}


def stage_centroids(head: Gemma4Assistant, gen: torch.Generator, near: int = 8) -> float:
    """Clusters and centroids of the staged head as trained ones make them (the module's
    docstring); returns how often an id's cluster is among the top-k its own row scores."""
    masked = head.masked_embedding
    assert masked is not None
    unit = torch.nn.functional.normalize
    rows = unit(head.head_rows.float(), dim=-1)
    count, size = masked.num_centroids, len(rows) // masked.num_centroids
    centroids = unit(torch.randn(count, rows.shape[1], generator=gen), dim=-1)
    starts = range(0, len(rows), ROWS)
    nearest = torch.cat([torch.topk(rows[i : i + ROWS] @ centroids.T, near)[1] for i in starts])
    nearest_ids = nearest.tolist()
    room = [size] * count
    members: list[list[int]] = [[] for _ in range(count)]
    left = []
    for token in torch.randperm(len(rows), generator=gen).tolist():
        cluster = next((c for c in nearest_ids[token] if room[c]), None)
        if cluster is None:
            left.append(token)
            continue
        room[cluster] -= 1
        members[cluster].append(token)
    for cluster in range(count):  # the few whose nearest were full: wherever room is left
        while room[cluster]:
            members[cluster].append(left.pop())
            room[cluster] -= 1
    ordering = torch.tensor(members)  # [count, size]
    centroids = unit(rows[ordering].mean(1), dim=-1)
    with torch.no_grad():
        masked.token_ordering.copy_(ordering.reshape(-1))
        masked.centroids.weight.copy_(centroids.to(masked.centroids.weight.dtype))
    cluster_of = torch.empty(len(rows), dtype=torch.int64)
    cluster_of[ordering.reshape(-1)] = torch.arange(count).repeat_interleave(size)
    probe = torch.randint(0, len(rows), (4096,), generator=gen)
    top = torch.topk(rows[probe] @ centroids.T, masked.top_k).indices
    return (top == cluster_of[probe, None]).any(-1).float().mean().item()


class PermutedEmbedding(torch.nn.Module):
    """The target's embedding lookup with row pi(t) for token t, times `gain`."""

    def __init__(self, inner: torch.nn.Module, perm: torch.Tensor, gain: float) -> None:
        super().__init__()
        self.inner, self.perm, self.gain = inner, perm, gain

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = self.inner(self.perm[ids])
        return rows * self.gain


def permutation(vocab: int, fixed: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A random permutation of [0, vocab) that keeps the ids in `fixed` where they are."""
    free = torch.tensor([i for i in range(vocab) if i not in set(fixed)])
    perm = torch.arange(vocab)
    perm[free] = free[torch.randperm(len(free), generator=torch.Generator().manual_seed(seed))]
    return perm


def stage_target(model: Gemma4LM, gain: float, perm: torch.Tensor) -> torch.nn.Module:
    """The staged target (see the module's docstring); returns the plain lookup."""
    inner = model.model.embed_tokens
    model.model.embed_tokens = PermutedEmbedding(inner, perm, gain)  # type: ignore[assignment]
    with torch.no_grad():
        model.model.norm.weight.abs_()
        for layer in model.decoder_layers:
            layer.layer_scalar.abs_()
    return inner


def target_agreement(model: Gemma4LM, perm: torch.Tensor, ids: torch.Tensor) -> float:
    """How often the staged target's next token is pi(t) (one forward over `ids`)."""
    cache = model.new_cache(len(ids) + 8)
    got = model(ids, [cache], [len(ids)], logit_rows=torch.arange(len(ids))).logits.argmax(-1)
    return (got == perm[ids]).float().mean().item()


def staged_assistant(
    model: Gemma4LM,
    table_rows: torch.nn.Module,
    accept: float,
    agreement: float,
    gain: float,
    ids: torch.Tensor,
    shape: str,
) -> tuple[Gemma4Assistant, dict[str, float]]:
    """A random assistant of the released shape, staged (the module's docstring), in int4."""
    cfg = model.config
    spec = ASSISTANTS[shape]
    raw = {
        **spec,
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": cfg.hidden_size,
        "text_config": {**spec["text_config"], "vocab_size": cfg.vocab_size},
    }
    head = Gemma4Assistant(AssistantConfig.from_dict(raw, {}, cfg), torch.bfloat16, "cpu", model)
    init_(head, 1, 1.0)
    width = head.config.text.hidden_size
    gen = torch.Generator().manual_seed(2)
    proj = torch.randn(width, cfg.hidden_size, generator=gen) * cfg.hidden_size**-0.5
    wrong = torch.rand(cfg.vocab_size, generator=gen) < max(0.0, 1.0 - accept / agreement)
    with torch.no_grad():
        for start in range(0, cfg.vocab_size, ROWS):  # head rows: P e_j, negated where wrong
            rows = torch.arange(start, min(start + ROWS, cfg.vocab_size))
            projected = table_rows(rows).float() @ proj.T
            projected[wrong[rows]] *= -1
            head.lm_head.weight[rows] = projected.to(head.dtype)
        pre = torch.zeros(width, 2 * cfg.hidden_size)
        pre[:, : cfg.hidden_size] = proj * gain
        head.pre_projection.weight.copy_(pre.to(head.dtype))
        for layer in head.decoder_layers:
            layer.layer_scalar.fill_(1.0)
        # the head's logits over the staged inputs (its layers add next to nothing)
        x = table_rows(model.model.embed_tokens.perm[ids]).float() @ proj.T  # type: ignore[index]
        x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
        staged: dict[str, float] = {}
        if head.masked_embedding is not None:
            staged["own_cluster_in_top_k"] = round(stage_centroids(head, gen), 4)
            scored = head.masked_embedding.logits(x.to(head.dtype), head.head_rows)
        else:
            scored = x @ head.lm_head.weight.float().T
        temperature = calibrated_temperature(scored, accept)
        head.model.norm.weight.fill_(temperature)
    head.lm_head.op = head.lm_head.weight.detach()
    convert = quantizer("int4")
    assert convert is not None
    convert_operands_(head, convert)
    return head, {
        "temperature": round(temperature, 4),
        "negated": round(wrong.float().mean().item(), 4),
        **staged,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--files", type=Path, default=Path("/tmp/quickdraft-moe"))
    ap.add_argument("--shape", choices=sorted(ASSISTANTS), default="26b-a4b")
    ap.add_argument("--accept", type=float, nargs="+", default=[0.68, 0.85])
    ap.add_argument("--gain", type=float, default=1e3, help="the target's embedding gain")
    ap.add_argument("--assistant-gain", type=float, default=1.0, help="its pre-projection's")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="assistant-staged")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    writers = {"e2b": write_gemma4_e2b, "26b-a4b-full": write_gemma4_26b_a4b}
    whole = args.shape in writers
    file = writers[args.shape](args.files) if whole else args.files / "gemma4-Q4_K_M-model"
    lm = load(str(file), "gguf", progress=False)
    freeze_loaded()  # as `quickdraft serve` does after loading
    model = lm.model
    assert isinstance(model, Gemma4LM)
    vocab = model.config.vocab_size
    perm = permutation(vocab, tuple(lm.eos_ids))
    table_rows = stage_target(model, args.gain, perm)
    gen = torch.Generator().manual_seed(1)
    pool = torch.tensor([i for i in range(vocab) if i not in set(lm.eos_ids)])
    probe = pool[torch.randint(0, len(pool), (64,), generator=gen)]
    agreement = target_agreement(model, perm, probe)
    prompts = [
        pool[torch.randint(0, len(pool), (args.prompt_len,), generator=gen)].tolist()
        for _ in range(args.prompts)
    ]
    serve_batch(lm, None, prompts[:1], 4, 1)  # warm
    model_cost(lm.model)  # the cost model's target curve, measured once
    step = forward_seconds(model, 1) * 1e3
    verify = forward_seconds(model, 5) * 1e3
    report: dict[str, Any] = {
        "machine": machine(),
        "threads": args.threads,
        "setup": {
            "shape": args.shape,
            "file": file.name if whole else "gemma4-Q4_K_M.gguf",
            "gain": args.gain,
            "assistant_gain": args.assistant_gain,
            "target_agreement": round(agreement, 3),
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "tokens": args.tokens,
            "rounds": args.rounds,
        },
        "target_step_ms": round(step, 2),
        "verify5_over_step": round(verify / step, 3),
        "runs": {},
    }
    for accept in args.accept:
        head, staged = staged_assistant(
            model, table_rows, accept, agreement, args.assistant_gain, probe, args.shape
        )
        drafter = AssistantDrafter(head)
        assistant_ms = min(assistant_step_seconds(drafter, 64) for _ in range(3)) * 1e3
        config = SpeculativeConfig(  # the drafter is built here: the path is never read
            method="assistant",
            num_draft_tokens=max(args.ks),
            adaptive=False,
            draft_model="staged-in-memory",
        )
        specs: dict[str, Speculation | None] = {"off": None}
        for k in args.ks:
            specs[f"k={k}"] = Speculation(
                dataclasses.replace(config, num_draft_tokens=k), drafter, None
            )
        policy = Speculation(
            dataclasses.replace(config, adaptive=True),
            drafter,
            DraftCost(assistant_costs(lm, drafter)()),
        )
        specs["cost model"] = policy
        run = {
            "staged": staged,
            "assistant_step_ms": round(assistant_ms, 2),
            "assistant_over_step": round(assistant_ms / step, 3),
            "concurrency_1": compare(lm, specs, prompts, args.tokens, 1, args.rounds),
            "concurrency_4": compare(
                lm, {"off": None, "cost model": policy}, prompts, args.tokens, 4, args.rounds
            ),
        }
        report["runs"][f"{accept:g}"] = run
        del drafter, head, specs, policy
    write(args.name, report, markdown(report), plot(report))
    print(json.dumps(report))


def markdown(report: dict[str, Any]) -> str:
    s = report["setup"]
    e2b = s.get("shape") == "e2b"
    target = {
        "e2b": "E2B whole: 35 layers, per-layer embeddings, vocabulary 262,144",
        "26b-a4b-full": "whole: 30 layers, 128 experts, vocabulary 262,144",
    }.get(s.get("shape", ""), "cut: 6 layers, 32 experts, vocabulary 32k")
    out = [
        f"# The Gemma 4 assistant end to end ({'E2B' if e2b else '26B-A4B'} shapes, "
        "acceptance staged)\n",
        f"{s['file']} ({target}; random Q4_K_M blocks), "
        f"{report['threads']} threads; assistant of the released "
        f"{'E2B' if e2b else '26B-A4B'} assistant's shape in "
        f"int4{' (its centroid-masked head: top 32 of 2048 clusters)' if e2b else ''}. "
        f"Staged: target embeddings x {s['gain']} (its next token is pi(t) "
        f"{s['target_agreement']} of the time), the assistant's head negated on a share of "
        f"the ids. {s['prompts']} random prompts of {s['prompt_len']} ids, {s['tokens']} greedy "
        f'tokens each, {s["rounds"]} rounds alternating (medians; "paired": the median of '
        "each round's ratio to off's in the same round). Target step "
        f"{report['target_step_ms']} ms at context 64; a 5-row verify "
        f"{report['verify5_over_step']}x a step.\n",
    ]
    for accept, run in report["runs"].items():
        out.append(
            f"## a = {accept} per position (assistant step {run['assistant_step_ms']} ms, "
            f"{run['assistant_over_step']}x a target step; {run['staged']['negated']:.1%} of "
            "the ids negated"
            + (
                f"; an id's own cluster among the 32 its row scores highest "
                f"{run['staged']['own_cluster_in_top_k']:.1%} of the time"
                if "own_cluster_in_top_k" in run["staged"]
                else ""
            )
            + ")\n"
        )
        for key in ("concurrency_1", "concurrency_4"):
            out.append(f"{key.replace('_', ' ')}:\n")
            out.append(compare_table(run[key]))
    return "\n".join(out)


def plot(report: dict[str, Any]) -> Any:
    runs = report["runs"]
    names = list(next(iter(runs.values()))["concurrency_1"])
    shape = {"e2b": "E2B", "26b-a4b-full": "26B-A4B whole"}.get(
        report["setup"].get("shape", ""), "26B-A4B cut"
    )
    return bar_chart(
        f"Gemma 4 assistant end to end, {shape} (staged)",
        "x speculation off",
        names,
        {
            f"a = {a}": [r["concurrency_1"][n]["paired_speedup"] for n in names]
            for a, r in runs.items()
        },
    )


if __name__ == "__main__":
    main()
