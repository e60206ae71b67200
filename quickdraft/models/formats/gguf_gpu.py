"""A GGUF model's own quantized weights on a GPU: the CPU load (kernels/linear_gguf.py's
layout, from the packed copy beside the file) moved operand by operand into
kernels/triton_gguf.py's device layout, the embedding table too. The model then runs behind
models/graphs.py's GraphModel like a bf16 one, its projections on the Triton GGUF kernels."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from quickdraft.kernels import triton_gguf
from quickdraft.kernels.linear_bf16 import PanelWeight
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.kernels.triton_gguf import DeviceGGUFEmbedding
from quickdraft.models.families.llama import CausalLM, Embedding
from quickdraft.models.layers import GGUFEmbedding, OperandModule, release_fused_


def runs_on_device(model_class: type, cfg: object) -> bool:
    """Whether a GGUF model of this class keeps its quantized weights on a GPU: dense
    CausalLMs (llama, qwen2, qwen3), the models GraphModel runs. The others (Gemma 3, MoE,
    hybrid) are dequantized to bf16 there."""
    moe = getattr(cfg, "moe_layers", None)
    return model_class is CausalLM and not (moe and any(moe))


def on_device(w: GGUFWeight) -> bool:
    """Whether every part of `w` is in a format the GPU kernels take (the others, Q2_K, Q3_K,
    IQ4_NL, IQ4_XS, MXFP4, are dequantized to bf16 there)."""
    return all(p.fmt.name in triton_gguf.DEVICE_FORMATS for p in w.parts)


def _same(a: GGUFWeight, b: GGUFWeight) -> bool:
    return (
        a.shape == b.shape
        and len(a.parts) == len(b.parts)
        and all(
            p.fmt is q.fmt and p.n == q.n and torch.equal(p.packed, q.packed)
            for p, q in zip(a.parts, b.parts, strict=True)
        )
    )


def to_device_(model: CausalLM, device: torch.device | str) -> CausalLM:
    """Move a CPU-loaded GGUF CausalLM to `device` in place: GGUFWeight operands into the
    device layout (the same values), other operands, parameters and the rope tables as they
    are, the embedding table in its format (sharing the head's weight when tied)."""
    device = torch.device(device)
    moved: dict[int, triton_gguf.DeviceGGUFWeight] = {}
    head_cpu = model.head
    for module in model.modules():
        if not isinstance(module, OperandModule):
            continue
        for name in module.OPERANDS:
            w = getattr(module, name)
            if isinstance(w, GGUFWeight) and not on_device(w):  # dequantized once, bf16
                setattr(module, name, w.dequantize(torch.bfloat16).to(device))
            elif isinstance(w, GGUFWeight):
                if id(w) not in moved:
                    moved[id(w)] = triton_gguf.to_device(w, device)
                setattr(module, name, moved[id(w)])
            elif isinstance(w, Tensor):
                setattr(module, name, w.to(device))
            elif isinstance(w, PanelWeight):  # a float tensor of the file, in CPU panels
                setattr(module, name, w.unpack().to(device))
            else:
                raise ValueError(f"{type(w).__name__} operands run on the CPU kernels only")
    emb = model.model.embed_tokens
    model.to(device)  # parameters and buffers: the norms, the emptied HF views
    for module in model.modules():  # plain tensor attributes: the fused q/k/v bias
        for name, value in list(vars(module).items()):
            if isinstance(value, Tensor) and not name.startswith("_"):
                setattr(module, name, value.to(device))
    if isinstance(emb, GGUFEmbedding):
        table: Embedding | DeviceGGUFEmbedding
        if emb.qtype.name in triton_gguf.DEVICE_FORMATS:
            cpu = GGUFWeight.from_raw(emb.qtype.name, emb.raw, emb.dim)
            if isinstance(head_cpu, GGUFWeight) and on_device(head_cpu) and _same(cpu, head_cpu):
                weight = moved[id(head_cpu)]  # tied: one copy serves both
            else:
                weight = triton_gguf.to_device(cpu, device)
            table = DeviceGGUFEmbedding(weight, model.dtype)
        else:  # a format with no GPU kernel: the table dequantized once
            vocab = emb.raw.shape[0]
            table = Embedding(vocab, emb.dim, model.dtype, device)
            for r0 in range(0, vocab, 8192):
                ids = list(range(r0, min(vocab, r0 + 8192)))
                table.weight.data[r0 : r0 + len(ids)] = emb.dequantize(ids).to(device)
        model.model.embed_tokens = table
    rope = model.rope
    for attr, value in vars(rope).items():
        if isinstance(value, Tensor):
            setattr(rope, attr, value.to(device))
    model.device = device
    model._fused = None
    return model


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the projection and embedding weights on the model's device (benchmarks: GPU
    memory of GGUF against bf16), each shared tensor counted once."""
    seen: dict[int, int] = {}

    def add(w: object) -> None:
        if isinstance(w, Tensor):
            if w.numel():
                seen[w.data_ptr()] = w.numel() * w.element_size()
        elif isinstance(w, triton_gguf.DeviceGGUFWeight):
            for p in w.parts:
                for t in p.tensors():
                    add(t)
        elif dataclasses.is_dataclass(w):  # the CPU formats: their packed tensors
            for f in dataclasses.fields(w):
                add(getattr(w, f.name))
        elif isinstance(w, tuple):
            for item in w:
                add(item)

    for module in model.modules():
        if isinstance(module, OperandModule):
            for name in module.OPERANDS:
                add(getattr(module, name))
    emb = model.model.embed_tokens
    add(emb.weight)
    return sum(seen.values())


# llama.cpp's fallbacks for rows whose length is not a multiple of 256
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v and ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_q4_k_m_(model: CausalLM, seed: int = 0) -> CausalLM:
    """Replace a dense model's operands and embedding, in place on its device, by random
    weights in the formats llama.cpp's Q4_K_M gives each tensor (Q4_K; Q6_K for the head and
    for attn_v / ffn_down of `_more_bits` layers; fallbacks where K % 256 != 0): benchmarks
    time a real model's GGUF shapes on a host that has no weights."""
    device = model.device
    cfg = model.config
    hidden, d = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layers = model.decoder_layers
    count = iter(range(1 << 30))

    def make(fmt: str, n: int, k: int) -> triton_gguf.DeviceGGUFWeight:
        if k % 256:
            fmt = _FALLBACK.get(fmt, fmt)
        return triton_gguf.random_weight(fmt, n, k, device, seed + next(count))

    def joined(*ws: triton_gguf.DeviceGGUFWeight) -> triton_gguf.DeviceGGUFWeight:
        return triton_gguf.DeviceGGUFWeight(
            tuple(p for w in ws for p in w.parts), ws[0].in_features
        )

    for i, layer in enumerate(layers):
        v = "Q6_K" if _more_bits(i, len(layers)) else "Q4_K"
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv = joined(
            make("Q4_K", q_rows, hidden), make("Q4_K", kv_rows, hidden), make(v, kv_rows, hidden)
        )
        attn.o = make("Q4_K", hidden, q_rows)
        inter = cfg.intermediate_size
        mlp.gate_up = joined(make("Q4_K", inter, hidden), make("Q4_K", inter, hidden))
        mlp.down = make(v, hidden, inter)
    head = make("Q6_K", cfg.vocab_size, hidden)
    model.head = head
    table = head if cfg.tie_word_embeddings else make("Q4_K", cfg.vocab_size, hidden)
    model.model.embed_tokens = DeviceGGUFEmbedding(table, model.dtype)
    release_fused_(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model
