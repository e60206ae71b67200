"""speculation/drafters/confidence.py: the lookups' per-token confidence, learned from verdicts,
and the policy pricing a looked-up draft by it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parity import PROMPTS, generate

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.speculation.cost import StepCost, StepShape
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.drafters.confidence import Confidence, ScoredLookup
from quickdraft.speculation.drafters.ngram import NgramDrafter
from quickdraft.speculation.drafters.suffix import SuffixDrafter
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.policy import BatchPolicy, Candidate, Decoding, DraftPlanner
from quickdraft.speculation.state import Acceptance, Speculation

PARAMS = SamplingParams()
GEN = torch.Generator()
# SmolLM2-135M Q4_K_M's forward by rows on an AMD EPYC, 2 threads (docs/speculation.md)
SMOLLM2 = StepCost((1, 2, 3, 4, 5, 6), (4.30e-3, 4.76e-3, 5.56e-3, 6.39e-3, 7.08e-3, 7.8e-3))


def job(state: object, tokens: list[int], k: int) -> DraftJob:
    return DraftJob(state, tokens, k, PARAMS, GEN)


def test_confidence_counts_reached_and_kept_tokens_per_kind() -> None:
    conf = Confidence(prior=0.6, weight=2.0, forget=1.0)
    assert conf.prob("a") == pytest.approx(0.6)
    conf.observe(["a", "b", "c"], drafted=3, accepted=1)  # a kept, b rejected, c never reached
    assert conf.prob("a") == pytest.approx((1 + 1.2) / 3)
    assert conf.prob("b") == pytest.approx(1.2 / 3)
    assert conf.prob("c") == pytest.approx(0.6)
    assert conf.chain(["a", "b"]) == pytest.approx([2.2 / 3, 2.2 / 3 * 0.4])
    conf.observe(["c", "c"], drafted=1, accepted=1)  # only the verified token counts
    assert conf.rates["c"] == [1.0, 1.0]
    forgetting = Confidence(prior=0.5, weight=1.0, forget=0.5)
    for _ in range(20):
        forgetting.observe(["x"], 1, 0)
    forgetting.observe(["x"], 1, 1)
    assert forgetting.prob("x") > 0.5  # the latest verdicts weigh most
    with pytest.raises(ValueError, match="prior"):
        Confidence(prior=1.0)


def test_ngram_keys_name_the_match_length_the_vote_and_the_index() -> None:
    drafter = NgramDrafter(min_n=1, max_n=4)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4]  # "1 2 3 4" went on with 5 9 once
    state = drafter.new_state(tokens)
    assert drafter._draft(state, tokens, 2) == ([5, 9], [(4, True), (4, True)])
    branch = [7, 1, 7, 2, 7]  # "7" went on with 1 and with 2: the latest wins, half the votes
    assert drafter._draft(drafter.new_state(branch), branch, 1) == ([2], [(1, False)])
    drafter.learn([30, 31, 32, 33])
    other = [40, 30, 31]  # only the shared index saw "30 31"
    assert drafter._draft(drafter.new_state(other), other, 2) == ([32, 33], [(0, True), (0, True)])


def test_suffix_keys_name_the_match_length_the_path_probability_and_the_tree() -> None:
    drafter = SuffixDrafter(max_spec_factor=4.0, min_token_prob=0.1)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    draft, keys = drafter._draft(drafter.new_state(tokens), tokens, 2)
    assert draft == [10, 11] and keys == [(8, 2, True), (8, 2, True)]
    branch = [5, 1, 5, 2, 5, 2, 5]  # after "5": 2 twice, 1 once
    draft, keys = drafter._draft(drafter.new_state(branch), branch, 1)
    # "5 2 5" went on with 2 alone (a tie with "2 5" goes to the longer match)
    assert draft == [2] and keys == [(3, 2, True)]
    short = [5, 1, 5, 2, 9, 5]
    draft, keys = drafter._draft(drafter.new_state(short), short, 1)
    assert draft == [2] and keys == [(1, 1, True)]  # "5" went on with 1 and 2: p 1/2
    drafter.learn([60, 61, 62, 63])
    other = [70, 60, 61]
    draft, keys = drafter._draft(drafter.new_state(other), other, 2)
    assert draft == [62, 63] and keys == [(2, 2, False), (2, 2, False)]


@pytest.mark.parametrize("drafter", [NgramDrafter(), SuffixDrafter(max_spec_factor=4.0)])
def test_propose_cuts_the_peeked_draft_and_outcome_learns_its_kinds(
    drafter: ScoredLookup, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    state = drafter.new_state(tokens)
    fresh = drafter.propose([job(state, tokens, 3)])[0].tokens
    assert fresh == [4, 5, 6]
    drafter.confidence = Confidence(prior=0.6, weight=2.0, forget=1.0)
    chain = drafter.peek(state, tokens, 3)
    assert chain == pytest.approx([0.6, 0.36, 0.216])  # the prior, per token
    with monkeypatch.context() as m:  # the step's propose looks nothing up again
        m.setattr(drafter, "_draft", lambda *a: pytest.fail("looked up twice"))
        assert drafter.propose([job(state, tokens, 2)])[0].tokens == [4, 5]
    assert len(state.peeked.proposed) == 2
    drafter.outcome(state, drafted=2, accepted=1)
    assert sum(r[0] for r in drafter.confidence.rates.values()) == 2.0
    assert sum(r[1] for r in drafter.confidence.rates.values()) == 1.0
    drafter.outcome(state, drafted=2, accepted=2)  # nothing proposed since: nothing learned
    assert sum(r[0] for r in drafter.confidence.rates.values()) == 2.0
    # consumed: the next propose at these tokens looks up (k larger than peeked, too)
    assert drafter.propose([job(state, tokens, 3)])[0].tokens == [4, 5, 6]
    longer = [*tokens, 4]
    drafter.peek(state, tokens, 1)
    assert drafter.propose([job(state, longer, 2)])[0].tokens == [5, 6]  # stale peek
    assert all(greedy for greedy, _ in state.peeked.proposed)
    sampled = DraftJob(state, longer, 2, SamplingParams(temperature=0.7), GEN)
    assert drafter.propose([sampled])[0].tokens == [5, 6]
    assert not any(greedy for greedy, _ in state.peeked.proposed)  # a table of their own


def test_policy_prices_a_peeked_draft_by_its_chain_not_the_profile() -> None:
    """On SmolLM2's table a second draft row costs ~17 % of a step and a first ~10 %: a draft
    whose tokens follow a long unanimous match goes deep, a weak one stops at once, whatever
    the request's running profile says."""
    policy = BatchPolicy(SMOLLM2)
    poor_record = Acceptance(prior_alpha=0.05, prior_weight=100.0)
    strong = Candidate(poor_record, 4, chain=[0.9, 0.81, 0.73, 0.66])
    assert policy.choose([strong], [None], StepShape(1, 1), 64) == [4]
    good_record = Acceptance(prior_alpha=0.95, prior_weight=100.0)
    weak = Candidate(good_record, 3, chain=[0.25, 0.06, 0.015])
    assert policy.choose([weak], [None], StepShape(1, 1), 64) == [1]
    hopeless = Candidate(good_record, 2, chain=[0.02, 0.004])
    assert policy.choose([hopeless], [None], StepShape(1, 1), 64) == [0]


def test_planner_peeks_a_scored_lookup_and_caps_k_at_what_it_found() -> None:
    drafter = SuffixDrafter()  # a match of m tokens drafts at most m (max_spec_factor 1)
    spec = Speculation(SpeculativeConfig(method="suffix", num_draft_tokens=5), drafter, None)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # the lookup finds 3 tokens
    state = spec.start(tokens)
    state.arm.synced = len(tokens)
    planner = DraftPlanner(lambda: StepCost((1, 64), (1e-3, 1.01e-3)))  # rows nearly free
    view = Decoding(state, True, 100, len(tokens), lambda: tokens)
    (plan,) = planner.choose([view], StepShape(1, 1), 64)
    assert plan.k == 3  # all it found, not the config's 5
    nothing = [1, 2, 3, 4]
    empty = spec.start(nothing)
    hits = empty.acceptance.hit_rate
    (plan,) = planner.choose([Decoding(empty, True, 100, 4, lambda: nothing)], StepShape(1, 1), 64)
    assert plan.k == 0 and empty.acceptance.hit_rate < hits  # asked, found nothing


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_adaptive_lookups_learn_their_confidence_and_stay_lossless(
    target: LoadedModel, method: str
) -> None:
    """The engine's policy peeks, the step proposes the cut draft, every verdict reaches the
    drafter's table (kept tokens = accepted drafts), and outputs equal speculation off."""
    spec = make_speculation(target, SpeculativeConfig(method=method, num_draft_tokens=5))
    assert spec is not None and isinstance(spec.drafter, ScoredLookup)
    spec.drafter.confidence = Confidence(forget=1.0)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    accepted = drafted = 0
    for prompt in PROMPTS:
        want = generate(target, prompt, params, SpeculativeConfig()).output_ids
        req = target.new_request(target.tokenizer.encode(prompt), params)
        for _ in stream(target, req, spec):
            pass
        assert req.output_ids == want, prompt
        accepted += req.spec.accepted
        drafted += req.spec.drafted
    rates = spec.drafter.confidence.rates
    assert drafted > 0 and rates
    assert sum(kept for _, kept in rates.values()) == accepted
    assert accepted <= sum(reached for reached, _ in rates.values()) <= drafted
