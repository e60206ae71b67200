# ~400 lines: most of it is the writer that lays a transformers checkpoint out as llama.cpp's
# converter does (every transform it applies), which every test here reads.
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

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from hybrid_models import copying_head, one_thread, randomize  # noqa: F401 (autouse fixture)
from test_gguf_loader import PROMPT, add_tiny_tokenizer, all_logits, home  # noqa: F401 (fixture)
from torch import Tensor

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.hub.errors import HubError
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.loading import LoadedModel, load
from quickdraft.models.qwen3_next import HybridLM
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.factory import make_speculation

pytestmark = pytest.mark.usefixtures("home")  # models convert into a throw-away QUICKDRAFT_HOME
VOCAB = 320
ARCHS = ["qwen3moe", "qwen3next", "qwen35", "qwen35moe"]
HYBRID = ("qwen3next", "qwen35", "qwen35moe")
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
    "qwen35moe": dict(
        model_type="qwen3_5_moe_text", shared_expert_intermediate_size=48, **_BASE, **_GDN, **_MOE
    ),
}
# HF module suffix -> llama.cpp tensor kind (convert_hf_to_gguf's tensor map for these archs)
_KINDS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def tile_v(t: Tensor, dim: int, k_heads: int, per_v: int, head: int) -> Tensor:
    """llama.cpp's Qwen3.5 reorder: value heads grouped per key head -> tiled."""
    shape = list(t.shape)
    grouped = t.reshape(*shape[:dim], k_heads, per_v, head, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def llama_cpp_tensors(
    state: dict[str, Tensor], arch: str, cfg: dict[str, Any]
) -> dict[str, Tensor]:
    """A transformers state dict (+ `mtp.*`) as llama.cpp's converter writes it for `arch`."""
    hybrid = arch in HYBRID
    layers = cfg["num_hidden_layers"]
    nk, nv = cfg.get("linear_num_key_heads", 1), cfg.get("linear_num_value_heads", 1)
    dk, dv = cfg.get("linear_key_head_dim", 1), cfg.get("linear_value_head_dim", 1)
    key_dim, per_v = nk * dk, nv // nk
    tiled = arch in ("qwen35", "qwen35moe")
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        t = t.detach().float().clone()
        if name.startswith("mtp."):  # the head goes in as one more block
            rest = name[len("mtp.") :]
            if rest.startswith("layers.0."):
                name = f"model.layers.{layers}.{rest[len('layers.0.') :]}"
            else:
                nextn = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm"}
                nextn |= {"pre_fc_norm_hidden": "hnorm", "norm": "shared_head_norm"}
                part, suffix = rest.split(".", 1)
                out[f"blk.{layers}.nextn.{nextn[part]}.{suffix}"] = t + (1 if hybrid else 0)
                continue
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            kind = {"model.embed_tokens.weight": "token_embd.weight"}
            kind |= {"lm_head.weight": "output.weight", "model.norm.weight": "output_norm.weight"}
            out[kind[name]] = t + 1 if hybrid and name == "model.norm.weight" else t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(\.weight|\.bias)?", name)
        assert m is not None, name
        blk, module = f"blk.{m[1]}.", m[2]
        if hybrid and module.endswith("norm") and module != "linear_attn.norm":
            t = t + 1  # zero-centred norm weights stored as 1 + w
        if tiled and module.startswith("linear_attn."):
            if module == "linear_attn.in_proj_qkv" or module == "linear_attn.conv1d":
                t = torch.cat([t[: 2 * key_dim], tile_v(t[2 * key_dim :], 0, nk, per_v, dv)])
            elif module == "linear_attn.in_proj_z":
                t = tile_v(t, 0, nk, per_v, dv)
            elif module.rpartition(".")[2] in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
                t = tile_v(t, 0, nk, per_v, 1)
            elif module == "linear_attn.out_proj":
                t = tile_v(t, 1, nk, per_v, dv)
        if module == "post_attention_layernorm":
            out[blk + ("post_attention_norm" if hybrid else "ffn_norm") + ".weight"] = t
        elif module == "linear_attn.A_log":
            out[blk + "ssm_a"] = -torch.exp(t)
        elif module == "linear_attn.dt_bias":
            out[blk + "ssm_dt.bias"] = t
        elif module == "linear_attn.conv1d":
            out[blk + "ssm_conv1d.weight"] = t.squeeze(1)
        elif module == "linear_attn.in_proj_qkvz":  # per key head [q k v z] -> qkv | z
            grouped = t.view(nk, 2 * dk + 2 * per_v * dv, -1)
            q, k, v, z = torch.split(grouped, [dk, dk, per_v * dv, per_v * dv], dim=1)
            out[blk + "attn_qkv.weight"] = torch.cat(
                [q.reshape(key_dim, -1), k.reshape(key_dim, -1), v.reshape(nv * dv, -1)]
            )
            out[blk + "attn_gate.weight"] = z.reshape(nv * dv, -1)
        elif module == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            out[blk + "ffn_gate_exps.weight"] = t[:, :inter]
            out[blk + "ffn_up_exps.weight"] = t[:, inter:]
        elif module == "mlp.experts.down_proj":
            out[blk + "ffn_down_exps.weight"] = t
        elif module == "mlp.shared_expert_gate":
            out[blk + "ffn_gate_inp_shexp.weight"] = t.reshape(-1)
        else:
            out[f"{blk}{_KINDS[module]}{m[3]}"] = t
    return out


def write_gguf(
    path: Path, arch: str, cfg: dict[str, Any], tensors: dict[str, Tensor], quant: bool
) -> Path:
    """The GGUF file: llama.cpp's metadata keys for `arch`; with `quant`, every matrix whose
    rows are whole 32-blocks in Q8_0 (norms, conv, A, dt stay F32 as llama.cpp keeps them)."""
    w = gguf.GGUFWriter(str(path), arch)
    nextn = 1 if any(".nextn." in n for n in tensors) else 0
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"] + nextn)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    if "intermediate_size" in cfg:
        w.add_feed_forward_length(cfg["intermediate_size"])
    if "num_experts" in cfg:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch in HYBRID:
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(4)
        w.add_rope_dimension_count(int(cfg["head_dim"] * 0.25))
        if nextn:
            w.add_nextn_predict_layers(nextn)
    if arch in ("qwen35", "qwen35moe"):
        w.add_rope_dimension_sections([2, 1, 1, 0])  # sums to rotary_dim / 2 (llama.cpp: 11 11 10)
    add_tiny_tokenizer(w, VOCAB)
    for name, t in tensors.items():
        values = t.numpy().astype(np.float32)
        if quant and values.ndim >= 2 and values.shape[-1] % 32 == 0:
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, quantize(values, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass
class Files:
    arch: str
    hf: Any  # the transformers model (fp32)
    f32: Path
    q8: Path


def reference(arch: str, seed: int = 1, out_scale: float = 1.0) -> Any:
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**HF_CONFIGS[arch])
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    randomize(hf, seed, out_scale, offset=arch in HYBRID)
    return hf.eval()


def head_state(hf: Any, arch: str, directory: Path) -> dict[str, Tensor]:
    """`mtp.*` tensors of a head that agrees with the target often (tests/hybrid_models.py's
    copying head), built on our model class of the same weights."""
    from quickdraft.models.loader import load_model

    hf.save_pretrained(directory)
    ours = load_model(directory, torch.float32)
    assert isinstance(ours, HybridLM)
    return {f"mtp.{k}": v for k, v in copying_head(ours).state_dict().items()}


@pytest.fixture(scope="module", params=ARCHS)
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Files:
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    hf = reference(arch, out_scale=0.3 if arch in HYBRID else 1.0)
    state = dict(hf.state_dict())
    if arch in HYBRID:
        state |= head_state(hf, arch, tmp / "hf")
    tensors = llama_cpp_tensors(state, arch, HF_CONFIGS[arch])
    cfg = HF_CONFIGS[arch]
    return Files(
        arch,
        hf,
        write_gguf(tmp / f"{arch}-f32.gguf", arch, cfg, tensors, quant=False),
        write_gguf(tmp / f"{arch}-q8_0.gguf", arch, cfg, tensors, quant=True),
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


@pytest.fixture(scope="module")
def hybrid_tensors() -> dict[str, Tensor]:
    return llama_cpp_tensors(dict(reference("qwen35").state_dict()), "qwen35", HF_CONFIGS["qwen35"])


def test_gguf_without_nextn_says_so_when_mtp_is_asked(
    hybrid_tensors: dict[str, Tensor], tmp_path: Path
) -> None:
    path = write_gguf(
        tmp_path / "plain.gguf", "qwen35", HF_CONFIGS["qwen35"], hybrid_tensors, False
    )
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
    path = write_gguf(tmp_path / f"{edit}.gguf", "qwen35", HF_CONFIGS["qwen35"], tensors, False)
    with pytest.raises(HubError, match=re.escape(message)):
        load(str(path), "fp32", progress=False)


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


def test_gguf_weights_run_in_their_blocks(files: Files) -> None:
    """--dtype gguf: every projection (attention, Gated DeltaNet in/out, experts, shared
    expert, head) stays a Q8_0 GGUFWeight, their rows reordered as llama.cpp's converter
    requires; the logits agree with the dequantized model's (the kernel rounds activations to
    int8 per block, so not bit for bit; a wrong row order would give cosines far below 0.9)."""
    native = load(str(files.q8), "gguf", progress=False)
    net: Any = native.model
    assert isinstance(net.head, GGUFWeight)
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
