# ~500 lines on purpose: most of it writes the tiny GGUF files (tokenizer, three architectures,
# mixed formats) that every loader test reads.
"""Models run on a GGUF file's own quantized weights (models/formats/gguf_loader.py, `--dtype
gguf`): tiny random GGUF files written with gguf-py (qwen2: q/k/v biases, untied head; llama: tied
embeddings and llama.cpp's permuted q/k rows; qwen3: per-head q/k RMSNorm), weights in a mix of
block formats, loaded end to end through `quickdraft.loading.load` into a throw-away
QUICKDRAFT_HOME. Checked: every operand holds the file's values, logits agree with the dequantized
(bf16) model, the packed copy beside the model gives the same bits, damaged copies and bad files
fail or recover clearly, the C++ layers run the GGUF operands batch-invariantly, and on F32 files
the greedy tokens equal llama.cpp's (the `peers` extra)."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize
from kernel_checks import needs_kernel
from safetensors import safe_open
from test_linear_gguf import random_blocks
from torch import Tensor

from quickdraft.engine import stream
from quickdraft.hub.errors import HubError
from quickdraft.hub.gguf_write import add_tiny_tokenizer
from quickdraft.kernels import PanelWeight, build, prefetch
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight
from quickdraft.loading import LoadedModel, load
from quickdraft.models.formats.gguf_loader import GGUFTensorError
from quickdraft.models.formats.loader import load_model
from quickdraft.models.formats.packed_copy import PACKED_NAME, operands_of, packed_name
from quickdraft.models.layers import GGUFEmbedding
from quickdraft.request import SamplingParams

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 256, 4, 2, 64, 512, 2, 300
# tensor kind -> GGUF type; a fused q/k/v or gate/up joins formats of both block sizes
TYPES: dict[str, dict[str, str]] = {
    "qwen2": dict(
        token_embd="Q4_K",
        output="Q6_K",
        attn_q="Q4_K",
        attn_k="Q5_0",
        attn_v="Q6_K",
        attn_output="Q4_0",
        ffn_gate="Q5_K",
        ffn_up="Q4_1",
        ffn_down="Q8_0",
    ),
    "qwen3": dict(  # as Qwen3 Q4_K_M files: K-quants, Q6_K for v and down
        token_embd="Q6_K",
        output="Q8_0",
        attn_q="Q4_K",
        attn_k="Q4_K",
        attn_v="Q6_K",
        attn_output="Q5_K",
        ffn_gate="Q4_K",
        ffn_up="Q4_K",
        ffn_down="Q6_K",
    ),
    "llama": dict(  # the tied table is also the head: Q8_0 has a kernel
        token_embd="Q8_0",
        attn_q="Q5_1",
        attn_k="Q4_K",
        attn_v="Q8_0",
        attn_output="Q6_K",
        ffn_gate="Q4_0",
        ffn_up="Q5_K",
        ffn_down="F16",  # a float operand: kept fp16, widened exactly by the linear kernel
    ),
}
PROMPT = "Hello world, this is a test of a tiny model."
LOGGER = "quickdraft.models.formats.gguf_loader"


def write_tiny_gguf(
    path: Path, arch: str, types: dict[str, str], seed: int = 0, extra: dict[str, int] | None = None
) -> Path:
    """A GGUF model file of `arch` with a byte-level BPE tokenizer (the 256 byte symbols, one
    merge "Ġ t", <s> </s> <|im_start|> <|im_end|> as control tokens, padded to VOCAB) and a
    ChatML template; each weight of kind k in `types[k]`; `extra`: more uint32 metadata."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    add_tiny_tokenizer(w, VOCAB)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)

    def matrix(name: str, n: int, k: int) -> None:
        kind = name.split(".")[-2]
        qtype = types[kind]
        values = (rng.standard_normal((n, k)) * 0.08).astype(np.float32)
        if qtype in ("F32", "F16"):
            w.add_tensor(name, values.astype(np.float16 if qtype == "F16" else np.float32))
        elif qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):  # gguf-py quantizes these
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, quantize(values, qt), raw_dtype=qt)
        else:  # K-quants (and types without a kernel): valid random blocks
            raw = random_blocks(qtype, n, k, seed=int(rng.integers(1 << 30)))
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])

    def vector(name: str, n: int, norm: bool = True) -> None:
        v = rng.uniform(0.8, 1.2, n) if norm else rng.standard_normal(n) * 0.1
        w.add_tensor(name, v.astype(np.float32))

    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    matrix("token_embd.weight", VOCAB, HIDDEN)
    vector("output_norm.weight", HIDDEN)
    if arch in ("qwen2", "qwen3"):
        matrix("output.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        pre = f"blk.{i}."
        vector(pre + "attn_norm.weight", HIDDEN)
        vector(pre + "ffn_norm.weight", HIDDEN)
        for kind, n, k in (
            ("attn_q", q_size, HIDDEN),
            ("attn_k", kv_size, HIDDEN),
            ("attn_v", kv_size, HIDDEN),
            ("attn_output", HIDDEN, q_size),
            ("ffn_gate", FFN, HIDDEN),
            ("ffn_up", FFN, HIDDEN),
            ("ffn_down", HIDDEN, FFN),
        ):
            matrix(f"{pre}{kind}.weight", n, k)
        if arch == "qwen2":
            for kind, n in (("attn_q", q_size), ("attn_k", kv_size), ("attn_v", kv_size)):
                vector(f"{pre}{kind}.bias", n, norm=False)
        if arch == "qwen3":
            vector(pre + "attn_q_norm.weight", HEAD_DIM)
            vector(pre + "attn_k_norm.weight", HEAD_DIM)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def all_logits(loaded: LoadedModel, ids: Tensor) -> Tensor:
    """[T, vocab] logits of every prompt position, one prefill (T > 16: the Python layers)."""
    net: Any = loaded.model
    return net(ids, [net.new_cache(64)], [len(ids)], logit_rows=torch.arange(len(ids))).logits


@dataclass
class Built:
    arch: str
    gguf: Path
    first: LoadedModel  # the first load: repacked from the file
    ids: Tensor  # the prompt's token ids
    logits: Tensor  # [len(ids), vocab] of `first`


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3"])
def built(
    request: pytest.FixtureRequest, home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Built:
    arch = request.param
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{arch}.gguf", arch, TYPES[arch])
    first = load(str(path), "gguf", progress=False)
    ids = torch.tensor(first.tokenizer.encode(PROMPT))
    assert len(ids) > 16
    return Built(arch, path, first, ids, all_logits(first, ids))


def file_rows(file: Path, name: str) -> Tensor:
    """A tensor of the file as the gguf package dequantizes it, fp32 ([N, K] for a matrix)."""
    t = next(t for t in gguf.GGUFReader(str(file)).tensors if t.name == name)
    values = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
    return torch.from_numpy(values).reshape([int(d) for d in reversed(t.shape)])


def llama_cpp_permute(w: Tensor, heads: int) -> Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of HF q/k rows (what the file holds)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def operand_values(op: Any) -> Tensor:
    if isinstance(op, Tensor) and op.dtype == torch.float16:  # a file's F16 tensor, as it is
        return op.float()
    assert isinstance(op, GGUFWeight | PanelWeight), type(op)
    return op.dequantize(torch.float32)


def test_operands_hold_the_files_values(built: Built) -> None:
    """Every projection of layer 0 and the head, dequantized, equals the gguf package's
    dequantization of its tensors (llama: q/k rows permuted back, checked by re-applying
    llama.cpp's own permutation); the embedding and biases too. A GGUF operand keeps each
    tensor's format, part by part."""
    net: Any = built.first.model
    f, types = built.gguf, TYPES[built.arch]
    attn, mlp = net.decoder_layers[0].self_attn, net.decoder_layers[0].mlp
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    assert [p.fmt.name for p in attn.qkv.parts] == [
        types[k] for k in ("attn_q", "attn_k", "attn_v")
    ]
    qkv = operand_values(attn.qkv)
    q, k, v = qkv[:q_size], qkv[q_size : q_size + kv_size], qkv[q_size + kv_size :]
    if built.arch == "llama":
        q, k = llama_cpp_permute(q, HEADS), llama_cpp_permute(k, KV_HEADS)
    assert torch.equal(q, file_rows(f, "blk.0.attn_q.weight"))
    assert torch.equal(k, file_rows(f, "blk.0.attn_k.weight"))
    assert torch.equal(v, file_rows(f, "blk.0.attn_v.weight"))
    assert torch.equal(operand_values(attn.o), file_rows(f, "blk.0.attn_output.weight"))
    gate_up = torch.cat(
        [file_rows(f, "blk.0.ffn_gate.weight"), file_rows(f, "blk.0.ffn_up.weight")]
    )
    assert torch.equal(operand_values(mlp.gate_up), gate_up)
    down = file_rows(f, "blk.0.ffn_down.weight")
    if types["ffn_down"] == "F16":  # kept fp16, the file's values exactly
        assert isinstance(mlp.down, Tensor) and mlp.down.dtype == torch.float16
    assert torch.equal(operand_values(mlp.down), down)
    table = file_rows(f, "token_embd.weight")
    head = table if built.arch == "llama" else file_rows(f, "output.weight")
    assert torch.equal(operand_values(net.head), head)
    emb = net.model.embed_tokens
    assert isinstance(emb, GGUFEmbedding)
    assert torch.equal(emb(built.ids), table[built.ids].to(net.dtype))
    # the dequantized rows kept between lookups: the same values, one token at a time, after
    # rows were evicted, and for a chunk longer than the cache
    emb.CACHED_ROWS = 3
    for i in [*built.ids.tolist(), *built.ids.tolist()]:
        one = torch.tensor([i])
        assert torch.equal(emb(one), table[one].to(net.dtype))
    assert len(emb._rows) <= 3
    assert torch.equal(emb(built.ids), table[built.ids].to(net.dtype))
    norm = net.decoder_layers[0].input_layernorm.weight
    assert torch.equal(norm, file_rows(f, "blk.0.attn_norm.weight").to(norm.dtype))
    if built.arch == "qwen2":
        bias = torch.cat([file_rows(f, f"blk.0.attn_{x}.bias") for x in "qkv"])
        assert torch.equal(attn.qkv_bias, bias.to(attn.qkv_bias.dtype))
    else:
        assert attn.qkv_bias is None
    if built.arch == "qwen3":
        for norm, name in ((attn.q_norm, "attn_q_norm"), (attn.k_norm, "attn_k_norm")):
            expected = file_rows(f, f"blk.0.{name}.weight").to(norm.weight.dtype)
            assert torch.equal(norm.weight, expected), name
    else:
        assert attn.q_norm is None and attn.k_norm is None


def test_logits_close_to_the_dequantized_model(built: Built) -> None:
    """The same weights either way; the GGUF kernel rounds activations to int8 per block,
    the bf16 model rounds weights to bf16: the logits agree closely, row by row."""
    deq = load(str(built.gguf), "bf16", progress=False)
    assert not isinstance(deq.model.head, GGUFWeight)  # type: ignore[attr-defined]
    ref = all_logits(deq, built.ids)
    assert built.logits.shape == ref.shape == (len(built.ids), VOCAB)
    cos = F.cosine_similarity(built.logits, ref, dim=-1)
    assert float(cos.min()) > 0.99, cos
    same = (built.logits.argmax(-1) == ref.argmax(-1)).float().mean()
    assert float(same) >= 0.8


def test_second_load_reads_the_packed_copy(built: Built, caplog: pytest.LogCaptureFixture) -> None:
    packed = built.first.path / PACKED_NAME
    before = packed.stat()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        second = load(str(built.gguf), "gguf", progress=False)
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert second.path == built.first.path
    after = packed.stat()  # not rewritten: no repack happened
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    net: Any = second.model
    assert isinstance(net.head, GGUFWeight)
    assert torch.equal(all_logits(second, built.ids), built.logits)
    with safe_open(str(packed), framework="pt") as f:  # a valid safetensors file
        assert torch.equal(f.get_tensor("head.0"), net.head.parts[0].packed)


def test_load_measures_the_prefetch_distance_over_the_models_operands(
    built: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model past prefetch.MIN_BYTES (here: any) is timed at load over its own operands and
    the best distance set; a model no larger loaded next (a draft) keeps it; the logits are
    the same bits whatever the distance."""
    if not build.kernels_available():
        pytest.skip("no CPU kernels here")
    ext = build.extension()
    default, default_32 = build.prefetch_bytes(), build.prefetch_bytes_32()
    monkeypatch.setattr(build, "_prefetch_setting", None)
    monkeypatch.setattr(build, "_tuned", None)
    monkeypatch.setattr(prefetch, "MIN_BYTES", 0)
    try:
        lm = load(str(built.gguf), "gguf", progress=False)
        tuned = build.tuned()
        assert tuned is not None and tuned.distance in prefetch.CANDIDATES
        ops = operands_of(lm.model)
        assert tuned.model_bytes == sum(prefetch.operand_bytes(w) for w in ops) > 0
        assert torch.equal(all_logits(lm, built.ids), built.logits)
        load(str(built.gguf), "gguf", progress=False)
        assert build.tuned() is tuned
    finally:
        ext.set_prefetch_bytes(default, default_32)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantized_draft_weights_from_the_gguf_are_kept(built: Built, quant: str) -> None:
    """int4 / int8 weights made from a GGUF's exact values (a draft model's), written beside
    it once: the second load reads that copy and gives the first's logits; the weights are
    the GGUF's within the format's rounding."""
    first = load(str(built.gguf), "gguf", progress=False, quantization=quant)
    net: Any = first.model
    kind = Int4Weight if quant == "int4" else Int8Weight
    assert isinstance(net.head, kind) and isinstance(net.decoder_layers[0].mlp.down, kind)
    copy = first.path / packed_name(quant)
    stamp = copy.stat().st_mtime_ns
    logits = all_logits(first, built.ids)
    second = load(str(built.gguf), "gguf", progress=False, quantization=quant)
    assert copy.stat().st_mtime_ns == stamp
    assert torch.equal(all_logits(second, built.ids), logits)
    own: Any = load(str(built.gguf), "gguf", progress=False).model
    pairs = [(net.head, own.head), (net.decoder_layers[0].mlp.down, own.decoder_layers[0].mlp.down)]
    for mine, theirs in pairs:
        w, ref = mine.dequantize(torch.float32), operand_values(theirs)
        err = float((w - ref).norm() / ref.norm())  # int4: steps of range / 15 per 32 weights
        assert err < (0.15 if quant == "int4" else 0.01), err
        # converted a block of rows at a time as the file is read: exactly what quantizing
        # the whole operand, in bf16, gives
        whole = kind.quantize(ref.bfloat16())
        assert torch.equal(mine.packed, whole.packed)


def damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif how == "garbage-header":
        file.write_bytes(b"\xff" * 64 + data[64:])
    else:
        file.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "garbage-header", "empty"])
def test_damaged_packed_copy_is_ignored_and_rewritten(
    built: Built, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    packed = built.first.path / PACKED_NAME
    size = packed.stat().st_size
    damage(packed, how)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        again = load(str(built.gguf), "gguf", progress=False)
    assert "ignoring" in caplog.text and PACKED_NAME in caplog.text
    assert torch.equal(all_logits(again, built.ids), built.logits)
    assert packed.stat().st_size == size  # repacked and written again


@pytest.mark.parametrize(
    ("kind", "qtype", "message"),
    [
        ("ffn_down", "IQ2_XXS", "'blk.0.ffn_down.weight' is IQ2_XXS"),
        ("ffn_down", "IQ3_S", "'blk.0.ffn_down.weight' is IQ3_S"),
        ("attn_k", "F32", "'blk.0.attn_k.weight'"),  # a float part in a quantized q/k/v
    ],
)
def test_tensor_without_a_kernel_is_named(
    home: Path, tmp_path: Path, kind: str, qtype: str, message: str
) -> None:
    """A tensor in a type with no kernel here (or a fused operand mixing float and quantized
    parts) fails naming it; the dequantized (bf16) model of the same file still loads."""
    path = write_tiny_gguf(tmp_path / "odd.gguf", "qwen2", {**TYPES["qwen2"], kind: qtype})
    with pytest.raises(GGUFTensorError, match=re.escape(message)) as err:
        load(str(path), "gguf", progress=False)
    assert "bf16" in str(err.value)  # says what to do instead
    deq = load(str(path), "bf16", progress=False)
    ids = torch.tensor(deq.tokenizer.encode(PROMPT))
    assert bool(all_logits(deq, ids).isfinite().all())


def test_fused_operand_mixing_float_and_quantized_says_so(home: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "mixed.gguf", "qwen2", {**TYPES["qwen2"], "attn_k": "F32"})
    with pytest.raises(GGUFTensorError, match="mix float and quantized"):
        load(str(path), "gguf", progress=False)


CUTS = {
    "metadata": lambda n: 2000,
    "tensor-data": lambda n: n * 6 // 10,
    "last-byte": lambda n: n - 1,
}


@pytest.mark.parametrize("cut", list(CUTS))
def test_truncated_gguf_behind_a_model_directory_is_named(
    built: Built, tmp_path: Path, cut: str
) -> None:
    """A "gguf" model directory whose linked file was cut short (and no packed copy yet):
    a GGUFTensorError naming the file, not a numpy error or a crash."""
    data = built.gguf.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[: CUTS[cut](len(data))])
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in built.first.path.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, model_dir / f.name)
    os.symlink(short, model_dir / "model.gguf")
    with pytest.raises(GGUFTensorError, match=r"not a readable GGUF file"):
        load_model(model_dir, torch.bfloat16)
    assert not (model_dir / PACKED_NAME).exists()


def test_truncated_gguf_file_given_to_load_is_named(built: Built, tmp_path: Path) -> None:
    data = built.gguf.read_bytes()
    short = tmp_path / "cut-short.gguf"
    short.write_bytes(data[: len(data) * 6 // 10])
    with pytest.raises(HubError, match=re.escape(short.name)):
        load(str(short), "gguf", progress=False)


def reloaded(built: Built) -> Any:
    """The model as `load` makes it (float operands in panels), from the packed copy."""
    net: Any = load_model(built.first.path, torch.bfloat16)
    net.pack_()
    return net


@needs_kernel
def test_cpp_layers_equal_python_layers_bitwise(built: Built) -> None:
    """Decode and verify rows through the C++ DenseLayers (GGUF operands, llama's also a
    bf16 panel one) give the bits the Python layers give: the same kernels in the same order.
    The fused model's Python layers raise, so the C++ path is what ran."""
    fused, plain = reloaded(built), reloaded(built)
    plain._fused = False
    assert fused._fused_layers() is not None
    ids = built.ids
    caches = [m.new_cache(64) for m in (fused, plain)]
    for m, cache in zip((fused, plain), caches, strict=True):
        m(ids[:8], [cache], [8])
        cache.commit(8)

    def python_layer_ran(*args: Any) -> Any:
        raise AssertionError("the fused model ran a Python layer")

    for layer in fused.decoder_layers:
        layer.forward_residual = python_layer_ran
    start = 8
    for n in (1, 5, 1, 3):
        outs = [
            m(ids[start : start + n], [c], [n], logit_rows=torch.arange(n), return_hidden=True)
            for m, c in zip((fused, plain), caches, strict=True)
        ]
        assert torch.equal(outs[0].logits, outs[1].logits)
        assert torch.equal(outs[0].hidden, outs[1].hidden)
        for c in caches:
            c.commit(start + n)
        start += n


@needs_kernel
@pytest.mark.parametrize("fused", [True, False], ids=["cpp-layers", "python-layers"])
def test_verify_rows_equal_decode_steps(built: Built, fused: bool) -> None:
    """k + 1 rows in one forward (a verify) give each row the bits of k + 1 one-row forwards
    (decode steps): greedy speculation stays token-identical to plain decoding."""
    net = reloaded(built)
    if not fused:
        net._fused = False
    ids = built.ids
    for k in (1, 4, 7):
        decode = net.new_cache(64)
        net(ids[:6], [decode], [6])
        decode.commit(6)
        steps = []
        for j in range(k + 1):
            steps.append(net(ids[6 + j : 7 + j], [decode], [1]).logits[-1])
            decode.commit(7 + j)
        verify = net.new_cache(64)
        net(ids[:6], [verify], [6])
        verify.commit(6)
        out = net(ids[6 : 7 + k], [verify], [k + 1], logit_rows=torch.arange(k + 1)).logits
        for j, step in enumerate(steps):
            assert torch.equal(out[j], step), f"k={k}: row {j} differs"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_equal_llama_cpp_on_the_same_f32_file(
    arch: str, home: Path, tmp_path: Path
) -> None:
    """llama.cpp as an independent oracle: on the same random F32 GGUF (no quantization on
    either side), quickdraft's fp32 greedy tokens equal llama.cpp's for 60 tokens."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import LlamaCpp

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, dict.fromkeys(TYPES[arch], "F32"), 3)
    lm = load(str(path), "fp32", progress=False)
    ids = lm.tokenizer.encode(PROMPT)
    req = lm.new_request(ids, SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in stream(lm, req):
        pass
    theirs = LlamaCpp(path, torch.get_num_threads(), 256).generate(ids, 60, ()).tokens
    assert req.output_ids == theirs


def logits_agree_with_llama_cpp(path: Path, ids: list[int], ours: Tensor) -> None:
    """Our prompt logits on the GGUF at `path` against llama.cpp's on the same file. Both
    round activations to int8 blocks, differently (llama.cpp's Q8_K / Q8_0 keep an fp16 or
    fp32 scale per block): on these random models that moves the greedy token within a few
    positions even for the Q4_K_M files this suite has long run, so the agreement is of the
    logits (median cosine >= 0.998, >= 0.98 at 90 % of the positions and >= 0.9 at all: the
    hybrids' recurrences carry the rounding along, the file dequantized in fp32 reads 0.985
    against llama.cpp there, and a router's near-tie can send one row to another expert; a
    mis-decoded format is far off) and of most argmaxes."""
    from quickdraft.bench.peers import LlamaCpp

    theirs = torch.from_numpy(LlamaCpp(path, torch.get_num_threads(), 256, True).prompt_logits(ids))
    cos = torch.nn.functional.cosine_similarity(ours.float(), theirs, dim=-1)
    assert float(cos.median()) >= 0.998 and float(cos.min()) >= 0.9, cos
    assert float((cos >= 0.98).float().mean()) >= 0.9, cos
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean()
    assert float(agree) >= 0.8, float(agree)


@pytest.mark.parametrize(
    ("ftype", "formats"),
    [
        ("Q2_K", {"Q2_K", "Q3_K"}),
        ("Q3_K_M", {"Q3_K"}),
        ("IQ4_NL", {"IQ4_NL"}),
        ("IQ4_XS", {"IQ4_XS"}),
    ],
)
def test_llama_cpp_quantized_low_bit_files_run_in_their_blocks(
    ftype: str, formats: set[str], home: Path, tmp_path: Path
) -> None:
    """A random F32 file through llama.cpp's own quantizer as Q2_K, Q3_K_M, IQ4_NL, IQ4_XS
    (the mixes unsloth and bartowski uploads use): --dtype gguf runs every projection in its
    block format, and the logits agree with llama.cpp's on the same file and with the file
    dequantized."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import llama_cpp_quantize

    src = write_tiny_gguf(tmp_path / "f32.gguf", "qwen2", dict.fromkeys(TYPES["qwen2"], "F32"), 3)
    path = tmp_path / f"{ftype}.gguf"
    llama_cpp_quantize(src, path, ftype, torch.get_num_threads())
    native = load(str(path), "gguf", progress=False)
    kinds = {
        p.fmt.name
        for m in native.model.modules()  # type: ignore[attr-defined]
        for w in vars(m).values()
        if isinstance(w, GGUFWeight)
        for p in w.parts
    }
    assert formats <= kinds, kinds
    ids = native.tokenizer.encode(PROMPT)
    mine = all_logits(native, torch.tensor(ids))
    logits_agree_with_llama_cpp(path, ids, mine)
    deq = all_logits(load(str(path), "fp32", progress=False), torch.tensor(ids))
    cos = torch.nn.functional.cosine_similarity(mine.float(), deq, dim=-1)
    assert float(cos.min()) >= 0.995, cos


# one file, ten formats: every block format a fused q/k/v or gate/up may join, the table in
# IQ4_XS, F32 norms and biases
TEN_FORMATS = dict(
    token_embd="IQ4_XS",
    output="Q6_K",
    attn_q="Q3_K",
    attn_k="IQ4_NL",
    attn_v="MXFP4",
    attn_output="Q2_K",
    ffn_gate="Q4_K",
    ffn_up="Q5_K",
    ffn_down="Q8_0",
)


def test_a_file_mixing_ten_formats_loads_natively(home: Path, tmp_path: Path) -> None:
    """Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, IQ4_NL, IQ4_XS, MXFP4 and F32 in one file, q/k/v
    joining three of them: every projection runs in its blocks, the logits agree with the
    dequantized file and with llama.cpp's, and a verify's rows equal its decode steps."""
    path = write_tiny_gguf(tmp_path / "ten.gguf", "qwen2", TEN_FORMATS, seed=5)
    native = load(str(path), "gguf", progress=False)
    net: Any = native.model
    qkv = net.model.layers[0].self_attn.qkv
    assert isinstance(qkv, GGUFWeight)
    assert [p.fmt.name for p in qkv.parts] == ["Q3_K", "IQ4_NL", "MXFP4"]
    assert isinstance(net.head, GGUFWeight)
    ids = native.tokenizer.encode(PROMPT)
    mine = all_logits(native, torch.tensor(ids))
    deq = all_logits(load(str(path), "fp32", progress=False), torch.tensor(ids))
    cos = torch.nn.functional.cosine_similarity(mine.float(), deq, dim=-1)
    assert float(cos.min()) >= 0.995, cos
    steps = []
    cache = net.new_cache(64)
    net(torch.tensor(ids[:8]), [cache], [8])
    cache.commit(8)
    for j in range(4):
        steps.append(net(torch.tensor(ids[8 + j : 9 + j]), [cache], [1]).logits[-1])
        cache.commit(9 + j)
    verify = net.new_cache(64)
    net(torch.tensor(ids[:8]), [verify], [8])
    verify.commit(8)
    rows = net(torch.tensor(ids[8:12]), [verify], [4], logit_rows=torch.arange(4)).logits
    assert all(torch.equal(rows[j], steps[j]) for j in range(4))
    if importlib.util.find_spec("llama_cpp") is not None:
        logits_agree_with_llama_cpp(path, ids, mine)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_file_greedy_equals_transformers(arch: str, home: Path, tmp_path: Path) -> None:
    """The same random F32 GGUF converted to fp32 safetensors: transformers' model class for
    the architecture, on those weights, agrees with ours on the logits and the greedy tokens."""
    import transformers

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, dict.fromkeys(TYPES[arch], "F32"), 3)
    lm = load(str(path), "fp32", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32)
    ids = torch.tensor(lm.tokenizer.encode(PROMPT))
    ours = all_logits(lm, ids)
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=5e-5, rtol=1e-4)
    with torch.no_grad():
        hf_ids = hf.generate(ids[None], max_new_tokens=32, do_sample=False)[0, len(ids) :]
    req = lm.new_request(ids.tolist(), SamplingParams(max_tokens=32, ignore_eos=True))
    for _ in stream(lm, req):
        pass
    assert req.output_ids == hf_ids.tolist()


def test_restricted_vocab_keeps_the_gguf_head_rows(built: Built) -> None:
    """A GGUF head cut to its first panels stays in its block format, and those ids' logits
    are bit for bit the unrestricted model's."""
    cut = load(str(built.gguf), "gguf", progress=False).model
    cut.restrict_vocab_(64, [VOCAB - 1])
    head: Any = cut.head
    assert isinstance(head, GGUFWeight) and head.out_features == 64
    logits = all_logits(load(str(built.gguf), "gguf", progress=False), built.ids)
    ids = built.ids
    mine = cut(ids, [cut.new_cache(len(ids))], [len(ids)], logit_rows=torch.arange(len(ids)))
    assert torch.equal(mine.logits[:, :64], logits[:, :64])
    assert bool((mine.logits[:, 64 : VOCAB - 1] == float("-inf")).all())
    torch.testing.assert_close(mine.logits[:, -1], logits[:, -1], atol=0.1, rtol=0.05)


def test_gguf_architecture_reads_the_header_only(tmp_path: Path) -> None:
    """`gguf_architecture` finds general.architecture after fields of every kind (strings,
    numbers, arrays of numbers and of strings) and says None for a file that is not GGUF."""
    import struct

    from quickdraft.hub.gguf_read import gguf_architecture

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    fields = [
        text("general.name") + struct.pack("<I", 8) + text("tiny"),
        text("x.count") + struct.pack("<IQ", 10, 7),
        text("x.flags") + struct.pack("<IIQ", 9, 7, 3) + bytes([1, 0, 1]),
        text("x.tokens") + struct.pack("<IIQ", 9, 8, 2) + text("a") + text("bc"),
        text("general.architecture") + struct.pack("<I", 8) + text("gemma4-assistant"),
    ]
    path = tmp_path / "header.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)) + b"".join(fields))
    assert gguf_architecture(path) == "gemma4-assistant"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields) - 1) + b"".join(fields[:-1]))
    assert gguf_architecture(path) is None
    (tmp_path / "not.gguf").write_text("hello")
    assert gguf_architecture(tmp_path / "not.gguf") is None
