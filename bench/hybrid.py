# Over 400 lines on purpose: one benchmark of one hybrid model end to end (build or GGUF
# round trip, parity, throughput, cycle stages, report), whose parts share the model and head.
"""Hybrid (Gated DeltaNet) target + MTP self-speculation, on a random-weight model of realistic
shape: Qwen3.5-0.8B's (hidden 1024; 24 layers = 18 GDN + 6 gated attention; 16 GDN heads of
128; 8 query / 2 KV heads of 256; MLP 3584) with the vocabulary cut to 32k: ~0.6B params, bf16.

Random weights carry no language, so acceptance is forced: the target's layers write into the
residual stream at a reduced scale (--out-scale), so its next token is mostly what the token
embedding alone predicts, and the MTP head is built to predict exactly that (fc passes the
embedding through, its decoder layer adds nothing but still runs). The compute is that of a
real head and target; only the acceptance rate is staged.

Measured side by side in one run, warm-up excluded:
  decode_vs_verify   target forward of 1 row vs k + 1 rows at the same context (median), and
                     the same for the forward's weight GEMMs alone (the CPU linear kernel)
  commit             HybridCache.commit per accept count 0..k (us), and the deferred state
                     update it leaves to the next forward (all GDN layers, ms), per count
  cycles             per MTP cycle: draft / verify (target forward + greedy verify) / commit
                     (cache + drafter) in ms, and commit's share of the cycle
  tok/s              plain greedy decode vs MTP (k fixed), same prompts and lengths; AL,
                     acceptance rate and histogram, and whether outputs were identical
Writes bench/results/hybrid.json, .md (tables) and .png (tok/s, decode vs verify, accepted
histogram); prints the tables, then the JSON as the last line.

--gguf [TYPE] runs the same weights from a GGUF file instead, as a user's GGUF runs: written
as llama.cpp lays out a qwen35 file (the MTP head as blk.24.nextn.*; hub/gguf_write.py) into a
temporary directory, its matrices in TYPE (Q4_K_M by default, by llama.cpp's own quantizer,
the `peers` extra; Q8_0 / Q4_0 / ... by gguf-py), loaded with --dtype gguf (its projections
stay in their blocks) and the MTP head from the file; writes hybrid-gguf.* instead.

    flock /tmp/quickdraft-heavy.lock .venv/bin/python bench/hybrid.py
    flock /tmp/quickdraft-bench.lock nice -n 19 .venv/bin/python bench/hybrid.py --gguf
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import tempfile
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from quickdraft.bench.peers import llama_cpp_quantize
from quickdraft.bench.report import bars, machine, peak_rss_mb, table, write
from quickdraft.bench.shapes import HYBRID_CONFIG, MOE_CUTS, MOE_REAL, init_
from quickdraft.bench.speculative import compare
from quickdraft.config import SpeculativeConfig
from quickdraft.hub.convert import convert_gguf
from quickdraft.hub.gguf_write import WRITABLE, llama_cpp_tensors, write_gguf
from quickdraft.kernels import PanelWeight, Weight, panels_apply, project
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.hybrid_config import HybridConfig
from quickdraft.models.families.moe import GatedMLP
from quickdraft.models.families.qwen3_next import GatedAttention, GatedDeltaNet, HybridLM
from quickdraft.models.heads.mtp import MTPHead, hybrid_mtp_parts
from quickdraft.request import SamplingParams
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.drafters.mtp import MTPDrafter, head_step_seconds, load_mtp_head
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.verify import verify_greedy

# --shape: the model's config, GGUF architecture and a description. qwen35: Qwen3.5-0.8B's
# language model (quickdraft/bench/shapes.py); qwen35moe: Qwen3.6-35B-A3B's per-layer widths
# (256 experts top 8 + a shared expert) with layers, experts and vocabulary cut as in
# bench/moe.py's file (8 layers, 64 experts, 32k), its MTP head one more MoE layer
SHAPES: dict[str, tuple[dict[str, Any], str, str]] = {
    "qwen35": (HYBRID_CONFIG, "qwen35", "Qwen3.5-0.8B layers/widths, vocab 32k, untied lm_head"),
    "qwen35moe": (
        {**MOE_REAL["qwen35moe"], **MOE_CUTS["qwen35moe"], "mtp_num_hidden_layers": 1},
        "qwen35moe",
        "Qwen3.6-35B-A3B widths, 8 layers (6 GDN + 2 attention), 64 experts top 8 + shared, "
        "vocab 32k",
    ),
}


def build(
    out_scale: float, config: dict[str, Any], pack: bool = True
) -> tuple[HybridLM, MTPHead, int, int]:
    """The model and its head as `quickdraft.loading.load` would run them (with `pack`, bf16
    operands packed into panels when the CPU kernels are available, see kernels/gemm.py and
    kernels/linear_bf16.py; without, HF-named bf16 tensors), and
    their parameter counts (taken before packing releases the HF-named tensors)."""
    cfg = HybridConfig.from_dict(config)
    model = HybridLM(cfg, torch.bfloat16)
    init_(model, 0, out_scale)
    params = sum(p.numel() for p in model.parameters())
    packed = pack and panels_apply(model.dtype, model.device)
    if packed:
        model.pack_()
    head = MTPHead(
        hybrid_mtp_parts(cfg, torch.bfloat16, torch.device("cpu")),
        cfg.hidden_size,
        model.get_submodule("model.embed_tokens"),
        model.head,
        torch.bfloat16,
        torch.device("cpu"),
    )
    init_(head, 1, 0.0)  # its layer runs but writes nothing into the residual stream
    h = cfg.hidden_size
    with torch.no_grad():  # fc passes norm_e(embed(t)) through; the final norm is the target's
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)
        head.get_parameter("pre_fc_norm_embedding.weight").zero_()
        head.get_parameter("norm.weight").copy_(model.get_parameter("model.norm.weight"))
    head_params = sum(p.numel() for p in head.parameters())
    if packed:
        head.pack_()
    return model, head, params, head_params


def build_gguf(
    out_scale: float, qtype: str, directory: Path, config: dict[str, Any], arch: str
) -> tuple[HybridLM, MTPHead, int, int, dict[str, Any], LoadedModel]:
    """The same model and head written into `directory` as a qwen35 GGUF laid out as
    llama.cpp's converter writes one (the head as blk.24.nextn.*), its matrices in `qtype`
    (gguf-py writes the formats in WRITABLE; any other llama.cpp file type, e.g. Q4_K_M, comes
    from llama.cpp's own quantizer run on an F32 file), then loaded as a user's GGUF is: the
    converter's config + tokenizer directory, `--dtype gguf` (the file's own blocks), the MTP
    head from its nextn tensors. Also what was written: writer, file size, tensors per format."""
    model, head, params, head_params = build(out_scale, config, pack=False)
    state = model.state_dict() | {f"mtp.{k}": v for k, v in head.state_dict().items()}
    del model, head
    tensors = llama_cpp_tensors(state, arch, config)
    del state
    path = directory / f"hybrid-{qtype}.gguf"
    source = path if qtype in WRITABLE else directory / "hybrid-F32.gguf"
    write_gguf(source, arch, config, tensors, qtype if qtype in WRITABLE else "F32")
    del tensors
    writer = f"gguf-py {version('gguf')}"
    if source != path:
        peer = llama_cpp_quantize(source, path, qtype, torch.get_num_threads())
        writer = f"llama.cpp's quantizer (llama-cpp-python {peer})"
        source.unlink()
    model_dir = convert_gguf(path, directory / "model", "gguf", progress=False)
    lm = load(str(model_dir), "gguf", progress=False)
    assert isinstance(lm.model, HybridLM)
    formats = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    written = {
        "format": qtype,
        "writer": writer,
        "file_mb": round(path.stat().st_size / 2**20, 1),
        "tensors_by_format": dict(formats.most_common()),
    }
    return lm.model, load_mtp_head(lm.model, lm.path), params, head_params, written, lm


def engine_rows(
    lm: LoadedModel, k: int, prompts: list[list[int]], tokens: int, rounds: int
) -> dict[str, Any]:
    """MTP with the cost model choosing k (<= `k`) through the engine, against speculation off,
    at concurrency 1 and 4 (issue 56: never below speculation off at 4), in `rounds` rounds of
    off then MTP (`compare`: each round's ratio is taken seconds apart)."""
    spec = make_speculation(lm, SpeculativeConfig(method="mtp", num_draft_tokens=k))
    out: dict[str, Any] = {}
    for c in (1, 4):
        batch = prompts if len(prompts) >= c else (prompts * c)[:c]
        res = compare(lm, {"off": None, "mtp": spec}, batch, tokens, c, rounds)
        mtp = res["mtp"]
        out[str(c)] = {
            "requests": len(batch),
            "rounds": rounds,
            "off_tok_s": res["off"]["tok_s"],
            "mtp_policy_tok_s": mtp["tok_s"],
            "speedup": mtp["speedup"],
            "paired_speedup": mtp["paired_speedup"],
            "round_ratios": mtp["round_ratios"],
            "acceptance_rate": mtp["acceptance_rate"],
            "drafted_per_step": mtp["drafted_per_step"],
            "identical_outputs": mtp["identical_outputs"],
        }
    return out


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def decode_vs_verify(model: HybridLM, k: int, context: int, reps: int) -> dict[str, Any]:
    """Alternate 1-row and (k + 1)-row forwards, each committed like a cycle would (1 row /
    a varying number of rows), so the deferred state updates are part of what is timed."""
    cache = model.new_cache(context + reps * (k + 2) + 8)
    ids = torch.randint(0, model.config.vocab_size, (context + k + 1,))
    model(ids[:context], [cache], [context])
    cache.commit(context)
    one, many = [], []
    for rep in range(reps + 2):
        t = time.perf_counter()
        model(ids[:1], [cache], [1])
        cache.commit(cache.length + 1)
        t1 = time.perf_counter()
        model(ids[: k + 1], [cache], [k + 1], logit_rows=torch.arange(k + 1))
        cache.commit(cache.length + 1 + rep % (k + 1))
        t2 = time.perf_counter()
        if rep >= 2:  # warm-up
            one.append(t1 - t)
            many.append(t2 - t1)
    return {
        "context": context,
        "decode_ms": median_ms(one),
        "verify_ms": median_ms(many),
        "verify_over_decode": round(statistics.median(many) / statistics.median(one), 3),
    }


def gemm_weights(model: HybridLM) -> list[Weight]:
    """The GEMM operands one forward multiplies, as it multiplies them (fused, packed)."""
    out: list[Weight] = [model.head]
    for mod in model.modules():
        if isinstance(mod, GatedAttention):
            out += [mod.qkv, mod.o]
        elif isinstance(mod, GatedDeltaNet):
            out += [mod.inp, mod.out]
        elif isinstance(mod, GatedMLP):
            out += [mod.gate_up, mod.down]
    return out


def gemm_ratio(model: HybridLM, rows: int, reps: int) -> dict[str, Any]:
    """The forward's weight GEMMs alone (the CPU linear kernels) at M = 1 vs M = rows."""
    weights = gemm_weights(model)

    def run(m: int) -> float:
        xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=model.dtype) for w in weights}
        t = time.perf_counter()
        for w in weights:
            project(xs[w.shape[1]], w)
        return time.perf_counter() - t

    run(1), run(rows)
    one = [run(1) for _ in range(reps)]
    many = [run(rows) for _ in range(reps)]
    return {
        "gemm_decode_ms": median_ms(one),
        "gemm_verify_ms": median_ms(many),
        "gemm_verify_over_decode": round(statistics.median(many) / statistics.median(one), 3),
    }


def commit_costs(model: HybridLM, k: int, reps: int = 200) -> dict[str, Any]:
    """HybridCache.commit per accept count (after a real verify forward), and the deferred
    rank-m state update the commit leaves for the next forward (all GDN layers)."""
    cache = model.new_cache(64 + k + 1)
    ids = torch.randint(0, model.config.vocab_size, (64,))
    model(ids, [cache], [64])
    cache.commit(64)
    base = cache.length
    model(ids[: k + 1], [cache], [k + 1], logit_rows=torch.arange(k + 1))
    commit_us, apply_ms = [], []
    layers = cache.shape.num_layers
    saved = (cache.ssm.clone(), cache.conv.clone())
    for accepted in range(k + 1):
        times, applies = [], []
        for _ in range(reps):
            cache.reserve(k + 1)  # the same checkpoints stand; a commit needs a forward before
            t = time.perf_counter()
            cache.commit(base + 1 + accepted)
            times.append(time.perf_counter() - t)
            cache.commit(base + 1 + accepted)  # no-op
            if len(applies) < 20:
                t = time.perf_counter()
                for g in range(layers):
                    cache.gdn_state(g)
                applies.append(time.perf_counter() - t)
            cache.ssm.copy_(saved[0])
            cache.conv.copy_(saved[1])
            cache.pending = [0] * layers
            cache.length = base
            cache.kv.commit(base)
        commit_us.append(round(statistics.median(times) * 1e6, 2))
        apply_ms.append(median_ms(applies))
    return {"commit_us_by_accepted": commit_us, "apply_update_ms_by_accepted": apply_ms}


def generate(
    model: HybridLM, drafter: MTPDrafter | None, prompt: list[int], tokens: int, k: int
) -> dict[str, Any]:
    """The decode cycle of `quickdraft.engine.stream` (engine/spec_cycle.py: propose, forward,
    verify, commit), timed per stage (greedy)."""
    gen, params = torch.Generator(), SamplingParams()
    cache = model.new_cache(len(prompt) + tokens + k + 1)
    hidden = drafter is not None
    t_start = time.perf_counter()
    out = model(torch.tensor(prompt), [cache], [len(prompt)], return_hidden=hidden)
    cache.commit(len(prompt))
    seq = [*prompt, int(out.logits[-1].argmax())]
    state = drafter.new_state(prompt) if drafter is not None else None
    if drafter is not None:
        drafter.commit(state, seq, out.hidden)
    t_first = time.perf_counter()
    draft_s, verify_s, commit_s, accepted_hist = [], [], [], [0] * (k + 1)
    cycles = accepted = drafted = 0
    while len(seq) - len(prompt) < tokens:
        room = tokens - (len(seq) - len(prompt)) - 1
        kk = min(k, room) if drafter is not None else 0
        t0 = time.perf_counter()
        draft = (
            drafter.propose([DraftJob(state, seq, kk, params, gen)])[0].tokens
            if drafter is not None and kk > 0
            else []
        )
        t1 = time.perf_counter()
        n = 1 + len(draft)
        out = model(
            torch.tensor([seq[-1], *draft]),
            [cache],
            [n],
            logit_rows=torch.arange(n),
            return_hidden=hidden,
        )
        verdict = verify_greedy(draft, out.logits)
        t2 = time.perf_counter()
        cache.commit(cache.length + 1 + verdict.accepted)
        seq += verdict.tokens
        if drafter is not None:
            assert out.hidden is not None
            drafter.commit(state, seq, out.hidden[: 1 + verdict.accepted])
        t3 = time.perf_counter()
        cycles += 1
        accepted += verdict.accepted
        drafted += len(draft)
        if len(draft) == k:
            accepted_hist[verdict.accepted] += 1
        draft_s.append(t1 - t0)
        verify_s.append(t2 - t1)
        commit_s.append(t3 - t2)
    t_end = time.perf_counter()
    return {
        "output": seq[len(prompt) :][:tokens],
        "decode_s": t_end - t_first,
        "prefill_s": t_first - t_start,
        "tokens_after_first": len(seq) - len(prompt) - 1,
        "cycles": cycles,
        "draft_s": draft_s,
        "verify_s": verify_s,
        "commit_s": commit_s,
        "accepted_hist": accepted_hist,
        "accepted": accepted,
        "drafted": drafted,
    }


def divergence(
    model: HybridLM, prompt: list[int], plain: list[int], spec: list[int]
) -> dict[str, Any]:
    """Where bf16 plain and speculative output first differ, and the target's top-2 logit gap
    there (one fresh forward over the common prefix): a near-tie flipped by rounding, or not."""
    i = next(j for j, (a, b) in enumerate(zip(plain, spec, strict=False)) if a != b)
    ids = torch.tensor([*prompt, *plain[:i]])
    logits = model(ids, [model.new_cache(len(ids))], [len(ids)]).logits[-1]
    top = torch.topk(logits, 2).values
    return {"token": i, "top2_gap": round(float(top[0] - top[1]), 4)}


def main() -> None:
    host = machine()  # at the start: the code recorded is the code measured
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out-scale", type=float, default=0.04)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument(
        "--gguf",
        nargs="?",
        const="Q4_K_M",
        metavar="TYPE",
        help="run the model from a qwen35 GGUF of TYPE (default Q4_K_M) on its own blocks "
        "(--dtype gguf); writes hybrid-gguf.*",
    )
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen35")
    ap.add_argument(
        "--engine",
        action="store_true",
        help="with --gguf: also MTP with the cost model through the engine at concurrency 1 "
        "and 4 against speculation off",
    )
    ap.add_argument("--engine-rounds", type=int, default=4, help="--engine's rounds")
    ap.add_argument("--name", help="results name (default hybrid[-gguf][-SHAPE])")
    args = ap.parse_args()
    config, arch, shape = SHAPES[args.shape]
    torch.manual_seed(0)
    t = time.perf_counter()
    written: dict[str, Any] | None = None
    lm: LoadedModel | None = None
    if args.gguf is None:
        model, head, params, head_params = build(args.out_scale, config)
    else:  # the directory goes at exit: the model maps its file until then
        directory = Path(tempfile.mkdtemp(prefix="quickdraft-hybrid-gguf-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        model, head, params, head_params, written, lm = build_gguf(
            args.out_scale, args.gguf, directory, config, arch
        )
    build_s = time.perf_counter() - t
    drafter = MTPDrafter(head, model.get_submodule("model.norm"))
    k = args.k

    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    generate(model, drafter, prompts[0][:16], 8, k)  # warm-up: allocator, kernels
    generate(model, None, prompts[0][:16], 8, k)
    speed = decode_vs_verify(model, k, context=256, reps=args.reps)
    speed |= gemm_ratio(model, k + 1, args.reps)
    commits = commit_costs(model, k)
    step_s = speed["decode_ms"] / 1e3

    divergences: list[dict[str, Any]] = []
    plain_s = spec_s = 0.0
    plain_n = spec_n = 0
    identical = 0
    hist = [0] * (k + 1)
    draft_s, verify_s, commit_s = [], [], []
    cycles = accepted = drafted = 0
    for prompt in prompts:  # plain and MTP alternate, prompt by prompt
        plain = generate(model, None, prompt, args.tokens, k)
        spec = generate(model, drafter, prompt, args.tokens, k)
        plain_s += plain["decode_s"]
        plain_n += plain["tokens_after_first"]
        spec_s += spec["decode_s"]
        spec_n += spec["tokens_after_first"]
        identical += plain["output"] == spec["output"]
        if plain["output"] != spec["output"]:
            divergences.append(divergence(model, prompt, plain["output"], spec["output"]))
        hist = [a + b for a, b in zip(hist, spec["accepted_hist"], strict=True)]
        draft_s += spec["draft_s"]
        verify_s += spec["verify_s"]
        commit_s += spec["commit_s"]
        cycles += spec["cycles"]
        accepted += spec["accepted"]
        drafted += spec["drafted"]
    cycle_ms = median_ms([a + b + c for a, b, c in zip(draft_s, verify_s, commit_s, strict=True)])
    full = sum(hist)
    cache = model.new_cache(args.prompt_len + args.tokens + k + 1)
    result = {
        "machine": host,
        "model": {
            "shape": f"{shape}, "
            + ("bf16" if written is None else f"GGUF {args.gguf}, bf16 activations"),
            "arch": arch,
            "params_m": round(params / 1e6, 1),
            "mtp_head_params_m": round(head_params / 1e6, 1),
            "weight_layout": layout(model),
            "layers": {"gdn": cache.shape.num_layers, "attention": model.num_attention_layers},
            "out_scale": args.out_scale,
            "build_s": round(build_s, 1),
            **({"gguf": written} if written is not None else {}),
        },
        "k": k,
        "decode_vs_verify": speed,
        "commit": {
            **commits,
            "share_of_cycle": round(statistics.median(commit_s) * 1e3 / cycle_ms, 5),
        },
        "cycle_ms": {
            "draft": median_ms(draft_s),
            "verify": median_ms(verify_s),
            "commit": median_ms(commit_s),
            "total": cycle_ms,
            "head_step_over_target_step": round(head_step_seconds(head) / step_s, 3),
        },
        "throughput": {
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "tokens": args.tokens,
            "plain_tok_s": round(plain_n / plain_s, 2),
            "mtp_tok_s": round(spec_n / spec_s, 2),
            "speedup": round((spec_n / spec_s) / (plain_n / plain_s), 3),
            "mean_acceptance_length": round(1 + accepted / cycles, 3),
            "acceptance_rate": round(accepted / max(1, drafted), 3),
            "accepted_histogram": hist,
            "full_k_cycles": full,
            "identical_outputs": f"{identical}/{len(prompts)}",
            "divergences": divergences,
        },
        # through the engine with the cost model (GGUF runs: a LoadedModel to serve)
        **(
            {"engine": engine_rows(lm, k, prompts, args.tokens, args.engine_rounds)}
            if lm is not None and args.engine
            else {}
        ),
        "memory": {
            # committed + spare slot (a prompt chunk's final state)
            "gdn_state_mb_per_seq": round((cache.ssm.nbytes + cache.conv.nbytes) / 2**20, 2),
            "checkpoint_kb_per_seq": round(
                sum(t.nbytes for t in (cache.cp_inputs, cache.cp_k, cache.cp_d, cache.cp_g)) / 1024,
                1,
            ),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        },
    }
    name = args.name or ("hybrid" if written is None else "hybrid-gguf") + (
        "" if args.shape == "qwen35" else f"-{args.shape}"
    )
    write(name, result, markdown(result), plot(result), figsize=(13, 4))


def layout(model: HybridLM) -> str:
    if isinstance(model.head, GGUFWeight):
        return "GGUF blocks"
    return "panels" if isinstance(model.head, PanelWeight) else "rows"


def markdown(result: dict[str, Any]) -> str:
    model, speed, cycle, tp = (
        result["model"],
        result["decode_vs_verify"],
        result["cycle_ms"],
        result["throughput"],
    )
    k = result["k"]
    head = (
        f"Hybrid (Gated DeltaNet) target + MTP self-speculation, k = {k}, on a random-weight "
        f"model of real shape ({model['shape']}; {model['params_m']}M params, MTP head "
        f"{model['mtp_head_params_m']}M, {model['weight_layout']} layout); acceptance is "
        f"staged (out_scale {model['out_scale']}), the compute is real.\n\n"
    )
    if "gguf" in model:
        g = model["gguf"]
        formats = ", ".join(f"{n} {k}" for k, n in g["tensors_by_format"].items())
        head += (
            f"Run from a {model.get('arch', 'qwen35')} GGUF of those weights ({g['format']}, "
            f"{g['file_mb']} MB, written by {g['writer']}; tensors: {formats}) on its own "
            "blocks (`--dtype gguf`), the MTP head from its `blk.N.nextn.*` tensors.\n\n"
        )
    figures = table(
        ["figure", "value"],
        [
            ["plain tok/s", tp["plain_tok_s"]],
            ["MTP tok/s", tp["mtp_tok_s"]],
            ["speedup", f"{tp['speedup']}x"],
            ["mean acceptance length", tp["mean_acceptance_length"]],
            ["acceptance rate", tp["acceptance_rate"]],
            ["identical outputs", tp["identical_outputs"]],
            [f"forward, 1 row / {k + 1} rows (ms)", f"{speed['decode_ms']} / {speed['verify_ms']}"],
            [f"forward, {k + 1} rows over 1", f"{speed['verify_over_decode']}x"],
            [
                f"weight GEMMs, 1 row / {k + 1} rows (ms)",
                f"{speed['gemm_decode_ms']} / {speed['gemm_verify_ms']}",
            ],
            [f"weight GEMMs, {k + 1} rows over 1", f"{speed['gemm_verify_over_decode']}x"],
            [
                "cycle: draft / verify / commit / total (ms)",
                f"{cycle['draft']} / {cycle['verify']} / {cycle['commit']} / {cycle['total']}",
            ],
            ["commit share of a cycle", result["commit"]["share_of_cycle"]],
            ["MTP head step over target step", cycle["head_step_over_target_step"]],
            ["GDN state per sequence (MB)", result["memory"]["gdn_state_mb_per_seq"]],
        ],
    )
    commits = table(
        ["accepted", "commit (us)", "deferred state update (ms)"],
        [
            [i, us, ms]
            for i, (us, ms) in enumerate(
                zip(
                    result["commit"]["commit_us_by_accepted"],
                    result["commit"]["apply_update_ms_by_accepted"],
                    strict=True,
                )
            )
        ],
    )
    rows = ""
    if "engine" in result:
        rows = "\n" + table(
            [
                "concurrency",
                "requests",
                "off tok/s",
                "MTP (cost model) tok/s",
                "speedup",
                "paired (each round's ratio)",
                "drafted rows a step",
                "identical",
            ],
            [
                [
                    c,
                    e["requests"],
                    e["off_tok_s"],
                    e["mtp_policy_tok_s"],
                    f"{e['speedup']}x",
                    f"{e['paired_speedup']}x {e['round_ratios']}",
                    e["drafted_per_step"],
                    e["identical_outputs"],
                ]
                for c, e in result["engine"].items()
            ],
        )
    return head + figures + "\n" + commits + rows


def plot(result: dict[str, Any]) -> Any:
    """Three panels: tok/s plain vs MTP; 1-row vs (k + 1)-row cost of the forward and of its
    weight GEMMs; how many drafts full-k cycles accepted."""
    speed, tp, k = result["decode_vs_verify"], result["throughput"], result["k"]
    panels = [
        ("Greedy decode", "tok/s", ["plain", "MTP"], {"": [tp["plain_tok_s"], tp["mtp_tok_s"]]}),
        (
            "Decode vs verify",
            "ms",
            ["forward", "weight GEMMs"],
            {
                "1 row": [speed["decode_ms"], speed["gemm_decode_ms"]],
                f"{k + 1} rows": [speed["verify_ms"], speed["gemm_verify_ms"]],
            },
        ),
        (
            f"Accepted drafts per cycle (k = {k})",
            "cycles",
            [str(i) for i in range(k + 1)],
            {"": tp["accepted_histogram"]},
        ),
    ]

    def draw(fig: Any) -> None:
        for ax, panel in zip(fig.subplots(1, len(panels)), panels, strict=True):
            bars(ax, *panel)

    return draw


if __name__ == "__main__":
    main()
