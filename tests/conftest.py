"""Shared fixtures: tiny random-weight Hugging Face models saved as real checkpoints, and the
real packaged models (pulled and converted once into QUICKDRAFT_HOME)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

# Without a GPU the Triton kernels (kernels/triton_ops.py) run in Triton's interpreter; it is
# chosen when triton is imported, and something may import it before tests/test_triton_ops.py
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        eos_token_id=2,
    ),
    "qwen3": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        eos_token_id=2,
    ),
}


@pytest.fixture(params=["avx2", "avx512"])  # linear_gguf.TILES (imported late: Triton, above)
def gguf_tile(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a GGUF kernel test on each GEMM tile (kernels/linear_gguf.py TILES) this CPU has;
    a tile whose flags the CPU lacks skips, naming them."""
    from quickdraft.kernels import build
    from quickdraft.kernels.linear_gguf import TILE_FLAGS, TILES, cpu_tiles

    if not build.kernels_available():
        pytest.skip("the C++ extension did not build or cannot run here")
    if request.param not in cpu_tiles():
        pytest.skip(f"this CPU lacks {sorted(TILE_FLAGS[request.param])}: no {request.param} tile")
    build.extension().gguf_isa(TILES[request.param])
    yield request.param
    build.extension().gguf_isa(-1)


@pytest.fixture()
def kernels_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer bisecting with QUICKDRAFT_NO_KERNELS=1 must not turn kernel tests into
    no-ops: they run the kernels whatever the environment says."""
    from quickdraft.kernels import build

    monkeypatch.setattr(build, "disabled", False)


def make_tiny_hf_model(arch: str, directory: Path, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight transformers model of `arch` (its TINY_CONFIGS entry updated by
    `overrides`), saved to `directory` (fp32)."""
    import transformers

    torch.manual_seed(seed)
    cfg_dict = {**TINY_CONFIGS[arch], **overrides}
    cfg = transformers.AutoConfig.for_model(**cfg_dict)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # HF init is small-std; widen it so logits are not all near-ties
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.08)
    model.eval()
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_hf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Any]:
    """(arch, checkpoint dir, the transformers reference model), one per architecture."""
    arch = request.param
    directory = tmp_path_factory.mktemp(f"tiny-{arch}")
    model = make_tiny_hf_model(arch, directory)
    return arch, directory, model


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 256..259


def write_tiny_tokenizer(
    directory: Path, extra_specials: tuple[str, ...] = (), template: str = CHATML
) -> None:
    """A real byte-level tokenizer (one token per byte, no merges) + ChatML template: 260 ids,
    within the tiny models' 320-entry vocabulary, so tiny models run the whole text pipeline.
    `extra_specials` get the ids from 260 on (e.g. a reasoning model's `<think>`)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([*TINY_SPECIALS, *extra_specials])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": "<s>", "eos_token": "<|im_end|>"})
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A throw-away QUICKDRAFT_HOME for the converted models and their packed copies."""
    from quickdraft.kernels import build

    with pytest.MonkeyPatch.context() as mp:  # the extension is built under the usual home
        mp.setattr(build, "disabled", False)
        build.kernels_available()
    root = tmp_path_factory.mktemp("quickdraft-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUICKDRAFT_HOME", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny Qwen2-architecture model directory (weights, config, tokenizer)."""
    directory = tmp_path_factory.mktemp("tiny-complete")
    make_tiny_hf_model("qwen2", directory, seed=3)
    write_tiny_tokenizer(directory)
    return directory


def noisy_copy(source: Path, out: Path) -> Path:
    """`source`'s model with small weight noise in `out`: a draft model that agrees with it
    often but not always (exercises rejections)."""
    for f in source.iterdir():
        shutil.copy(f, out / f.name)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    noisy = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def near_draft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return noisy_copy(tiny_model_dir, tmp_path_factory.mktemp("near-draft"))


@pytest.fixture(scope="session")
def bf16_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny target whose every op has a batch-invariant kernel in bf16 (head_dim 32: the
    attention kernel's granularity; the default tiny model's 16 runs SDPA, which is not
    batch-invariant), and a draft model with small weight noise (agrees often, not always)."""
    target = tmp_path_factory.mktemp("bf16-target")
    make_tiny_hf_model(
        "qwen2", target, seed=11, hidden_size=256, intermediate_size=512, head_dim=32
    )
    write_tiny_tokenizer(target)
    return target, noisy_copy(target, tmp_path_factory.mktemp("bf16-draft"))
