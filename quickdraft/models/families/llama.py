"""Decoder-only transformers: Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3, and Qwen3-MoE (Qwen3 with
routed experts in place of the MLP, models/families/moe.py).

Stage: the target (and draft) model. One `forward` runs N new tokens of one or more sequences
packed together (prefill, decode, or a k+1-token verify): projections and MLPs run on all
`[N, hidden]` rows at once (weights are streamed once), attention runs per sequence against its
own KVCache. It writes each sequence's new KV past `cache.length` and leaves committing to the
caller. Parameter names are Hugging Face's (state_dict keys match HF checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.config import ModelConfig
from quickdraft.kernels.attention import attend
from quickdraft.kernels.dense_layer import dense_layer
from quickdraft.kernels.gemm import Weight, project, to_panels
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight
from quickdraft.kernels.pointwise import rope as apply_rope
from quickdraft.kernels.pointwise import silu_mul
from quickdraft.kernels.triton_gguf import DeviceGGUFEmbedding
from quickdraft.models.base import ForwardOutput, ImageRows, packed_positions
from quickdraft.models.caches.kv_cache import KVCache
from quickdraft.models.families.moe import RoutedMoE
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


class Attention(OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("qkv", "o")
    FUSED: ClassVar[tuple[str, ...]] = ("qkv_weight",)

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        in_size: int = 0,  # the width of x when it is not hidden_size (EAGLE-3's 2H input)
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_weight, self.qkv_bias = fused_projections(
            self,
            in_size or cfg.hidden_size,
            {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
            cfg.attention_bias,
            dtype,
            device,
        )
        self.o_proj = LinearView(
            torch.empty(cfg.hidden_size, q_size, dtype=dtype, device=device), None
        )
        # The GEMM operands the forward reads: views of the HF-named parameters (loading fills
        # them), replaced by packed or quantized forms by `CausalLM.pack_` / `quantize_`.
        self.qkv: Weight = self.qkv_weight
        self.o: Weight = self.o_proj.weight.detach()
        # what a family adds (models/families/gpt_oss.py): an o bias, a sliding window (0: none),
        # per-head attention sinks (a Parameter there)
        self.o_bias: Tensor | None = None
        self.window = 0
        self.sinks: Tensor | None = None
        self.q_norm = (
            RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        )
        self.scale = self.head_dim**-0.5

    def rotated_qkv(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, hidden] -> q [N, H, d], k, v [N, Hkv, d]: projected, q and k normed (Qwen3)
        and rotated."""
        n, d = x.shape[0], self.head_dim
        qkv = project(x, self.qkv, self.qkv_bias)  # [N, (H + 2 Hkv) * d]
        q = qkv[:, : self.num_heads * d].view(n, self.num_heads, d)
        k = qkv[:, self.num_heads * d : (self.num_heads + self.num_kv_heads) * d]
        k = k.view(n, self.num_kv_heads, d)
        v = qkv[:, (self.num_heads + self.num_kv_heads) * d :].view(n, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope[0][:, 0], rope[1][:, 0]  # [N, head_dim]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v  # fused; q, k are views

    def forward(
        self,
        x: Tensor,  # [N, hidden]
        rope: tuple[Tensor, Tensor],  # cos, sin [N, 1, head_dim]
        caches: Sequence[KVCache],
        num_new: Sequence[int],
    ) -> Tensor:
        q, k, v = self.rotated_qkv(x, rope)
        sinks = None if self.sinks is None else self.sinks.float()
        outs, start = [], 0
        for cache, count in zip(caches, num_new, strict=True):
            seg = slice(start, start + count)
            keys, values = cache.write(
                self.layer_idx, k[seg].transpose(0, 1), v[seg].transpose(0, 1)
            )
            outs.append(attend(q[seg], keys, values, cache.length, self.scale, self.window, sinks))
            start += count
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, H * d]
        return project(out, self.o, self.o_bias)


class MLP(OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("gate_up", "down")
    FUSED: ClassVar[tuple[str, ...]] = ("gate_up_weight",)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_weight, _ = fused_projections(
            self,
            cfg.hidden_size,
            {"gate_proj": self.inter, "up_proj": self.inter},
            False,
            dtype,
            device,
        )
        self.down_proj = LinearView(
            torch.empty(cfg.hidden_size, self.inter, dtype=dtype, device=device), None
        )
        self.gate_up: Weight = self.gate_up_weight  # GEMM operands, as in Attention
        self.down: Weight = self.down_proj.weight.detach()

    def forward(self, x: Tensor) -> Tensor:
        gate_up = project(x, self.gate_up)  # [N, 2 * inter]
        return project(silu_mul(gate_up), self.down)  # fused silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp: MLP | RoutedMoE = (
            RoutedMoE(
                cfg.hidden_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.norm_topk_prob,
                dtype,
                device,
            )
            if cfg.moe_layers and cfg.moe_layers[idx]
            else MLP(cfg, dtype, device)
        )

    def forward(
        self,
        x: Tensor,  # [N, hidden]
        rope: tuple[Tensor, Tensor],
        caches: Sequence[KVCache],
        num_new: Sequence[int],
    ) -> Tensor:
        """x -> the layer's output hidden state (HF's decoder layer)."""
        h, residual = self.forward_residual(x, None, rope, caches, num_new)
        return residual + h

    def forward_residual(
        self,
        h: Tensor,  # [N, hidden] the previous layer's MLP output (the embedding for layer 0)
        residual: Tensor | None,  # [N, hidden] the residual stream before adding h; None: layer 0
        rope: tuple[Tensor, Tensor],
        caches: Sequence[KVCache],
        num_new: Sequence[int],
    ) -> tuple[Tensor, Tensor]:
        """HF's `x = x + attn(norm(x)); x = x + mlp(norm(x))` with each residual add fused
        into the norm that follows it; returns (mlp output, residual): the layer's output
        hidden state is their sum."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            residual, x = self.input_layernorm.add_forward(residual, h)
        attn = self.self_attn(x, rope, caches, num_new)
        residual, x = self.post_attention_layernorm.add_forward(residual, attn)
        return self.mlp(x), residual


def _fused_layer(layer: DecoderLayer, dtype: torch.dtype) -> Any:
    """`layer` as the extension's C++ DenseLayer, or None where it cannot run (a MoE layer
    whose block is not one C++ call)."""
    attn, mlp = layer.self_attn, layer.mlp
    moe = None if isinstance(mlp, MLP) else mlp.block()
    if moe is None and not isinstance(mlp, MLP):
        return None
    tail = (mlp.gate_up, mlp.down) if isinstance(mlp, MLP) else ()
    return dense_layer(
        attn.layer_idx,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        layer.input_layernorm.eps,
        attn.scale,
        (
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            None if attn.q_norm is None else attn.q_norm.weight,
            None if attn.k_norm is None else attn.k_norm.weight,
        ),
        (attn.qkv, attn.o, *tail),
        attn.qkv_bias,
        dtype,
        attn.o_bias,
        attn.window,
        None if attn.sinks is None else attn.sinks.float(),
        moe,
    )


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class DecoderModel(nn.Module):
    """HF's `model.` submodule: embeddings, layers, final norm."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        layer: type[DecoderLayer] = DecoderLayer,  # a family's own (models/families/gpt_oss.py)
    ) -> None:
        super().__init__()
        # a GGUF model's stays in its file's format (models/formats/gguf_loader.py)
        self.embed_tokens: Embedding | GGUFEmbedding | DeviceGGUFEmbedding = Embedding(
            cfg.vocab_size, cfg.hidden_size, dtype, device
        )
        self.layers = nn.ModuleList(
            layer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class CausalLM(HeadLogits, OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("head",)
    LAYER: ClassVar[type[DecoderLayer]] = DecoderLayer  # the decoder layer of the family

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = cfg, dtype, device
        self.model = DecoderModel(cfg, dtype, device, self.LAYER)
        # the same modules, typed (ModuleList items are plain nn.Modules to a type checker)
        self.decoder_layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        embed = self.model.embed_tokens
        head: Tensor = (
            embed.weight
            if cfg.tie_word_embeddings and isinstance(embed, Embedding)
            else torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.lm_head = LinearView(head, None)
        self.head: Weight = self.lm_head.weight.detach()  # GEMM operand, as in Attention
        self.vocab: VocabSubset | None = None  # a draft model's restricted vocabulary
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, device)
        self.requires_grad_(False)
        # the layers as C++ DenseLayers once built (`_fused_layers`); False: they cannot be
        self._fused: list[Any] | bool | None = None

    def quantize_(self, fmt: str) -> None:
        """Replace every projection's GEMM operand by its `fmt` form in place and free the
        full-precision copies (the embedding table stays: a lookup reads one row). "int8":
        per-row absmax int8, half the bytes of bf16; "int4": 4-bit groups of 32 with an fp16
        scale and min, 0.3x the bytes of bf16 (activations go through int8 in its kernel).
        Meant for draft models, where precision only moves the acceptance rate; the
        state_dict is not usable afterwards."""
        if fmt not in _QUANTIZERS:
            raise ValueError(f"unknown weight format {fmt!r}; supported: {', '.join(_QUANTIZERS)}")
        convert_operands_(self, _QUANTIZERS[fmt])
        self._fused = None

    def pack_(self) -> None:
        """bf16 projection operands -> PanelWeight (the same values, in the layout the panel
        kernel streams; see kernels/linear_bf16.py); the state_dict is not usable afterwards."""
        convert_operands_(self, to_panels)
        self._fused = None

    def _fused_layers(self) -> list[Any] | None:
        """Every layer as a C++ DenseLayer (kernels/dense_layer.py), or None when the kernels
        are off or some layer's operands are not in a kernel format (fp32 or bf16 weights not
        yet in panels). Built on first use after `pack_` / `quantize_`."""
        if self._fused is None:
            layers = [
                _fused_layer(layer, self.dtype) if self.device.type == "cpu" else None
                for layer in self.decoder_layers
            ]
            self._fused = False if any(f is None for f in layers) else layers
        return self._fused if isinstance(self._fused, list) else None

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
        images: ImageRows | None = None,  # image rows and M-RoPE positions (Qwen2.5-VL only)
    ) -> ForwardOutput:
        assert input_ids.dim() == 1 and sum(num_new) == input_ids.shape[0]
        cfg = self.config
        positions = packed_positions(caches, num_new, cfg.max_position_embeddings, self.device)
        h, rope = self.rope.with_images(  # [N, hidden], the rope tables
            self.model.embed_tokens(input_ids),
            positions,
            images,
            cfg.mrope_section,
            self.dtype,
            interleaved=False,
        )
        residual: Tensor | None = None
        wanted = set(hidden_layers)
        taps: dict[int, Tensor] = {}  # layer -> its output [N, hidden]
        # the rows of one sequence (decode, verify, a prompt chunk) or of several (a batched
        # step): the C++ layers (the same kernels in the same order as the Python layers, so
        # the same bits)
        kv = all(isinstance(c, KVCache) for c in caches)
        fused = self._fused_layers() if kv else None
        if fused is not None:
            cos, sin = rope[0][:, 0], rope[1][:, 0]
            if len(caches) == 1:
                cache = caches[0]
                k_pages, v_pages, block = cache.pages
            else:
                many = many_args(caches, num_new)
        for i, layer in enumerate(self.decoder_layers):
            if fused is not None and len(caches) == 1:
                h, residual = fused[i].forward(
                    h, residual, cos, sin, cache.k, cache.v, cache.length, k_pages, v_pages, block
                )
            elif fused is not None:
                h, residual = fused[i].forward_many(h, residual, cos, sin, *many)
            else:
                h, residual = layer.forward_residual(h, residual, rope, caches, num_new)
            if i in wanted:  # the layer's output: the sum the next norm forms
                taps[i] = residual + h
        assert residual is not None, "a model has at least one layer"
        layers = tapped_layers(taps, hidden_layers, len(self.decoder_layers), self.model.norm)
        if logit_rows is None:
            ends = torch.tensor(list(num_new), device=self.device).cumsum(0) - 1
            logit_rows = ends
        if return_hidden:
            hidden = self.model.norm.add_forward(residual, h)[1]  # [N, hidden] post-norm
            return ForwardOutput(self._logits(hidden[logit_rows]), hidden, layers)
        last = self.model.norm.add_forward(residual[logit_rows], h[logit_rows])[1]
        return ForwardOutput(self._logits(last), None, layers)


def many_args(caches: Sequence[Any], num_new: Sequence[int]) -> tuple[Any, ...]:
    """`DenseLayer.forward_many`'s per-sequence arguments after (h, residual, cos, sin): the
    caches' k and v, committed lengths, row counts, shared blocks' page tables (an empty
    tensor: none) and block sizes."""
    none = torch.empty(0, dtype=torch.int64)
    pages = [c.pages for c in caches]
    return (
        [c.k for c in caches],
        [c.v for c in caches],
        [c.length for c in caches],
        list(num_new),
        [none if p[0] is None else p[0] for p in pages],
        [none if p[1] is None else p[1] for p in pages],
        [p[2] for p in pages],
    )


def _quantizer(kind: type[Int8Weight] | type[Int4Weight]) -> Callable[[Weight], Weight]:
    def quantize(weight: Weight) -> Weight:
        if isinstance(weight, kind):
            return weight  # already in this format: quantize_ twice is a no-op
        if not isinstance(weight, (Tensor, GGUFWeight)):
            raise ValueError(f"weights already converted to {type(weight).__name__}")
        # a GGUF model's own: from its bf16-rounded values, dequantized a block of rows at a time
        return kind.quantize(weight)

    return quantize


_QUANTIZERS = {"int8": _quantizer(Int8Weight), "int4": _quantizer(Int4Weight)}


def operand_converter(fmt: str) -> Callable[[Weight], Weight] | None:
    """The conversion `quantize_(fmt)` applies to each operand; None for "none"."""
    if fmt == "none":
        return None
    if fmt not in _QUANTIZERS:
        raise ValueError(f"unknown weight format {fmt!r}; supported: {', '.join(_QUANTIZERS)}")
    return _QUANTIZERS[fmt]
