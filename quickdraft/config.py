"""Frozen configuration records.

`ModelConfig.from_hf` reads a Hugging Face `config.json` (+ `generation_config.json`) into the
fields our model code uses; nothing else in the package parses config files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quickdraft.request import RelaxedThinking

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}


# "gguf": a GGUF model's own quantized weights (no dequantize step), activations and KV cache
# in bf16; for a Hugging Face directory, its weights in bf16
GGUF_DTYPE = "gguf"


def parse_dtype(name: str) -> torch.dtype:
    """The activation dtype a --dtype name runs in ("gguf": bf16)."""
    if name == GGUF_DTYPE:
        return torch.bfloat16
    try:
        return DTYPES[name]
    except KeyError:
        choices = sorted([*DTYPES, GGUF_DTYPE])
        raise ValueError(f"unknown dtype {name!r}; choose one of {choices}") from None


def read_hf_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json or {}) of a model directory."""
    path = Path(path)
    raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen: dict[str, Any] = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    return raw, gen


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the dense decoder (models/families/llama.py) needs. Field names follow Hugging Face."""

    # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "qwen2_5_vl" (see models/registry.py)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # Qwen3-MoE: routed experts in place of the MLP on the layers marked in `moe_layers`
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Qwen2.5-VL: the rotary half-dims in contiguous (t, h, w) chunks (() = text only)
    mrope_section: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # the raw config.json

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for EOS ids) from a model dir."""
        return cls.from_dict(*read_hf_config(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], gen: dict[str, Any] | None = None) -> ModelConfig:
        gen = gen or {}
        full = raw
        model_type = raw.get("model_type", "")
        # a vision-language config (Qwen2.5-VL) keeps the language model in `text_config`
        # (transformers 5 writes it so; the original release has it at the top level)
        raw = {**raw, **(raw.get("text_config") or {})}
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        mrope = tuple(int(s) for s in rope.get("mrope_section") or ())
        if rope_type == "mrope" or mrope:  # M-RoPE is default RoPE over three position streams
            rope_type = "default"
        if rope_type not in ("default", None):
            # Scaled RoPE variants change logits beyond the native context; refuse rather
            # than silently produce different text from the reference.
            raise ValueError(f"rope type {rope_type!r} is not supported yet (model {model_type})")
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        eos = gen.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        layers, experts = int(raw["num_hidden_layers"]), int(raw.get("num_experts") or 0)
        sparse_step = int(raw.get("decoder_sparse_step") or 1)
        mlp_only = set(raw.get("mlp_only_layers") or ())
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=int(raw.get("intermediate_size") or 0),
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type in ("qwen2", "qwen2_5_vl"))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe_layers=tuple(
                experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0
                for i in range(layers)
            ),
            num_experts=experts,
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            eos_token_ids=eos_ids,
            bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
            mrope_section=mrope,
            extra=full,
        )


# ---------------------------------------------------------------- defaults (the one source)
# Everything that has a default a user can override lives here or in the dataclass that owns it
# (SpeculativeConfig, SamplingParams, SchedulerConfig, ServerConfig, the bench options): the CLI,
# the server settings, the benchmarks and the load test pass None for what they were not told,
# and never restate a default.

DEFAULT_MODEL = "qwen2.5-coder-1.5b"  # `quickdraft serve` / `generate` / `bench` with no model
# catalog target -> its packaged draft model (same tokenizer): what `serve` and `bench` draft with
# when not told otherwise
DEFAULT_DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}
DEFAULT_DTYPE = GGUF_DTYPE
DEFAULT_NUM_DRAFT_TOKENS = 5  # the draft length ceiling k
BENCH_MAX_TOKENS = 128  # output tokens per request in the benchmarks
PREFILL_CHUNK = 512  # prompt tokens per forward: bounds the [chunk, context] mask and activations
RESPONSES_STORE_MB = 256  # the Responses API's stored responses (server/responses_store.py)

SPEC_METHODS = (
    "none",
    "ngram",
    "suffix",
    "draft",
    "mtp",
    "eagle3",
    "dflash",
    "assistant",
    "adaptive",
)
# method "adaptive": the drafters a request may pick among (speculation/adaptive.py); those
# that read the target's hidden states (mtp, eagle3, dflash) need every committed row and are not
# offered yet
ADAPTIVE_DRAFTERS = ("ngram", "suffix", "draft")
# relaxed thinking-phase acceptance where a flag or request turns it on without numbers:
# drafts among the row's 8 largest logits and within 1.0 of its argmax (speculation/relaxed.py)
RELAXED_TOP_K, RELAXED_DELTA = 8, 1.0
# weight formats `load(..., quantization=)` accepts: "gguf" the model's GGUF's own (as dtype
# "gguf"), "none" the dtype's, int8 / int4 made from the dequantized weights
QUANTIZATIONS = ("gguf", "none", "int8", "int4")
# draft-model weights where the CLI and benchmarks are not told otherwise: same output, faster
# drafts (docs/benchmarks.md: draft vs draft_unquantized)
DEFAULT_DRAFT_QUANTIZATION = "int4"
# token ids a draft model's head scores: the first N of the vocabulary (a BPE vocabulary lists
# its tokens in merge order, roughly the most frequent first) plus the end-of-generation ids;
# the rest are never drafted (the target still decides every token). 0: the whole vocabulary,
# the default: for the Qwen2.5 0.5B/1.5B pair no cut paid (docs/speculation.md, "A draft
# model's vocabulary"); it is for drafts whose head is a large share of their bytes.
DEFAULT_DRAFT_VOCAB = 0
# output tokens the n-gram drafter's shared index keeps (~300 requests of 200 tokens, ~25 MB of
# index at most); 0 turns it off
NGRAM_SHARED_TOKENS = 1 << 16
# n-gram lengths the drafter matches, longest first (docs/speculation.md says why from 1)
NGRAM_MIN, NGRAM_MAX = 1, 4
# suffix drafter (drafters/suffix.py; SuffixDecoding's defaults): the longest substring its
# trees hold, the draft length per matched token (a match of m tokens drafts at most
# floor(factor x m)), and the path probability below which a draft stops
SUFFIX_MAX_DEPTH = 64
SUFFIX_MAX_SPEC_FACTOR = 1.0
SUFFIX_MIN_TOKEN_PROB = 0.1
# output tokens of finished requests its shared trees keep, all tenants together; 0 turns
# them off
SUFFIX_SHARED_TOKENS = 1 << 16
DRAFT_QUANTIZATION_HELP = (
    f"draft model weights: gguf (its GGUF's own formats), int4 (groups of 32, 0.31x the bytes "
    f"of bf16), int8 (0.5x) or none (the target's dtype); default {DEFAULT_DRAFT_QUANTIZATION}. "
    "A draft model's precision only moves the acceptance rate, never the output. On a GPU "
    "the draft model runs in the target's dtype (these formats are CPU kernels). int8 / int4 "
    "also quantize an MTP head trained by train-drafter (gguf / none: bf16)"
)


def cache_dir() -> Path:
    """Where downloads, converted models and the kernel build live: $QUICKDRAFT_HOME, else
    ~/.cache/quickdraft; read at call time (tests and CI may set it late)."""
    return Path(os.environ.get("QUICKDRAFT_HOME") or Path.home() / ".cache" / "quickdraft")


def given(**fields: Any) -> dict[str, Any]:
    """The fields that were given (not None): `Config(**given(a=args.a, ...))` keeps the
    dataclass's own default for everything a caller was not told."""
    return {k: v for k, v in fields.items() if v is not None}


def require_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How a request speculates. `num_draft_tokens` is the ceiling; the adaptive policy
    (speculation/policy.py) picks k <= it per cycle, down to 0 (no drafting) when it cannot pay."""

    # "none" | "ngram" | "suffix" | "draft" | "mtp" (the target's own head) | "eagle3" |
    # "dflash" | "assistant" (a Gemma 4 target's assistant model)
    method: str = "none"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    # catalog name / path, for method "draft"; the DFlash checkpoint dir for "dflash"; the
    # EAGLE-3 head for "eagle3"; for "mtp" a standalone head dir (train-drafter --kind mtp;
    # None: the target's own head) or, as vLLM reads it, a Gemma 4 assistant; the assistant dir
    # for "assistant"
    draft_model: str | None = None
    # the draft model's weights (DRAFT_QUANTIZATION_HELP); "none" keeps the target's dtype
    draft_quantization: str = DEFAULT_DRAFT_QUANTIZATION
    # token ids the draft model or a learned head (MTP, EAGLE-3, DFlash) scores when it has no
    # draft vocabulary of its own (DEFAULT_DRAFT_VOCAB); 0: all
    draft_vocab: int = DEFAULT_DRAFT_VOCAB
    ngram_min: int = NGRAM_MIN
    ngram_max: int = NGRAM_MAX
    # n-gram drafter: most recent output tokens of finished requests it also looks up (0: off)
    ngram_shared_tokens: int = NGRAM_SHARED_TOKENS
    # suffix drafter: tree depth, draft tokens per matched token, the draft's probability floor,
    # and the output tokens of finished requests its shared trees keep (0: off)
    suffix_max_depth: int = SUFFIX_MAX_DEPTH
    suffix_max_spec_factor: float = SUFFIX_MAX_SPEC_FACTOR
    suffix_min_token_prob: float = SUFFIX_MIN_TOKEN_PROB
    suffix_shared_tokens: int = SUFFIX_SHARED_TOKENS
    # DFlash drafter: rows of its block (drafts per forward + 1; 0: the checkpoint's, capped by
    # k + 1) and the committed tokens its context keeps (0: all of them)
    dflash_block_size: int = 0
    dflash_window: int = 0
    adaptive: bool = True
    # method "adaptive": the drafters it picks among per request (ADAPTIVE_DRAFTERS; "draft"
    # needs `draft_model`); (): ngram and suffix, and draft when a draft model is given
    adaptive_drafters: tuple[str, ...] = ()
    # relaxed (lossy) acceptance inside reasoning blocks for this model's requests, unless a
    # request says otherwise (SamplingParams.relaxed_thinking); None: strict, the default
    relaxed_thinking: RelaxedThinking | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r}: choose one of {SPEC_METHODS}")
        if not 0 <= self.num_draft_tokens <= 32:
            raise ValueError(f"num_draft_tokens must be in [0, 32], got {self.num_draft_tokens}")
        if self.method == "adaptive":
            unknown = [d for d in self.adaptive_drafters if d not in ADAPTIVE_DRAFTERS]
            if unknown:
                raise ValueError(
                    f"adaptive drafters {unknown}: choose among {list(ADAPTIVE_DRAFTERS)}"
                )
            if "draft" in self.adaptive_drafters and not self.draft_model:
                raise ValueError("adaptive drafter 'draft' needs a draft model (--draft-model)")
            if not self.adaptive:
                raise ValueError("method 'adaptive' prices drafters: it needs the adaptive policy")
        if self.method in ("draft", "dflash", "assistant") and not self.draft_model:
            raise ValueError(
                f"speculative method {self.method!r} needs a draft model (--draft-model)"
            )
        if self.draft_quantization not in QUANTIZATIONS:
            raise ValueError(
                f"draft quantization {self.draft_quantization!r}: choose one of {QUANTIZATIONS}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0: all), got {self.draft_vocab}")
        if self.ngram_shared_tokens < 0:
            raise ValueError(f"ngram_shared_tokens must be >= 0, got {self.ngram_shared_tokens}")
        if self.suffix_max_depth < 2:
            raise ValueError(f"suffix_max_depth must be >= 2, got {self.suffix_max_depth}")
        if not self.suffix_max_spec_factor > 0:
            raise ValueError(
                f"suffix_max_spec_factor must be > 0, got {self.suffix_max_spec_factor}"
            )
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ValueError(
                f"suffix_min_token_prob must be in [0, 1], got {self.suffix_min_token_prob}"
            )
        if self.suffix_shared_tokens < 0:
            raise ValueError(f"suffix_shared_tokens must be >= 0, got {self.suffix_shared_tokens}")
        if self.dflash_block_size < 0 or self.dflash_block_size == 1:
            raise ValueError(
                f"dflash_block_size must be >= 2 (0: the checkpoint's), "
                f"got {self.dflash_block_size}"
            )
        if self.dflash_window < 0:
            raise ValueError(f"dflash_window must be >= 0 (0: all), got {self.dflash_window}")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_draft_tokens > 0

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafter methods this config speculates with: one, or an adaptive set."""
        if self.method != "adaptive":
            return (self.method,)
        if self.adaptive_drafters:
            return self.adaptive_drafters
        return ("ngram", "suffix", "draft") if self.draft_model else ("ngram", "suffix")


@dataclass(frozen=True, slots=True)
class PrefixCacheConfig:
    """The prefix cache each served model keeps (engine/prefix_cache.py, docs/prefix_cache.md):
    the KV of whole token blocks earlier requests computed, matched at admission."""

    enabled: bool = True
    block_size: int = 16  # tokens per cached block: the granularity of a match
    # memory budget in GB (10^9 bytes) per model; None: min(25 % of the RAM available when the
    # engine starts, 8 GB)
    max_gb: float | None = None
    # hybrid (recurrent) targets: a state snapshot every N blocks; a hit resumes from the
    # deepest one, and prompt chunks end at these boundaries
    snapshot_every: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"prefix cache block_size must be >= 1, got {self.block_size}")
        if self.max_gb is not None and not self.max_gb >= 0:
            raise ValueError(f"prefix cache budget must be >= 0 GB, got {self.max_gb}")
        if self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1 block, got {self.snapshot_every}")


# vLLM `--speculative-config` keys -> ours; vLLM's method names -> ours
_VLLM_SPEC_KEYS = {
    "method": "method",
    "model": "draft_model",
    "num_speculative_tokens": "num_draft_tokens",
    "prompt_lookup_min": "ngram_min",
    "prompt_lookup_max": "ngram_max",
    "quantization": "draft_quantization",
    "draft_vocab_size": "draft_vocab",
    "suffix_decoding_max_tree_depth": "suffix_max_depth",
    "suffix_decoding_max_spec_factor": "suffix_max_spec_factor",
    "suffix_decoding_min_token_prob": "suffix_min_token_prob",
}
_VLLM_METHODS = {
    "draft_model": "draft",
    "ngram": "ngram",
    "suffix": "suffix",
    "draft": "draft",
    "mtp": "mtp",
    "eagle3": "eagle3",
    "dflash": "dflash",
    "assistant": "assistant",
}


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
