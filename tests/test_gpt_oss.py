"""gpt-oss (models/families/gpt_oss.py): a tiny random GptOssForCausalLM from transformers (4
layers, local and full alternating with a 6-key window, 8 experts top-2, YaRN, sinks and biases set
away from zero) saved as a Hugging Face directory: our fp32 logits equal transformers' over a
context past the window, greedy decoding through the engine equals transformers' generate, a
verify's rows equal decode steps bit for bit, and the attention kernel's sinks equal the
reference."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kernel_checks import needs_kernel
from parity import c_layers_equal_python_layers, verify_rows_and_steps
from test_gguf_loader import PROMPT, all_logits, logits_agree_with_llama_cpp
from test_reasoning import HARMONY_SPECIALS

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.engine.core import EngineCore
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.hub.gguf_write import TINY_SPECIALS, llama_cpp_tensors, write_gguf
from quickdraft.kernels.attention import TILES, attend, cpu_tiles, reference_attend
from quickdraft.kernels.build import extension
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.gpt_oss import GptOssConfig, GptOssLM, GptOssMoE
from quickdraft.models.formats.loader import load_model
from quickdraft.request import SamplingParams
from quickdraft.server.reasoning import HARMONY, parse_harmony
from quickdraft.speculation.factory import make_speculation

WINDOW, VOCAB, ORIGINAL = 6, 300, 16


def hf_model(seed: int = 0, truncate: bool = False) -> torch.nn.Module:
    import transformers

    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": truncate,
            "original_max_position_embeddings": ORIGINAL,
        },
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # biases, sinks and experts away from their zero / tiny init
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.7, 1.3)
            elif p.dim() == 1 or name.endswith("_bias"):
                p.normal_(0, 0.5 if "sinks" in name else 0.05)
            else:
                p.normal_(0, 0.08)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf = hf_model()
    path = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def pair(hf_dir: tuple[torch.nn.Module, Path]) -> tuple[torch.nn.Module, GptOssLM]:
    ours = load_model(hf_dir[1], torch.float32)
    assert isinstance(ours, GptOssLM)
    return hf_dir[0], ours


def test_config_reads_the_layers_window_and_yarn(pair: tuple[torch.nn.Module, GptOssLM]) -> None:
    cfg = pair[1].config
    assert isinstance(cfg, GptOssConfig)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert cfg.sliding_window == WINDOW and cfg.yarn["factor"] == 32.0
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert [layer.self_attn.window for layer in pair[1].decoder_layers] == [WINDOW, 0] * 2


def test_logits_equal_transformers(pair: tuple[torch.nn.Module, GptOssLM]) -> None:
    """Prefill of 20 tokens (past the 6-key window and the 16-token YaRN original context):
    every row's logits."""
    hf, ours = pair
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    cache = ours.new_cache(64)
    mine = ours(ids, [cache], [20], logit_rows=torch.arange(20)).logits
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_greedy_decoding_equals_transformers_generate(
    pair: tuple[torch.nn.Module, GptOssLM],
) -> None:
    hf, ours = pair
    ids = torch.randint(0, 300, (5,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(ids[None], max_new_tokens=24, do_sample=False)[0, 5:].tolist()
    cache = ours.new_cache(64)
    logits = ours(ids, [cache], [5]).logits
    cache.commit(5)
    got = []
    for _ in range(24):
        nxt = int(logits[-1].argmax())
        got.append(nxt)
        logits = ours(torch.tensor([nxt]), [cache], [1]).logits
        cache.commit(cache.length + 1)
    assert got == want


@needs_kernel
def test_verify_rows_equal_decode_steps(hf_dir: tuple[torch.nn.Module, Path]) -> None:
    """bf16 (the batch-invariant kernels), across the window's edge: a 5-row verify gives
    each row its decode step's bits."""
    ours = load_model(hf_dir[1], torch.bfloat16)
    assert isinstance(ours, GptOssLM)
    ids = torch.randint(0, 300, (14,), generator=torch.Generator().manual_seed(3))
    rows, steps = verify_rows_and_steps(ours, ids, 9)
    for j in range(5):
        assert torch.equal(rows[j], steps[j]), f"row {j}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 5])
def test_attention_sinks_match_the_reference(dtype: torch.dtype, window: int) -> None:
    """The kernel's sinks (every tile) against the spelled-out softmax with a sink column,
    large sinks included (a sink above every score: the output shrinks towards 0), and a
    row's bits whatever rows share the call."""
    if extension() is None:
        pytest.skip("the C++ extension did not build or cannot run here")
    ext = extension()
    g = torch.Generator().manual_seed(4)
    n, heads, kv, d, start = 6, 4, 2, 64, 11
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    k = torch.randn(kv, start + n, d, generator=g).to(dtype)
    v = torch.randn(kv, start + n, d, generator=g).to(dtype)
    sinks = torch.tensor([-2.0, 0.5, 3.0, 40.0])
    ref = reference_attend(q, k, v, start, d**-0.5, window, sinks).float()
    try:
        for tile in cpu_tiles():
            ext.attend_isa(TILES[tile])
            out = attend(q, k, v, start, d**-0.5, window, sinks)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
            assert float(out[:, 3 * d :].float().abs().max()) < 1e-6  # sink 40
            for i in range(n):  # row i alone, as a decode step at its position
                one = attend(
                    q[i : i + 1],
                    k[:, : start + i + 1],
                    v[:, : start + i + 1],
                    start + i,
                    d**-0.5,
                    window,
                    sinks,
                )
                assert torch.equal(one[0], out[i])
    finally:
        ext.attend_isa(-1)


# -- the GGUF file, as llama.cpp's converter writes one --------------------------------------


def write_gpt_oss_gguf(path: Path, hf: torch.nn.Module) -> Path:
    """`hf`'s weights as a `gpt-oss` GGUF in llama.cpp's naming (F32), with the tiny byte-level
    tokenizer (hub/gguf_write.py: experts split into gate / up, down transposed, as llama.cpp's
    converter does)."""
    cfg = hf.config.to_dict()
    return write_gguf(path, "gpt-oss", cfg, llama_cpp_tensors(hf.state_dict(), "gpt-oss", cfg))


@pytest.fixture(scope="module")
def gguf_pair(home: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """(transformers' model with llama.cpp's YaRN rounding, its F32 gpt-oss GGUF)."""
    hf = hf_model(truncate=True)
    return hf, write_gpt_oss_gguf(tmp_path_factory.mktemp("gguf") / "gpt-oss-f32.gguf", hf)


def generate(lm: LoadedModel, ids: list[int], n: int, spec: Any = None) -> Any:
    req = lm.new_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in stream(lm, req, spec):
        pass
    return req


def test_gguf_file_equals_transformers(gguf_pair: tuple[Any, Path]) -> None:
    """The F32 file converted (config from its metadata, experts re-interleaved): the fp32
    model's logits equal transformers' on the weights it was written from."""
    hf, path = gguf_pair
    lm = load(str(path), "fp32", progress=False)
    assert isinstance(lm.model, GptOssLM)
    ids = torch.tensor(lm.tokenizer.encode(PROMPT))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(all_logits(lm, ids), theirs, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_equal_llama_cpp_on_the_f32_file(gguf_pair: tuple[Any, Path]) -> None:
    """llama.cpp as an independent reading of the same file (sinks, windows, YaRN, biased
    experts): 48 greedy tokens equal."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import LlamaCpp

    lm = load(str(gguf_pair[1]), "fp32", progress=False)
    ids = lm.tokenizer.encode(PROMPT)
    theirs = LlamaCpp(gguf_pair[1], torch.get_num_threads(), 256).generate(ids, 48, ()).tokens
    assert generate(lm, ids, 48).output_ids == theirs


def test_mxfp4_file_runs_its_experts_in_their_blocks(
    gguf_pair: tuple[Any, Path], tmp_path: Path
) -> None:
    """The file through llama.cpp's quantizer as MXFP4_MOE (what gpt-oss GGUFs hold): --dtype
    gguf keeps every expert in MXFP4 with its biases, requests decoded together equal each
    alone, logits agree with llama.cpp's on the same file, the second start reads the packed
    copy (same bits), and greedy n-gram speculation equals plain decoding."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
    from quickdraft.bench.peers import llama_cpp_quantize

    path = tmp_path / "gpt-oss-mxfp4.gguf"
    llama_cpp_quantize(gguf_pair[1], path, "MXFP4_MOE", torch.get_num_threads())
    lm = load(str(path), "gguf", progress=False)
    # three sequences at different positions (window starts, experts) in one packed forward
    # per step: each gets the tokens it gets alone
    prompts = [lm.tokenizer.encode(t) for t in (PROMPT, "Short one.", "1, 2, 3, 4, 5, 6")]
    alone = [generate(lm, ids, 24).output_ids for ids in prompts]
    core = EngineCore(lm, SchedulerConfig(max_running=3))
    reqs = [lm.new_request(ids, SamplingParams(max_tokens=24, ignore_eos=True)) for ids in prompts]
    for req in reqs:
        core.add(req, None)
    while core.has_work:
        core.step()
    assert core.stats.max_batch == 3 and [r.output_ids for r in reqs] == alone
    moe = lm.model.model.layers[0].mlp  # type: ignore[union-attr]
    assert isinstance(moe, GptOssMoE) and moe.operands is not None
    gate_up, bias, down, _ = moe.operands[0]
    assert isinstance(gate_up, GGUFWeight) and isinstance(down, GGUFWeight)
    assert {p.fmt.name for p in gate_up.parts + down.parts} == {"MXFP4"}
    assert bias.shape == (2 * 96,)
    c_layers_equal_python_layers(lm.model)  # sinks, windows, biases, the MoE block's call
    ids = lm.tokenizer.encode(PROMPT)
    mine = all_logits(lm, torch.tensor(ids))
    logits_agree_with_llama_cpp(path, ids, mine)
    again = load(str(path), "gguf", progress=False)
    assert torch.equal(all_logits(again, torch.tensor(ids)), mine)
    spec = make_speculation(lm, SpeculativeConfig(method="ngram", num_draft_tokens=4))
    for prompt in (PROMPT, "the cat sat on the mat. the cat sat on"):
        ids = lm.tokenizer.encode(prompt)
        assert generate(lm, ids, 40, spec).output_ids == generate(lm, ids, 40).output_ids


# -- served: the harmony path through a real server and the openai client ---------------------

HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_served_harmony_model_splits_channels_and_refuses_forced_calls(
    gguf_pair: tuple[Any, Path], tmp_path: Path
) -> None:
    """The tiny gpt-oss with harmony's markers in its vocabulary, served on loopback: a chat
    completion and the same one streamed give the same reasoning and content with no marker
    left in either (the output's tokens, read from its logprobs, parsed as a whole give the
    same fields: the markers are kept in the text and parsed), and a forced tool call, which
    would be written in Hermes' format, is refused naming tool_choice."""
    import openai

    from quickdraft.engine import Engine, ServedModel
    from quickdraft.server import ServerConfig, create_app
    from quickdraft.server.main import BackgroundServer

    hf = gguf_pair[0]
    cfg = hf.config.to_dict()
    specials = (*TINY_SPECIALS, *HARMONY_SPECIALS)
    path = write_gguf(
        tmp_path / "harmony.gguf",
        "gpt-oss",
        cfg,
        llama_cpp_tensors(hf.state_dict(), "gpt-oss", cfg),
        specials=specials,
        chat_template=HARMONY_TEMPLATE,
    )
    lm = load(str(path), "fp32", progress=False)
    engine = Engine({"tiny": ServedModel(lm, SpeculativeConfig())})
    engine.start()
    try:
        with BackgroundServer(create_app(engine, ServerConfig())) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            msgs: Any = [{"role": "user", "content": "hello there"}]
            # the markers made likely, so that the output holds some wherever they fall
            bias = {str(lm.tokenizer.encode(t, add_special_tokens=False)[0]): 4 for t in HARMONY}
            ask: Any = dict(
                model="tiny", messages=msgs, max_tokens=32, temperature=0, logit_bias=bias
            )
            reply = client.chat.completions.create(logprobs=True, **ask).choices[0]
            raw = "".join(e.token for e in reply.logprobs.content)  # type: ignore[union-attr]
            assert "<|" in raw  # the sampled tokens, markers included
            want = parse_harmony(raw)
            whole = reply.message
            reasoning = getattr(whole, "reasoning_content", None)
            assert (whole.content, reasoning) == (want.content, want.reasoning)
            got = {"content": "", "reasoning": ""}
            for chunk in client.chat.completions.create(stream=True, **ask):
                for c in chunk.choices:
                    got["content"] += c.delta.content or ""
                    got["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            assert got == {"content": want.content or "", "reasoning": want.reasoning or ""}
            tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            with pytest.raises(openai.BadRequestError, match="tool_choice"):
                client.chat.completions.create(
                    model="tiny", messages=msgs, tools=tools, tool_choice="required"
                )
    finally:
        engine.stop()


# -- the released checkpoints' own MXFP4 experts --------------------------------------------


def ggml_to_hf_mxfp4(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 blocks [rows, nb * 17] -> an HF checkpoint's (`*_blocks` [rows, nb, 16] with
    byte k = values 2k | 2k + 1 << 4, `*_scales` [rows, nb]): the inverse of
    models/families/gpt_oss.py's repacking, written here from the two layouts' definitions."""
    b = raw.reshape(rows, -1, 17)
    scales, qs = b[..., 0], b[..., 1:]
    v = np.concatenate([qs & 15, qs >> 4], axis=-1)  # ggml: values j, then j + 16
    blocks = v[..., 0::2] | (v[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(scales.copy())


@pytest.fixture(scope="module")
def mxfp4_dir(
    hf_dir: tuple[torch.nn.Module, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny model saved as the released gpt-oss checkpoints are: experts as MXFP4
    `*_blocks` / `*_scales` (rows = outputs, gate / up rows interleaved), the rest as is."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from safetensors.torch import save_file

    hf, src = hf_dir
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = t.float().transpose(1, 2).contiguous()  # [E, out, in]
            e, n, k = rows.shape
            raw = quantize(rows.reshape(e * n, k).numpy(), GGMLQuantizationType.MXFP4)
            blocks, scales = ggml_to_hf_mxfp4(raw, e * n)
            tensors[name + "_blocks"] = blocks.reshape(e, n, k // 32, 16)
            tensors[name + "_scales"] = scales.reshape(e, n, k // 32)
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_released_mxfp4_checkpoint_runs_its_experts_in_mxfp4(mxfp4_dir: Path) -> None:
    """The checkpoint's MXFP4 experts become MXFP4 GGUF operands holding exactly the values
    transformers' own MXFP4 dequantization gives (the independent reading of the format), and
    the model's logits agree with the same model run on those values dequantized."""
    from safetensors import safe_open
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ours = load_model(mxfp4_dir, torch.float32)
    assert isinstance(ours, GptOssLM)
    moe = ours.decoder_layers[1].mlp
    assert isinstance(moe, GptOssMoE)
    gate_up, _, down, _ = moe.expert_operands()[3]
    assert isinstance(gate_up, GGUFWeight) and {p.fmt.name for p in gate_up.parts} == {"MXFP4"}
    with safe_open(str(mxfp4_dir / "model.safetensors"), "pt") as f:
        pre = "model.layers.1.mlp.experts."
        deq = {
            part: convert_moe_packed_tensors(
                f.get_tensor(pre + part + "_blocks"),
                f.get_tensor(pre + part + "_scales"),
                dtype=torch.float32,
            )
            for part in ("gate_up_proj", "down_proj")
        }
    hf_gate_up = deq["gate_up_proj"][3].T  # [2I, H], gate / up rows interleaved
    want = torch.cat([hf_gate_up[0::2], hf_gate_up[1::2]])
    assert torch.equal(gate_up.dequantize(torch.float32), want)
    assert isinstance(down, GGUFWeight)
    assert torch.equal(down.dequantize(torch.float32), deq["down_proj"][3].T)
    # the same model on those values, dequantized: the int8 activations' rounding apart
    dense = load_model(mxfp4_dir, torch.float32)
    for layer in dense.decoder_layers:
        m = layer.mlp
        assert isinstance(m, GptOssMoE)
        m.operands = [
            (g.dequantize(torch.float32), b, d.dequantize(torch.float32), db)  # type: ignore[union-attr]
            for g, b, d, db in m.expert_operands()
        ]
        m._grouped_for = None
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(5))
    a = ours(ids, [ours.new_cache(32)], [12], logit_rows=torch.arange(12)).logits
    b = dense(ids, [dense.new_cache(32)], [12], logit_rows=torch.arange(12)).logits
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert float(cos.min()) > 0.99, cos


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_mxfp4_checkpoint_missing_or_truncated_tensor_is_named(
    mxfp4_dir: Path, tmp_path: Path, damage: str
) -> None:
    """A scale tensor left out, or a blocks tensor cut short: the error names the file and the
    tensor before any expert is repacked from it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(mxfp4_dir / "model.safetensors"))
    name = "model.layers.2.mlp.experts.down_proj"
    if damage == "missing":
        del tensors[name + "_scales"]
    else:
        tensors[name + "_blocks"] = tensors[name + "_blocks"][:, :, :-1].contiguous()
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((mxfp4_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=re.escape(name)) as err:
        load_model(broken, torch.float32)
    assert damage == "missing" or "model.safetensors" in str(err.value)


@needs_kernel
@pytest.mark.parametrize("method", ["suffix", "draft", "eagle3", "dflash"])
def test_every_drafter_equals_plain_decoding(
    gguf_pair: tuple[Any, Path], method: str, tmp_path: Path
) -> None:
    """The gpt-oss file on its own blocks: greedy speculation with each kind of drafter (the
    file as its own draft model, random EAGLE-3 and DFlash heads of its shape, whose drafts
    are mostly rejected and rolled back) gives plain decoding's tokens."""
    from eagle3_heads import random_drafter_config

    _, path = gguf_pair
    lm = load(str(path), "gguf", progress=False)
    layers = lm.model.config.num_hidden_layers  # type: ignore[union-attr]
    fields = random_drafter_config(method, tmp_path / method, path, layers, VOCAB)
    spec = make_speculation(lm, SpeculativeConfig(**fields))
    drafted = 0
    for prompt in (PROMPT, "the cat sat on the mat. the cat sat on"):
        ids = lm.tokenizer.encode(prompt)
        fast = generate(lm, ids, 24, spec)
        assert fast.output_ids == generate(lm, ids, 24).output_ids
        drafted += fast.spec.drafted
    assert drafted > 0
