"""Feed-forward blocks of the Qwen3-Next family: the gated MLP and the sparse MoE block with a
gated shared expert (Qwen3-Next, Qwen3.5-MoE); the routed experts alone (`RoutedMoE`) are
Qwen3-MoE's block.

Contract: `forward(x [N, hidden]) -> [N, hidden]` over packed tokens of any sequences (no state).
Parameter names and layouts are transformers 5.x's: `gate.weight` [E, hidden] (router),
`experts.gate_up_proj` [E, 2 * inter, hidden], `experts.down_proj` [E, hidden, inter],
`shared_expert.{gate,up,down}_proj`, `shared_expert_gate` [1, hidden]. Checkpoints that store
one tensor per expert (`experts.{e}.gate_proj.weight`, ...) are mapped onto the fused tensors
by the loader's name map (models/families/qwen3_next.py: `checkpoint_name_map`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from quickdraft.kernels.gemm import Weight, project
from quickdraft.kernels.moe_gguf import grouped_experts, moe_block, reference_experts
from quickdraft.kernels.pointwise import gelu_mul, sigmoid, silu_mul
from quickdraft.models.layers import LinearView, OperandModule, fused_projections


class GatedMLP(OperandModule):
    """down(silu(gate(x)) * up(x)); gate and up run as one fused GEMM."""

    OPERANDS: ClassVar[tuple[str, ...]] = ("gate_up", "down")
    FUSED: ClassVar[tuple[str, ...]] = ("gate_up_weight",)

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.inter = inter
        self.gate_up_weight, _ = fused_projections(
            self, hidden, {"gate_proj": inter, "up_proj": inter}, False, dtype, device
        )
        self.down_proj = LinearView(torch.empty(hidden, inter, dtype=dtype, device=device), None)
        self.gate_up: Weight = self.gate_up_weight  # the GEMM operands the forward reads
        self.down: Weight = self.down_proj.weight.detach()

    def forward(self, x: Tensor) -> Tensor:
        gate_up = project(x, self.gate_up)  # [N, 2 * inter]
        return project(silu_mul(gate_up), self.down)  # fused silu(gate) * up


class Experts(nn.Module):
    def __init__(
        self,
        num: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        device: torch.device,
        act: Callable[[Tensor], Tensor] = silu_mul,  # [rows, 2I] -> [rows, I] (Gemma 4: GeGLU)
    ) -> None:
        super().__init__()
        self.inter, self.act = inter, act
        self.gate_up_proj = nn.Parameter(
            torch.empty(num, 2 * inter, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num, hidden, inter, dtype=dtype, device=device), requires_grad=False
        )
        # per expert (gate_up, down) GEMM operands in place of the stacked tensors: a GGUF's
        # experts kept in their block formats (models/gguf_qwen.py); None: the tensors above
        self.operands: list[tuple[Weight, Weight]] | None = None
        self._grouped: Any = None  # the grouped kernel over `operands` (None: it cannot run)
        self._grouped_for: object = None  # the operand list it was built for

    def forward(self, x: Tensor, top_idx: Tensor, top_weight: Tensor) -> Tensor:
        """x [N, hidden], top_idx / top_weight [N, top_k] -> the weighted sum of each row's
        chosen experts (kernels/moe_gguf.py: one grouped call when the experts are in GGUF
        blocks, else one GEMM pair per chosen expert)."""
        grouped = self.grouped_kernel() if x.is_cpu else None
        if grouped is not None:
            out: Tensor = grouped.forward(x, top_idx, top_weight)
            return out
        operands = self.operands if self.operands is not None else _Stacked(self)
        return reference_experts(x, top_idx, top_weight, operands, self.act)

    def grouped_kernel(self) -> Any:
        """The extension's grouped call for `operands`, built once per operand list (for the
        activations it has: silu_mul and gelu_mul)."""
        if self.act not in (silu_mul, gelu_mul):
            return None
        if self._grouped_for is not self.operands:
            self._grouped_for = self.operands
            ops, gelu = self.operands, self.act is gelu_mul
            hidden = 0 if ops is None else ops[0][1].shape[0]
            self._grouped = None if ops is None else grouped_experts(ops, hidden, gelu=gelu)
        return self._grouped


class _Stacked(Sequence[tuple[Weight, Weight]]):
    """Expert e's (gate_up, down) as views of the stacked parameters."""

    def __init__(self, experts: Experts) -> None:
        self.experts = experts

    def __len__(self) -> int:
        return int(self.experts.gate_up_proj.shape[0])

    def __getitem__(self, e: int) -> tuple[Weight, Weight]:  # type: ignore[override]
        return self.experts.gate_up_proj[e], self.experts.down_proj[e]


class Router(nn.Module):
    def __init__(self, num: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num, hidden, dtype=dtype, device=device), requires_grad=False
        )


def route(x: Tensor, router: Tensor, top_k: int, norm_topk: bool) -> tuple[Tensor, Tensor]:
    """x [N, hidden] -> (top_weight [N, top_k] fp32, top_idx [N, top_k]): softmax over the
    router logits, the top k, renormalized to sum 1 when `norm_topk`."""
    router_logits = project(x, router)  # [N, E]
    probs = torch.softmax(router_logits.float(), dim=-1)
    top_weight, top_idx = torch.topk(probs, top_k, dim=-1)  # [N, top_k]
    if norm_topk:  # summed in slot order: a reduction could order it by batch shape
        total = top_weight[:, 0]
        for j in range(1, top_k):
            total = total + top_weight[:, j]
        top_weight = top_weight / total[:, None]
    return top_weight, top_idx


class _OneCall:
    """A block's lazily built one-call kernel (kernels/moe_gguf.py `moe_block`): rebuilt when
    any operand it holds is replaced, None where it cannot run them."""

    def __init__(self) -> None:
        self.kernel: Any = None
        self.built_for: tuple[object, ...] | None = None

    def get(
        self, experts: Experts, router: Tensor, top_k: int, norm_topk: bool, shared: Any
    ) -> Any:
        key = (experts.operands, router, *(shared or ()))
        if self.built_for is None or any(
            a is not b for a, b in zip(key, self.built_for, strict=True)
        ):
            self.built_for = key
            self.kernel = moe_block(experts.grouped_kernel(), router, top_k, norm_topk, shared)
        return self.kernel


class RoutedMoE(nn.Module):
    """Top-k softmax routing over `num_experts`, no shared expert (Qwen3-MoE)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        inter: int,
        norm_topk: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.gate = Router(num_experts, hidden, dtype, device)
        self.experts = Experts(num_experts, hidden, inter, dtype, device)
        self._one_call = _OneCall()

    def block(self) -> Any:
        """The block as one C++ call (kernels/moe_gguf.py `moe_block`), None where it cannot
        run (experts not in GGUF blocks)."""
        return self._one_call.get(self.experts, self.gate.weight, self.top_k, self.norm_topk, None)

    def forward(self, x: Tensor) -> Tensor:
        block = self.block() if x.is_cpu else None
        if block is not None:
            out: Tensor = block.forward(x)
            return out
        top_weight, top_idx = route(x, self.gate.weight, self.top_k, self.norm_topk)
        return self.experts(x, top_idx, top_weight.to(x.dtype))


class SparseMoE(OperandModule):
    """Top-k softmax routing over `num_experts`, plus sigmoid(gate(x)) * shared_expert(x)."""

    OPERANDS: ClassVar[tuple[str, ...]] = ("shared_gate",)  # routed experts keep their layout

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        inter: int,
        shared_inter: int,
        norm_topk: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.gate = Router(num_experts, hidden, dtype, device)
        self.experts = Experts(num_experts, hidden, inter, dtype, device)
        self.shared_expert = GatedMLP(hidden, shared_inter, dtype, device)
        self.shared_expert_gate = LinearView(
            torch.empty(1, hidden, dtype=dtype, device=device), None
        )
        self.shared_gate: Weight = self.shared_expert_gate.weight.detach()  # GEMM operand
        self._one_call = _OneCall()

    def block(self) -> Any:
        """The block as one C++ call (kernels/moe_gguf.py `moe_block`), None where it cannot
        run (experts or the shared expert not in GGUF blocks)."""
        shared = (self.shared_expert.gate_up, self.shared_expert.down, self.shared_gate)
        return self._one_call.get(
            self.experts, self.gate.weight, self.top_k, self.norm_topk, shared
        )

    def forward(self, x: Tensor) -> Tensor:
        block = self.block() if x.is_cpu else None
        if block is not None:
            out: Tensor = block.forward(x)
            return out
        top_weight, top_idx = route(x, self.gate.weight, self.top_k, self.norm_topk)
        routed = self.experts(x, top_idx, top_weight.to(x.dtype))
        shared = sigmoid(project(x, self.shared_gate)) * self.shared_expert(x)
        return routed + shared
