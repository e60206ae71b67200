"""Adaptive drafter choice (method "adaptive", speculation/adaptive.py): the pick rule on priced
arms (the better expected tokens/s wins, a lookup that rarely finds anything loses, an idle arm
is explored once that is cheap), and end to end on tiny random models: greedy output identical
to speculation off under the real pick rule and under one that switches arms every step (each
switch resyncs the arm: a draft model that is the target itself keeps drafting what the target
emits), seeded sampling with lookup drafters identical to speculation off, the
prefix cache keeping the draft model's state beside the other arms, and the config's checks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.engine.core import EngineCore
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.loading import LoadedModel, load
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation import policy as policy_module
from quickdraft.speculation import state as state_module
from quickdraft.speculation.adaptive import EXPLORE_MIN, Pick, Pricing, pick
from quickdraft.speculation.cost import DraftCost, StepCost, use_cost
from quickdraft.speculation.drafters.ngram import NgramDrafter
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import (
    Acceptance,
    AdaptiveSpeculation,
    AnySpeculation,
    SpecState,
    Speculation,
)

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(",
    "the cat sat on the mat. the cat sat on the",
    '{"name": "x", "id": 1}, {"name": "y", "id": 2}, {"name": ',
    "abcabcabcabc",
    "zzz yyy xxx zzz yyy",
]
STEP = 0.01  # seconds of the synthetic target step below


# ---------------------------------------------------------------- the pick rule


def pricing() -> Pricing:
    """A target whose step costs STEP and each verify row a tenth of it; catch-ups are free."""
    return Pricing(STEP, lambda k: 0.1 * STEP * k, lambda tokens, left, alpha, cost: 0.0)


def adaptive(*arms: tuple[str, DraftCost | None]) -> AdaptiveSpeculation:
    members = tuple(
        Speculation(SpeculativeConfig(method=name, draft_model="m"), NgramDrafter(), cost)
        for name, cost in arms
    )
    return AdaptiveSpeculation(SpeculativeConfig(method="adaptive"), members)


def costing(fraction: float) -> DraftCost:
    """A drafter whose one-token forward costs `fraction` of the target's step."""
    return DraftCost(StepCost((1, 64), (fraction * STEP, 64 * fraction * STEP)))


def set_acceptance(arm_acceptance: Acceptance, alpha: float, hit: float = 1.0) -> None:
    arm_acceptance.prior_alpha, arm_acceptance.hit_rate = alpha, hit


def test_adaptive_pick_prefers_the_better_rate() -> None:
    spec = adaptive(("ngram", None), ("draft", costing(0.1))).start([1, 2, 3])
    lookup, model = spec.arms
    set_acceptance(lookup.acceptance, 0.6)
    set_acceptance(model.acceptance, 0.6)
    assert pick(spec, pricing(), 4, 3, 100).arm == 0  # same acceptance: the free one
    set_acceptance(model.acceptance, 0.95)
    assert pick(spec, pricing(), 4, 3, 100).arm == 1  # much better drafts pay for forwards
    set_acceptance(model.acceptance, 0.95, hit=1.0)
    set_acceptance(lookup.acceptance, 0.99, hit=0.05)  # great when it finds a match: rarely
    assert pick(spec, pricing(), 4, 3, 100).arm == 1
    assert spec.active == 1


def test_adaptive_pick_explores_an_idle_arm_once_it_is_cheap() -> None:
    spec = adaptive(("ngram", None), ("suffix", None)).start([1, 2, 3])
    set_acceptance(spec.arms[0].acceptance, 0.9)
    set_acceptance(spec.arms[1].acceptance, 0.1)
    picks = [pick(spec, pricing(), 4, 3 + i, 100) for i in range(EXPLORE_MIN + 1)]
    assert [p.arm for p in picks[:EXPLORE_MIN]] == [0] * EXPLORE_MIN
    assert picks[EXPLORE_MIN].arm == 1 and picks[EXPLORE_MIN].explore
    assert spec.arms[1].idle == 0 and spec.arms[0].idle == 1
    # a drafter whose catch-up costs more than the idle steps' budget is not explored
    costly = adaptive(("ngram", None), ("draft", costing(5.0))).start([1, 2, 3])
    set_acceptance(costly.arms[1].acceptance, 0.1)
    assert not any(pick(costly, pricing(), 4, 3, 100).explore for _ in range(3 * EXPLORE_MIN))


def test_adaptive_shadow_drafts_score_the_lookups() -> None:
    """A lookup that did not draft learns from what it would have drafted: the prefix that
    matches the emitted tokens is accepted, a mismatch within them is a rejection, and what
    lies past them is not judged."""
    spec = adaptive(("draft", costing(0.1)), ("ngram", None)).start([1, 2, 3])
    lookup = spec.arms[1].acceptance
    spec.arms[1].shadow = [5, 6, 9, 9]
    spec.record(2, 2, True, 10, emitted=[5, 6, 7])  # 2 accepted, the third rejected
    assert (lookup.successes, lookup.failures) == (2, 1)
    spec.arms[1].shadow = [7, 8, 9]
    spec.record(1, 0, True, 11, emitted=[7])  # 1 accepted; the rest is not known
    assert (lookup.successes, lookup.failures) == (2 * lookup.forget + 1, lookup.forget)
    assert spec.arms[1].shadow is None
    spec.arms[1].shadow = []
    spec.record(1, 0, True, 12, emitted=[4])  # it found nothing to draft
    assert lookup.hit_rate < 1.0


def test_adaptive_start_scores_the_lookups_on_the_prompt() -> None:
    """Before the first pick, each free lookup shadow-drafts over the prompt's last positions:
    a prompt that repeats itself raises its acceptance above the pooled prior, one that never
    repeats lowers it; a drafter with a cost is not run."""
    members = (
        Speculation(SpeculativeConfig(method="ngram"), NgramDrafter(), None),
        Speculation(
            SpeculativeConfig(method="draft", draft_model="m"), NgramDrafter(), costing(0.1)
        ),
    )
    spec = AdaptiveSpeculation(SpeculativeConfig(method="adaptive", num_draft_tokens=4), members)
    prior = members[0].pooled.alpha
    repeating = spec.start(list(range(10, 30)) * 4)
    assert repeating.arms[0].acceptance.alpha > prior + (1 - prior) / 2  # most of the way to 1
    assert repeating.arms[1].acceptance.successes == repeating.arms[1].acceptance.failures == 0
    fresh = spec.start(list(range(100, 180)))
    assert fresh.arms[0].acceptance.hit_rate < 0.1
    assert all(a.shadow is None for a in (*repeating.arms, *fresh.arms))


def test_adaptive_prompt_score_is_a_prior_the_request_moves_at_once() -> None:
    """The prompt's score sets where a lookup's estimate starts and weighs as the prior's few
    drafts: a prompt that never repeats starts it low, and two cycles whose drafts were all
    accepted (an answer that copies its context) already take it most of the way up."""
    members = (Speculation(SpeculativeConfig(method="ngram"), NgramDrafter(), None),)
    spec = AdaptiveSpeculation(SpeculativeConfig(method="adaptive", num_draft_tokens=8), members)
    # "7 8" went on with 9 thirty times; at the end it goes on otherwise every time
    tail = [t for i in range(14) for t in (7, 8, 50 + i)]
    state = spec.start([7, 8, 9] * 30 + tail + list(range(200, 208)))
    acc = state.arms[0].acceptance
    start = acc.alpha
    assert acc.successes == acc.failures == 0 and acc.prior_alpha == start
    assert start < 0.5  # the lookup guessed 9 there and was wrong
    for _ in range(2):
        acc.update(8, 8)
    assert acc.alpha > 0.8


def test_adaptive_pick_with_no_room_keeps_the_arm() -> None:
    spec = adaptive(("ngram", None), ("suffix", None)).start([1, 2, 3])
    spec.active = 1
    assert pick(spec, pricing(), 0, 3, 1).arm == 1


def test_adaptive_config_is_checked() -> None:
    with pytest.raises(ValueError, match="adaptive drafters"):
        SpeculativeConfig(method="adaptive", adaptive_drafters=("ngram", "mtp"))
    with pytest.raises(ValueError, match="draft model"):
        SpeculativeConfig(method="adaptive", adaptive_drafters=("ngram", "draft"))
    with pytest.raises(ValueError, match="adaptive policy"):
        SpeculativeConfig(method="adaptive", adaptive=False)
    assert SpeculativeConfig(method="adaptive").drafters == ("ngram", "suffix")
    with_draft = SpeculativeConfig(method="adaptive", draft_model="m")
    assert with_draft.drafters == ("ngram", "suffix", "draft")


# ---------------------------------------------------------------- end to end


@pytest.fixture()
def target(tiny_model_dir: Path) -> LoadedModel:
    """A fresh load: the tests below replace its step-cost table."""
    return load(str(tiny_model_dir), "fp32", progress=False)


def all_three(lm: LoadedModel, draft_dir: Path) -> AnySpeculation:
    """n-gram, suffix and the draft model, priced so that each wins somewhere: verify rows
    nearly free next to a step (so drafting pays), the draft model's forward ~5% of it."""
    cfg = SpeculativeConfig(
        method="adaptive",
        num_draft_tokens=4,
        draft_model=str(draft_dir),
        draft_quantization="none",
        ngram_shared_tokens=0,
        suffix_shared_tokens=0,
    )
    spec = make_speculation(lm, cfg)
    assert isinstance(spec, AdaptiveSpeculation)
    use_cost(lm.model, StepCost((1, 2, 64), (0.01, 0.0101, 0.02)))
    for member in spec.members:
        if member.draft_cost is not None:
            member.draft_cost = DraftCost(StepCost((1, 64), (0.0005, 0.004)))
    return spec


def generate(
    lm: LoadedModel, prompt: str, params: SamplingParams, spec: AnySpeculation | None
) -> Request:
    req = lm.new_request(lm.tokenizer.encode(prompt), params)
    for _ in stream(lm, req, spec):
        pass
    return req


def test_adaptive_greedy_equals_plain(target: LoadedModel, near_draft_dir: Path) -> None:
    """The real pick rule: which arms it picks depends on the step costs the policy measures
    while it runs (observe recalibrates the tables), so only the output and the books are
    checked here; the switching itself is forced in the test below."""
    spec = all_three(target, near_draft_dir)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        plain = generate(target, prompt, params, None)
        req = generate(target, prompt, params, spec)
        assert req.output_ids == plain.output_ids, prompt
        assert req.spec.method == "adaptive"
        accepted += req.spec.accepted
        assert sum(c[2] for c in req.spec.drafters.values()) == req.spec.accepted
    assert accepted > 0


def round_robin(spec: SpecState, pricing: Pricing, k_max: int, num_tokens: int, left: int) -> Pick:
    """A pick rule that hands the draft to the next arm every step it is asked, forcing
    EXPLORE_K drafts (the batch policy would size a costly arm's drafts down to none)."""
    if k_max > 0:
        spec.active = (spec.active + 1) % len(spec.arms)
    for i, arm in enumerate(spec.arms):
        arm.idle = 0 if i == spec.active else arm.idle + 1
    return Pick(spec.active, k_max > 0)


def test_adaptive_switching_every_step_equals_plain(
    target: LoadedModel, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each arm drafts every third step, so every step's arm must first resync from tokens
    another arm's drafts committed (the draft model trims and feeds its KV, the lookups index
    what they missed): greedy output stays identical to speculation off and every arm drafts.
    The draft model is the target itself, so it drafts what the target emits only if each
    resync left its KV exactly on the committed tokens."""
    monkeypatch.setattr(policy_module, "pick", round_robin)
    spec = all_three(target, tiny_model_dir)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    drafted: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for prompt in PROMPTS:
        plain = generate(target, prompt, params, None)
        req = generate(target, prompt, params, spec)
        assert req.output_ids == plain.output_ids, prompt
        for name, counts in req.spec.drafters.items():
            drafted[name] = drafted.get(name, 0) + counts[1]
            accepted[name] = accepted.get(name, 0) + counts[2]
    assert set(drafted) == {"ngram", "suffix", "draft"}, drafted
    assert all(drafted.values()), drafted
    assert accepted["draft"] >= 0.9 * drafted["draft"], (drafted, accepted)


def test_adaptive_sampled_lookups_equal_plain(target: LoadedModel) -> None:
    """Seeded sampling with one-hot drafters emits what speculation off emits (verify.py
    couples each position's draw to the seed), whichever drafter drafted."""
    cfg = SpeculativeConfig(
        method="adaptive", num_draft_tokens=4, ngram_shared_tokens=0, suffix_shared_tokens=0
    )
    spec = make_speculation(target, cfg)
    assert isinstance(spec, AdaptiveSpeculation)
    use_cost(target.model, StepCost((1, 2, 64), (0.01, 0.0101, 0.02)))
    params = SamplingParams(max_tokens=48, temperature=0.8, ignore_eos=True)
    drafted = 0
    for seed, prompt in enumerate(PROMPTS):
        p = replace(params, seed=seed)
        plain = generate(target, prompt, p, None)
        req = generate(target, prompt, p, spec)
        assert req.output_ids == plain.output_ids, prompt
        drafted += req.spec.drafted
    assert drafted > 0


def test_adaptive_prefix_cache_keeps_the_draft_arm(
    target: LoadedModel, near_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the prefix cache, a second request with the first's prompt gets the draft model's
    KV of the cached blocks in its draft arm (the cache keeps that arm's state, whichever arm is
    active), and greedy output stays identical to speculation off."""
    spec = all_three(target, near_draft_dir)
    assert isinstance(spec, AdaptiveSpeculation)
    for member in spec.members:  # the lookups start out poor: the draft model drafts first
        if member.draft_cost is None:
            member.pooled.prior_alpha, member.pooled.hit_rate = 0.05, 0.05
    monkeypatch.setattr(state_module, "WARM_UP_POSITIONS", 0)  # (the prompt repeats itself)
    prefix = PrefixCacheConfig(block_size=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = target.tokenizer.encode(PROMPTS[0] + PROMPTS[1])
    outputs = []
    for run_spec in (None, spec):
        core = EngineCore(target, SchedulerConfig(max_running=2), prefix)
        seqs = []
        for _ in range(2):  # one after the other: the second hits the first's blocks
            seqs.append(core.add(target.new_request(prompt, params), run_spec))
            core.step()  # admission + the whole prefill (one chunk)
            second = seqs[-1]
            if run_spec is not None and len(seqs) == 2:
                assert second.spec is not None
                assert "draft" in seqs[0].request.spec.drafters  # the first one drafted with it
                arm = next(a for a in second.spec.arms if a.name == "draft")
                imported = arm.draft_state.cache.length
                assert 0 < imported <= second.cached_tokens and arm.synced == imported
            while core.has_work:
                core.step()
        assert all(s.error is None for s in seqs), [s.error for s in seqs]
        assert seqs[1].cached_tokens > 0
        outputs.append([s.request.output_ids for s in seqs])
    assert outputs[1] == outputs[0]
