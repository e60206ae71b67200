"""Speculative decoding on the real packaged models (fp32, where k-token verify and 1-token
decode agree exactly): SmolLM2-135M with n-gram, Qwen2.5-Coder-1.5B with the 0.5B draft.
Greedy output must be token-identical to speculation off, with drafts accepted."""

from __future__ import annotations

import pytest

from quickdraft.config import SpeculativeConfig
from quickdraft.generate import LoadedModel, load, stream
from quickdraft.sampling import SamplingParams
from quickdraft.speculate import Speculation, make_speculation

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Repeat exactly twice: the quick brown fox jumps over the lazy dog.",
    "Convert to JSON with keys name and age: Alice 31, Bob 25, Carol 42.",
    "What is the capital of France? Answer in one sentence.",
    "List the numbers 1 to 20 separated by commas.",
    "Write a haiku about the sea.",
    "def fib(n):\n    # complete this function\n",
    "Explain what a hash map is in two sentences.",
]


def run(lm: LoadedModel, prompt: str, spec: Speculation | None) -> tuple[list[int], int, int]:
    req = lm.new_request(
        lm.tokenizer.encode_chat([{"role": "user", "content": prompt}]),
        SamplingParams(max_tokens=64),
    )
    for _ in stream(lm, req, spec):
        pass
    return req.output_ids, req.spec.drafted, req.spec.accepted


@pytest.mark.parametrize(
    ("target", "cfg"),
    [
        ("smollm2-135m", SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)),
        (
            "qwen2.5-coder-1.5b",
            SpeculativeConfig(
                method="draft", num_draft_tokens=4, draft_model="qwen2.5-coder-0.5b", adaptive=False
            ),
        ),
    ],
    ids=["smollm2-ngram", "qwen1.5b-draft0.5b"],
)
def test_speculative_real_greedy_equals_plain(target: str, cfg: SpeculativeConfig) -> None:
    lm = load(target, "fp32")
    spec = make_speculation(lm, cfg)  # once: a draft model loads and calibrates in seconds
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain, _, _ = run(lm, prompt, None)
        out, d, a = run(lm, prompt, spec)
        assert out == plain, prompt
        drafted, accepted = drafted + d, accepted + a
    assert drafted > 0 and accepted > 0
