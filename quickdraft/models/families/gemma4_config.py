"""Gemma 4's text config (`gemma4_text`, or the `text_config` of `gemma4` and
`gemma4_assistant`) as models/families/gemma4.py reads it: the per-layer shapes (head sizes, KV
heads, which layer's KV each layer attends to) resolved once from either spelling transformers has
used (`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from quickdraft.config import ModelConfig, read_hf_config

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True, slots=True)
class Gemma4Config(ModelConfig):
    sliding_window: int = 0  # keys a local layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer: "sliding_attention" | "full_attention"
    head_dims: tuple[int, ...] = ()  # per layer
    kv_heads: tuple[int, ...] = ()  # per layer
    attention_k_eq_v: bool = False  # global layers: values are the keys' projection
    rope_local_theta: float = 10000.0
    rope_partial: float = 1.0  # global layers: the rotated fraction of the frequencies
    final_logit_softcapping: float = 0.0  # 0: none
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    ple_size: int = 0  # hidden_size_per_layer_input (0: no per-layer embeddings)
    ple_vocab: int = 0  # vocab_size_per_layer_input
    moe: bool = False  # enable_moe_block: routed experts beside every layer's MLP
    # per layer, the TARGET layer whose KV it reads (an assistant drafter, all layers); ():
    # from num_kv_shared_layers
    kv_sources: tuple[int, ...] = ()
    # use_bidirectional_attention "vision": an image's rows see each other both ways in the
    # local layers (the 26B-A4B and 31B; causal in E2B / E4B)
    two_way_images: bool = False
    pad_token_id: int = 0  # what an image row's per-layer input is looked up as

    @classmethod
    def from_hf(cls, path: str | Path) -> Gemma4Config:
        return cls.from_dict(*read_hf_config(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], gen: dict[str, Any] | None = None) -> Gemma4Config:
        full = raw
        raw = {**raw, **(raw.get("text_config") or {})}
        if raw.get("use_bidirectional_attention") == "all":
            raise ValueError("gemma4: bidirectional attention is not supported")
        n = int(raw["num_hidden_layers"])
        types = list(
            raw.get("layer_types")
            or [SLIDING if (i + 1) % 6 else FULL for i in range(n)]  # transformers' default
        )
        if len(types) != n:
            raise ValueError(f"gemma4: {len(types)} layer_types for {n} layers")
        types[-1] = FULL  # transformers forces it
        params = raw.get("rope_parameters") or {}
        glob, local = params.get(FULL, {}), params.get(SLIDING, {})
        for kind in (glob.get("rope_type", "proportional"), local.get("rope_type", "default")):
            if kind not in ("default", "proportional"):
                raise ValueError(f"gemma4: rope type {kind!r} is not supported")
        if float(glob.get("factor", 1.0)) != 1.0:
            raise ValueError(f"gemma4: rope factor {glob['factor']} is not supported")
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or 256)
        kv = int(raw.get("num_key_value_heads") or heads)
        k_eq_v = bool(raw.get("attention_k_eq_v", False))
        overrides = {int(i): o for i, o in (raw.get("per_layer_config") or {}).items()}
        if not overrides:  # the released configs: the global layers' shape in two fields
            over: dict[str, int] = {"head_dim": int(raw.get("global_head_dim") or 512)}
            if k_eq_v and raw.get("num_global_key_value_heads"):
                over["num_key_value_heads"] = int(raw["num_global_key_value_heads"])
            overrides = {i: over for i, t in enumerate(types) if t == FULL}
        head_dims = tuple(int(overrides.get(i, {}).get("head_dim", head_dim)) for i in range(n))
        kv_heads = tuple(int(overrides.get(i, {}).get("num_key_value_heads", kv)) for i in range(n))
        shared = int(raw.get("num_kv_shared_layers") or 0)
        moe = bool(raw.get("enable_moe_block", False))
        cap = raw.get("final_logit_softcapping")
        plain = {
            **raw,
            "model_type": full.get("model_type", "gemma4_text"),
            "text_config": None,
            "head_dim": head_dim,
            "rope_parameters": {"rope_theta": glob.get("rope_theta", 1e6)},
            "num_experts": raw.get("num_experts") if moe else 0,
            "num_experts_per_tok": raw.get("top_k_experts") if moe else 0,
            "tie_word_embeddings": raw.get("tie_word_embeddings", True),
        }
        base = ModelConfig.from_dict(plain, gen)
        return cls(
            **{f.name: getattr(base, f.name) for f in fields(ModelConfig)},
            sliding_window=int(raw.get("sliding_window") or 0),
            layer_types=tuple(types),
            head_dims=head_dims,
            kv_heads=kv_heads,
            attention_k_eq_v=k_eq_v,
            rope_local_theta=float(local.get("rope_theta", 10000.0)),
            rope_partial=float(glob.get("partial_rotary_factor", 1.0)),
            final_logit_softcapping=float(cap or 0.0),
            num_kv_shared_layers=shared,
            use_double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
            ple_size=int(raw.get("hidden_size_per_layer_input") or 0),
            ple_vocab=int(raw.get("vocab_size_per_layer_input") or 0),
            moe=moe,
            two_way_images=raw.get("use_bidirectional_attention") == "vision",
            pad_token_id=int(raw.get("pad_token_id") or 0),
        )

    @property
    def first_shared(self) -> int:
        """The first layer that reads an earlier layer's KV (num_hidden_layers: none)."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def store_layer(self, kind: str) -> int:
        """The last layer of type `kind` that computes its own KV: the one the shared layers
        of that type (and an assistant drafter) read."""
        own = [i for i in range(self.first_shared) if self.layer_types[i] == kind]
        if not own:
            raise ValueError(f"gemma4: no {kind} layer computes KV before the shared ones")
        return own[-1]

    @property
    def kv_source(self) -> tuple[int, ...]:
        """Per layer, the layer whose KV it attends to (itself, or its type's store layer)."""
        if self.kv_sources:
            return self.kv_sources
        return tuple(
            i if i < self.first_shared else self.store_layer(t)
            for i, t in enumerate(self.layer_types)
        )
