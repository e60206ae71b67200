"""Relaxed thinking-phase acceptance (speculation/relaxed.py, verify.py's `lenient`): which rows
may be lenient (inside `<think>`, never a draft that closes it, strict after it), the top-k /
delta rule, the verify functions with a mask, and end to end on a tiny random Qwen3 whose
tokenizer has `<think>` / `</think>` and whose template opens the block: off = identical to
speculation off, on = identical wherever the block is closed, more accepted inside it (counted
as relaxed in the request's telemetry), strict again from the token that closes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CHATML, make_tiny_hf_model, noisy_copy, write_tiny_tokenizer

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import RelaxedThinking, Request, SamplingError, SamplingParams
from quickdraft.server.protocol import ChatCompletionRequest
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.relaxed import ThinkScan, ThinkTokens, lenient_rows, think_tokens
from quickdraft.speculation.sampling import TokenRng, probabilities
from quickdraft.speculation.state import AnySpeculation
from quickdraft.speculation.verify import relaxed_ok, verify_greedy, verify_sampled

THINK = ThinkTokens(open=7, close=8)
# Qwen3-thinking style: the generation prompt opens the reasoning block
THINKING_CHATML = CHATML.replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
)
WIDE = RelaxedThinking(top_k=64, delta=100.0)  # keeps nearly every draft: shows the mechanism


# ---------------------------------------------------------------- rows and the rule


def test_relaxed_rows_follow_the_block() -> None:
    assert lenient_rows(False, [1, 2, 3], THINK) == [False, False, False]
    assert lenient_rows(True, [1, 2, 3], THINK) == [True, True, True]
    # a draft that closes the block is strict, and so is every row after it
    assert lenient_rows(True, [1, 8, 3, 4], THINK) == [True, False, False, False]
    # a draft that opens it: its own row is outside, the rows after it inside
    assert lenient_rows(False, [1, 7, 3], THINK) == [False, False, True]


def test_relaxed_think_scan_is_incremental() -> None:
    scan = ThinkScan(THINK)
    assert not scan.inside([1, 2])
    assert scan.inside([1, 2, 7, 5])
    assert scan.inside([1, 2, 7, 5, 6])
    assert not scan.inside([1, 2, 7, 5, 6, 8, 9])
    assert scan.scanned == 7
    # a template that writes an empty block (thinking off) leaves it closed
    assert not ThinkScan(THINK).inside([1, 7, 3, 8, 3])


def test_relaxed_ok_needs_top_k_and_delta() -> None:
    logits = torch.tensor(
        [
            [5.0, 4.5, 1.0, 0.0],  # d=1: 2nd, gap 0.5
            [0.0, 1.0, 3.0, 2.9],  # d=3: 2nd, gap 0.1
            [4.0, 3.0, 2.0, 1.0],  # d=2: 3rd, gap 2.0
            [0.0, 0.0, 0.0, 0.0],  # bonus row
        ]
    )
    draft = [1, 3, 2]
    assert relaxed_ok(draft, logits, [True] * 3, top_k=2, delta=1.0) == [True, True, False]
    assert relaxed_ok(draft, logits, [True] * 3, top_k=3, delta=2.0) == [True, True, True]
    assert relaxed_ok(draft, logits, [True] * 3, top_k=3, delta=0.2) == [False, True, False]
    assert relaxed_ok(draft, logits, [True, False, True], 3, 2.0) == [True, False, True]
    masked = logits.clone()
    masked[0, 1] = float("-inf")  # a grammar-masked draft is never near the argmax
    assert relaxed_ok(draft, masked, [True] * 3, 4, 1e4) == [False, True, True]


def test_relaxed_greedy_verify_counts_what_strict_rejects() -> None:
    logits = torch.tensor([[5.0, 4.5, 0.0], [0.0, 1.0, 3.0], [0.0, 2.0, 1.0], [9.0, 0.0, 0.0]])
    draft = [1, 2, 2]  # row 0 argmax 0 (d=1 near), row 1 argmax 2 (= d), row 2 argmax 1
    strict = verify_greedy(draft, logits)
    assert (strict.tokens, strict.accepted, strict.relaxed) == ([0], 0, 0)
    assert verify_greedy(draft, logits, [False, False, False]) == strict
    relaxed = verify_greedy(draft, logits, [True, True, False])
    # d_1 kept by the rule, d_2 is the argmax, d_3 rejected: the recovered token is row 2's argmax
    assert (relaxed.tokens, relaxed.accepted, relaxed.relaxed, relaxed.bonus) == (
        [1, 2, 1],
        2,
        1,
        False,
    )
    every = verify_greedy(draft, logits, [True, True, True])
    assert (every.tokens, every.accepted, every.relaxed, every.bonus) == ([1, 2, 2, 0], 3, 2, True)


@pytest.mark.parametrize("with_p_draft", [False, True], ids=["one-hot", "p_draft"])
def test_relaxed_sampled_verify_only_turns_rejections_into_acceptances(with_p_draft: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=3)
    for trial in range(40):
        logits = torch.randn(4, 16, generator=gen) * 2  # k = 3
        draft = torch.randint(0, 16, (3,), generator=gen).tolist()
        p_target = probabilities(logits, params)
        p_draft = probabilities(torch.randn(3, 16, generator=gen), params) if with_p_draft else None
        strict = verify_sampled(draft, p_draft, p_target, TokenRng(trial), 0)
        # an all-False mask is the lossless path, draw for draw
        assert verify_sampled(draft, p_draft, p_target, TokenRng(trial), 0, [False] * 3) == strict
        relaxed = verify_sampled(draft, p_draft, p_target, TokenRng(trial), 0, [True] * 3)
        assert relaxed.accepted >= strict.accepted
        assert relaxed.relaxed == 0 or relaxed.accepted > strict.accepted
        # a token the request's own filters (top_k 3) exclude is never kept
        for i in range(relaxed.accepted):
            assert p_target[i, draft[i]] > 0


def test_relaxed_thinking_params_are_checked() -> None:
    with pytest.raises(SamplingError, match="top_k"):
        RelaxedThinking(top_k=-1)
    with pytest.raises(SamplingError, match="delta"):
        RelaxedThinking(top_k=4, delta=float("nan"))
    assert not RelaxedThinking().enabled


def test_relaxed_thinking_request_field() -> None:
    def params(**extra: object) -> SamplingParams:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
        return ChatCompletionRequest.model_validate(body).sampling(16)

    assert params().relaxed_thinking is None  # the server's setting
    assert params(relaxed_thinking=False).relaxed_thinking == RelaxedThinking()
    on = params(relaxed_thinking=True).relaxed_thinking
    assert on is not None and on.enabled
    custom = params(relaxed_thinking={"top_k": 3, "delta": 0.5}).relaxed_thinking
    assert custom == RelaxedThinking(3, 0.5)
    with pytest.raises(ValueError):
        params(relaxed_thinking={"top_k": 1000})


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def thinking_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random Qwen3 with `<think>` (260) / `</think>` (261) tokens and a template that
    opens the block, and a draft model with small weight noise."""
    target = tmp_path_factory.mktemp("thinking-target")
    make_tiny_hf_model("qwen3", target, seed=7)
    write_tiny_tokenizer(target, ("<think>", "</think>"), THINKING_CHATML)
    return target, noisy_copy(target, tmp_path_factory.mktemp("thinking-draft"))


@pytest.fixture(scope="module")
def thinker(thinking_pair: tuple[Path, Path]) -> LoadedModel:
    return load(str(thinking_pair[0]), "fp32", progress=False)


def draft_spec(lm: LoadedModel, draft: Path, relaxed: RelaxedThinking | None) -> AnySpeculation:
    cfg = SpeculativeConfig(
        method="draft",
        num_draft_tokens=4,
        draft_model=str(draft),
        draft_quantization="none",
        adaptive=False,  # always draft: every cycle exercises the rule
        relaxed_thinking=relaxed,
    )
    spec = make_speculation(lm, cfg)
    assert spec is not None
    return spec


def generate(
    lm: LoadedModel, ids: list[int], spec: AnySpeculation | None, **params: object
) -> Request:
    fields: dict[str, object] = {"max_tokens": 40, "ignore_eos": True, **params}
    req = lm.new_request(ids, SamplingParams(**fields))  # type: ignore[arg-type]
    for _ in stream(lm, req, spec):
        pass
    return req


PROMPTS = ["Why is the sky blue?", "abc", "Tell me a story about a cat.", "def f(x):", "1, 2, 3"]


def test_relaxed_model_has_think_tokens(thinker: LoadedModel) -> None:
    assert think_tokens(thinker.tokenizer) == ThinkTokens(260, 261)
    ids = thinker.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert 260 in ids[-3:]  # the template opened the block


def test_relaxed_off_is_identical(thinker: LoadedModel, thinking_pair: tuple[Path, Path]) -> None:
    """Off by default: the same drafter, with the model's setting unset and with a request
    that turns it off over a model that has it on, emits exactly speculation off's tokens."""
    default = draft_spec(thinker, thinking_pair[1], None)
    model_on = draft_spec(thinker, thinking_pair[1], WIDE)
    for prompt in PROMPTS:
        ids = thinker.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        plain = generate(thinker, ids, None).output_ids
        assert generate(thinker, ids, default).output_ids == plain
        off = generate(thinker, ids, model_on, relaxed_thinking=RelaxedThinking())
        assert off.output_ids == plain and off.spec.relaxed == 0 and off.spec.drafted > 0


def test_relaxed_is_exact_outside_the_block(
    thinker: LoadedModel, thinking_pair: tuple[Path, Path]
) -> None:
    """A prompt whose block is already closed (thinking turned off by the template's empty
    block): relaxed acceptance on, output identical, nothing counted as relaxed."""
    spec = draft_spec(thinker, thinking_pair[1], WIDE)
    newline = thinker.tokenizer.encode("\n\n")
    for prompt in PROMPTS:
        ids = thinker.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        ids = [*ids, *newline, 261, *newline]  # <think>\n\n</think>\n\n
        plain = generate(thinker, ids, None).output_ids
        relaxed = generate(thinker, ids, spec)
        assert relaxed.output_ids == plain
        assert relaxed.spec.relaxed == 0 and relaxed.spec.accepted > 0


def test_relaxed_accepts_more_inside_the_block(
    thinker: LoadedModel, thinking_pair: tuple[Path, Path]
) -> None:
    strict = draft_spec(thinker, thinking_pair[1], None)
    relaxed = draft_spec(thinker, thinking_pair[1], WIDE)
    strict_al = relaxed_al = 0.0
    counted = 0
    for prompt in PROMPTS:
        ids = thinker.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        s = generate(thinker, ids, strict)
        r = generate(thinker, ids, relaxed)
        strict_al += s.spec.mean_acceptance_length
        relaxed_al += r.spec.mean_acceptance_length
        counted += r.spec.relaxed
        assert r.spec.as_dict()["relaxed_accepted"] == r.spec.relaxed <= r.spec.accepted
    assert counted > 0
    assert relaxed_al > strict_al


def close_bias(lm: LoadedModel, ids: list[int], tokens: int = 40) -> float | None:
    """A logit bias on `</think>` that makes plain greedy decoding emit it for the first time a
    few tokens in: just above its gap to the argmax at the first position past the second where
    that gap is below every earlier one (the bias then changes nothing before it); None if the
    gap never falls so."""
    seq = list(ids)
    gaps: list[float] = []
    model = lm.model
    for _ in range(tokens):
        cache = model.new_cache(len(seq))
        logits = model(torch.tensor(seq), [cache], [len(seq)]).logits[-1]
        gaps.append(float(logits.max() - logits[261]))
        seq.append(int(logits.argmax()))
    for p in range(2, tokens - 2):
        if gaps[p] + 0.02 < min(gaps[:p]):
            return gaps[p] + 0.01
    return None


def test_relaxed_is_strict_again_after_the_block_closes(
    thinker: LoadedModel, thinking_pair: tuple[Path, Path]
) -> None:
    """The model closes its block mid-output (a logit bias on `</think>`, the same for every
    run): with relaxed acceptance on, everything after the closing token is exactly what plain
    greedy decoding continues with from the same tokens."""
    spec = draft_spec(thinker, thinking_pair[1], WIDE)
    closed = 0
    for prompt in PROMPTS:
        ids = thinker.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        at_gap = close_bias(thinker, ids)
        if at_gap is None:
            continue
        bias = ((261, at_gap),)
        out = generate(thinker, ids, spec, logit_bias=bias).output_ids
        if 261 not in out[:-1]:
            continue
        at = out.index(261) + 1
        closed += 1
        rest = generate(thinker, ids + out[:at], None, logit_bias=bias, max_tokens=len(out) - at)
        assert rest.output_ids == out[at:]
    assert closed > 0
