"""GGUF block formats on a GPU (kernels/triton_gguf.py): the Triton GEMM computes the CPU
kernel's function (`GGUFWeight.reference_linear`) for every format, M = 1..33 and fused
operands of mixed formats; a row's bits do not depend on the other rows; the table lookup gives
the gguf package's values; the device layout holds the file's exact parts; and a tiny GGUF
model moved to the device layout (models/formats/gguf_gpu.py) runs behind GraphModel with the CPU
model's logits, its verify rows equal to its decode steps bit for bit. Without a GPU the kernels run
in Triton's interpreter on CPU tensors (conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from test_gguf_loader import HIDDEN, PROMPT, TYPES, VOCAB, write_tiny_gguf

from quickdraft.kernels import triton_gguf, triton_ops
from quickdraft.kernels.gemm import dequantized_rows, panel_rows, project
from quickdraft.kernels.linear_gguf import FORMATS, GGUFWeight, decode, random_blocks
from quickdraft.loading import load
from quickdraft.models.families.llama import CausalLM
from quickdraft.models.formats.gguf_gpu import random_q4_k_m_, to_device_, weight_bytes
from quickdraft.models.formats.loader import load_model
from quickdraft.models.graphs import GraphModel
from quickdraft.models.layers import OperandModule

pytestmark = pytest.mark.skipif(
    not triton_ops.installed(), reason="needs triton (CUDA torch wheels ship it)"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = sorted(triton_gguf.DEVICE_FORMATS, key=list(FORMATS).index)


def weight(name: str, n: int, k: int, seed: int = 0) -> tuple[GGUFWeight, np.ndarray]:
    raw = random_blocks(FORMATS[name], n, k, seed=seed)
    return GGUFWeight.from_raw(name, raw, k), raw


def in_features(name: str) -> int:
    # K-quants take K % 256 == 0; the 32-value formats get K = 32 (mod 64): a padded block
    return 512 if FORMATS[name].block == 256 else 160


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to fp32 rounding of the block terms (the interpreter gives the same bits)."""
    scale = b.abs().max().item()
    assert (a.float() - b.float()).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("name", NAMES)
def test_layout_holds_the_files_parts(name: str) -> None:
    fmt = FORMATS[name]
    k = in_features(name)
    w, raw = weight(name, 21, k)
    dev = triton_gguf.to_device(w, DEVICE)
    u, sc, m, d, dm = triton_gguf.unpacked(dev.parts[0])
    p = decode(fmt, raw, k)
    want_u = torch.from_numpy(p.u.view(np.int8) if fmt.bits == 8 else p.u).long()
    assert torch.equal(u[:, :k].cpu(), want_u) and not u[:, k:].any()
    assert torch.equal(d[:, : k // fmt.block].cpu(), torch.from_numpy(p.d.astype(np.float64)))
    assert torch.equal(dm[:, : k // fmt.block].cpu(), torch.from_numpy(p.dm.astype(np.float64)))
    if p.sc is not None:
        assert torch.equal(sc.cpu(), torch.from_numpy(p.sc).double())
    if p.m is not None:
        assert torch.equal(m.cpu(), torch.from_numpy(p.m).double())
    # the file's bytes plus the padded block and the fp16 scales' alignment: under 10 %
    assert dev.nbytes <= 1.1 * raw.nbytes * (-(-k // 64) * 64) / k


@pytest.mark.parametrize("name", NAMES)
def test_linear_is_the_cpu_kernels_function(name: str) -> None:
    k = in_features(name)
    w, _ = weight(name, 70, k, seed=1)  # 70 rows: a partial tile of outputs
    dev = triton_gguf.to_device(w, DEVICE)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(33, k, generator=g)
    x[3] = 0.0  # a zero row: dx = 0, output 0
    x[5, :32] *= 40.0  # one block far larger than the rest
    ref = w.reference_linear(x)
    out = triton_gguf.linear(x.to(DEVICE), dev).cpu()
    close(out, ref)
    assert not out[3].any()
    assert torch.equal(triton_gguf.reference_linear(x, triton_gguf.to_device(w, "cpu")), ref)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_a_rows_bits_do_not_depend_on_the_other_rows(name: str) -> None:
    """A decode step (M = 1), a verify (M = 3 .. 16) and a prefill chunk (M = 33, other tiles)
    give row 2 the same bits: greedy speculation equals plain decoding on these weights."""
    k = in_features(name)
    dev = triton_gguf.to_device(weight(name, 48, k, seed=3)[0], DEVICE)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    alone = triton_gguf.linear(x[2:3], dev)
    for m in (*range(3, 17), 33):
        assert torch.equal(triton_gguf.linear(x[:m], dev)[2:3], alone), m


def test_fused_operand_of_mixed_formats_with_bias() -> None:
    """q / k / v in Q4_K, Q8_0, Q6_K (as Q4_K_M files mix them): one output, each part's rows
    by its own kernel, the bias added in fp32, in bf16."""
    parts = [
        weight(n, r, 256, seed=i)[0]
        for i, (n, r) in enumerate([("Q4_K", 64), ("Q8_0", 32), ("Q6_K", 32)])
    ]
    w = GGUFWeight.concat(parts)
    dev = triton_gguf.to_device(w, DEVICE)
    bias = torch.randn(128) * 0.1
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out = project(x.to(DEVICE), dev, bias.to(DEVICE)).cpu()
    ref = w.reference_linear(x, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("name", NAMES)
def test_rows_are_the_gguf_packages_values(name: str) -> None:
    k = in_features(name)
    w, raw = weight(name, 40, k, seed=6)
    dev = triton_gguf.to_device(w, DEVICE)
    ids = torch.tensor([3, 0, 39, 17, 3])
    qtype = GGMLQuantizationType[name]
    want = torch.from_numpy(np.asarray(dequantize(raw[ids.numpy()], qtype), dtype=np.float32))
    got = triton_gguf.rows(dev, ids.to(DEVICE), torch.float32).cpu()
    assert torch.equal(got, want.reshape(len(ids), k))
    bf = triton_gguf.rows(dev, ids.to(DEVICE), torch.bfloat16).cpu()
    want_bf = want.reshape(len(ids), k).to(torch.bfloat16)
    if DEVICE == "cuda":
        assert torch.equal(bf, want_bf)
    else:  # the interpreter rounds fp32 -> bf16 toward zero: one ulp
        torch.testing.assert_close(bf, want_bf, atol=0, rtol=8e-3)


def test_row_slices_and_dequantized_rows() -> None:
    """A restricted draft head: whole rows of the operand, in the same layout; and the rows a
    vocabulary keeps, dequantized."""
    w = GGUFWeight.concat([weight("Q4_K", 40, 256)[0], weight("Q8_0", 24, 256, seed=1)[0]])
    dev = triton_gguf.to_device(w, DEVICE)
    cut = panel_rows(dev, 1, 3)  # rows 16 .. 48: both parts
    assert isinstance(cut, triton_gguf.DeviceGGUFWeight) and cut.shape == (32, 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(7))
    close(triton_gguf.linear(x.to(DEVICE), cut).cpu(), w.reference_linear(x)[:, 16:48])
    rows = dequantized_rows(dev, [0, 45, 63])
    assert rows.device == dev.device  # a restricted head's extra rows stay by its weight
    assert torch.equal(rows.cpu(), w.dequantize(torch.float32)[[0, 45, 63]])


# -- a model on the device layout -----------------------------------------------------------


def operands(model: CausalLM) -> list[Any]:
    return [
        getattr(m, name)
        for m in model.modules()
        if isinstance(m, OperandModule)
        for name in m.OPERANDS
    ]


def moved(path: Path) -> tuple[CausalLM, CausalLM]:
    """(the CPU GGUF model, another copy moved to the device layout), fp32 activations."""
    cpu = load_model(path, torch.float32, "cpu")
    dev = load_model(path, torch.float32, "cpu")
    assert isinstance(cpu, CausalLM) and isinstance(dev, CausalLM)
    return cpu, to_device_(dev, DEVICE)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_model_on_the_device_layout_gives_the_cpu_logits(
    arch: str, home: Path, tmp_path: Path
) -> None:
    """qwen2 (biases, untied Q6_K head, mixed fused formats) and llama (tied Q8_0 table, an
    F16 operand): prefill then a 5-row verify on the Triton kernels, the GGUF operands on the
    device layout against the same forward on the CPU kernels (the pointwise kernels are the
    same: a one-ulp difference in a norm can move an activation across a rounding boundary of
    its int8 quantization, a visible step in the logits). Then each verify row against a
    decode step, bit for bit."""
    gguf_file = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, TYPES[arch])
    lm = load(str(gguf_file), "gguf", progress=False)  # the model directory, packed once
    cpu, dev = moved(lm.path)
    assert isinstance(dev.model.embed_tokens, triton_gguf.DeviceGGUFEmbedding)
    assert isinstance(dev.model.layers[0].self_attn.qkv, triton_gguf.DeviceGGUFWeight)
    if arch == "llama":  # tied: the table is the head's operand; F16 down: a plain tensor
        assert dev.model.embed_tokens.weight is dev.head
        assert isinstance(dev.model.layers[0].mlp.down, torch.Tensor)
    if arch == "qwen2":  # every weight quantized: under 0.4x their bytes in bf16
        bf16 = 2 * sum(w.shape.numel() for w in operands(cpu)) + 2 * VOCAB * HIDDEN
        assert weight_bytes(dev) <= 0.4 * bf16
    net = GraphModel(dev, graphs=False, fused=True)
    ids = torch.tensor(lm.tokenizer.encode(PROMPT))[:22].to(DEVICE)
    rows = torch.arange(3, device=DEVICE)
    ref = GraphModel(cpu, graphs=False, fused=True)
    cache = ref.new_cache(64)
    ref(ids[:18].cpu(), [cache], [18])
    cache.commit(18)
    want = ref(ids[18:21].cpu(), [cache], [3], rows.cpu()).logits
    cache = net.new_cache(64)
    net(ids[:18], [cache], [18])
    cache.commit(18)
    got = net(ids[18:21], [cache], [3], rows).logits.cpu()  # not committed: rolled back
    if DEVICE == "cpu":  # the interpreter's block terms round as the C++ kernel's
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # fused multiply-adds may flip an activation's rounding: the same tokens
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    if arch == "llama":
        return  # its F16 operand is a plain GEMM, which does not promise batch invariance
    for j in range(3):
        step = net(ids[18 + j : 19 + j], [cache], [1]).logits[-1].cpu()
        cache.commit(19 + j)
        assert torch.equal(step, got[j]), f"row {j}"


def test_formats_without_a_device_kernel_are_dequantized_on_the_device(
    home: Path, tmp_path: Path
) -> None:
    """A file whose down projection is IQ4_XS and table Q3_K (formats the CPU kernels run but
    the device layout does not take): those operands move as their exact values in bf16, the
    others keep the device layout, and the logits stay the CPU kernels'; the device layout
    itself refuses the format by name."""
    types = {**TYPES["qwen2"], "ffn_down": "IQ4_XS", "token_embd": "Q3_K"}
    gguf_file = write_tiny_gguf(tmp_path / "tiny-iq.gguf", "qwen2", types)
    lm = load(str(gguf_file), "gguf", progress=False)
    cpu, dev = moved(lm.path)
    down_cpu = cpu.model.layers[0].mlp.down
    assert isinstance(down_cpu, GGUFWeight) and down_cpu.parts[0].fmt.name == "IQ4_XS"
    with pytest.raises(ValueError, match="IQ4_XS has no GPU kernel"):
        triton_gguf.to_device(down_cpu, DEVICE)
    down = dev.model.layers[0].mlp.down
    assert isinstance(down, torch.Tensor) and down.dtype == torch.bfloat16
    assert torch.equal(down.cpu(), down_cpu.dequantize(torch.bfloat16))
    assert isinstance(dev.model.layers[0].self_attn.qkv, triton_gguf.DeviceGGUFWeight)
    assert not isinstance(dev.model.embed_tokens, triton_gguf.DeviceGGUFEmbedding)
    ids = torch.tensor(lm.tokenizer.encode(PROMPT))[:12]
    want = GraphModel(cpu, graphs=False, fused=True)
    got = GraphModel(dev, graphs=False, fused=True)
    a, b = want.new_cache(32), got.new_cache(32)
    ref = want(ids, [a], [12], torch.arange(12)).logits
    out = got(ids.to(DEVICE), [b], [12], torch.arange(12, device=DEVICE)).logits.cpu()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_random_q4_k_m_model_runs_and_rows_equal_steps(tiny_model_dir: Path) -> None:
    """The benchmarks' stand-in for a real GGUF (random weights in Q4_K_M's formats, made on
    the device): it runs behind GraphModel, and a 4-row verify gives each row the bits of its
    decode step."""
    model = load_model(tiny_model_dir, torch.float32, DEVICE)
    assert isinstance(model, CausalLM)
    random_q4_k_m_(model, seed=3)
    kinds = {p.fmt.name for w in operands(model) for p in w.parts}
    assert kinds <= set(FORMATS) and "Q8_0" in kinds  # hidden 64: the K-quants' fallbacks
    net = GraphModel(model, graphs=False, fused=True)
    ids = torch.arange(3, 15, device=DEVICE)
    cache = net.new_cache(32)
    net(ids[:8], [cache], [8])
    cache.commit(8)
    verify = net(ids[8:12], [cache], [4], torch.arange(4, device=DEVICE)).logits
    assert torch.isfinite(verify).all()
    for j in range(4):
        step = net(ids[8 + j : 9 + j], [cache], [1]).logits[-1]
        cache.commit(9 + j)
        assert torch.equal(step, verify[j]), f"row {j}"


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_swiglu_is_the_gemm_then_silu_mul(name: str) -> None:
    """The fused gate / up GEMM (one launch) gives the bits of the GEMM followed by
    triton_ops.silu_mul, in bf16; gate and up of two formats fall back to that pair."""
    k = in_features(name)
    gate, up = weight(name, 48, k, seed=8)[0], weight(name, 48, k, seed=9)[0]
    dev = triton_gguf.to_device(GGUFWeight.concat([gate, up]), DEVICE)
    assert len(dev.parts) == 1  # one format: merged, one launch
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    x = x.to(DEVICE)
    fused = triton_gguf.swiglu(x, dev)
    assert torch.equal(fused, triton_ops.silu_mul(triton_gguf.linear(x, dev)))
    assert torch.equal(triton_gguf.swiglu(x[2:3], dev), fused[2:3])
    if k == 512:
        other = weight("Q6_K", 48, 512)[0]
        mixed = triton_gguf.to_device(GGUFWeight.concat([gate, other]), DEVICE)
        assert len(mixed.parts) == 2
        want = triton_ops.silu_mul(triton_gguf.linear(x, mixed))
        assert torch.equal(triton_gguf.swiglu(x, mixed), want)


def test_moving_a_model_leaves_no_tensor_behind(home: Path, tmp_path: Path) -> None:
    """to_device_ onto the meta device (a stand-in for a GPU that any CPU tensor left behind
    would meet): the operands' parts, the table, the parameters, the q/k/v bias and the rope
    tables all move."""
    gguf_file = write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", TYPES["qwen2"])
    lm = load(str(gguf_file), "gguf", progress=False)
    model = load_model(lm.path, torch.bfloat16, "cpu")
    assert isinstance(model, CausalLM)
    to_device_(model, "meta")
    left = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            values = value.parts if isinstance(value, triton_gguf.DeviceGGUFWeight) else [value]
            for v in values:
                tensors = v.tensors() if isinstance(v, triton_gguf.DeviceGGUFPart) else [v]
                left += [
                    f"{name}.{attr}"
                    for t in tensors
                    if isinstance(t, torch.Tensor) and t.device.type != "meta"
                ]
        left += [
            f"{name}.{p}"
            for p, t in module.named_parameters(recurse=False)
            if t.device.type != "meta"
        ]
    left += [
        k
        for k, t in vars(model.rope).items()
        if isinstance(t, torch.Tensor) and t.device.type != "meta"
    ]
    assert not left, left
    assert model.device.type == "meta"
