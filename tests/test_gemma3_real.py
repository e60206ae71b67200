"""The packaged gemma3-270m (Q4_K_M GGUF) on its real weights (marker `real`): dequantized to
fp32 it gives transformers' Gemma3ForCausalLM greedy tokens on the same weights (32 per
prompt, one prompt longer than the 512-key sliding window); the GGUF's own weights write
coherent text, and greedy n-gram speculation (drafting forced) equals plain decoding on a
context that crosses the window."""

from __future__ import annotations

import pytest
import torch

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation

pytestmark = pytest.mark.real

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
# ~700 tokens: the local layers' window (512) cuts off its start
LONG = " ".join(
    f"Item {i}: the {c} box holds {i * 7 % 13} marbles." for i, c in enumerate(["red", "blue"] * 30)
)


def greedy(lm: LoadedModel, ids: list[int], n: int, spec: object = None) -> tuple[list[int], int]:
    req = lm.new_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in stream(lm, req, spec):  # type: ignore[arg-type]
        pass
    return req.output_ids, req.spec.accepted


def test_fp32_greedy_equals_transformers() -> None:
    import transformers

    lm = load("gemma3-270m", "fp32", progress=False)
    hf = transformers.Gemma3ForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32).eval()
    for prompt in [*PROMPTS, LONG]:
        ids = lm.tokenizer.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        assert greedy(lm, ids, 32)[0] == out[0, len(ids) :].tolist(), prompt[:40]
    assert len(lm.tokenizer.encode(LONG)) > 600


def test_gguf_writes_coherent_text_and_ngram_equals_plain() -> None:
    lm = load("gemma3-270m", "gguf", progress=False)
    colors = lm.tokenizer.decode(greedy(lm, lm.tokenizer.encode(PROMPTS[3]), 12)[0])
    assert "red" in colors and "blue" in colors, colors
    code = lm.tokenizer.decode(greedy(lm, lm.tokenizer.encode(PROMPTS[1]), 24)[0])
    assert "return" in code, code
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    spec = make_speculation(lm, cfg)
    ids = lm.tokenizer.encode(LONG)
    plain, _ = greedy(lm, ids, 48)
    tokens, accepted = greedy(lm, ids, 48, spec)
    assert tokens == plain
    assert accepted > 0
