"""Gemma 3 (models/families/gemma3.py) from a GGUF file in llama.cpp's naming: a tiny random-weight
`gemma3` file (6 layers: 5 local with an 8-key sliding window, 1 global; norms stored as
llama.cpp stores them, 1 + w) written with gguf-py. Checked: the fp32 model equals
transformers' Gemma3ForCausalLM on the converted weights (logits, 32 greedy tokens) and
llama.cpp on the same F32 file (60 greedy tokens), every context long past the window; the
GGUF's own quantized weights run close to the dequantized model; a verify's rows equal decode
steps bit for bit across the window's edge, and greedy n-gram speculation equals plain
decoding."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import quantize
from kernel_checks import needs_kernel
from test_linear_gguf import random_blocks

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.engine.core import EngineCore
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.hub.gguf_write import add_tiny_tokenizer
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.loading import LoadedModel, load
from quickdraft.models.formats.gguf_loader import GGUFTensorError
from quickdraft.models.formats.packed_copy import PACKED_NAME
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB, WINDOW = 128, 4, 2, 64, 256, 6, 300, 8
F32 = dict.fromkeys(
    ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
    "F32",
)
QUANT = dict(  # as gemma-3-270m's Q4_K_M file: Q8_0 table, Q5_0 q/k/gate/up, K-quants
    token_embd="Q8_0",
    attn_q="Q5_0",
    attn_k="Q5_0",
    attn_v="Q8_0",
    attn_output="Q4_K",
    ffn_gate="Q5_0",
    ffn_up="Q5_0",
    ffn_down="Q6_K",
)
PROMPT = "Hello world, this is a test of a tiny model."


def write_tiny_gemma3(path: Path, types: dict[str, str], seed: int = 0) -> Path:
    """A `gemma3` GGUF with a byte-level BPE tokenizer (hub/gguf_write.py's, <bos> <eos>, no
    chat template: a base model) and random weights; each weight of kind k in `types[k]`; the
    head tied to the table."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(WINDOW)
    add_tiny_tokenizer(w, VOCAB, ("<bos>", "<eos>"), "<bos>", "<eos>", chat_template=None)

    def matrix(name: str, n: int, k: int) -> None:
        qtype = types[name.split(".")[-2]]
        values = (rng.standard_normal((n, k)) * 0.08).astype(np.float32)
        if qtype == "F32":
            w.add_tensor(name, values)
        elif qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):  # gguf-py quantizes these
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, quantize(values, qt), raw_dtype=qt)
        else:  # K-quants: valid random blocks
            raw = random_blocks(qtype, n, k, seed=int(rng.integers(1 << 30)))
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])

    def norm(name: str, n: int) -> None:  # llama.cpp's 1 + w
        w.add_tensor(name, rng.uniform(0.7, 1.3, n).astype(np.float32))

    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    matrix("token_embd.weight", VOCAB, HIDDEN)
    norm("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        pre = f"blk.{i}."
        for kind in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(f"{pre}{kind}.weight", HIDDEN)
        norm(pre + "attn_q_norm.weight", HEAD_DIM)
        norm(pre + "attn_k_norm.weight", HEAD_DIM)
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def f32_file(home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gguf") / "gemma3-f32.gguf", F32, seed=3)


def greedy(lm: LoadedModel, ids: list[int], n: int, spec: Any = None) -> tuple[list[int], int]:
    """(n greedy tokens after `ids`, drafts accepted)."""
    req = lm.new_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in stream(lm, req, spec):
        pass
    return req.output_ids, req.spec.accepted


def test_f32_file_equals_transformers(f32_file: Path) -> None:
    """The F32 file converted to fp32 safetensors: transformers' Gemma3ForCausalLM on those
    weights gives our logits (every prompt position, past the window) and greedy tokens."""
    import transformers

    lm = load(str(f32_file), "fp32", progress=False)
    ids = lm.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * WINDOW
    hf = transformers.Gemma3ForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32)
    assert hf.config.layer_types.count("full_attention") == 1  # layer 5 global, 0-4 local
    net: Any = lm.model
    ours = net(
        torch.tensor(ids), [net.new_cache(64)], [len(ids)], logit_rows=torch.arange(len(ids))
    ).logits
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=5e-5, rtol=1e-4)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_length=0)
    assert greedy(lm, ids, 32)[0] == out[0, len(ids) :].tolist()


def test_greedy_tokens_equal_llama_cpp_on_the_same_f32_file(f32_file: Path) -> None:
    """llama.cpp as an independent oracle on the same random F32 file: 60 greedy tokens, the
    context passing the 8-key window many times."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import LlamaCpp

    lm = load(str(f32_file), "fp32", progress=False)
    ids = lm.tokenizer.encode(PROMPT)
    theirs = LlamaCpp(f32_file, torch.get_num_threads(), 256).generate(ids, 60, ()).tokens
    assert greedy(lm, ids, 60)[0] == theirs


@pytest.fixture(scope="module")
def quant(home: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    path = write_tiny_gemma3(tmp_path_factory.mktemp("gguf") / "gemma3-q.gguf", QUANT)
    return path, load(str(path), "gguf", progress=False)


def test_quantized_file_runs_its_own_formats_close_to_dequantized(
    quant: tuple[Path, LoadedModel],
) -> None:
    path, lm = quant
    net: Any = lm.model
    attn = net.decoder_layers[0].self_attn
    assert [p.fmt.name for p in attn.qkv.parts] == ["Q5_0", "Q5_0", "Q8_0"]
    assert isinstance(net.head, GGUFWeight) and net.head.parts[0].fmt.name == "Q8_0"
    ids = torch.tensor(lm.tokenizer.encode(PROMPT))
    deq: Any = load(str(path), "bf16", progress=False).model
    rows = torch.arange(len(ids))
    ours = net(ids, [net.new_cache(64)], [len(ids)], logit_rows=rows).logits
    ref = deq(ids, [deq.new_cache(64)], [len(ids)], logit_rows=rows).logits
    cos = F.cosine_similarity(ours, ref, dim=-1)
    assert float(cos.min()) > 0.99, cos


@needs_kernel
def test_verify_rows_equal_decode_steps_across_the_window(
    quant: tuple[Path, LoadedModel],
) -> None:
    """k + 1 rows in one forward give each row the bits of k + 1 one-row forwards, also where
    the rows' windows start at different keys (positions 5..20 with an 8-key window)."""
    _, lm = quant
    net: Any = lm.model
    ids = torch.tensor(lm.tokenizer.encode(PROMPT + PROMPT))
    for start, k in ((5, 15), (9, 4), (14, 7)):
        decode = net.new_cache(64)
        net(ids[:start], [decode], [start])
        decode.commit(start)
        steps = []
        for j in range(k + 1):
            steps.append(net(ids[start + j : start + j + 1], [decode], [1]).logits[-1])
            decode.commit(start + j + 1)
        verify = net.new_cache(64)
        net(ids[:start], [verify], [start])
        verify.commit(start)
        rows = torch.arange(k + 1)
        out = net(ids[start : start + k + 1], [verify], [k + 1], logit_rows=rows).logits
        for j, step in enumerate(steps):
            assert torch.equal(out[j], step), f"start {start}, k={k}: row {j} differs"


@needs_kernel
@pytest.mark.parametrize("which", ["gguf", "f32"])
def test_ngram_speculation_equals_plain_decoding(
    which: str, quant: tuple[Path, LoadedModel], f32_file: Path
) -> None:
    """Greedy n-gram speculation, drafting forced, gives plain decoding's 80 tokens, with
    drafts accepted and rejected (rollbacks) far past the window."""
    lm = quant[1] if which == "gguf" else load(str(f32_file), "fp32", progress=False)
    ids = lm.tokenizer.encode(PROMPT)
    plain, _ = greedy(lm, ids, 80)
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=4, ngram_min=1, adaptive=False)
    spec = make_speculation(lm, cfg)
    tokens, accepted = greedy(lm, ids, 80, spec)
    assert tokens == plain
    assert accepted > 0


def test_gelu_rows_are_batch_invariant() -> None:
    """The MLP's gelu: a row's bits alone equal its bits among M rows, for a width whose
    tail torch handles by position (2053); torch's whole-tensor gelu fails this here."""
    from quickdraft.kernels.pointwise import gelu_tanh_rows

    x = torch.randn(9, 2 * 2053, generator=torch.Generator().manual_seed(0))[:, :2053]
    rows = gelu_tanh_rows(x)
    for i in range(len(x)):
        assert torch.equal(gelu_tanh_rows(x[i : i + 1])[0], rows[i]), i
    whole = F.gelu(x, approximate="tanh")
    alone = torch.stack([F.gelu(r, approximate="tanh") for r in x.unbind(0)])
    assert not torch.equal(whole, alone)  # why the rows go one at a time


def test_second_load_reads_the_packed_copy(quant: tuple[Path, LoadedModel]) -> None:
    """The packed copy written beside the model on the first load gives a Gemma3LM with the
    same bits (its norms, already shifted to HF's w, are not shifted twice)."""
    path, first = quant
    assert (first.path / PACKED_NAME).is_file()
    second = load(str(path), "gguf", progress=False)
    ids = torch.tensor(first.tokenizer.encode(PROMPT))
    nets: list[Any] = [first.model, second.model]
    outs = [n(ids, [n.new_cache(64)], [len(ids)], logit_rows=torch.arange(len(ids))) for n in nets]
    assert torch.equal(outs[0].logits, outs[1].logits)


@needs_kernel
def test_requests_decoded_together_equal_each_alone(quant: tuple[Path, LoadedModel]) -> None:
    """Two sequences at different positions (different window starts) in one packed forward
    per step give each the tokens it gets alone."""
    _, lm = quant
    prompts = [lm.tokenizer.encode(PROMPT), lm.tokenizer.encode("Short one.")]
    alone = [greedy(lm, ids, 40)[0] for ids in prompts]
    core = EngineCore(lm, SchedulerConfig(max_running=2))
    reqs = [lm.new_request(ids, SamplingParams(max_tokens=40, ignore_eos=True)) for ids in prompts]
    for req in reqs:
        core.add(req, None)
    while core.has_work:
        core.step()
    assert core.stats.max_batch == 2
    assert [r.output_ids for r in reqs] == alone


def test_missing_tensor_is_named(home: Path, tmp_path: Path) -> None:
    """A gemma3 file without one of its norms fails naming the tensor, on both load paths."""
    full = write_tiny_gemma3(tmp_path / "full.gguf", F32)
    reader = gguf.GGUFReader(str(full))
    w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "gemma3")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for t in reader.tensors:
        if t.name != "blk.2.post_ffw_norm.weight":
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFTensorError, match=re.escape("'blk.2.post_ffw_norm.weight'")):
        load(str(tmp_path / "cut.gguf"), "gguf", progress=False)
    with pytest.raises(ValueError, match="post_feedforward_layernorm"):
        load(str(tmp_path / "cut.gguf"), "fp32", progress=False)
