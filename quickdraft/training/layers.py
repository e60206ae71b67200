"""Differentiable decoder pieces for the trained drafters (training/dflash.py, training/mtp.py):
the serving layers' math (models/families/llama.py) in plain torch, with the serving checkpoint's
parameter names, so that `state_dict()` is the checkpoint.

Stage: the model half of `quickdraft train-drafter`. Contract: tensors carry a batch of
sequences `[S, L, ...]` (the serving layers take packed rows); RoPE goes through the serving
model's `Rope` tables and the ops' plain reference, RMSNorm through `F.rms_norm`, so neither
has a second hand-written copy. `Attention` follows the target family's shape: q/k biases
where `attention_bias` (Qwen2), per-head q/k norms where `qk_norm` (Qwen3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.config import ModelConfig
from quickdraft.kernels.pointwise import reference_rope
from quickdraft.models.layers import Rope


class Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # in the weight's dtype: under bf16 autocast x arrives in bf16 from a matmul
        return F.rms_norm(x.to(self.weight.dtype), (x.shape[-1],), self.weight, self.eps)


def linear(n_in: int, n_out: int, std: float, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias)
    nn.init.normal_(layer.weight, std=std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of x [S, L, heads, d] by tables [S * L, d] (the ops' plain reference: autograd)."""
    return reference_rope(x.flatten(0, 1), cos, sin).view_as(x)


def rope_tables(rope: Rope, positions: Tensor) -> tuple[Tensor, Tensor]:
    """positions [S, L] -> cos, sin [S * L, d] fp32 (the serving model's tables)."""
    cos, sin = rope.tables(positions.flatten(), torch.float32)
    return cos[:, 0], sin[:, 0]


class Attention(nn.Module):
    def __init__(self, shape: ModelConfig, std: float, out_std: float, in_size: int = 0) -> None:
        """`in_size`: the width of its input when it is not hidden_size (EAGLE-3's 2H)."""
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        n_in = in_size or h
        self.heads, self.kv_heads, self.head_dim = (
            shape.num_attention_heads,
            shape.num_key_value_heads,
            d,
        )
        bias = shape.attention_bias
        self.q_proj = linear(n_in, self.heads * d, std, bias)
        self.k_proj = linear(n_in, self.kv_heads * d, std, bias)
        self.v_proj = linear(n_in, self.kv_heads * d, std, bias)
        self.o_proj = linear(self.heads * d, h, out_std)
        self.q_norm = Norm(d, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = Norm(d, shape.rms_norm_eps) if shape.qk_norm else None

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [S, L, H] (normed) -> q [S, L, heads, d], rotated by tables [S * L, d]."""
        q = self.q_proj(x).view(*x.shape[:2], self.heads, self.head_dim)
        return rotate(q if self.q_norm is None else self.q_norm(q), cos, sin)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [S, L, H] (normed) -> k (rotated), v [S, L, kv_heads, d]."""
        k = self.k_proj(x).view(*x.shape[:2], self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(*x.shape[:2], self.kv_heads, self.head_dim)
        return rotate(k if self.k_norm is None else self.k_norm(k), cos, sin), v

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False
    ) -> Tensor:
        """q [S, L, heads, d] over k, v [S, M, kv_heads, d] (mask [S, 1, L, M] bool: what each
        row sees; or `causal`) -> the projected output [S, L, H]."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )  # [S, heads, L, d]
        s, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(s, length, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: ModelConfig, std: float, out_std: float) -> None:
        super().__init__()
        h, i = shape.hidden_size, shape.intermediate_size
        self.gate_proj, self.up_proj = linear(h, i, std), linear(h, i, std)
        self.down_proj = linear(i, h, out_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One pre-norm decoder layer; the callers run its attention (what each row sees differs
    between drafters) and `finish` it."""

    def __init__(self, shape: ModelConfig, std: float, out_std: float, attn_in: int = 0) -> None:
        super().__init__()
        self.input_layernorm = Norm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, std, out_std, attn_in)
        self.post_attention_layernorm = Norm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape, std, out_std)

    def finish(self, x: Tensor, attended: Tensor) -> Tensor:
        """The residual add of the attention output, then the MLP half."""
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))


def init_stds(num_layers: int) -> tuple[float, float]:
    """(std, residual-output std): N(0, 0.02), outputs scaled by 1/sqrt(2 * layers) (GPT-2)."""
    return 0.02, 0.02 / math.sqrt(2 * num_layers)


def head_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies bf16 natively (AVX512-BF16 / AMX), else fp32."""
    from quickdraft.kernels.build import cpu_flags

    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & cpu_flags() else torch.float32


@dataclass(frozen=True, slots=True)
class FrozenTarget:
    """What a drafter under training takes from its target: inputs, never parameters (a
    callable and buffers are not in the drafter's checkpoint)."""

    embed: Callable[[Tensor], Tensor]  # token ids -> the target's raw embeddings [.., H]
    head: Tensor  # [vocab, H] the target's lm_head, dense
    # [H] fp32: the target's final norm's effective per-channel scale (whatever its weight
    # convention), times sqrt(1 + eps) so that a unit-weight `Norm` of the same rows matches.
    # A drafter's final norm starts at it: the head expects rows at that scale, and a unit norm
    # would start at logits of ~+-100.
    norm_scale: Tensor


def frozen_target(model: Any, dtype: torch.dtype | None = None) -> FrozenTarget:
    """`model`'s (a LanguageModel) FrozenTarget, its head in `dtype` (default head_dtype())."""
    embed = model.get_submodule("model.embed_tokens")
    head = model.head
    dense = head if isinstance(head, Tensor) else head.dequantize(dtype or head_dtype())
    shape = model.config
    with torch.inference_mode():
        ones = torch.ones(1, shape.hidden_size, dtype=model.dtype)
        scale = model.get_submodule("model.norm")(ones)[0].float()
    return FrozenTarget(
        lambda ids: embed(ids),
        dense.detach().to(dtype or head_dtype()).clone(),
        scale * math.sqrt(1 + shape.rms_norm_eps),
    )
