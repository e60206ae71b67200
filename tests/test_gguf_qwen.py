"""GGUF files of the Qwen3-MoE and hybrid Qwen3-Next / Qwen3.5 / Qwen3.5-MoE families
(hub/gguf_qwen.py): a tiny random-weight transformers model of each arch is written as a GGUF
the way llama.cpp's converter writes it (names, metadata, 1 + w norms, -exp(A_log), squeezed
conv, split qkvz, tiled value heads, split experts, the MTP head as `blk.{n}.nextn.*`), in F32
and with the projections in Q8_0. quickdraft converts the file and gives transformers' logits
and 32 greedy tokens; with --dtype gguf it runs the Q8_0 blocks themselves, close to the
dequantized model; on the hybrids MTP speculation from the GGUF's nextn tensors equals
speculation off (converted and native); bad files fail naming the tensor or arch; and on the
F32 files quickdraft's greedy tokens equal llama.cpp's (the `peers` extra) for 64 tokens, MTP
on or off."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hybrid_models import copying_head, one_thread, randomize  # noqa: F401 (autouse fixture)
from parity import c_layers_equal_python_layers
from test_gguf_loader import PROMPT, all_logits, logits_agree_with_llama_cpp
from torch import Tensor

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.hub.errors import HubError
from quickdraft.hub.gguf_qwen import HYBRID_ARCHS, MOE_ARCHS
from quickdraft.hub.gguf_write import add_tiny_tokenizer, llama_cpp_tensors, write_gguf
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.moe import Experts
from quickdraft.models.families.qwen3_next import HybridLM
from quickdraft.models.formats.packed_copy import PACKED_NAME
from quickdraft.models.layers import GGUFEmbedding
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.drafters.mtp import load_mtp_head
from quickdraft.speculation.factory import make_speculation

pytestmark = pytest.mark.usefixtures("home")  # models convert into a throw-away QUICKDRAFT_HOME
VOCAB = 320
ARCHS = ["qwen3moe", "qwen3next", "qwen35", "qwen35moe"]
HYBRID = HYBRID_ARCHS
_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_GDN: dict[str, Any] = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # 2 value heads per key head: the reorders matter
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3moe": dict(
        model_type="qwen3_moe",
        num_hidden_layers=3,
        intermediate_size=96,
        norm_topk_prob=True,  # llama.cpp always renormalizes
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_BASE,
        **_MOE,
    ),
    "qwen3next": dict(
        model_type="qwen3_next",
        intermediate_size=96,
        shared_expert_intermediate_size=48,
        **_BASE,
        **_GDN,
        **_MOE,
    ),
    "qwen35": dict(model_type="qwen3_5_text", intermediate_size=96, **_BASE, **_GDN),
    # its shared expert a whole Q8_0 block wide, so the MoE block is one C++ call
    "qwen35moe": dict(
        model_type="qwen3_5_moe_text", shared_expert_intermediate_size=32, **_BASE, **_GDN, **_MOE
    ),
}


@dataclass
class Files:
    arch: str
    hf: Any  # the transformers model (fp32)
    f32: Path
    q8: Path
    mtp: dict[str, Tensor]  # the MTP head written into the hybrids' files (`mtp.*`)


def reference(arch: str, seed: int = 1, out_scale: float = 1.0) -> Any:
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**HF_CONFIGS[arch])
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    randomize(hf, seed, out_scale, offset=arch in HYBRID)
    return hf.eval()


def head_state(hf: Any, arch: str, directory: Path) -> dict[str, Tensor]:
    """`mtp.*` tensors of a head that agrees with the target often (tests/hybrid_models.py's
    copying head), built on our model class of the same weights."""
    from quickdraft.models.formats.loader import load_model

    hf.save_pretrained(directory)
    ours = load_model(directory, torch.float32)
    assert isinstance(ours, HybridLM)
    return {f"mtp.{k}": v for k, v in copying_head(ours).state_dict().items()}


@pytest.fixture(scope="module", params=ARCHS)
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Files:
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    hf = reference(arch, out_scale=0.3 if arch in HYBRID else 1.0)
    mtp = head_state(hf, arch, tmp / "hf") if arch in HYBRID else {}
    tensors = llama_cpp_tensors(dict(hf.state_dict()) | mtp, arch, HF_CONFIGS[arch])
    cfg = HF_CONFIGS[arch]
    return Files(
        arch,
        hf,
        write_gguf(tmp / f"{arch}-f32.gguf", arch, cfg, tensors),
        write_gguf(tmp / f"{arch}-q8_0.gguf", arch, cfg, tensors, "Q8_0"),
        mtp,
    )


def generate(lm: LoadedModel, ids: list[int], spec: Any = None, tokens: int = 32) -> Request:
    req = lm.new_request(ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
    for _ in stream(lm, req, spec):
        pass
    return req


def hf_greedy(hf: Any, ids: Tensor, tokens: int = 32) -> list[int]:
    hf.generation_config.eos_token_id = None  # all `tokens`, as ignore_eos on our side
    with torch.no_grad():
        out = hf.generate(ids[None], max_new_tokens=tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_f32_gguf_equals_transformers(files: Files) -> None:
    """The F32 file, converted (fp32): transformers' logits (5e-5) and 32 greedy tokens."""
    lm = load(str(files.f32), "fp32", progress=False)
    ids = torch.tensor(lm.tokenizer.encode(PROMPT))
    with torch.no_grad():
        theirs = files.hf(ids[None]).logits[0]
    torch.testing.assert_close(all_logits(lm, ids), theirs, atol=5e-5, rtol=1e-4)
    assert generate(lm, ids.tolist()).output_ids == hf_greedy(files.hf, ids)


def test_q8_0_gguf_equals_transformers_on_its_weights(files: Files) -> None:
    """The Q8_0 file dequantized: transformers' class loads the converted directory and gives
    quickdraft's logits and greedy tokens; the weights moved from the F32 file's by Q8_0's
    rounding only."""
    import transformers

    lm = load(str(files.q8), "fp32", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32)
    ids = torch.tensor(lm.tokenizer.encode(PROMPT))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(all_logits(lm, ids), theirs, atol=5e-5, rtol=1e-4)
    table = lm.model.get_parameter("model.embed_tokens.weight")  # type: ignore[attr-defined]
    err = (table - files.hf.get_parameter("model.embed_tokens.weight")).abs().max()
    assert 0 < float(err) < 0.01  # Q8_0: a step of absmax / 127 per 32 weights
    assert generate(lm, ids.tolist()).output_ids == hf_greedy(hf, ids)


MTP = SpeculativeConfig(method="mtp", num_draft_tokens=4, adaptive=False)


@pytest.mark.parametrize(
    ("which", "dtype"), [("f32", "fp32"), ("q8", "fp32"), ("q8", "gguf")], ids=str
)
def test_mtp_from_the_gguf_nextn_tensors_equals_plain(files: Files, which: str, dtype: str) -> None:
    """--speculative-method mtp with nothing but the GGUF: the head comes from its
    blk.{n}.nextn.* block (converted, or run in its Q8_0 blocks with --dtype gguf); 48 greedy
    tokens on 3 prompts equal speculation off, with drafts accepted."""
    if files.arch not in HYBRID:
        pytest.skip("qwen3moe has no MTP head")
    lm = load(str(getattr(files, which)), dtype, progress=False)
    spec = make_speculation(lm, MTP)
    accepted = 0
    for prompt in (PROMPT, "the cat sat on the mat. the cat", "1, 2, 3, 4,"):
        ids = lm.tokenizer.encode(prompt)
        plain, fast = generate(lm, ids, None, 48), generate(lm, ids, spec, 48)
        assert fast.output_ids == plain.output_ids, prompt
        accepted += fast.spec.accepted
    assert accepted > 0


def test_layers_run_as_one_c_call_each(files: Files) -> None:
    """In their Q8_0 blocks every layer is one C++ call with the Python layers' bits: Qwen3-MoE's
    (attention, then the MoE block's one call), Qwen3.5's and Qwen3.5-MoE's Gated DeltaNet and
    gated-attention layers (Qwen3-Next's interleaved in-projection keeps its Python layers)."""
    model = load(str(files.q8), "gguf", progress=False).model
    if files.arch == "qwen3next":
        assert model._fused_layers() is None
        return
    c_layers_equal_python_layers(model)


def test_mtp_head_layer_is_one_c_call(files: Files) -> None:
    """The GGUF nextn head in its Q8_0 blocks runs its layer as one C++ call with the Python
    layer's bits: two chained steps over two sequences (logits, outputs, KV rows)."""
    if files.arch not in ("qwen35", "qwen35moe"):  # qwen3next: its 48-wide shared expert
        pytest.skip(f"{files.arch}: no head, or its MoE block is not one call here")
    lm = load(str(files.q8), "gguf", progress=False)
    head = load_mtp_head(lm.model, lm.path)
    assert head._fused_layer() is not None
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(7, HF_CONFIGS[files.arch]["hidden_size"], generator=g)

    def run(fused: bool) -> list[Tensor]:
        head._fused = None if fused else False
        caches, outs = [head.new_cache(16), head.new_cache(16)], []
        for counts in ([4, 3], [1, 2]):
            n = sum(counts)
            ids = torch.arange(n) * 5 % VOCAB
            outs += head(ids, hidden[:n], caches, counts, torch.arange(n))
            for c, k in zip(caches, counts, strict=True):
                c.commit(c.length + k)
        return outs + [t[:, :, : c.length] for c in caches for t in (c.k, c.v)]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)
    head._fused = None


def test_mtp_head_cut_to_the_first_ids_keeps_their_logits_and_greedy_output(
    files: Files,
) -> None:
    """`--draft-vocab` on the GGUF nextn head (its Q8_0 blocks): the head is the target head's
    first panels in their own blocks (views of them), so those ids' logits are the full head's
    bit for bit, the end-of-generation id past them is dequantized beside (close), every other
    id is -inf; MTP speculation with the cut head still equals plain decoding, with drafts
    accepted."""
    if files.arch not in HYBRID:
        pytest.skip("qwen3moe has no MTP head")
    lm = load(str(files.q8), "gguf", progress=False)
    full, cut = load_mtp_head(lm.model, lm.path), load_mtp_head(lm.model, lm.path)
    cut.keep_first_(100, [300])  # 100 -> 112 ids (whole 16-row panels) and id 300
    # the kept panels are views of the target's head, which stays: no second copy
    mine, target = cut.lm_head_weight, lm.model.head  # type: ignore[attr-defined]
    assert isinstance(mine, GGUFWeight) and isinstance(target, GGUFWeight)
    assert mine.parts[0].packed.data_ptr() == target.parts[0].packed.data_ptr()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, HF_CONFIGS[files.arch]["hidden_size"], generator=g)
    ids = torch.tensor([3, 17, 42, 99, 250])

    def logits(head: Any) -> Tensor:
        return head(ids, hidden, [head.new_cache(8)], [5], torch.arange(5))[0]

    a, b = logits(full), logits(cut)
    assert b.shape == a.shape == (5, VOCAB)
    assert torch.equal(b[:, :112], a[:, :112])
    torch.testing.assert_close(b[:, 300], a[:, 300], atol=0.05, rtol=0.05)
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[:112], others[300] = False, False
    assert bool((b[:, others] == float("-inf")).all())

    spec = make_speculation(lm, dataclasses.replace(MTP, draft_vocab=160))
    assert spec is not None and spec.drafter.head.vocab is not None  # type: ignore[attr-defined]
    accepted = 0
    for prompt in (PROMPT, "the cat sat on the mat. the cat"):
        prompt_ids = lm.tokenizer.encode(prompt)
        plain, fast = generate(lm, prompt_ids, None, 48), generate(lm, prompt_ids, spec, 48)
        assert fast.output_ids == plain.output_ids, prompt
        accepted += fast.spec.accepted
    assert accepted > 0


def test_mtp_head_from_the_f32_file_is_the_head_written(files: Files) -> None:
    """The F32 file's nextn block, converted, gives back every `mtp.*` tensor written (to the
    fp32 rounding of the norms' 1 + w). A writer that stored eh_proj shifted by 1 like the
    norms made a head of noise whose drafts were almost never accepted; speculation stayed
    lossless, so only this showed it."""
    if files.arch not in HYBRID:
        pytest.skip("qwen3moe has no MTP head")
    lm = load(str(files.f32), "fp32", progress=False)
    head = load_mtp_head(lm.model, lm.path)
    for name, written in files.mtp.items():
        got = head.get_parameter(name[len("mtp.") :])
        torch.testing.assert_close(got, written, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def hybrid_tensors() -> dict[str, Tensor]:
    return llama_cpp_tensors(dict(reference("qwen35").state_dict()), "qwen35", HF_CONFIGS["qwen35"])


def test_gguf_without_nextn_says_so_when_mtp_is_asked(
    hybrid_tensors: dict[str, Tensor], tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "plain.gguf", "qwen35", HF_CONFIGS["qwen35"], hybrid_tensors)
    lm = load(str(path), "fp32", progress=False)
    assert len(generate(lm, [1, 2, 3], None, 4).output_ids) == 4  # runs without a head
    with pytest.raises(ValueError, match="nextn"):
        make_speculation(lm, MTP)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("drop", "lacks tensor 'blk.1.ssm_a'"),
        ("reshape", "tensor 'blk.2.attn_gate.weight' has shape"),
        ("extra", "no place in the model: ['blk.0.ffn_gate_exps.weight']"),
    ],
)
def test_bad_tensor_is_named(
    hybrid_tensors: dict[str, Tensor], tmp_path: Path, edit: str, message: str
) -> None:
    tensors = dict(hybrid_tensors)
    if edit == "drop":
        del tensors["blk.1.ssm_a"]
    elif edit == "reshape":
        tensors["blk.2.attn_gate.weight"] = tensors["blk.2.attn_gate.weight"][:-32]
    else:
        tensors["blk.0.ffn_gate_exps.weight"] = torch.zeros(2, 32, 64)
    path = write_gguf(tmp_path / f"{edit}.gguf", "qwen35", HF_CONFIGS["qwen35"], tensors)
    with pytest.raises(HubError, match=re.escape(message)):
        load(str(path), "fp32", progress=False)


def test_truncated_file_names_the_tensor_it_cuts(files: Files, tmp_path: Path) -> None:
    """A download cut short: the error names the tensor whose data runs past the end (with
    its type and shape), before any weight is read."""
    data = files.q8.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(
        HubError, match=r"tensor \S+ \(\w+ \(.*\)\) ends at byte [\d,]+ but the file has"
    ):
        load(str(cut), "gguf", progress=False)


def test_second_load_reads_the_packed_copy(files: Files) -> None:
    """The first --dtype gguf load writes the packed copy (routed experts, Gated DeltaNet head
    orders and all); the second reads it, repacks nothing and gives the same logits bit for
    bit; a damaged copy is ignored and rewritten, and an older layout's copy removed."""
    first = load(str(files.q8), "gguf", progress=False)
    packed = first.path / PACKED_NAME
    before = packed.stat()
    ids = torch.tensor(first.tokenizer.encode(PROMPT))
    second = load(str(files.q8), "gguf", progress=False)
    after = packed.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert torch.equal(all_logits(second, ids), all_logits(first, ids))
    experts = [m for m in second.model.modules() if isinstance(m, Experts)]
    assert bool(experts) == (files.arch in MOE_ARCHS)
    assert all(isinstance(m.operands[0][0], GGUFWeight) for m in experts)  # type: ignore[index]
    packed.write_bytes(packed.read_bytes()[:-100])
    stale = packed.with_name("packed-v1.safetensors")  # an older layout's copy: no start reads it
    stale.write_bytes(b"old")
    third = load(str(files.q8), "gguf", progress=False)
    assert torch.equal(all_logits(third, ids), all_logits(first, ids))
    assert packed.stat().st_size == before.st_size
    assert not stale.exists()


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "qwen4")
    add_tiny_tokenizer(w, VOCAB)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        HubError, match=r"architecture 'qwen4' is not supported \(supported: .*qwen35moe"
    ):
        load(str(tmp_path / "odd.gguf"), "fp32", progress=False)


@pytest.fixture(scope="module")
def llama_cpp() -> Iterator[Any]:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import LlamaCpp

    yield LlamaCpp


def test_greedy_tokens_equal_llama_cpp_on_the_f32_file(files: Files, llama_cpp: Any) -> None:
    """llama.cpp as an independent reading of the same F32 file: 64 greedy tokens equal,
    for the hybrids also with quickdraft's MTP speculation on."""
    lm = load(str(files.f32), "fp32", progress=False)
    ids = lm.tokenizer.encode(PROMPT)
    try:
        peer = llama_cpp(files.f32, torch.get_num_threads(), 256)
    except (ValueError, RuntimeError) as e:  # a llama.cpp build that lacks the arch
        pytest.skip(f"this llama.cpp cannot load {files.arch}: {e}")
    theirs = peer.generate(ids, 64, ()).tokens
    assert generate(lm, ids, None, 64).output_ids == theirs
    if files.arch in HYBRID:  # and with MTP speculation on (lossless: the same tokens)
        fast = generate(lm, ids, make_speculation(lm, MTP), 64)
        assert fast.output_ids == theirs and fast.spec.accepted > 0


def test_llama_cpp_quantized_file_runs_in_its_blocks(
    files: Files, llama_cpp: Any, tmp_path: Path
) -> None:
    """The F32 file through llama.cpp's own quantizer (Q4_K_M; at these widths it falls back
    to Q5_0 / Q8_0 tensor by tensor, so fused operands join formats): --dtype gguf runs its
    blocks close to the dequantized file, and on the hybrids MTP from its quantized nextn block
    equals speculation off, with drafts accepted."""
    from quickdraft.bench.peers import llama_cpp_quantize

    path = tmp_path / f"{files.arch}-q4_k_m.gguf"
    llama_cpp_quantize(files.f32, path, "Q4_K_M", torch.get_num_threads())
    native = load(str(path), "gguf", progress=False)
    assert isinstance(native.model.head, GGUFWeight)  # type: ignore[attr-defined]
    ids = native.tokenizer.encode(PROMPT)
    mine = all_logits(native, torch.tensor(ids))
    ref = all_logits(load(str(path), "fp32", progress=False), torch.tensor(ids))
    cos = torch.nn.functional.cosine_similarity(mine.float(), ref, dim=-1)
    assert float(cos.median()) > 0.999 and float(cos.min()) > 0.95, cos
    if files.arch in HYBRID:
        spec = make_speculation(native, MTP)
        accepted = 0
        for prompt in (PROMPT, "the cat sat on the mat. the cat", "1, 2, 3, 4,"):
            ids = native.tokenizer.encode(prompt)
            fast = generate(native, ids, spec, 48)
            assert fast.output_ids == generate(native, ids, None, 48).output_ids, prompt
            accepted += fast.spec.accepted
        assert accepted > 0


def test_mxfp4_experts_run_in_their_blocks(files: Files, llama_cpp: Any, tmp_path: Path) -> None:
    """llama.cpp's MXFP4_MOE file type (gpt-oss's: the routed experts in MXFP4): the grouped
    experts run those blocks natively, and the logits agree with llama.cpp's on the same file
    and with the file dequantized."""
    if files.arch not in MOE_ARCHS:
        pytest.skip(f"{files.arch} has no experts")
    from quickdraft.bench.peers import llama_cpp_quantize

    path = tmp_path / f"{files.arch}-mxfp4.gguf"
    llama_cpp_quantize(files.f32, path, "MXFP4_MOE", torch.get_num_threads())
    native = load(str(path), "gguf", progress=False)
    experts = [m for m in native.model.modules() if isinstance(m, Experts)]  # type: ignore[attr-defined]
    formats = {p.fmt.name for m in experts for ws in m.operands or () for w in ws for p in w.parts}  # type: ignore[union-attr]
    assert experts and formats == {"MXFP4"}, formats
    ids = native.tokenizer.encode(PROMPT)
    mine = all_logits(native, torch.tensor(ids))
    logits_agree_with_llama_cpp(path, ids, mine)
    deq = all_logits(load(str(path), "fp32", progress=False), torch.tensor(ids))
    cos = torch.nn.functional.cosine_similarity(mine.float(), deq, dim=-1)
    assert float(cos.min()) >= 0.98, cos  # the hybrids: the helper says why


def test_gguf_weights_run_in_their_blocks(files: Files) -> None:
    """--dtype gguf: every projection (attention, Gated DeltaNet in/out, experts, shared
    expert, head) stays a Q8_0 GGUFWeight and the embedding table a GGUFEmbedding, their rows
    reordered as llama.cpp's converter requires; the logits agree with the dequantized model's
    (the kernel rounds activations to int8 per block, so not bit for bit; a wrong row order
    would give cosines far below 0.9)."""
    native = load(str(files.q8), "gguf", progress=False)
    net: Any = native.model
    assert isinstance(net.head, GGUFWeight)
    assert isinstance(net.model.embed_tokens, GGUFEmbedding)  # the table in its blocks too
    for layer in net.model.layers:
        mixer = (
            layer.linear_attn if getattr(layer, "layer_type", "") == "linear_attention" else None
        )
        ops = (
            [mixer.inp, mixer.out]
            if mixer is not None
            else [layer.self_attn.qkv, layer.self_attn.o]
        )
        if files.arch in ("qwen35",):
            ops += [layer.mlp.gate_up, layer.mlp.down]
        else:
            ops += [w for pair in layer.mlp.experts.operands for w in pair]
        assert all(isinstance(w, GGUFWeight) for w in ops)
    ids = torch.tensor(native.tokenizer.encode(PROMPT))
    mine = all_logits(native, ids)
    ref = all_logits(load(str(files.q8), "fp32", progress=False), ids)
    cos = torch.nn.functional.cosine_similarity(mine.float(), ref, dim=-1)
    # a routed expert can flip where two router logits nearly tie: one row may part further
    assert float(cos.median()) > 0.999 and float(cos.min()) > 0.95, cos
    assert float((mine.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8
