"""Logit bias, penalties, grammars and logprobs under speculation (speculation/logits.py).

fp32 tiny random models: greedy output AND logprobs are the same with speculation off, n-gram
and a draft model (with drafts accepted, so the check is not vacuous); each control changes the
output (so it really runs); grammar outputs match their regex / schema; sampled output under
bias + penalties + a grammar mask keeps the shaped target distribution (chi-square).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch
from hybrid_models import copying_head, random_hybrid, randomize, save_hybrid_dir
from second_token import assert_second_token_follows, second_token_marginal

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.grammar import Grammar, GrammarError
from quickdraft.loading import LoadedModel, load
from quickdraft.request import Request, SamplingError, SamplingParams
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.logits import LogitControls, token_logprobs
from quickdraft.speculation.sampling import probabilities

PROMPT = "abc abc abc abc abc abc abc"
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["kind", "ok", "n"],
    "additionalProperties": False,
}
REGEX = r"[abc]{2,6}-[0-9]{1,3}"


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


def specs(near_draft_dir: Path, self_draft_dir: Path) -> dict[str, SpeculativeConfig | None]:
    """Speculation off, n-gram, a draft model near the target, and the target as its own
    draft model (its shaped drafts are then all accepted: the drafter applies the controls)."""

    def draft(path: Path) -> SpeculativeConfig:
        return SpeculativeConfig(
            method="draft",
            num_draft_tokens=3,
            draft_model=str(path),
            draft_quantization="none",
            adaptive=False,
        )

    return {
        "off": None,
        "ngram": SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False),
        "draft": draft(near_draft_dir),
        "self": draft(self_draft_dir),
    }


def run(
    lm: LoadedModel, prompt: str, params: SamplingParams, cfg: SpeculativeConfig | None
) -> Request:
    spec = None if cfg is None else make_speculation(lm, cfg)
    req = lm.new_request(lm.tokenizer.encode(prompt), params)
    for _ in stream(lm, req, spec):
        pass
    return req


# --------------------------------------------------------------------------- unit: positions


def reference_shape(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], out: list[int]
) -> torch.Tensor:
    """OpenAI / vLLM formulas, one row, written out: bias, repetition over prompt + output,
    frequency and presence over the output."""
    row = logits.double().clone()
    for t, b in params.logit_bias:
        row[t] += b
    for t in set(prompt) | set(out):
        r = params.repetition_penalty
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    for t in set(out):
        row[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
    return row


def test_each_verify_row_is_shaped_as_plain_decoding_would_at_its_position() -> None:
    vocab, k = 50, 5
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, vocab, generator=gen) * 3
    params = SamplingParams(
        presence_penalty=0.7,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias=((3, 5.0), (7, -100.0)),
    )
    prompt, output, draft = [1, 2, 3], [4, 4, 9], [4, 11, 4, 2, 30]
    ctl = LogitControls(params, prompt, vocab)
    ctl.commit(output)
    shaped = ctl.apply(logits, draft)
    for i in range(k + 1):
        alone = LogitControls(params, prompt, vocab)
        alone.commit(output + draft[:i])
        one = alone.apply(logits[i : i + 1], [])
        assert torch.equal(shaped[i], one[0]), i  # bit for bit, as plain decoding computes it
        ref = reference_shape(logits[i], params, prompt, output + draft[:i])
        torch.testing.assert_close(shaped[i].double(), ref, rtol=1e-6, atol=1e-5)


def test_token_logprobs_are_log_softmax_with_top_tokens() -> None:
    raw = torch.tensor([[0.0, 1.0, 2.0], [5.0, 0.0, 0.0]])
    got = token_logprobs(raw, [1, 0], 2)
    ref = torch.log_softmax(raw, -1)
    assert got[0].token == 1 and got[0].logprob == pytest.approx(float(ref[0, 1]))
    assert [t for t, _ in got[0].top] == [2, 1] and [t for t, _ in got[1].top] == [0, 1]
    assert got[1].top[0][1] == pytest.approx(float(ref[1, 0]))


def test_bad_controls_are_refused_naming_the_field(target: LoadedModel) -> None:
    for kwargs, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
    ]:
        with pytest.raises(SamplingError) as err:
            SamplingParams(**kwargs)  # type: ignore[arg-type]
        assert err.value.param == param
    with pytest.raises(SamplingError) as err:
        target.new_request([1, 2], SamplingParams(logit_bias=((10_000, 1.0),)))
    assert err.value.param == "logit_bias"
    for grammar in [
        Grammar("json_schema", '{"type": "object", "properties": 3}'),
        Grammar("regex", "a(b"),
        Grammar("ebnf", "root ::= missing_rule"),
    ]:
        with pytest.raises(GrammarError) as gerr:
            target.new_request([1, 2], SamplingParams(grammar=grammar))
        assert gerr.value.param == "response_format"


# --------------------------------------------------------------------------- end to end


CONTROLS = {
    "penalties": dict(presence_penalty=0.8, frequency_penalty=0.5),
    "repetition": dict(repetition_penalty=1.5),
    "bias": dict(logit_bias=((70, 3.0), (66, 2.0), (71, -5.0))),
    "logprobs": dict(logprobs=20),
}


def assert_same_top(
    got: list[tuple[int, float]], want: list[tuple[int, float]], name: str, tol: float = 1e-5
) -> None:
    """The same top-n logprobs rank by rank within `tol`; the tokens at a rank may differ only
    in a near-tie (fp32 weights run torch's GEMMs, whose rounding differs between a 1-row
    decode and a k+1-row verify on some CPUs, e.g. AMX: two logprobs within tol can swap)."""
    assert len(got) == len(want), name
    for (tg, lg), (tw, lw) in zip(got, want, strict=True):
        assert lg == pytest.approx(lw, abs=tol), name
        if tg != tw:  # a swap: the other's token sits in a near-tie with this rank
            theirs = dict(want).get(tg, dict(got)[tg])
            assert abs(theirs - lw) <= 2 * tol, (name, tg, tw)


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_controls_greedy_and_logprobs_equal_with_speculation_on_and_off(
    target: LoadedModel, near_draft_dir: Path, tiny_model_dir: Path, control: str
) -> None:
    params = SamplingParams(
        **{"max_tokens": 40, "ignore_eos": True, "logprobs": 3, **CONTROLS[control]}
    )  # type: ignore[arg-type]
    reqs = {
        name: run(target, PROMPT, params, cfg)
        for name, cfg in specs(near_draft_dir, tiny_model_dir).items()
    }
    base = reqs["off"]
    assert len(base.output_ids) == 40
    for name, req in reqs.items():
        assert req.output_ids == base.output_ids, name
        assert [lp.token for lp in req.logprobs] == base.output_ids, name
        for a, b in zip(req.logprobs, base.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5), name
            assert_same_top(a.top, b.top, name)
    assert reqs["ngram"].spec.drafted > 0 and reqs["draft"].spec.drafted > 0
    self_spec = reqs["self"].spec
    assert self_spec.accepted == self_spec.drafted > 0  # shaped drafts: the target's own picks
    if control != "logprobs":  # the control really acts: the output differs without it
        plain = run(target, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), None)
        assert plain.output_ids != base.output_ids


@pytest.mark.parametrize(
    "grammar",
    [Grammar("regex", REGEX), Grammar("json_schema", json.dumps(SCHEMA)), Grammar("json_object")],
    ids=["regex", "json_schema", "json_object"],
)
def test_grammar_output_is_valid_and_equal_with_speculation_on_and_off(
    target: LoadedModel, near_draft_dir: Path, tiny_model_dir: Path, grammar: Grammar
) -> None:
    prompt = '{"kind": "cat", "ok": true, "n": 7} {"kind": "dog", "ok": false, "n": 12} '
    params = SamplingParams(max_tokens=64, grammar=grammar)
    reqs = {
        name: run(target, prompt, params, cfg)
        for name, cfg in specs(near_draft_dir, tiny_model_dir).items()
    }
    base = reqs["off"]
    for name, req in reqs.items():
        assert req.output_ids == base.output_ids, name
    self_spec = reqs["self"].spec
    assert self_spec.accepted == self_spec.drafted > 0  # drafted inside the grammar
    if grammar.kind == "regex":
        assert re.fullmatch(REGEX, base.text), base.text
    elif base.finish_reason == "stop":
        value = json.loads(base.text)
        if grammar.kind == "json_schema":
            jsonschema.validate(value, SCHEMA)
        assert isinstance(value, dict)
    else:  # an unconstrained JSON object may run out of tokens; it is still a JSON prefix
        assert base.text.startswith("{")
    if grammar.kind != "json_object":
        assert base.finish_reason == "stop", base.text


def test_sampled_output_under_controls_follows_the_shaped_target_distribution(
    target: LoadedModel, near_draft_dir: Path
) -> None:
    """The second token's marginal under draft-model speculation (k = 2, sampled drafts that
    know nothing of the controls) equals the exact marginal of the shaped target."""
    cfg = SpeculativeConfig(
        method="draft", num_draft_tokens=2, draft_model=str(near_draft_dir), adaptive=False
    )
    spec = make_speculation(target, cfg)
    tok = target.tokenizer
    prompt = tok.encode("ab")
    letters = [tok.encode(c)[0] for c in "abcdef"]
    base = dict(
        max_tokens=4,  # with 2 the cycle after the first token has no room to draft
        temperature=1.0,
        ignore_eos=True,
        presence_penalty=1.0,
        logit_bias=((letters[0], 1.5), (letters[1], 1.0)),
        grammar=Grammar("regex", "[a-f]{2}"),
    )
    sp = SamplingParams(**base)  # type: ignore[arg-type]
    vocab = target.model.config.vocab_size
    model = target.model

    def shaped(ids: list[int], out: list[int]) -> torch.Tensor:
        o = model(torch.tensor(ids), [model.new_cache(8)], [len(ids)])
        ctl = LogitControls(sp, prompt, vocab, target.grammar_matcher(sp.grammar))  # type: ignore[arg-type]
        ctl.commit(out)
        return probabilities(ctl.apply(o.logits, []), sp)[0]

    assert set(shaped(prompt, []).nonzero().flatten().tolist()) <= set(letters)
    marginal = second_token_marginal(shaped, prompt)
    reqs = assert_second_token_follows(
        target, spec, prompt, lambda seed: replace(sp, seed=seed), marginal, 2000
    )
    drafted, accepted = sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)
    assert 0 < accepted < drafted  # both branches of the rejection sampler ran


def test_controls_with_mtp_on_a_hybrid_target_equal_speculation_off(tmp_path: Path) -> None:
    """MTP self-speculation on a random Gated-DeltaNet target: penalties, bias, logprobs and a
    grammar give the same output and logprobs as speculation off, with drafts accepted."""
    model = random_hybrid("qwen3_next", seed=1)
    randomize(model, seed=1, out_scale=0.03)
    lm = load(str(save_hybrid_dir(model, "qwen3_next", tmp_path, copying_head(model))), "fp32")
    mtp = SpeculativeConfig(method="mtp", num_draft_tokens=3, adaptive=False)
    cases = [
        SamplingParams(max_tokens=40, ignore_eos=True, logprobs=4, presence_penalty=0.3),
        SamplingParams(max_tokens=40, ignore_eos=True, logit_bias=((70, 2.0),), logprobs=0),
        SamplingParams(max_tokens=40, grammar=Grammar("regex", "[a-z ]{1,30}")),
    ]
    accepted = 0
    for params in cases:
        off = run(lm, PROMPT, params, None)
        on = run(lm, PROMPT, params, mtp)
        assert on.output_ids == off.output_ids
        assert [lp.logprob for lp in on.logprobs] == pytest.approx(
            [lp.logprob for lp in off.logprobs], abs=1e-5
        )
        accepted += on.spec.accepted
    assert accepted > 0


def test_text_the_grammar_forces_is_drafted_and_accepted(target: LoadedModel) -> None:
    """JSON keys the schema requires are forced text: drafted even where the n-gram index has
    nothing (the prompt holds no JSON), accepted, and the output equals speculation off."""
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    m = target.grammar_matcher(grammar)
    assert m.accept(target.tokenizer.encode("{")[0])
    assert m.forced_text().startswith('"kind"')  # the first required key
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=6, adaptive=False)
    params = SamplingParams(max_tokens=64, grammar=grammar)
    off = run(target, "zq", params, None)
    on = run(target, "zq", params, ngram)
    assert on.output_ids == off.output_ids and off.finish_reason == "stop"
    assert on.spec.accepted >= len('"kind":"","ok":,"n":')  # the keys and their punctuation
    jsonschema.validate(json.loads(on.text), SCHEMA)
