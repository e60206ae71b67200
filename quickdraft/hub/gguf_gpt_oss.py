"""gpt-oss GGUF files (llama.cpp's `gpt-oss` architecture) as Hugging Face's `gpt_oss`: the
config.json fields beyond the dense ones, and every HF tensor from the GGUF tensors llama.cpp's
converter wrote (conversion/gpt_oss.py there):
- HF's experts are stacked `gate_up_proj` [E, hidden, 2 inter] with gate and up interleaved
  (columns 2i, 2i + 1) and `down_proj` [E, inter, hidden]; llama.cpp split them into
  `ffn_gate_exps` / `ffn_up_exps` [E, inter, hidden] and transposed down to `ffn_down_exps`
  [E, hidden, inter], the biases likewise (`ffn_*_exps.bias`);
- the router is `ffn_gate_inp` (+ bias), the sinks `attn_sinks.weight`, the norm after
  attention `post_attention_norm`;
- YaRN: llama.cpp floors and ceils the correction range (HF's truncate=True), whatever the
  HF config said, so a converted file runs as llama.cpp runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from quickdraft.hub.errors import HubError
from quickdraft.hub.gguf_qwen import Planned, Planner

ARCH = "gpt-oss"


def gpt_oss_config(meta: Callable[..., Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json fields of a gpt-oss file beyond the dense ones in `cfg` (`meta(key, default,
    required=...)` reads `gpt-oss.key`)."""
    n = cfg["num_hidden_layers"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if meta("rope.scaling.type", "none") == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": cfg["rope_theta"],
            "factor": float(meta("rope.scaling.factor", required=True)),
            "original_max_position_embeddings": int(
                meta("rope.scaling.original_context_length", required=True)
            ),
            "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": True,
        }
    return {
        "intermediate_size": int(meta("expert_feed_forward_length", required=True)),
        "num_local_experts": int(meta("expert_count", required=True)),
        "num_experts_per_tok": int(meta("expert_used_count", required=True)),
        "sliding_window": int(meta("attention.sliding_window", required=True)),
        # llama.cpp's swa pattern 2: the even layers local
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        "rope_parameters": rope,
        "attention_bias": True,
        "swiglu_limit": 7.0,
    }


def _interleaved(dim: int) -> Callable[[list[Tensor]], Tensor]:
    """gate and up stacked along a new last axis, then merged: HF's columns 2i (gate), 2i + 1
    (up) along `dim` once moved there."""

    def build(ts: list[Tensor]) -> Tensor:
        both = torch.stack(ts, dim=-1)  # [..., inter, (hidden,) 2]
        if dim == 2:  # weights [E, inter, hidden, 2] -> [E, hidden, inter, 2] -> [E, hidden, 2I]
            both = both.transpose(1, 2)
        return both.reshape(*both.shape[:-2], -1)

    return build


def gpt_oss_plan(shapes: dict[str, tuple[int, ...]], cfg: dict[str, Any]) -> list[Planned]:
    """Every HF tensor of a gpt-oss model (config.json `cfg`) from the GGUF tensors `shapes`
    (name -> torch-order shape); a HubError names a missing, misshapen or unexpected tensor."""
    p = Planner(shapes, ARCH)
    hidden, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    experts, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    p.add("model.embed_tokens.weight", (vocab, hidden), [("token_embd.weight", (vocab, hidden))])
    if "output.weight" in shapes:
        p.add("lm_head.weight", (vocab, hidden), [("output.weight", (vocab, hidden))])
    p.add("model.norm.weight", (hidden,), [("output_norm.weight", (hidden,))])
    for i in range(layers):
        blk, hf = f"blk.{i}.", f"model.layers.{i}."
        p.add(hf + "input_layernorm.weight", (hidden,), [(blk + "attn_norm.weight", (hidden,))])
        post: list[tuple[str, tuple[int, ...]]] = [(blk + "post_attention_norm.weight", (hidden,))]
        p.add(hf + "post_attention_layernorm.weight", (hidden,), post)
        for part, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            at = f"{hf}self_attn.{part}_proj."
            p.add(at + "weight", (rows, hidden), [(f"{blk}attn_{part}.weight", (rows, hidden))])
            p.add(at + "bias", (rows,), [(f"{blk}attn_{part}.bias", (rows,))])
        o = (hidden, heads * d)
        p.add(hf + "self_attn.o_proj.weight", o, [(blk + "attn_output.weight", o)])
        p.add(hf + "self_attn.o_proj.bias", (hidden,), [(blk + "attn_output.bias", (hidden,))])
        p.add(hf + "self_attn.sinks", (heads,), [(blk + "attn_sinks.weight", (heads,))])
        router = (experts, hidden)
        p.add(hf + "mlp.router.weight", router, [(blk + "ffn_gate_inp.weight", router)])
        p.add(hf + "mlp.router.bias", (experts,), [(blk + "ffn_gate_inp.bias", (experts,))])
        ex = hf + "mlp.experts."
        mat, vec = (experts, inter, hidden), (experts, inter)
        p.add(
            ex + "gate_up_proj",
            (experts, hidden, 2 * inter),
            [(blk + "ffn_gate_exps.weight", mat), (blk + "ffn_up_exps.weight", mat)],
            _interleaved(2),
        )
        p.add(
            ex + "gate_up_proj_bias",
            (experts, 2 * inter),
            [(blk + "ffn_gate_exps.bias", vec), (blk + "ffn_up_exps.bias", vec)],
            _interleaved(1),
        )
        down = (experts, hidden, inter)
        p.add(
            ex + "down_proj",
            (experts, inter, hidden),
            [(blk + "ffn_down_exps.weight", down)],
            lambda ts: ts[0].transpose(1, 2),
        )
        bias = (experts, hidden)
        p.add(ex + "down_proj_bias", bias, [(blk + "ffn_down_exps.bias", bias)])
    extra = sorted(set(shapes) - p.used)
    if extra:
        raise HubError(f"{ARCH} GGUF tensors with no place in the model: {extra[:8]}")
    return p.plan
