"""Gemma 4 GGUF files (hub/gguf_gemma4.py, models/formats/gguf_gemma4_loader.py) written here from
the tiny transformers models of tests/test_gemma4.py as llama.cpp's converter writes them (per-layer
head sizes and KV heads, the k = v global layers without attn_v, rope_freqs, fused experts,
per-layer embeddings), and through llama.cpp's own quantizer. Checked: the F32 file converted equals
transformers and its greedy tokens equal llama.cpp's (llama-cpp-python) for both shapes; the
quantized files run natively (--dtype gguf: every operand in its blocks, both embedding tables left
in theirs) with logits that agree with llama.cpp's on the same file, the second start reads the
packed copy (same bits), n-gram speculation equals plain decoding, and a file that lacks a tensor is
refused naming it; the C++ layers give the Python layers' bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from kernel_checks import needs_kernel
from parity import c_layers_equal_python_layers
from test_gemma4 import hf_model
from test_gguf_loader import PROMPT, all_logits, logits_agree_with_llama_cpp

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.hub.gguf_write import llama_cpp_tensors, write_gguf
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.gemma4 import Gemma4LM
from quickdraft.models.layers import GGUFEmbedding
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation


def write_gemma4(path: Path, shape: str, calm: bool = False) -> tuple[Any, Path]:
    hf = hf_model(shape, calm=calm)
    cfg = hf.config.to_dict()
    return hf, write_gguf(path, "gemma4", cfg, llama_cpp_tensors(hf.state_dict(), "gemma4", cfg))


def generate(lm: LoadedModel, ids: list[int], n: int, spec: Any = None) -> list[int]:
    req = lm.new_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in stream(lm, req, spec):
        pass
    return req.output_ids


@pytest.mark.parametrize("shape", ["dense", "e2b-moe"])
def test_f32_file_equals_transformers_and_llama_cpp(shape: str, home: Path, tmp_path: Path) -> None:
    """The converted F32 file: fp32 logits equal transformers' on the weights it was written
    from, and 40 greedy tokens equal llama.cpp's on the same file."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import LlamaCpp

    hf, path = write_gemma4(tmp_path / f"gemma4-{shape}.gguf", shape)
    lm = load(str(path), "fp32", progress=False)
    assert isinstance(lm.model, Gemma4LM)
    ids = lm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(all_logits(lm, torch.tensor(ids)), theirs, atol=1e-4, rtol=1e-4)
    reference = LlamaCpp(path, torch.get_num_threads(), 256).generate(ids, 40, ()).tokens
    assert generate(lm, ids, 40) == reference


# dense in llama.cpp's Q4_K_M mix; the MoE in Q8_0 (at Q4 a random router's near-ties send a
# row or two to other experts in one engine than in the other)
QUANTIZED = [("dense", "Q4_K_M"), ("e2b-moe", "Q8_0")]


@needs_kernel
@pytest.mark.parametrize(("shape", "qtype"), QUANTIZED, ids=[s for s, _ in QUANTIZED])
def test_quantized_file_runs_natively_and_agrees_with_llama_cpp(
    shape: str, qtype: str, home: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import llama_cpp_quantize

    _, f32 = write_gemma4(tmp_path / f"gemma4-{shape}.gguf", shape, calm=True)
    path = tmp_path / f"gemma4-{shape}-{qtype}.gguf"
    llama_cpp_quantize(f32, path, qtype, torch.get_num_threads())
    lm = load(str(path), "gguf", progress=False)
    model = lm.model
    assert isinstance(model, Gemma4LM)
    layer = model.decoder_layers[0]
    assert isinstance(layer.self_attn.qkv, GGUFWeight) and isinstance(model.head, GGUFWeight)
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    if model.config.ple_size:
        assert isinstance(model.model.embed_tokens_per_layer, GGUFEmbedding)
        assert isinstance(layer.per_layer_input_gate.op, GGUFWeight)
    if model.config.moe:
        assert layer.experts.operands is not None
        assert all(isinstance(w, GGUFWeight) for pair in layer.experts.operands for w in pair)
    c_layers_equal_python_layers(model)
    ids = lm.tokenizer.encode(PROMPT)
    mine = all_logits(lm, torch.tensor(ids))
    logits_agree_with_llama_cpp(path, ids, mine)
    again = load(str(path), "gguf", progress=False)  # the packed copy
    assert torch.equal(all_logits(again, torch.tensor(ids)), mine)
    spec = make_speculation(lm, SpeculativeConfig(method="ngram", num_draft_tokens=4))
    for prompt in (PROMPT, "the cat sat on the mat. the cat sat on"):
        ids = lm.tokenizer.encode(prompt)
        assert generate(lm, ids, 32, spec) == generate(lm, ids, 32)


def test_a_file_that_lacks_a_tensor_is_refused_by_name(home: Path, tmp_path: Path) -> None:
    hf = hf_model("e2b-moe")
    cfg = hf.config.to_dict()
    tensors = llama_cpp_tensors(hf.state_dict(), "gemma4", cfg)
    del tensors["blk.1.post_ffw_norm_2.weight"]
    path = write_gguf(tmp_path / "gemma4-cut.gguf", "gemma4", cfg, tensors)
    assert gguf.GGUFReader(str(path)).tensors  # a readable file
    with pytest.raises(Exception, match=r"blk\.1\.post_ffw_norm_2\.weight"):
        load(str(path), "gguf", progress=False)
