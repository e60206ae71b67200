"""Speculative decoding on the real packaged models: greedy output with speculation on equals
speculation off, token for token, in the formats users run: the GGUF's own weights (the
default) and bf16. This holds only because every kernel on the target's path is
batch-invariant (a row's logits do not depend on how many rows share its forward; issue 31):
without that, near-ties flip (bf16 used to leave 3 of 6 SmolLM2 prompts identical).

The prompts are the repo's fixed set (quickdraft/prompts/spec_bench.json): code, prose and
JSON, 48 tokens each (past EOS if need be), drafting forced (no adaptive policy). SmolLM2-135M
drafts with n-gram over every prompt of the three sets; Qwen2.5-Coder-1.5B with the 0.5B draft
model (int4, the default) over the first 3 of each.

The speculation-off references decode a set's prompts as one continuous batch: a batched row
equals the row alone bit for bit, so the equality also checks that a request decoded in a
batch equals it alone. Each speculative run is single-stream."""

from __future__ import annotations

import pytest

from quickdraft.bench.speculative import prompt_sets
from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.engine.core import EngineCore
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.loading import LoadedModel, load
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import Speculation

pytestmark = pytest.mark.real

SETS = ("code", "prose", "json")
TOKENS = 48


def new_request(lm: LoadedModel, prompt: str) -> Request:
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return lm.new_request(ids, SamplingParams(max_tokens=TOKENS, ignore_eos=True))


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


NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
DRAFT = SpeculativeConfig(
    method="draft", num_draft_tokens=4, draft_model="qwen2.5-coder-0.5b", adaptive=False
)


@pytest.mark.parametrize("dtype", ["gguf", "bf16"])
@pytest.mark.parametrize(
    ("target", "cfg", "per_set"),
    [("smollm2-135m", NGRAM, None), ("qwen2.5-coder-1.5b", DRAFT, 3)],
    ids=["smollm2-ngram", "qwen1.5b-draft0.5b"],
)
def test_speculative_real_greedy_equals_plain(
    target: str, cfg: SpeculativeConfig, per_set: int | None, dtype: str
) -> None:
    lm = load(target, dtype)
    spec = make_speculation(lm, cfg)  # once: a draft model loads and calibrates in seconds
    sets = prompt_sets()
    for name in SETS:
        prompts = sets[name][:per_set]
        drafted = accepted = 0
        for prompt, plain in zip(prompts, plain_batch(lm, prompts), strict=True):
            out, d, a = run(lm, prompt, spec)
            assert len(out) == TOKENS
            assert out == plain, f"{name}: {prompt!r}"
            drafted, accepted = drafted + d, accepted + a
        assert drafted > 0 and accepted > 0, name
