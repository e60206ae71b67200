"""Speculative decoding end to end (fp32, tiny random models): greedy output is token-identical
to speculation off for every drafter (with drafts proposed AND accepted, so it cannot pass
vacuously), a draft equal to the target is accepted ~always, sampled output keeps the target's
distribution, and EOS / max_tokens / stop strings inside an accepted block cut exactly there."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
from kernel_checks import needs_kernel
from parity import PROMPTS, generate, greedy_parity
from second_token import assert_second_token_follows, plain_distribution, second_token_marginal

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.kernels import Int8Weight
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.llama import CausalLM
from quickdraft.request import SamplingParams
from quickdraft.speculation.cost import DraftCost, StepCost, known_cost, use_cost
from quickdraft.speculation.drafters.base import Draft, Drafter, DraftJob
from quickdraft.speculation.drafters.draft_model import DraftModelDrafter
from quickdraft.speculation.drafters.ngram import NgramDrafter
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import Speculation


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


@pytest.mark.parametrize(
    "method", ["ngram", "draft-near", "draft-near-int8", "draft-near-int4", "draft-self"]
)
def test_speculative_greedy_equals_plain(
    target: LoadedModel, near_draft_dir: Path, tiny_model_dir: Path, method: str
) -> None:
    draft_dir = {
        "draft-near": near_draft_dir,
        "draft-near-int8": near_draft_dir,
        "draft-near-int4": near_draft_dir,
        "draft-self": tiny_model_dir,
    }.get(method)
    cfg = SpeculativeConfig(
        method="ngram" if method == "ngram" else "draft",
        num_draft_tokens=4,
        draft_model=str(draft_dir) if draft_dir else None,
        draft_quantization=method[-4:] if method.endswith(("int8", "int4")) else "none",
        ngram_min=1,
        ngram_max=3,
        adaptive=False,  # always draft, so every prompt exercises verify + rollback
    )
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    drafted, accepted = greedy_parity(target, PROMPTS, params, cfg)
    assert drafted > 0 and accepted > 0
    if method == "draft-self":
        assert accepted / drafted >= 0.98
    else:
        assert accepted < drafted  # some rejections happened too: rollback was exercised


def test_ngram_shared_index_across_requests_stays_lossless(target: LoadedModel) -> None:
    """One n-gram Speculation serves every prompt twice: the second time its shared index holds
    each prompt's own earlier output, so it accepts more drafts, and every output is
    still token-identical to speculation off."""
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    spec = make_speculation(target, cfg)
    assert spec is not None and isinstance(spec.drafter, NgramDrafter)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = [generate(target, p, params, SpeculativeConfig()).output_ids for p in PROMPTS]
    accepted = []
    for _ in range(2):
        total = 0
        for prompt, want in zip(PROMPTS, plain, strict=True):
            req = target.new_request(target.tokenizer.encode(prompt), params)
            for _ in stream(target, req, spec):
                pass
            assert req.output_ids == want, prompt
            total += req.spec.accepted
        accepted.append(total)
        assert spec.drafter.shared_size > 0
    # measured 197 -> 276 (the request's own index is asked first: these prompts repeat
    # themselves, and a random tiny model often departs from its own patterns)
    assert accepted[1] > accepted[0] + len(PROMPTS) * 4, accepted


def test_ngram_seeded_sampling_equals_speculation_off(target: LoadedModel) -> None:
    """A seeded sampled request emits the same tokens with n-gram drafts as without: one-hot
    drafts are verified against the same per-position draws plain sampling makes
    (`verify_one_hot`), so neither the drafts nor the shared index, which the second pass
    has filled with the first pass's outputs, change a token."""
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=4, ngram_min=1, adaptive=False)
    spec = make_speculation(target, cfg)
    assert spec is not None
    drafted = accepted = 0
    for rep in range(2):
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(
                max_tokens=40, temperature=0.5, top_p=0.95, seed=100 + i, ignore_eos=True
            )
            plain = generate(target, prompt, params, SpeculativeConfig())
            req = target.new_request(target.tokenizer.encode(prompt), params)
            for _ in stream(target, req, spec):
                pass
            assert req.output_ids == plain.output_ids, (rep, prompt)
            drafted += req.spec.drafted
            accepted += req.spec.accepted
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts kept and rejected


def test_speculative_sampled_matches_target_distribution(
    target: LoadedModel, near_draft_dir: Path
) -> None:
    """Second emitted token under speculation (k=2, sampled drafts) vs its exact marginal."""
    cfg = SpeculativeConfig(
        method="draft", num_draft_tokens=2, draft_model=str(near_draft_dir), adaptive=False
    )
    spec = make_speculation(target, cfg)
    prompt = target.tokenizer.encode("ab")
    # 4 tokens: with 2 the one cycle after the first token has no room to draft
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=6, ignore_eos=True)
    marginal = second_token_marginal(plain_distribution(target, params), prompt)
    reqs = assert_second_token_follows(
        target, spec, prompt, lambda seed: replace(params, seed=seed), marginal, 3000
    )
    drafted, accepted = sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)
    assert 0 < accepted < drafted  # both branches of the rejection sampler ran


@pytest.mark.parametrize("case", ["eos", "max_tokens", "stop"])
def test_speculative_block_truncates_exactly(
    target: LoadedModel, tiny_model_dir: Path, case: str
) -> None:
    """A draft == target accepts whole blocks; finishing inside one must cut exactly there."""
    prompt = PROMPTS[1]
    free = generate(
        target, prompt, SamplingParams(max_tokens=40, ignore_eos=True), SpeculativeConfig()
    )
    cfg = SpeculativeConfig(  # unquantized: an int4 copy of the target would reject some drafts
        method="draft",
        num_draft_tokens=5,
        draft_model=str(tiny_model_dir),
        draft_quantization="none",
        adaptive=False,
    )
    if case == "eos":
        eos = free.output_ids[13]
        first = free.output_ids.index(eos)
        lm = LoadedModel(target.name, target.path, "fp32", target.model, target.tokenizer, (eos,))
        req = generate(lm, prompt, SamplingParams(max_tokens=40), cfg)
        assert req.output_ids == free.output_ids[:first]
    elif case == "max_tokens":
        req = generate(target, prompt, SamplingParams(max_tokens=11, ignore_eos=True), cfg)
        assert req.output_ids == free.output_ids[:11] and req.finish_reason == "length"
    else:
        assert len(free.text) >= 12, free.text
        mid = len(free.text) // 2
        stop = free.text[mid : mid + 3]
        req = generate(
            target, prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)), cfg
        )
        assert req.text == free.text[: free.text.index(stop)] and req.finish_reason == "stop"
    assert req.spec.accepted > 0


def test_speculative_draft_cost_is_calibrated_while_decoding(
    tiny_model_dir: Path, near_draft_dir: Path
) -> None:
    """A draft model's forwards are timed into its own cost table at start-up, and every
    draft phase then corrects that table by measured / predicted; n-gram stays free. Forced
    requests (adaptive off) need no cost model: none is measured for them."""
    target = load(str(tiny_model_dir), "fp32", progress=False)  # fresh: no step cost yet
    forced = make_speculation(
        target,
        SpeculativeConfig(
            method="draft", num_draft_tokens=3, draft_model=str(near_draft_dir), adaptive=False
        ),
    )
    assert forced is not None
    req = target.new_request(target.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=24))
    for _ in stream(target, req, forced):
        pass
    assert req.spec.drafted > 0 and known_cost(target.model) is None and forced.draft_cost is None

    cfg = SpeculativeConfig(method="draft", num_draft_tokens=3, draft_model=str(near_draft_dir))
    probed = make_speculation(target, cfg)
    assert probed is not None and probed.draft_cost is not None
    assert probed.draft_cost.table.seconds[0] > 0 and known_cost(target.model) is not None
    # A table that says drafting is 100x cheaper than it is, next to a target whose verify rows
    # look free, so that the policy keeps drafting: each phase measures ~100x the table,
    # clamped to 4x, and the ratio follows.
    use_cost(target.model, StepCost((1, 64), (0.01, 0.01)))
    real = probed.draft_cost.table
    cheap = real.scaled(0.01)
    spec = Speculation(cfg, probed.drafter, DraftCost(cheap))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    req = target.new_request(target.tokenizer.encode(PROMPTS[0]), params)
    for _ in stream(target, req, spec):
        pass
    assert spec.draft_cost is not None and req.spec.drafted > 0
    assert spec.draft_cost.seen == req.spec.drafted_per_position[0]  # each phase that drafted
    assert spec.draft_cost.ratio > 3.0

    ngram = make_speculation(target, SpeculativeConfig(method="ngram"))
    assert ngram is not None
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    req = target.new_request(target.tokenizer.encode(PROMPTS[3]), params)
    for _ in stream(target, req, ngram):
        pass
    assert req.spec.drafted > 0 and ngram.draft_cost is None


def test_speculative_disable_env_forces_off(
    target: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUICKDRAFT_DISABLE_SPECULATION", "1")
    assert make_speculation(target, SpeculativeConfig(method="ngram")) is None


def test_speculative_draft_quantization_is_checked(
    target: LoadedModel, tiny_model_dir: Path
) -> None:
    with pytest.raises(ValueError, match="draft quantization 'int3'"):
        SpeculativeConfig(method="draft", draft_model="x", draft_quantization="int3")
    cfg = SpeculativeConfig(
        method="draft", draft_model=str(tiny_model_dir), draft_quantization="int8"
    )
    spec = make_speculation(target, cfg)
    assert spec is not None
    # the draft model really runs on int8 weights
    drafter = spec.drafter
    assert isinstance(drafter, DraftModelDrafter)
    model = drafter.model
    assert isinstance(model, CausalLM)
    assert all(isinstance(layer.mlp.down, Int8Weight) for layer in model.decoder_layers)


def test_speculative_draft_with_other_tokenizer_is_refused(
    target: LoadedModel, tmp_path: Path, tiny_model_dir: Path
) -> None:
    import json

    for f in tiny_model_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, different id mapping
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer"):
        make_speculation(target, SpeculativeConfig(method="draft", draft_model=str(tmp_path)))


@needs_kernel
@pytest.mark.parametrize("method", ["ngram", "draft-near"])
def test_speculative_bf16_greedy_equals_plain(
    bf16_pair: tuple[Path, Path], method: str, kernels_enabled: None
) -> None:
    """bf16 on the kernels (bf16 panels, as `load` runs a bf16 model): every op gives a row
    the same bits alone (decode) and inside a verify, so greedy output with speculation is
    token-identical to plain decoding in bf16 too, not only in fp32."""
    target_dir, draft_dir = bf16_pair
    target = load(str(target_dir), "bf16", progress=False)
    cfg = SpeculativeConfig(
        method="ngram" if method == "ngram" else "draft",
        num_draft_tokens=4,
        draft_model=str(draft_dir) if method == "draft-near" else None,
        draft_quantization="none",
        adaptive=False,
    )
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        plain = generate(target, prompt, params, SpeculativeConfig())
        spec = generate(target, prompt, params, cfg)
        assert spec.output_ids == plain.output_ids, prompt
        accepted += spec.spec.accepted
    assert accepted > 0


class FlooredDrafter:
    """A drafter whose every job stops below the chain probability `min_prob`, as the adaptive
    policy's jobs do (policy.py `Plan`); records the draft lengths."""

    def __init__(self, inner: DraftModelDrafter, min_prob: float) -> None:
        self.inner, self.min_prob = inner, min_prob
        self.lengths: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def propose(self, jobs: list[DraftJob]) -> list[Draft]:
        drafts = self.inner.propose([replace(j, min_prob=self.min_prob) for j in jobs])
        self.lengths.extend(len(d.tokens) for d in drafts)
        return drafts


def test_speculative_sampled_stays_exact_when_drafts_stop_on_their_probability(
    target: LoadedModel, near_draft_dir: Path
) -> None:
    """Third emitted token under sampled drafts of up to 3 that stop where the draft model's
    chain probability falls below a floor, vs its exact marginal: a stop that reads only the
    drafter's own guesses leaves the target's distribution intact."""
    cfg = SpeculativeConfig(
        method="draft", num_draft_tokens=3, draft_model=str(near_draft_dir), adaptive=False
    )
    spec = make_speculation(target, cfg)
    assert isinstance(spec, Speculation) and isinstance(spec.drafter, DraftModelDrafter)
    floored = FlooredDrafter(spec.drafter, 0.4)
    spec = Speculation(spec.config, cast(Drafter, floored), None)
    prompt = target.tokenizer.encode("ab")
    params = SamplingParams(max_tokens=5, temperature=1.0, top_k=4, ignore_eos=True)
    marginal = second_token_marginal(plain_distribution(target, params), prompt, at=2)
    reqs = assert_second_token_follows(
        target, spec, prompt, lambda seed: replace(params, seed=seed), marginal, 3000, at=2
    )
    assert {1, 2} <= set(floored.lengths), set(floored.lengths)  # cut short, and not always
    drafted, accepted = sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)
    assert 0 < accepted < drafted
