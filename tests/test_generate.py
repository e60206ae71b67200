"""End-to-end generation: our decode loop against transformers `generate` (fp32), the CLI, and
the real packaged SmolLM2-135M."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams


def run(lm: LoadedModel, ids: list[int], **kw: object) -> list[int]:
    req = lm.new_request(ids, SamplingParams(**kw))  # type: ignore[arg-type]
    for _ in stream(lm, req):
        pass
    return req.output_ids


def hf_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    """transformers' own forward + KV cache, argmax each step, EOS not special (no
    `generate`: its min_new_tokens masks EOS, which would change the tokens)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = hf(torch.tensor([ids]), use_cache=True)
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(
                torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True
            )
    return tokens


def test_generate_greedy_matches_transformers_tiny(tiny_model_dir: Path) -> None:
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    ours = run(lm, ids, max_tokens=40, ignore_eos=True)
    assert ours == hf_greedy(tiny_model_dir, ids, 40)


def test_generate_seeded_sampling_repeats(tiny_model_dir: Path) -> None:
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    ids = lm.tokenizer.encode("abc")
    a = run(lm, ids, max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    b = run(lm, ids, max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    c = run(lm, ids, max_tokens=24, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True)
    assert a == b and a != c


def test_generate_prompt_beyond_context_is_clear_error(tiny_model_dir: Path) -> None:
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    with pytest.raises(ValueError, match="the model context is 512 tokens"):
        lm.new_request([65] * 600, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        lm.new_request([65] * 500, SamplingParams(max_tokens=64))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "quickdraft", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_cli_generate_streams_and_summarises(tiny_model_dir: Path) -> None:
    res = cli(
        "generate",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "fp32",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--chat",
        "hi",
    )
    assert res.returncode == 0, res.stderr
    assert "output 8 tok" in res.stderr and "tok/s" in res.stderr


def test_cli_unknown_model_lists_known_names() -> None:
    res = cli("generate", "--model", "no-such-model", "x")
    assert res.returncode == 2
    assert "smollm2-135m" in res.stderr and "qwen2.5-coder-1.5b" in res.stderr


@pytest.mark.real
def test_generate_real_smollm2_matches_transformers() -> None:
    """Real SmolLM2-135M (fp32): prefill + 32 greedy steps give transformers' exact tokens."""
    lm = load("smollm2-135m", "fp32")
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    ours = run(lm, ids, max_tokens=32, ignore_eos=True)
    assert ours == hf_greedy(lm.path, ids, 32)
    text = lm.tokenizer.decode(ours)
    assert "Paris" in text
