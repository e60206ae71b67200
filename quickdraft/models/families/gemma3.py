"""Gemma 3 text decoder (Hugging Face `gemma3_text`, Gemma3ForCausalLM; GGUF `gemma3`).

Stage: the target model, with the contract of models/base.py (one packed forward over the new
tokens of several sequences, KV written past `cache.length`, the commit left to the caller).
What differs from the Llama family (models/families/llama.py):
- local and global layers (`layer_types`): a local ("sliding_attention") layer's query at
  position p attends to keys p - sliding_window + 1 .. p only, a global one to 0 .. p; each
  layer type has its own RoPE base. The cache keeps every key of every layer and `attend`
  masks by the window per query position, so a verify row sees what its decode step sees
  and a rollback (`commit` of a shorter length) never needs a key that was dropped;
- Gemma's zero-centred RMSNorm, y = x / rms(x) * (1 + w), everywhere (also per head on q and
  k); norms after attention and after the MLP as well as before them;
- a GeGLU MLP: down(gelu_tanh(gate) * up); embeddings scaled by sqrt(hidden) in the model
  dtype; attention scaled by query_pre_attn_scalar ** -0.5; the head tied to the embedding.
Attention / final logit softcapping (Gemma 2) are refused by the config reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from quickdraft.config import ModelConfig, read_hf_config
from quickdraft.kernels.attention import attend
from quickdraft.kernels.gemm import Weight, project, to_panels
from quickdraft.kernels.pointwise import add_rms_norm, gelu_tanh_rows, rms_norm
from quickdraft.kernels.pointwise import rope as apply_rope
from quickdraft.models.base import ForwardOutput, ImageRows, packed_positions, refuse_images
from quickdraft.models.caches.kv_cache import KVCache
from quickdraft.models.families.llama import _QUANTIZERS, Embedding
from quickdraft.models.layers import (
    GGUFEmbedding,
    HeadLogits,
    LinearView,
    OperandModule,
    RMSNorm,
    Rope,
    VocabSubset,
    convert_operands_,
    fused_projections,
    tapped_layers,
)

SLIDING = "sliding_attention"


@dataclass(frozen=True, slots=True)
class Gemma3Config(ModelConfig):
    sliding_window: int = 0  # keys a local layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer: "sliding_attention" | "full_attention"
    rope_local_theta: float = 10000.0  # RoPE base of the local layers
    rope_scale: float = 1.0  # linear RoPE scaling of the global layers (1: none)
    query_pre_attn_scalar: float = 256.0  # attention scale = this ** -0.5

    @classmethod
    def from_hf(cls, path: str | Path) -> Gemma3Config:
        raw, gen = read_hf_config(path)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if raw.get(key) is not None:
                raise ValueError(f"gemma3: {key}={raw[key]} is not supported")
        if raw.get("use_bidirectional_attention"):
            raise ValueError("gemma3: bidirectional attention is not supported")
        params = raw.get("rope_parameters") or {}
        if "full_attention" in params:  # transformers 5: one RoPE record per layer type
            glob, local = params["full_attention"], params.get(SLIDING, {})
        else:  # transformers 4: rope_theta / rope_scaling + rope_local_base_freq
            glob = {"rope_theta": raw.get("rope_theta", 1e6), **(raw.get("rope_scaling") or {})}
            local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
        kind = glob.get("rope_type", glob.get("type", "default"))
        if kind not in ("default", "linear") or local.get("rope_type", "default") != "default":
            raise ValueError(f"gemma3: rope type {kind!r} is not supported")
        n = int(raw["num_hidden_layers"])
        pattern = int(raw.get("sliding_window_pattern", 6))
        types = raw.get("layer_types") or [
            SLIDING if (i + 1) % pattern else "full_attention" for i in range(n)
        ]
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        eos = gen.get("eos_token_id", raw.get("eos_token_id"))
        return cls(
            model_type=raw["model_type"],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(glob.get("rope_theta", 1e6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=True,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
            extra=raw,
            sliding_window=int(raw.get("sliding_window") or 0),
            layer_types=tuple(types),
            rope_local_theta=float(local.get("rope_theta", 10000.0)),
            rope_scale=float(glob.get("factor", 1.0)) if kind == "linear" else 1.0,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", head_dim)),
        )


class GemmaRMSNorm(RMSNorm):
    """y = x / rms(x) * (1 + w): the weight is stored zero-centred (HF's convention)."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, offset=1.0)

    def add_forward(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        return add_rms_norm(x, delta, self.weight, self.eps, offset=1.0)


class Attention(OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("qkv", "o")
    FUSED: ClassVar[tuple[str, ...]] = ("qkv_weight",)

    def __init__(self, cfg: Gemma3Config, idx: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer_idx = idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = d = cfg.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_weight, self.qkv_bias = fused_projections(
            self,
            cfg.hidden_size,
            {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
            cfg.attention_bias,
            dtype,
            device,
        )
        self.o_proj = LinearView(
            torch.empty(cfg.hidden_size, q_size, dtype=dtype, device=device), None
        )
        self.qkv: Weight = self.qkv_weight  # GEMM operands (see llama.Attention)
        self.o: Weight = self.o_proj.weight.detach()
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.window = cfg.sliding_window if cfg.layer_types[idx] == SLIDING else 0

    def forward(
        self,
        x: Tensor,  # [N, hidden]
        rope: tuple[Tensor, Tensor],  # cos, sin [N, 1, head_dim] of this layer's type
        caches: Sequence[KVCache],
        num_new: Sequence[int],
    ) -> Tensor:
        n, d, h, hkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = project(x, self.qkv, self.qkv_bias)  # [N, (H + 2 Hkv) * d]
        q = self.q_norm(qkv[:, : h * d].view(n, h, d))
        k = self.k_norm(qkv[:, h * d : (h + hkv) * d].view(n, hkv, d))
        v = qkv[:, (h + hkv) * d :].view(n, hkv, d)
        cos, sin = rope[0][:, 0], rope[1][:, 0]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        outs, start = [], 0
        for cache, count in zip(caches, num_new, strict=True):
            seg = slice(start, start + count)
            keys, values = cache.write(
                self.layer_idx, k[seg].transpose(0, 1), v[seg].transpose(0, 1)
            )
            outs.append(attend(q[seg], keys, values, cache.length, self.scale, self.window))
            start += count
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, H * d]
        return project(out, self.o)


class MLP(OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("gate_up", "down")
    FUSED: ClassVar[tuple[str, ...]] = ("gate_up_weight",)

    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.inter = inter = cfg.intermediate_size
        self.gate_up_weight, _ = fused_projections(
            self, cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, False, dtype, device
        )
        self.down_proj = LinearView(
            torch.empty(cfg.hidden_size, inter, dtype=dtype, device=device), None
        )
        self.gate_up: Weight = self.gate_up_weight
        self.down: Weight = self.down_proj.weight.detach()

    def forward(self, x: Tensor) -> Tensor:
        gate_up = project(x, self.gate_up)  # [N, 2 * inter]
        act = gelu_tanh_rows(gate_up[:, : self.inter]) * gate_up[:, self.inter :]
        return project(act, self.down)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, idx: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps, dtype, device)
        self.self_attn = Attention(cfg, idx, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps, dtype, device)
        self.sliding = cfg.layer_types[idx] == SLIDING

    def forward(
        self,
        h: Tensor,  # [N, hidden] the residual stream
        rope: tuple[Tensor, Tensor],
        caches: Sequence[KVCache],
        num_new: Sequence[int],
    ) -> Tensor:
        attn = self.self_attn(self.input_layernorm(h), rope, caches, num_new)
        residual, x = self.pre_feedforward_layernorm.add_forward(
            h, self.post_attention_layernorm(attn)
        )
        return residual + self.post_feedforward_layernorm(self.mlp(x))


class DecoderModel(nn.Module):
    """HF's `model.` submodule: embeddings, layers, final norm."""

    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens: Embedding | GGUFEmbedding = Embedding(
            cfg.vocab_size, cfg.hidden_size, dtype, device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class Gemma3LM(HeadLogits, OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("head",)

    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        if len(cfg.layer_types) != cfg.num_hidden_layers:
            raise ValueError(
                f"gemma3: {len(cfg.layer_types)} layer_types for {cfg.num_hidden_layers} layers"
            )
        self.config, self.dtype, self.device = cfg, dtype, device
        self.model = DecoderModel(cfg, dtype, device)
        self.decoder_layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        embed = self.model.embed_tokens
        head: Tensor = (
            embed.weight
            if cfg.tie_word_embeddings and isinstance(embed, Embedding)
            else torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.lm_head = LinearView(head, None)
        self.head: Weight = self.lm_head.weight.detach()
        self.rope_global = Rope(cfg.head_dim, cfg.rope_theta, device)
        self.rope_global.inv_freq /= cfg.rope_scale  # linear scaling: positions / factor
        self.rope_local = Rope(cfg.head_dim, cfg.rope_local_theta, device)
        # HF multiplies by sqrt(hidden) rounded to the model dtype
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device=device)
        self.vocab: VocabSubset | None = None  # as a draft model, a restricted vocabulary
        self.requires_grad_(False)

    def quantize_(self, fmt: str) -> None:
        """GEMM operands -> "int8" / "int4" (see llama.CausalLM.quantize_)."""
        if fmt not in _QUANTIZERS:
            raise ValueError(f"unknown weight format {fmt!r}; supported: {', '.join(_QUANTIZERS)}")
        convert_operands_(self, _QUANTIZERS[fmt])

    def pack_(self) -> None:
        """bf16 projection operands -> PanelWeight (same values, the panel kernel's layout)."""
        convert_operands_(self, to_panels)

    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            capacity,
            self.dtype,
            self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,  # [N] new tokens of all sequences, packed in `caches` order
        caches: Sequence[KVCache],
        num_new: Sequence[int],  # new tokens per sequence; sums to N
        logit_rows: Tensor | None = None,  # rows of N to score; default: last row of each seq
        return_hidden: bool = False,
        hidden_layers: Sequence[int] = (),  # layers whose outputs to return (ForwardOutput)
        images: ImageRows | None = None,  # refused: no vision path
    ) -> ForwardOutput:
        assert input_ids.dim() == 1 and sum(num_new) == input_ids.shape[0]
        refuse_images(self, images)
        positions = packed_positions(
            caches, num_new, self.config.max_position_embeddings, self.device
        )
        ropes = {
            True: self.rope_local.tables(positions, self.dtype),
            False: self.rope_global.tables(positions, self.dtype),
        }
        h = self.model.embed_tokens(input_ids) * self.embed_scale  # [N, hidden]
        wanted = set(hidden_layers)
        taps: dict[int, Tensor] = {}  # layer -> its output [N, hidden]
        for i, layer in enumerate(self.decoder_layers):
            h = layer(h, ropes[layer.sliding], caches, num_new)
            if i in wanted:
                taps[i] = h
        layers = tapped_layers(taps, hidden_layers, len(self.decoder_layers), self.model.norm)
        return self.head_outputs(h, self.model.norm, num_new, logit_rows, return_hidden, layers)
