"""Speculative decoding on the real packaged models (fp32, where k-token verify and 1-token
decode agree exactly): SmolLM2-135M with n-gram, Qwen2.5-Coder-1.5B with the 0.5B draft.
Greedy output must be token-identical to speculation off, with drafts accepted.

The speculation-off references decode all prompts as one continuous batch (8 rows per forward
cost about what one does, which took this test from ~8 to ~2 minutes of plain decoding): in
fp32 a batched row's logits match a single-sequence run's closely enough that no argmax here
moves, the same property the verify pass relies on. Each speculative run is single-stream."""

from __future__ import annotations

import pytest

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.engine.core import EngineCore
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.loading import LoadedModel, load
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import Speculation

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


def new_request(lm: LoadedModel, prompt: str) -> Request:
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return lm.new_request(ids, SamplingParams(max_tokens=64))


def run(lm: LoadedModel, prompt: str, spec: Speculation | None) -> tuple[list[int], int, int]:
    req = new_request(lm, prompt)
    for _ in stream(lm, req, spec):
        pass
    return req.output_ids, req.spec.drafted, req.spec.accepted


def plain_batch(lm: LoadedModel, prompts: list[str]) -> list[list[int]]:
    """Greedy outputs without speculation, all prompts in one continuous batch."""
    core = EngineCore(lm, SchedulerConfig(max_running=len(prompts)))
    reqs = [new_request(lm, p) for p in prompts]
    for req in reqs:
        core.add(req, None)
    while core.has_work:
        core.step()
    assert core.stats.max_batch == len(prompts)  # they really decoded together
    return [req.output_ids for req in reqs]


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
    for prompt, plain in zip(PROMPTS, plain_batch(lm, PROMPTS), strict=True):
        out, d, a = run(lm, prompt, spec)
        assert out == plain, prompt
        drafted, accepted = drafted + d, accepted + a
    assert drafted > 0 and accepted > 0
