"""The grouped routed-expert kernel (kernels/moe_gguf.py, moe_gguf.cpp): one call per MoE layer
equals the per-expert loop bit for bit, for the block-format mixes GGUF files hold, rows alone
and inside any batch, on every GEMM tile this CPU has; the MoE blocks take it for GGUF experts."""

from __future__ import annotations

import functools

import pytest
import torch
from kernel_checks import needs_kernel
from test_linear_gguf import random_blocks
from torch import Tensor

from quickdraft.kernels import kernel_calls
from quickdraft.kernels.gemm import Weight, project
from quickdraft.kernels.linear_bf16 import PanelWeight
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.kernels.moe_gguf import grouped_experts, reference_experts
from quickdraft.kernels.pointwise import gelu_mul, sigmoid
from quickdraft.models.families.gpt_oss import GptOssConfig, GptOssMoE
from quickdraft.models.families.moe import Experts, RoutedMoE, SparseMoE, route

pytestmark = [pytest.mark.usefixtures("kernels_enabled"), needs_kernel]

H, INTER, E = 512, 256, 6  # hidden, expert width (one super-block each), experts
# (gate, up, down) formats: a Q4_K_M file's experts, Q5_K_M's, a Q4_0 file's, a Q8_0 file's,
# gpt-oss's MXFP4, unsloth's low-bit dynamic mixes
MIXES = [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q6_K"), ("Q4_0", "Q4_0", "Q4_0")]
MIXES += [("Q8_0", "Q8_0", "Q8_0"), ("MXFP4", "MXFP4", "MXFP4")]
MIXES += [("Q2_K", "Q2_K", "Q3_K"), ("IQ4_XS", "IQ4_XS", "IQ4_NL")]


@functools.cache
def experts(mix: tuple[str, str, str], inter: int = INTER) -> list[tuple[Weight, Weight]]:
    gate, up, down = mix
    out: list[tuple[Weight, Weight]] = []
    for e in range(E):
        gate_up = GGUFWeight.concat(
            [
                GGUFWeight.from_raw(gate, random_blocks(gate, inter, H, seed=3 * e), H),
                GGUFWeight.from_raw(up, random_blocks(up, inter, H, seed=3 * e + 1), H),
            ]
        )
        out.append(
            (gate_up, GGUFWeight.from_raw(down, random_blocks(down, H, inter, 3 * e + 2), inter))
        )
    return out


def routing(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """x [n, H] and top-k choices: distinct experts per row in random order, random weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    weight = torch.rand(n, k, generator=g).to(dtype)
    return x, idx, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["xfp32", "xbf16"])
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "+".join(m))
@pytest.mark.parametrize("n,k", [(1, 1), (1, 4), (3, 2), (16, 4), (40, 3)], ids=str)
def test_grouped_equals_per_expert_reference(
    mix: tuple[str, str, str], dtype: torch.dtype, n: int, k: int, gguf_tile: str
) -> None:
    ops = experts(mix)
    kernel = grouped_experts(ops, H)
    assert kernel is not None
    x, idx, weight = routing(n, k, dtype, seed=n + k)
    before = kernel_calls()
    out = kernel.forward(x, idx, weight)
    assert kernel_calls() == before + 1
    ref = reference_experts(x, idx, weight, ops)
    assert out.dtype == dtype and out.shape == (n, H)
    assert torch.equal(out, ref)
    assert out.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["xfp32", "xbf16"])
def test_grouped_rows_are_batch_invariant(dtype: torch.dtype, gguf_tile: str) -> None:
    """A row's bits inside any batch of M = 2..16 (others routed elsewhere or to the same
    experts) are the bits it gets alone: a decode step and a verify pass agree."""
    ops = experts(MIXES[0])
    kernel = grouped_experts(ops, H)
    x, idx, weight = routing(16, 4, dtype, seed=7)
    alone = torch.cat(
        [kernel.forward(x[i : i + 1], idx[i : i + 1], weight[i : i + 1]) for i in range(16)]
    )
    for m in range(2, 17):
        assert torch.equal(kernel.forward(x[:m], idx[:m], weight[:m]), alone[:m]), f"M={m}"


def gpt_oss_moe(mix: tuple[str, str, str], dtype: torch.dtype) -> GptOssMoE:
    """A gpt-oss MoE block over GGUF experts of `mix` (H = 512, E = 6, top 4) with random
    biases in `dtype` and a random router."""
    cfg = GptOssConfig.from_dict(
        {
            "model_type": "gpt_oss",
            "vocab_size": 64,
            "hidden_size": H,
            "intermediate_size": INTER,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_local_experts": E,
            "num_experts_per_tok": 4,
        }
    )
    moe = GptOssMoE(cfg, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(E, H, generator=g) * 0.05)
        moe.router.bias.copy_(torch.randn(E, generator=g) * 0.1)

    def bias(n: int) -> Tensor:
        return (torch.randn(n, generator=g) * 0.5).to(dtype)

    moe.operands = [(gu, bias(2 * INTER), dn, bias(H)) for gu, dn in experts(mix)]
    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["xfp32", "xbf16"])
@pytest.mark.parametrize("mix", [("MXFP4",) * 3, MIXES[0]], ids=lambda m: "+".join(m))
def test_grouped_gpt_oss_experts_equal_the_reference(
    mix: tuple[str, str, str], dtype: torch.dtype, gguf_tile: str
) -> None:
    """gpt-oss's experts (biases on both GEMMs, the clamped swiglu) in one grouped call: the
    bits of the per-expert loop, for every batch size, and a row's bits alone (activations
    large enough that the clamps at +-7 bite)."""
    moe = gpt_oss_moe(mix, dtype)
    x = (torch.randn(16, H, generator=torch.Generator().manual_seed(12)) * 4).to(dtype)
    logits = project(x, moe.router.weight, moe.router.bias)
    top_value, idx = torch.topk(logits, 4, dim=-1)
    weight = torch.softmax(top_value.float(), dim=-1)
    kernel = moe.grouped_kernel()
    assert kernel is not None
    before = kernel_calls()
    out = kernel.forward(x, idx, weight)
    assert kernel_calls() == before + 1
    assert torch.equal(out, moe.reference(x, idx, weight))
    assert torch.equal(moe(x), out)  # the block's forward takes the kernel
    alone = torch.cat(
        [kernel.forward(x[i : i + 1], idx[i : i + 1], weight[i : i + 1]) for i in range(16)]
    )
    for m in (1, 2, 5, 16):
        assert torch.equal(kernel.forward(x[:m], idx[:m], weight[:m]), alone[:m]), f"M={m}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["xfp32", "xbf16"])
@pytest.mark.parametrize("mix", [MIXES[0], MIXES[3]], ids=lambda m: "+".join(m))
def test_grouped_gemma4_experts_equal_the_reference(
    mix: tuple[str, str, str], dtype: torch.dtype, gguf_tile: str
) -> None:
    """Gemma 4's experts (the GeGLU, gelu row by row) in one grouped call: the bits of the
    per-expert loop with pointwise.gelu_mul, and a row's bits alone; moe.Experts with that
    activation takes the kernel."""
    ops = experts(mix)
    kernel = grouped_experts(ops, H, gelu=True)
    assert kernel is not None
    x, idx, weight = routing(16, 4, dtype, seed=21)
    out = kernel.forward(x, idx, weight)
    assert torch.equal(out, reference_experts(x, idx, weight, ops, gelu_mul))
    assert not torch.equal(out, reference_experts(x, idx, weight, ops))  # not silu's
    alone = torch.cat(
        [kernel.forward(x[i : i + 1], idx[i : i + 1], weight[i : i + 1]) for i in range(16)]
    )
    for m in (1, 3, 16):
        assert torch.equal(kernel.forward(x[:m], idx[:m], weight[:m]), alone[:m]), f"M={m}"
    block = Experts(E, H, INTER, dtype, torch.device("cpu"), gelu_mul)
    block.operands = ops
    before = kernel_calls()
    assert torch.equal(block(x, idx, weight), out)
    assert kernel_calls() == before + 1


def test_grouped_takes_widths_of_32_block_formats() -> None:
    """An expert width of 3 blocks of 32 (a Q4_0 / Q8_0 file's; K-quants need 256s)."""
    mix = ("Q4_0", "Q4_0", "Q8_0")
    ops = experts(mix, inter=96)
    kernel = grouped_experts(ops, H)
    x, idx, weight = routing(5, 2, torch.bfloat16, seed=3)
    assert torch.equal(kernel.forward(x, idx, weight), reference_experts(x, idx, weight, ops))


def test_grouped_refuses_what_it_cannot_run() -> None:
    ops = experts(MIXES[0])
    dense: list[tuple[Weight, Weight]] = [(torch.zeros(2 * INTER, H), torch.zeros(H, INTER))] * E
    assert grouped_experts(dense, H) is None  # an unquantized file's experts: the loop runs them
    mixed = [*ops[:-1], experts(MIXES[1])[-1]]
    assert grouped_experts(mixed, H) is None  # experts of different formats
    kernel = grouped_experts(ops, H)
    x, idx, weight = routing(2, 2, torch.bfloat16)
    with pytest.raises(RuntimeError, match="expert id 6 out of range"):
        kernel.forward(x, torch.tensor([[0, 6], [1, 2]]), weight)
    with pytest.raises(RuntimeError, match="x must be"):
        kernel.forward(x[:, :256], idx, weight)


@pytest.mark.parametrize("shared", [None, "tensor", "panels"], ids=["routed", "sparse", "panels"])
@pytest.mark.parametrize("n", [1, 5, 9, 300])
def test_moe_block_in_one_call_equals_its_python_ops(shared: str | None, n: int) -> None:
    """RoutedMoE (Qwen3-MoE) and SparseMoE (+ the gated shared expert, Qwen3.5-MoE) over GGUF
    blocks run as one call with the bits of their ops run one by one from Python; the shared
    gate as a plain tensor or packed in panels (what a loaded model holds). 300 rows: a
    prompt's, split between the threads in the per-row work (ops.h qd_rows_grain)."""
    torch.manual_seed(n)
    cpu = torch.device("cpu")
    moe: RoutedMoE | SparseMoE = (
        SparseMoE(H, E, 2, INTER, INTER, True, torch.bfloat16, cpu)
        if shared
        else RoutedMoE(H, E, 2, INTER, True, torch.bfloat16, cpu)
    )
    moe.gate.weight.copy_(torch.randn(E, H).bfloat16())
    ops = experts(MIXES[0])
    moe.experts.operands = list(ops)
    if isinstance(moe, SparseMoE):
        moe.shared_expert.gate_up, moe.shared_expert.down = experts(MIXES[1])[0]
        moe.shared_gate = (torch.randn(1, H) * 0.05).bfloat16()
        if shared == "panels":
            moe.shared_gate = PanelWeight.pack(moe.shared_gate)
    x = torch.randn(n, H).bfloat16()
    before = kernel_calls()
    out = moe(x)
    # router, experts (the shared expert's gate_up and down in their regions), the shared
    # gate: the kernels, each once
    assert kernel_calls() - before == (3 if shared else 2)
    assert moe._one_call.kernel is not None
    top_weight, top_idx = route(x, moe.gate.weight, 2, True)
    ref = reference_experts(x, top_idx, top_weight.bfloat16(), ops)
    if isinstance(moe, SparseMoE):
        ref = ref + sigmoid(project(x, moe.shared_gate)) * moe.shared_expert(x)
    assert torch.equal(out, ref)


def test_routed_moe_takes_the_grouped_kernel_for_gguf_experts() -> None:
    """RoutedMoE over GGUF experts runs its experts as one grouped call, with the loop's bits."""
    torch.manual_seed(0)
    moe = RoutedMoE(H, E, 2, INTER, True, torch.bfloat16, torch.device("cpu"))
    moe.gate.weight.copy_(torch.randn(E, H).bfloat16())
    ops = experts(MIXES[0])
    moe.experts.operands = list(ops)
    x = torch.randn(9, H).bfloat16()
    out = moe(x)
    assert moe.experts._grouped is not None
    top_weight, top_idx = route(x, moe.gate.weight, 2, True)
    assert torch.equal(out, reference_experts(x, top_idx, top_weight.bfloat16(), ops))
