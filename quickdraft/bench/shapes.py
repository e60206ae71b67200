"""Random-weight models of real shapes for the benchmarks that have no real weights offline:
Qwen3.5-0.8B's language model (the hybrid Gated DeltaNet family, vocabulary cut to 32k), the
sparse MoE models' configs (Qwen3.6-35B-A3B, Qwen3-30B-A3B, gpt-oss-20b, Gemma-4-26B-A4B) and
their cuts, Gemma 4 E2B (and its file: `write_gemma4_e2b`) and the assistants of the 26B-A4B
and of E2B, and how weights are drawn (`init_`). bench/hybrid.py, bench/prefix_cache.py and the
vision set (quickdraft/bench/vision.py) build on them."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quickdraft.hub.gguf_write import (
    llama_cpp_tensors,
    q4_k_m_types,
    random_chunks,
    write_gguf_streamed,
)
from quickdraft.models.families.gemma4 import Gemma4LM
from quickdraft.models.families.gemma4_config import Gemma4Config

# Qwen3.5-0.8B's language model: hidden 1024; 24 layers = 18 GDN + 6 gated attention; 16 GDN
# heads of 128; 8 query / 2 KV heads of 256; MLP 3584; the vocabulary cut to 32k
HYBRID_CONFIG: dict[str, Any] = dict(
    model_type="qwen3_5_text",
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=24,
    full_attention_interval=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    intermediate_size=3584,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    mtp_num_hidden_layers=1,
)
WRITERS = ("o_proj", "out_proj", "down_proj")  # projections that write the residual stream


_ROPE = {"rope_type": "default", "partial_rotary_factor": 0.25}
# Sparse MoE models' released configs (Qwen3.6-35B-A3B shares Qwen3.5-35B-A3B's architecture)
MOE_REAL: dict[str, dict[str, Any]] = {
    "qwen35moe": dict(
        model_type="qwen3_5_moe_text",
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters={**_ROPE, "rope_theta": 1e7},
    ),
    "qwen3moe": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    # gpt-oss-20b: 24 layers alternating 128-key windows and full attention, 64 query / 8 KV
    # heads of 64 with sinks, 32 experts top 4 of 2880, YaRN
    "gpt-oss": dict(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_experts=32,
        num_local_experts=32,
        num_experts_per_tok=4,
        intermediate_size=2880,
        sliding_window=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": True,
            "original_max_position_embeddings": 4096,
        },
    ),
    # Gemma-4-26B-A4B's language model: 30 layers, 5 local (1024-key window, 8 KV heads of
    # 256) to 1 global (2 KV heads of 512, values = keys); 16 query heads; a GeGLU MLP of 2112
    # beside 128 experts top 8 of 704; soft-capped logits, the head tied
    "gemma4": dict(
        model_type="gemma4_text",
        vocab_size=262144,
        hidden_size=2816,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        attention_k_eq_v=True,
        intermediate_size=2112,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        num_experts_per_tok=8,
        moe_intermediate_size=704,
        sliding_window=1024,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1e6,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}
# what bench/moe.py cuts so that its random-weight files fit here (1.15 GiB and 0.47 GiB in
# Q4_K_M); bench/hybrid.py --shape qwen35moe runs the same cut
MOE_CUTS: dict[str, dict[str, Any]] = {
    "qwen35moe": dict(num_hidden_layers=8, num_experts=64, vocab_size=32000),
    "qwen3moe": dict(num_hidden_layers=4, num_experts=32, vocab_size=32000),
    # an F32 source of all 32 experts would take 32 GB per 8 layers: 8 experts, 4 layers
    "gpt-oss": dict(num_hidden_layers=4, num_experts=8, num_local_experts=8, vocab_size=32000),
    # one 5:1 period of layers (an F32 source of 128 experts takes 3 GB a layer): 32 experts
    "gemma4": dict(num_hidden_layers=6, num_experts=32, vocab_size=32000),
}


# the released gemma-4-26B-A4B-it-assistant's text config (its config.json): the target's
# attention shapes, window and RoPE, 4 query-only layers of its own widths
GEMMA4_ASSISTANT: dict[str, Any] = {
    **MOE_REAL["gemma4"],
    "hidden_size": 1024,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "num_kv_shared_layers": 4,
    "enable_moe_block": False,
}


# Gemma 4 E2B's language model, whole: 35 layers, 4 local (512-key window) to 1 global, 8
# query heads over 1 KV head (256 wide, 512 in the global layers); the last 20 layers read the
# KV of the last local / global layer before them and have an MLP twice as wide (12288 for
# 6144); per-layer embeddings of 256 a layer; vocabulary 262,144, the head tied. llama.cpp
# names a 35-layer gemma4 E2B; these widths give 4.65 B parameters with the K/V projections
# the sharing layers keep unused (llama-bench's count of a released E2B file,
# ggml-org/llama.cpp#22738), 4.63 B without them (our model, and the file we write)
GEMMA4_E2B: dict[str, Any] = {
    **MOE_REAL["gemma4"],
    "hidden_size": 1536,
    "intermediate_size": 6144,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "num_global_key_value_heads": None,
    "attention_k_eq_v": False,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    "num_kv_shared_layers": 20,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "enable_moe_block": False,
    "num_experts": None,
    "top_k_experts": None,
    "num_experts_per_tok": None,
    "moe_intermediate_size": None,
}

# the released gemma-4-E2B-it-assistant's text config as its published file shows it: 4
# query-only layers of hidden 256 over E2B's KV, read back to 1536 (llama.cpp's conversion:
# block_count 4, embedding_length 256, out 1536, 162 MB in f16); its MLP width 2048 is what
# those 81 M parameters leave beside the 262,144 x 256 tied table (inferred, not published).
# The head is centroid-masked: 2048 clusters of 128 ids, the top 32 scored (4096 ids).
GEMMA4_E2B_ASSISTANT: dict[str, Any] = {
    **GEMMA4_E2B,
    "hidden_size": 256,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "num_kv_shared_layers": 4,
    "use_double_wide_mlp": False,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
}


def write_gemma4_e2b(directory: Path) -> Path:
    """Gemma 4 E2B whole (`write_gemma4`)."""
    return write_gemma4(directory, "gemma4-e2b", GEMMA4_E2B)


def write_gemma4_26b_a4b(directory: Path) -> Path:
    """Gemma-4-26B-A4B whole, every layer, expert and id (`write_gemma4`; 16.8 GB)."""
    cfg = MOE_REAL["gemma4"]
    return write_gemma4(directory, "gemma4-full", {**cfg, "layer_types": cfg["layer_types"] * 5})


def write_gemma4(directory: Path, stem: str, cfg: dict[str, Any]) -> Path:
    """A Gemma 4 language model of config `cfg` as random blocks, typed as llama.cpp's
    quantizer types a tied Gemma 4 in Q4_K_M (hub/gguf_write.py `q4_k_m_types`), streamed to
    `directory`/`stem`-Q4_K_M.gguf (kept for later runs)."""
    path = directory / f"{stem}-Q4_K_M.gguf"
    if path.exists():
        return path
    model = Gemma4LM(Gemma4Config.from_dict(cfg), torch.bfloat16, "meta")
    tensors = llama_cpp_tensors(model.state_dict(), "gemma4", cfg)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    types = q4_k_m_types(shapes, cfg["num_hidden_layers"], tied=True)
    plan = {n: (shapes[n], types[n]) for n in shapes}

    def chunks(name: str, shape: tuple[int, ...], qtype: str) -> Iterator[np.ndarray]:
        if name == "rope_freqs.weight":  # the global layers' RoPE, values not weights
            yield tensors[name].numpy()
        elif name.endswith("layer_output_scale.weight"):  # scales the layer's whole stream
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            yield rng.uniform(0.8, 1.0, shape).astype(np.float32)
        else:
            yield from random_chunks(name, shape, qtype)

    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    write_gguf_streamed(tmp, "gemma4", cfg, plan, chunks)
    tmp.rename(path)
    return path


def init_(module: torch.nn.Module, seed: int, out_scale: float) -> None:
    """Unit-gain random weights (std fan_in^-0.5), unit-RMS embeddings, stable GDN decays.
    `out_scale` scales what the layers write into the residual stream: a small one makes the
    next token mostly what the token embedding alone predicts (how acceptance is staged)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                v = torch.rand(p.shape, generator=gen) * 2 - 1
            elif name.endswith("dt_bias"):
                v = torch.rand(p.shape, generator=gen)
            elif name.endswith("linear_attn.norm.weight"):
                v = torch.ones(p.shape)
            elif "norm" in name:
                v = torch.rand(p.shape, generator=gen) * 0.2 - 0.1  # (1 + w)
            elif name.endswith("embed_tokens.weight"):
                v = torch.randn(p.shape, generator=gen)
            else:
                v = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
                if any(w in name for w in WRITERS):
                    v *= out_scale
            p.copy_(v.to(p.dtype))
