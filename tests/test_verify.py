"""Verification: greedy matching, and rejection sampling that reproduces the target distribution.

The distribution tests draw drafts from a known drafter, run `verify_sampled` many times and
compare the emitted tokens' histogram with `p_target` by a chi-square test at p = 0.001. Seeds
are fixed, so every run is the same draw: a pass never flakes. `test_chi_square_rejects_*`
runs the same statistic on deliberately wrong samplers to show it has the power to catch them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from quickdraft.request import SamplingParams
from quickdraft.speculation.sampling import TokenRng, probabilities, sample_with
from quickdraft.speculation.verify import Verdict, verify_greedy, verify_sampled

VOCAB = 8
FILTERED = VOCAB - 1  # zeroed in every p_target row, as top-k/top-p would; p_draft keeps it
TRIALS = 100_000

# chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, dof))
CHI2_CRITICAL = {5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264}


def chi_square(tokens: Tensor, p_target: Tensor) -> tuple[float, int]:
    """Pearson statistic of emitted `tokens` `[N]` against `p_target` `[vocab]`, over the
    tokens the target can emit, and its degrees of freedom."""
    counts = torch.bincount(tokens, minlength=p_target.numel()).double()
    expected = p_target.double() * tokens.numel()
    support = p_target > 0
    assert expected[support].min() >= 5, "chi-square needs >= 5 expected per cell"
    stat = ((counts - expected)[support] ** 2 / expected[support]).sum()
    return float(stat), int(support.sum()) - 1


def follows(tokens: Tensor, p_target: Tensor) -> bool:
    """True when `tokens` are consistent with `p_target`: none outside its support, and the
    chi-square statistic below the p = 0.001 critical value."""
    outside = torch.bincount(tokens, minlength=p_target.numel())[p_target == 0].sum()
    stat, dof = chi_square(tokens, p_target)
    return int(outside) == 0 and stat < CHI2_CRITICAL[dof]


def random_rows(gen: torch.Generator, rows: int, filtered: int | None) -> Tensor:
    """Random distributions `[rows, VOCAB]`, optionally with token `filtered` at zero."""
    logits = torch.randn(rows, VOCAB, generator=gen) * 0.8
    probs = torch.softmax(logits, -1)
    if filtered is not None:
        probs[:, filtered] = 0.0
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass
class Runs:
    """`TRIALS` verifications of k = 2 drafts sampled from p_draft."""

    p_target: Tensor  # [3, VOCAB]
    p_draft: Tensor  # [2, VOCAB]
    first: Tensor  # [TRIALS] first emitted token
    accepted: Tensor  # [TRIALS] accepted count (0..2)
    second: Tensor  # [TRIALS] second emitted token, -1 when the first draft was rejected
    bonus: Tensor  # [TRIALS] third emitted token (the bonus), -1 unless both were accepted


@pytest.fixture(scope="module")
def runs() -> Runs:
    gen = torch.Generator().manual_seed(1234)
    p_target = random_rows(gen, 3, filtered=FILTERED)
    p_draft = random_rows(gen, 2, filtered=None)
    # rows are context-free, so drafting d_2 independently of d_1 is a valid drafter
    drafts = torch.multinomial(p_draft, TRIALS, replacement=True, generator=gen).T.tolist()
    verify_rng = TokenRng(99)
    first, accepted, second, bonus = [], [], [], []
    for draft in drafts:
        verdict = verify_sampled(draft, p_draft, p_target, verify_rng, position=0)
        first.append(verdict.tokens[0])
        accepted.append(verdict.accepted)
        second.append(verdict.tokens[1] if verdict.accepted >= 1 else -1)
        bonus.append(verdict.tokens[2] if verdict.bonus else -1)
    return Runs(
        p_target,
        p_draft,
        torch.tensor(first),
        torch.tensor(accepted),
        torch.tensor(second),
        torch.tensor(bonus),
    )


# --- greedy -------------------------------------------------------------------------------------

TARGET_IDS = [3, 1, 4, 1, 5]  # the target's argmax per row


def peaked_logits(ids: list[int]) -> Tensor:
    """Random logits `[len(ids), VOCAB]` whose row i has its argmax at ids[i]."""
    logits = torch.randn(len(ids), VOCAB, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(ids)), ids] = 10.0
    return logits


@pytest.mark.parametrize(
    ("draft", "expected"),
    [
        pytest.param([3, 1, 4, 1], Verdict([3, 1, 4, 1, 5], 4, bonus=True), id="all_accepted"),
        pytest.param([0, 1, 4, 1], Verdict([3], 0, bonus=False), id="reject_first"),
        # d_4 matches its row again, but nothing after a rejection may be accepted
        pytest.param([3, 1, 0, 1], Verdict([3, 1, 4], 2, bonus=False), id="reject_middle"),
        pytest.param([3, 1, 4, 0], Verdict([3, 1, 4, 1], 3, bonus=False), id="reject_last"),
        pytest.param([], Verdict([3], 0, bonus=True), id="empty_draft"),
    ],
)
def test_verify_greedy_accepts_matching_prefix(draft: list[int], expected: Verdict) -> None:
    logits = peaked_logits(TARGET_IDS[: len(draft) + 1])  # [k + 1, VOCAB]
    verdict = verify_greedy(draft, logits)
    assert verdict == expected
    assert len(verdict.tokens) == verdict.accepted + 1


# --- rejection sampling: distribution ------------------------------------------------------------


def test_verify_sampled_first_token_follows_p_target(runs: Runs) -> None:
    stat, dof = chi_square(runs.first, runs.p_target[0])
    assert follows(runs.first, runs.p_target[0]), f"chi2={stat:.1f} dof={dof}"


def test_verify_sampled_second_token_follows_p_target_after_accept(runs: Runs) -> None:
    second = runs.second[runs.second >= 0]
    assert second.numel() > TRIALS // 3
    stat, dof = chi_square(second, runs.p_target[1])
    assert follows(second, runs.p_target[1]), f"chi2={stat:.1f} dof={dof}"


def test_verify_sampled_bonus_token_follows_last_p_target_row(runs: Runs) -> None:
    bonus = runs.bonus[runs.bonus >= 0]
    assert bonus.numel() > TRIALS // 4
    stat, dof = chi_square(bonus, runs.p_target[2])
    assert follows(bonus, runs.p_target[2]), f"chi2={stat:.1f} dof={dof}"


def test_verify_sampled_acceptance_rate_matches_theory(runs: Runs) -> None:
    # P(accept d_i) = sum_x min(p_target(x), p_draft(x)) at each position
    theory = torch.minimum(runs.p_target[:2], runs.p_draft).sum(-1).tolist()
    rate_1 = (runs.accepted >= 1).double().mean().item()
    rate_2 = ((runs.accepted >= 2).sum() / (runs.accepted >= 1).sum()).item()
    # binomial sd at 100k trials is ~0.0016; 0.01 is > 5 sd
    assert rate_1 == pytest.approx(theory[0], abs=0.01)
    assert rate_2 == pytest.approx(theory[1], abs=0.01)


def test_verify_sampled_one_hot_draft_first_token_follows_p_target() -> None:
    gen = torch.Generator().manual_seed(7)
    p_target = random_rows(gen, 2, filtered=FILTERED)  # [2, VOCAB]
    # any proposal rule is lossless with one-hot drafts; this one often proposes FILTERED
    proposal = random_rows(gen, 1, filtered=None)[0]
    drafts = torch.multinomial(proposal, 30_000, replacement=True, generator=gen).tolist()
    first, accepted = [], 0
    rng = TokenRng(8)
    for trial, d in enumerate(drafts):
        # a fresh pair of output positions per trial: the races never repeat
        verdict = verify_sampled([d], None, p_target, rng, position=2 * trial)
        first.append(verdict.tokens[0])
        accepted += verdict.accepted
    tokens = torch.tensor(first)
    stat, dof = chi_square(tokens, p_target[0])
    assert follows(tokens, p_target[0]), f"chi2={stat:.1f} dof={dof}"
    # one-hot acceptance: P(accept) = sum_x proposal(x) * p_target(x)
    theory = float((proposal * p_target[0]).sum())
    assert accepted / len(drafts) == pytest.approx(theory, abs=0.01)


def test_verify_sampled_zero_draft_probability_stays_lossless() -> None:
    # A drafter that always proposes a token it scored 0: not sampled from its p_draft, so
    # verify must fall back to the one-hot rule for that row (see verify.py).
    gen = torch.Generator().manual_seed(11)
    p_target = random_rows(gen, 2, filtered=FILTERED)
    p_draft = random_rows(gen, 1, filtered=2)  # [1, VOCAB], p_draft[0, 2] == 0
    rng = TokenRng(12)
    tokens = torch.tensor(
        [verify_sampled([2], p_draft, p_target, rng, 0).tokens[0] for _ in range(10_000)]
    )
    stat, dof = chi_square(tokens, p_target[0])
    assert follows(tokens, p_target[0]), f"chi2={stat:.1f} dof={dof}"


# --- the chi-square test has power: wrong samplers are rejected ----------------------------------

# A vectorised rejection sampler over N trials of k = 1, with its accept rule and its recovered
# distribution swappable: (p_target, p_draft, drafts) -> accept probability per trial, and
# (p_target, p_draft, drafts) -> recovered distribution per trial `[N, VOCAB]`.
AcceptRule = Callable[[Tensor, Tensor, Tensor], Tensor]
RecoverRule = Callable[[Tensor, Tensor, Tensor], Tensor]


def accept_ratio(p_target: Tensor, p_draft: Tensor, drafts: Tensor) -> Tensor:
    return (p_target[drafts] / p_draft[drafts]).clamp(max=1.0)


def accept_inverted(p_target: Tensor, p_draft: Tensor, drafts: Tensor) -> Tensor:
    return (p_draft[drafts] / p_target[drafts]).nan_to_num(0.0, posinf=1.0).clamp(max=1.0)


def recover_residual(p_target: Tensor, p_draft: Tensor, drafts: Tensor) -> Tensor:
    return (p_target - p_draft).clamp_min(0.0).expand(len(drafts), -1)


def recover_from_target(p_target: Tensor, p_draft: Tensor, drafts: Tensor) -> Tensor:
    return p_target.expand(len(drafts), -1)


def recover_one_hot_rule(p_target: Tensor, p_draft: Tensor, drafts: Tensor) -> Tensor:
    # the one-hot draft's residual (d zeroed) wrongly used for a draft with probabilities
    return p_target.expand(len(drafts), -1).scatter(1, drafts[:, None], 0.0)


def vectorised_sampler(accept: AcceptRule, recover: RecoverRule) -> Tensor:
    gen = torch.Generator().manual_seed(1234)
    p_target = random_rows(gen, 1, filtered=FILTERED)[0]
    p_draft = random_rows(gen, 1, filtered=None)[0]
    drafts = torch.multinomial(p_draft, TRIALS, replacement=True, generator=gen)  # [N]
    keep = torch.rand(TRIALS, generator=gen) < accept(p_target, p_draft, drafts)  # [N]
    recovered = torch.multinomial(recover(p_target, p_draft, drafts), 1, generator=gen)[:, 0]
    return torch.where(keep, drafts, recovered)  # [N] first emitted token


def test_chi_square_accepts_vectorised_correct_sampler() -> None:
    # the harness itself is sound: with the right rules it passes
    gen = torch.Generator().manual_seed(1234)
    p_target = random_rows(gen, 1, filtered=FILTERED)[0]
    assert follows(vectorised_sampler(accept_ratio, recover_residual), p_target)


@pytest.mark.parametrize(
    ("accept", "recover"),
    [
        pytest.param(accept_ratio, recover_from_target, id="recovered_from_p_target"),
        pytest.param(accept_ratio, recover_one_hot_rule, id="recovered_by_one_hot_rule"),
        pytest.param(accept_inverted, recover_residual, id="ratio_inverted"),
    ],
)
def test_chi_square_rejects_wrong_sampler(accept: AcceptRule, recover: RecoverRule) -> None:
    gen = torch.Generator().manual_seed(1234)
    p_target = random_rows(gen, 1, filtered=FILTERED)[0]
    tokens = vectorised_sampler(accept, recover)
    stat, dof = chi_square(tokens, p_target)
    assert not follows(tokens, p_target), f"wrong sampler passed: chi2={stat:.1f} dof={dof}"


# --- greedy equivalence and reproducibility ------------------------------------------------------


def draft_distribution(kind: str, draft: list[int], gen: torch.Generator) -> Tensor | None:
    if kind == "none":
        return None
    if kind == "one_hot":
        return torch.nn.functional.one_hot(torch.tensor(draft, dtype=torch.long), VOCAB).float()
    return random_rows(gen, len(draft), filtered=None)


@pytest.mark.parametrize("kind", ["none", "one_hot", "soft"])
def test_verify_sampled_with_greedy_params_equals_verify_greedy(kind: str) -> None:
    gen = torch.Generator().manual_seed(5)
    greedy = SamplingParams()
    for trial in range(200):
        k = trial % 6
        logits = torch.randn(k + 1, VOCAB, generator=gen)  # [k + 1, VOCAB]
        draft = logits[:k].argmax(-1).tolist()
        if k and trial % 3:  # corrupt one position so rejections happen at every depth
            pos = trial % k
            draft[pos] = (draft[pos] + 1 + trial % (VOCAB - 1)) % VOCAB
        p_draft = draft_distribution(kind, draft, gen)
        p_target = probabilities(logits, greedy)  # one-hot argmax
        verdict = verify_sampled(draft, p_draft, p_target, TokenRng(trial), position=trial)
        assert verdict == verify_greedy(draft, logits)


def run_seeded(seed: int, global_seed: int) -> list[Verdict]:
    rng = TokenRng(seed)
    shapes = torch.Generator().manual_seed(3)  # same problems for every seed
    torch.manual_seed(global_seed)  # verify must draw from `rng` only, never the global RNG
    verdicts: list[Verdict] = []
    position = 0
    for trial in range(200):
        k = trial % 5
        p_target = random_rows(shapes, k + 1, filtered=FILTERED)
        p_draft = random_rows(shapes, k, filtered=None)
        draft = [int(t) for t in torch.multinomial(p_draft, 1, generator=shapes)[:, 0]]
        # every other trial with one-hot drafts: both paths replay from the seed
        q = p_draft if trial % 2 else None
        verdicts.append(verify_sampled(draft, q, p_target, rng, position))
        position += len(verdicts[-1].tokens)
    return verdicts


def test_verify_sampled_seeded_run_is_reproducible() -> None:
    first = run_seeded(42, global_seed=1)
    assert run_seeded(42, global_seed=2) == first
    assert run_seeded(43, global_seed=1) != first  # the seed matters: the == is not vacuous


# --- one-hot drafts are coupled to plain sampling ------------------------------------------------


def test_verify_one_hot_emits_what_plain_sampling_emits() -> None:
    # Row i's token is the plain sample at output position `position + i` whatever the draft:
    # the verdict is the longest prefix of the draft that matches those samples, then the
    # sample at the first mismatch (or the bonus). Drafts are built to match 0..k rows.
    shapes = torch.Generator().manual_seed(21)
    rng = TokenRng(-5)  # negative seeds are valid (OpenAI's and torch's range)
    depths = set()
    for trial in range(300):
        k = trial % 6
        position = 17 * trial
        p_target = random_rows(shapes, k + 1, filtered=FILTERED)
        plain = [
            int(sample_with(p_target[i : i + 1], rng.race(position + i, VOCAB)))
            for i in range(k + 1)
        ]
        match = trial % (k + 1)  # the first `match` drafts equal the plain samples
        draft = plain[:match] + [(t + 1) % VOCAB for t in plain[match:k]]
        verdict = verify_sampled(draft, None, p_target, rng, position)
        assert verdict == Verdict(plain[: match + 1], match, bonus=match == k)
        depths.add(match)
    assert depths == set(range(6))


def test_token_rng_race_is_a_function_of_seed_and_position() -> None:
    a, b = TokenRng(3), TokenRng(3)
    b.race(9, VOCAB)  # draws in another order: position 4's race is unchanged
    assert torch.equal(a.race(4, VOCAB), b.race(4, VOCAB))
    assert not torch.equal(a.race(4, VOCAB), a.race(5, VOCAB))
    assert not torch.equal(a.race(4, VOCAB), TokenRng(4).race(4, VOCAB))
    # the sequential stream is separate: drawing from it leaves the races alone
    torch.rand(5, generator=a.generator)
    assert torch.equal(a.race(4, VOCAB), b.race(4, VOCAB))
