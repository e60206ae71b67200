"""Building blocks shared by every model file: RMSNorm, RoPE, fused projections, attention.

Contract: all functions take packed tokens `[num_tokens, ...]` (no batch dim); attention runs
per sequence against that sequence's KVCache. Math follows the Hugging Face reference so that
fp32 logits match it to < 1e-4 (tests/test_models.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.kernels import (
    Int4Weight,
    Int8Weight,
    PanelWeight,
    kernels_available,
    linear,
    linear_int4,
    linear_int8,
    linear_panel,
)
from quickdraft.kernels.cpu_linear import _extension
from quickdraft.kernels.cpu_ops import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """y = w * x / rms(x)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # One fused pass in fp32 (cpu_ops): matches HF's explicit fp32 upcast in fp32 and is at
        # least as accurate in bf16.
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """(x + delta, norm(x + delta)) in one pass: the residual add before a pre-norm."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class LinearView(nn.Module):
    """One HF-named projection whose weight (and bias) are views into a fused tensor, so the
    state_dict keeps HF names while the forward runs one GEMV over the fused weight."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        # nn.Parameter aliases the storage of its argument: copying into it fills the fused tensor.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def fused_projections(
    owner: nn.Module,
    in_features: int,
    outs: dict[str, int],
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, Tensor | None]:
    """Register `owner.<name>` LinearViews for each entry of `outs` and return the fused
    weight `[sum(outs), in_features]` (and bias). Build the model on its final device and
    dtype: `.to()` afterwards would re-allocate the views and break the aliasing."""
    total = sum(outs.values())
    weight = torch.empty(total, in_features, dtype=dtype, device=device)
    fused_bias = torch.zeros(total, dtype=dtype, device=device) if bias else None
    start = 0
    for name, size in outs.items():
        b = None if fused_bias is None else fused_bias[start : start + size]
        owner.add_module(name, LinearView(weight[start : start + size], b))
        start += size
    return weight, fused_bias


class Rope:
    """Rotary embedding tables (fp32, HF "default" rope), grown on demand."""

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        self.inv_freq = 1.0 / (
            theta
            ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
        )
        self.cos = torch.empty(0, head_dim, device=device)
        self.sin = torch.empty(0, head_dim, device=device)

    def tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin `[num_tokens, 1, head_dim]` fp32 for `positions` `[num_tokens]`."""
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            size = max(need, 2 * self.cos.shape[0], 256)
            t = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()
        # Rounded to the model dtype as HF does, then held in fp32: the fused rope op computes
        # in fp32 and would otherwise convert the tables again in every layer.
        cos, sin = self.cos[positions, None], self.sin[positions, None]
        if dtype != torch.float32:
            cos, sin = cos.to(dtype).float(), sin.to(dtype).float()
        return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x `[num_tokens, heads, head_dim]`; rotate-half convention (HF Llama/Qwen)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# Longest run of new queries `attend` gives the C++ kernel (decode steps and verifies); longer
# ones (prompt chunks) go to SDPA, whose blocked GEMMs win once there are many query rows.
ATTEND_KERNEL_MAX_QUERIES = 16


def attend(q: Tensor, k: Tensor, v: Tensor, start: int, scale: float) -> Tensor:
    """Causal grouped-query attention of n new queries at positions [start, start + n).

    q `[n, heads, head_dim]`; k, v `[kv_heads, start + n, head_dim]` -> `[n, heads * head_dim]`:
    query i sees keys 0 .. start + i. Up to ATTEND_KERNEL_MAX_QUERIES queries run the C++ kernel
    (kernels/attention.cpp: fp32 math, rows independent of n) when it accepts the inputs, the
    rest `reference_attend` (SDPA).
    """
    ext = _extension() if q.is_cpu and q.shape[0] <= ATTEND_KERNEL_MAX_QUERIES else None
    if ext is not None and ext.attend_eligible(q, k, v, start):
        out: Tensor = ext.attend(q, k, v, start, scale)
        return out
    return reference_attend(q, k, v, start, scale)


def reference_attend(q: Tensor, k: Tensor, v: Tensor, start: int, scale: float) -> Tensor:
    """`attend` by torch's SDPA. The query heads sharing a kv head are folded into the
    query-row dimension (`[1, kv_heads, group * n, d]`): SDPA then takes its fast fused CPU
    kernel in bf16 as well (its enable_gqa and per-head bmm paths are 4-20x slower here) and the
    cache is never repeated."""
    n, heads, d = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    qg = q.view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, d)
    mask = None
    if n > 1:
        # row (g, i) is query i at absolute position start + i: it sees keys 0..start + i
        rows = torch.arange(n, device=q.device).repeat(group)[:, None] + start
        mask = torch.arange(k.shape[1], device=q.device)[None, :] <= rows  # [group * n, S]
    out = F.scaled_dot_product_attention(qg, k[None], v[None], attn_mask=mask, scale=scale)
    return out[0].view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)


# a projection's GEMM operand: bf16/fp32, bf16 in 16-row panels, int8 + row scales, or 4-bit
Weight = Tensor | PanelWeight | Int8Weight | Int4Weight


def project(x: Tensor, weight: Weight, bias: Tensor | None = None) -> Tensor:
    """The one entry point for weight GEMMs (fast bf16 / int8 / int4 kernels when they apply)."""
    if isinstance(weight, PanelWeight):
        return linear_panel(x, weight, bias)
    if isinstance(weight, Int8Weight):
        return linear_int8(x, weight, bias)
    if isinstance(weight, Int4Weight):
        return linear_int4(x, weight, bias)
    return linear(x, weight, bias)


def convert_operands_(model: nn.Module, convert: Callable[[Weight], Weight]) -> None:
    """Replace every GEMM operand of `model` in place by `convert(operand)` and free the
    nn.Linear-layout copies. Operands are the attributes each module names in its `OPERANDS`
    (what its forward passes to `project`); once any operand changed, the HF-named LinearView
    weights and the fused tensors a module names in `FUSED` are emptied, so the state_dict is
    not usable afterwards (a tied lm_head's storage lives on in the embedding, which lookups
    read). A convert that changes nothing leaves the model as it was."""
    changed = False
    for module in model.modules():
        for name in getattr(module, "OPERANDS", ()):
            old = getattr(module, name)
            new = convert(old)
            changed = changed or new is not old
            setattr(module, name, new)
    if not changed:
        return
    for module in model.modules():
        for name in getattr(module, "FUSED", ()):
            setattr(module, name, torch.empty(0))
        if isinstance(module, LinearView):
            module.weight.data = module.weight.new_empty(0)


def panels_apply(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 operands should become PanelWeights: bf16 on a CPU where the kernels run."""
    return dtype == torch.bfloat16 and device.type == "cpu" and kernels_available()


def to_panels(weight: Weight) -> Weight:
    """`convert` for convert_operands_: bf16 tensors become PanelWeights, anything else (fp32,
    already packed or quantized) stays as it is."""
    if isinstance(weight, Tensor) and weight.dtype == torch.bfloat16 and weight.dim() == 2:
        return PanelWeight.pack(weight)
    return weight
