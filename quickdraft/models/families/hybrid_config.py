"""Configuration and checkpoint layout of the hybrid Gated-DeltaNet family (Qwen3-Next, Qwen3.5,
Qwen3.5-MoE): the frozen config record read from config.json, and the map from checkpoint
tensor names onto the parameters of models/families/qwen3_next.py.

Contract: `HybridConfig.from_hf(dir)` reads config.json (+ generation_config.json); composite
vision-language configs (`qwen3_5`, `qwen3_5_moe`) keep the language model in `text_config`.
`checkpoint_name_map(cfg)` returns name -> (parameter name, index into it) or None (skip).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quickdraft.config import ModelConfig, read_hf_config

HYBRID_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """What the hybrid model needs. Field names follow Hugging Face's text config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # int(head_dim * partial_rotary_factor)
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    interleaved_qkvz: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba (grouped per key head)
    intermediate_size: int  # dense MLP width (0 when every layer is MoE)
    moe_layers: tuple[bool, ...]  # per layer: sparse MoE block instead of the dense MLP
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    mtp_num_hidden_layers: int  # `mtp_num_hidden_layers` / `num_nextn_predict_layers`, else 0
    # Qwen3.5's interleaved M-RoPE: rotary frequencies per (t, h, w) stream; () for Qwen3-Next
    mrope_section: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # the text config

    @classmethod
    def from_hf(cls, path: str | Path) -> HybridConfig:
        return cls.from_dict(*read_hf_config(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], gen: dict[str, Any] | None = None) -> HybridConfig:
        """`raw` is config.json; composite (vision-language) configs keep the language model's
        fields in `text_config`, top-level keys fill what the text config lacks."""
        gen = gen or {}
        model_type = raw.get("model_type", "")
        text = {**raw, **raw.get("text_config", {})}
        layers = int(text["num_hidden_layers"])
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported yet (model {model_type})")
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(layers)
            ]
        unknown = set(layer_types) - {"linear_attention", "full_attention"}
        if unknown or len(layer_types) != layers:
            raise ValueError(f"bad layer_types for {layers} layers: {layer_types}")
        experts = int(text.get("num_experts") or 0)
        sparse_step = int(text.get("decoder_sparse_step") or 1)
        mlp_only = set(text.get("mlp_only_layers") or ())
        eos = gen.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        mtp = text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0))
        return cls(
            model_type=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=layers,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            # the top-level model (ForConditionalGeneration) owns lm_head: its flag wins
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            attention_bias=bool(text.get("attention_bias", False)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            interleaved_qkvz=model_type == "qwen3_next",
            intermediate_size=int(text.get("intermediate_size") or 0),
            moe_layers=tuple(
                experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0
                for i in range(layers)
            ),
            num_experts=experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            mtp_num_hidden_layers=int(mtp or 0),
            mrope_section=tuple(rope.get("mrope_section") or (11, 11, 10))
            if model_type.startswith("qwen3_5")
            else (),
            eos_token_ids=eos_ids,
            bos_token_id=gen.get("bos_token_id", text.get("bos_token_id")),
            extra=text,
        )


# A checkpoint tensor name -> (our parameter name, index into it), or None to skip the tensor.
NameMap = Callable[[str], tuple[str, tuple[int | slice, ...]] | None]

_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def checkpoint_name_map(cfg: HybridConfig | ModelConfig) -> NameMap:
    """Composite Qwen3.5 / Qwen2.5-VL checkpoints prefix the language model with
    `model.language_model.` and carry a vision tower (`model.visual.`, or `visual.` in the
    original Qwen2.5-VL release; skipped: models/formats/loader.py `load_vision` loads it);
    Qwen3-Next and Qwen3-MoE checkpoints store one tensor per expert, which go into the fused
    `experts.gate_up_proj` / `down_proj`."""
    inter = cfg.moe_intermediate_size

    def target(name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        if name.startswith(("model.visual.", "visual.")):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            return name, ()
        prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
        if kind == "down":
            return f"{prefix}.down_proj", (expert,)
        rows = slice(0, inter) if kind == "gate" else slice(inter, 2 * inter)
        return f"{prefix}.gate_up_proj", (expert, rows)

    return target
