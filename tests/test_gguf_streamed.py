"""GGUF files written without holding them (hub/gguf_write.py `write_gguf_streamed`, how
bench/moe.py writes a full-size MoE file): the bytes read back as written, the file loads in
quickdraft and in llama.cpp, and `q4_k_m_type` types every tensor as llama.cpp's quantizer
does (at widths where every K-quant applies)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)

from quickdraft.bench.shapes import GEMMA4_E2B, MOE_REAL, init_
from quickdraft.hub.gguf_write import (
    llama_cpp_tensors,
    q4_k_m_type,
    q4_k_m_types,
    random_chunks,
    write_gguf,
    write_gguf_streamed,
)
from quickdraft.loading import load
from quickdraft.models.families.gemma4 import Gemma4LM
from quickdraft.models.families.gemma4_config import Gemma4Config
from quickdraft.models.families.hybrid_config import HybridConfig
from quickdraft.models.families.qwen3_next import HybridLM

pytestmark = pytest.mark.usefixtures("home")

# Qwen3.6-35B-A3B's structure at widths of whole 256-value rows everywhere (so every Q4_K_M
# type applies); llama.cpp reads one head size for keys and values
CFG: dict[str, Any] = {
    **MOE_REAL["qwen35moe"],
    **dict(vocab_size=512, hidden_size=256, num_hidden_layers=8, num_experts=4),
    **dict(num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256),
    **dict(num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2),
    **dict(linear_num_value_heads=2, max_position_embeddings=512),
}


def tensors(device: str) -> dict[str, torch.Tensor]:
    model = HybridLM(HybridConfig.from_dict(CFG), torch.bfloat16, device)
    if device != "meta":
        init_(model, 0, 1.0)
    return llama_cpp_tensors(model.state_dict(), "qwen35moe", CFG)


def plan() -> dict[str, tuple[tuple[int, ...], str]]:
    blocks = CFG["num_hidden_layers"]
    return {
        n: (tuple(t.shape), q4_k_m_type(n, tuple(t.shape), blocks))
        for n, t in tensors("meta").items()
    }


def test_q4_k_m_rule_types_every_tensor_as_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp's quantizer on an F32 file: every tensor gets the type `q4_k_m_type` says
    (routers and norms F32, the head Q6_K, attn_v / attn_qkv / ffn_down* Q6_K on its layers)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import llama_cpp_quantize

    f32 = write_gguf(tmp_path / "f32.gguf", "qwen35moe", CFG, tensors("cpu"))
    q = tmp_path / "q4_k_m.gguf"
    llama_cpp_quantize(f32, q, "Q4_K_M", 2)
    theirs = {t.name: t.tensor_type.name for t in GGUFReader(str(q)).tensors}
    ours = {n: qtype for n, (_, qtype) in plan().items()}
    assert theirs == ours
    assert {"Q4_K", "Q6_K", "F32"} <= set(ours.values())


def test_streamed_file_reads_back_and_runs(tmp_path: Path) -> None:
    """Random blocks streamed tensor by tensor: the reader finds each tensor's bytes where
    the header says, equal to what was written; quickdraft runs the file in its blocks close
    to its dequantized values (the gguf package's decoders), and llama.cpp runs it too."""
    p = plan()
    path = write_gguf_streamed(tmp_path / "streamed.gguf", "qwen35moe", CFG, p, random_chunks)
    reader = GGUFReader(str(path))
    assert [t.name for t in reader.tensors] == list(p)
    for t in reader.tensors:
        shape, qtype = p[t.name]
        assert t.tensor_type.name == qtype
        written = np.concatenate(
            [c.reshape(-1).view(np.uint8) for c in random_chunks(t.name, shape, qtype)]
        )
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), written), t.name
    native = load(str(path), "gguf", progress=False)
    deq = load(str(path), "fp32", progress=False)
    ids = torch.tensor([1, 5, 9, 300, 42, 7])
    logits = []
    for lm in (native, deq):
        cache = lm.model.new_cache(16)  # type: ignore[attr-defined]
        logits.append(
            lm.model(ids, [cache], [len(ids)], logit_rows=torch.arange(len(ids))).logits.float()
        )  # type: ignore[operator]
    assert bool(torch.isfinite(logits[0]).all())
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1)
    assert float(cos.min()) > 0.98, cos
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import LlamaCpp

    run = LlamaCpp(path, 2, 64).generate(ids.tolist(), 4, ())
    assert len(run.tokens) == 4


# Gemma 4 E2B's structure (per-layer embeddings 8 x 256 wide, KV sharing, double-wide
# MLPs, a tied head) at widths of whole 256-value rows
GEMMA4_CFG: dict[str, Any] = {
    **GEMMA4_E2B,
    **dict(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=256),
    **dict(intermediate_size=256, num_hidden_layers=8, num_kv_shared_layers=3),
    **dict(hidden_size_per_layer_input=256, head_dim=256, global_head_dim=256),
    "layer_types": ["sliding_attention", "full_attention"] * 4,
    "max_position_embeddings": 512,
}


def gemma4_types(
    cfg: dict[str, Any], tmp_path: Path
) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, str]]:
    """A random Gemma 4 of `cfg` written F32 and quantized to Q4_K_M by llama.cpp: each
    tensor's shape, the type llama.cpp gave it, and the one `q4_k_m_types` (tied) says."""
    from quickdraft.bench.peers import llama_cpp_quantize

    model = Gemma4LM(Gemma4Config.from_dict(cfg), torch.bfloat16)
    init_(model, 0, 1.0)
    state = llama_cpp_tensors(model.state_dict(), "gemma4", cfg)
    f32 = write_gguf(tmp_path / "f32.gguf", "gemma4", cfg, state)
    q = tmp_path / "q4_k_m.gguf"
    llama_cpp_quantize(f32, q, "Q4_K_M", 2)
    theirs = {t.name: t.tensor_type.name for t in GGUFReader(str(q)).tensors}
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    return shapes, theirs, q4_k_m_types(shapes, cfg["num_hidden_layers"], tied=True)


def test_q4_k_m_rule_types_a_tied_gemma4_as_llama_cpp(tmp_path: Path) -> None:
    """A tied head: llama.cpp's quantizer gives both token tables (the per-layer one too) the
    head's Q6_K and leaves the per-layer model projection as it was, and places attn_v among
    the layers that have one; `q4_k_m_types(tied=True)` says the same for every tensor."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    _, theirs, ours = gemma4_types(GEMMA4_CFG, tmp_path)
    assert theirs == ours
    assert theirs["per_layer_token_embd.weight"] == theirs["token_embd.weight"] == "Q6_K"
    # attn_v by its place among the 5 layers that have one, not by its layer's of 8
    got = [ours[f"blk.{i}.attn_v.weight"] for i in range(5)]
    assert got == ["Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q6_K"]


def test_q4_k_m_rule_falls_back_as_llama_cpp_on_rows_of_32_value_blocks(tmp_path: Path) -> None:
    """Gemma-4-26B-A4B's structure (a GeGLU MLP of 96 beside experts of 64: rows that are
    not whole 256-value blocks): llama.cpp's quantizer falls back to Q5_0 / Q8_0 there, and
    `q4_k_m_types` says so for every tensor; random blocks of those types stream and load."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    cfg = {
        **MOE_REAL["gemma4"],
        **dict(vocab_size=512, hidden_size=256, intermediate_size=96, num_hidden_layers=8),
        **dict(num_experts=4, top_k_experts=2, num_experts_per_tok=2, moe_intermediate_size=64),
        **dict(num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1),
        **dict(head_dim=256, global_head_dim=256, max_position_embeddings=512),
        "layer_types": ["sliding_attention", "full_attention"] * 4,
    }
    shapes, theirs, ours = gemma4_types(cfg, tmp_path)
    assert theirs == ours
    assert {"Q5_0", "Q8_0"} <= set(ours.values())
    plan = {n: (shapes[n], ours[n]) for n in shapes}
    path = write_gguf_streamed(tmp_path / "streamed.gguf", "gemma4", cfg, plan, random_chunks)
    lm = load(str(path), "gguf", progress=False)
    ids = torch.tensor([1, 5, 9, 300])
    logits = lm.model(ids, [lm.model.new_cache(8)], [4]).logits  # type: ignore[operator]
    assert bool(torch.isfinite(logits.float()).all())
