"""N-gram drafter: lookup behaviour, and the incremental index against a naive reference."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from quickdraft.request import SamplingParams
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.drafters.ngram import NgramDrafter, NgramState

PARAMS = SamplingParams()
GEN = torch.Generator()


def propose(
    drafter: NgramDrafter, tokens: list[int], k: int, state: Any = None, tenant: str = ""
) -> list[int]:
    state = drafter.new_state(tokens, tenant) if state is None else state
    (draft,) = drafter.propose([DraftJob(state, tokens, k, PARAMS, GEN)])
    assert draft.p_draft is None  # n-gram drafts are one-hot
    return draft.tokens


# --- naive references: O(n^2) scans, written independently of the index ------------------------


def naive_followers(tokens: list[int], gram: list[int]) -> list[int]:
    """What followed each earlier occurrence of `gram` in `tokens`, oldest first."""
    n = len(gram)
    return [tokens[end] for end in range(n, len(tokens)) if tokens[end - n : end] == gram]


def naive_propose(
    tokens: list[int], k: int, min_n: int, max_n: int, min_share: float = 0.5
) -> list[int]:
    context, out = list(tokens), []
    while len(out) < k:
        followers: list[int] = []
        for n in range(min(max_n, len(context)), min_n - 1, -1):
            followers = naive_followers(tokens, context[len(context) - n :])
            if followers:
                break
        if not followers:
            break
        top = max(followers.count(t) for t in followers)
        best = next(t for t in reversed(followers) if followers.count(t) == top)  # latest
        if top / len(followers) < min_share:
            break
        out.append(best)
        context.append(best)
    return out


def naive_index(tokens: list[int], n: int) -> dict[tuple[int, ...], dict[int, int]]:
    counts: dict[tuple[int, ...], dict[int, int]] = {}
    for start in range(len(tokens) - n):  # start + n < len: a follower exists
        follow = counts.setdefault(tuple(tokens[start : start + n]), {})
        follow[tokens[start + n]] = follow.get(tokens[start + n], 0) + 1
    return counts


def as_counts(state: NgramState) -> list[dict[tuple[int, ...], dict[int, int]]]:
    return [{gram: f.counts for gram, f in table.items()} for table in state.index]


# --- behaviour -----------------------------------------------------------------------------------


def test_ngram_proposes_continuation_of_repeated_phrase() -> None:
    tokens = [10, 11, 12, 13, 14, 99, 10, 11, 12]
    assert propose(NgramDrafter(2, 4), tokens, 4) == [13, 14, 99, 10]


def test_ngram_prefers_longer_match() -> None:
    # (2, 3) last occurred before 8; the longer (1, 2, 3) occurred before 7
    tokens = [1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3]
    assert propose(NgramDrafter(2, 4), tokens, 1) == [7]
    assert propose(NgramDrafter(2, 2), tokens, 1) == [8]  # the shorter match alone differs


def test_ngram_prefers_most_recent_occurrence() -> None:
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert propose(NgramDrafter(2, 2), tokens, 1) == [6]


@pytest.mark.parametrize("k", [0, 1, 3, 6], ids=lambda k: f"k{k}")
def test_ngram_respects_k(k: int) -> None:
    tokens = list(range(10)) * 3 + [0, 1, 2]
    assert propose(NgramDrafter(2, 4), tokens, k) == list(range(3, 3 + k))


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param([], id="empty"),
        pytest.param([4], id="shorter_than_min_n"),
        pytest.param([1, 2, 3, 4, 5, 6], id="no_repeat"),
        pytest.param([1, 2, 9, 1, 3, 2], id="only_unigrams_repeat"),
    ],
)
def test_ngram_no_hit_proposes_nothing(tokens: list[int]) -> None:
    assert propose(NgramDrafter(2, 4), tokens, 4) == []


def test_ngram_suffix_never_matches_itself() -> None:
    drafter = NgramDrafter(1, 3)
    tokens = [5, 6, 7]
    state = drafter.new_state(tokens)
    assert propose(drafter, tokens, 3, state) == []
    for n, table in zip(range(1, 4), state.index, strict=True):
        assert tuple(tokens[-n:]) not in table  # nothing follows the suffix yet


def test_ngram_continuation_may_run_into_suffix() -> None:
    # (1, 2) -> 3, then the drafts extend the context: (2, 3) -> 1, (3, 1) -> 2, ... a repeating
    # pattern proposes its next periods
    assert propose(NgramDrafter(2, 2), [1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]


def test_ngram_votes_for_most_frequent_follower() -> None:
    # (1, 2) was followed by 5 twice and by 6 once (most recently): 5 wins, share 2/3
    tokens = [1, 2, 5, 1, 2, 5, 1, 2, 6, 1, 2]
    assert propose(NgramDrafter(2, 2), tokens, 1) == [5]
    assert propose(NgramDrafter(2, 2, min_share=0.7), tokens, 1) == []  # 2/3 < 0.7: a branch


def test_ngram_stops_at_branch_point() -> None:
    # (3, 4) was always followed by 7 and (4, 7) by 8 or 9 once each: share 1/2 < 0.6 there
    tokens = [3, 4, 7, 8, 0, 3, 4, 7, 9, 0, 3, 4]
    assert propose(NgramDrafter(2, 2, min_share=0.6), tokens, 4) == [7]
    assert propose(NgramDrafter(2, 2, min_share=0.5), tokens, 4) == [7, 9, 0, 3]  # latest tie


@pytest.mark.parametrize(
    ("min_n", "max_n"),
    [pytest.param(0, 2, id="min_zero"), pytest.param(3, 2, id="min_above_max")],
)
def test_ngram_rejects_bad_n_range(min_n: int, max_n: int) -> None:
    with pytest.raises(ValueError, match=f"min_n={min_n}, max_n={max_n}"):
        NgramDrafter(min_n, max_n)


@pytest.mark.parametrize("share", [-0.1, 1.5], ids=["negative", "above_one"])
def test_ngram_rejects_bad_min_share(share: float) -> None:
    with pytest.raises(ValueError, match="min_share"):
        NgramDrafter(min_share=share)


def test_ngram_commit_of_shorter_tokens_rebuilds() -> None:
    drafter = NgramDrafter(2, 3)
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    state = drafter.new_state(tokens)
    assert propose(drafter, tokens, 1, state) == [4]
    drafter.commit(state, tokens[:5])  # [1, 2, 3, 1, 2]: the (1, 2) -> 4 entry is gone
    assert as_counts(state) == as_counts(drafter.new_state(tokens[:5]))
    assert propose(drafter, tokens[:5], 1, state) == [3]


def test_ngram_free_drops_index() -> None:
    drafter = NgramDrafter()
    state = drafter.new_state([1, 2, 3, 1, 2])
    drafter.free(state)
    assert state.index == [{}] * (drafter.max_n - drafter.min_n + 1)
    assert state.indexed == 0


def finish(drafter: NgramDrafter, prompt: list[int], output: list[int], tenant: str = "") -> None:
    """One request through the drafter: prompt, its committed output, then free."""
    state = drafter.new_state(prompt, tenant)
    drafter.commit(state, prompt + output)
    drafter.free(state)


def test_ngram_shared_index_learns_finished_outputs() -> None:
    drafter = NgramDrafter(2, 4)
    finish(drafter, [50, 51, 52], [1, 2, 3, 4, 5])
    # a new request whose own tokens never saw (1, 2) drafts what followed it in that output
    assert propose(drafter, [7, 8, 1, 2], 4) == [3, 4, 5]
    # its own tokens come first: here (1, 2) was followed by 9
    assert propose(drafter, [1, 2, 9, 8, 1, 2], 2) == [9, 8]
    # the prompt is not learned (only outputs), and n-grams never span two outputs
    assert propose(drafter, [60, 50, 51], 2) == []
    finish(drafter, [50], [6, 7, 8])
    assert propose(drafter, [0, 4, 5], 2) == []  # (4, 5) ended an output: nothing followed
    assert propose(drafter, [0, 5, 6], 2) == []  # (5, 6) spans two outputs
    assert propose(drafter, [0, 6, 7], 2) == [8]
    off = NgramDrafter(2, 4, shared_tokens=0)
    finish(off, [50, 51, 52], [1, 2, 3, 4, 5])
    assert propose(off, [7, 8, 1, 2], 4) == [] and off.shared_size == 0


def test_ngram_shared_index_is_per_tenant() -> None:
    """A request drafts only from its own tenant's finished outputs."""
    drafter = NgramDrafter(2, 4)
    finish(drafter, [50, 51, 52], [1, 2, 3, 4, 5], tenant="a")
    assert propose(drafter, [7, 8, 1, 2], 4, tenant="b") == []
    assert propose(drafter, [7, 8, 1, 2], 4) == []  # "" is a tenant like any other
    assert propose(drafter, [7, 8, 1, 2], 4, tenant="a") == [3, 4, 5]
    finish(drafter, [50], [1, 2, 9, 9], tenant="b")
    assert propose(drafter, [7, 8, 1, 2], 4, tenant="b") == [9, 9]
    assert propose(drafter, [7, 8, 1, 2], 4, tenant="a") == [3, 4, 5]


def test_ngram_shared_index_keeps_the_newest_outputs_within_budget() -> None:
    """Against a naive index of the kept outputs, over random outputs, tenants and budgets: the
    newest outputs of all tenants together fit the one budget, each tenant's index is exactly
    its own kept outputs."""
    rng = random.Random(4)
    for budget in (6, 10, 25):
        drafter = NgramDrafter(1, 3, shared_tokens=budget)
        learned: list[tuple[str, list[int]]] = []
        for _ in range(60):
            output = [rng.randrange(4) for _ in range(rng.randint(0, 9))]
            tenant = rng.choice("abc")
            finish(drafter, [9], output, tenant)
            if len(output) > 1:
                learned.append((tenant, output[-budget:]))
            kept = list(zip(drafter.learned, _kept_outputs(drafter), strict=True))
            assert kept == learned[len(learned) - len(kept) :]  # the newest, in order
            assert drafter.shared_size == sum(len(out) for _, out in kept) <= budget
            assert set(drafter.shared) == {t for t, _ in kept}  # no empty tenant is kept
            for tenant_name, scope in drafter.shared.items():
                assert scope.size == sum(len(out) for t, out in kept if t == tenant_name)
                mine = [out for t, out in kept if t == tenant_name]
                for n, table in zip(range(1, 4), scope.index, strict=True):
                    want: dict[tuple[int, ...], dict[int, int]] = {}
                    for out in mine:
                        for gram, follow in naive_index(out, n).items():
                            for token, count in follow.items():
                                got = want.setdefault(gram, {})
                                got[token] = got.get(token, 0) + count
                    assert {g: dict(f.counts) for g, f in table.items()} == want


def _kept_outputs(drafter: NgramDrafter) -> list[list[int]]:
    """Every kept output in the order learned (each tenant's deque is in that order too)."""
    queues = {t: list(scope.outputs) for t, scope in drafter.shared.items()}
    return [queues[t].pop(0) for t in drafter.learned]


def test_ngram_rejects_negative_shared_budget() -> None:
    with pytest.raises(ValueError, match="shared_tokens"):
        NgramDrafter(shared_tokens=-1)


# --- the incremental index ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("min_n", "max_n"),
    [pytest.param(1, 1, id="n1"), pytest.param(2, 4, id="n2-4"), pytest.param(1, 3, id="n1-3")],
)
def test_ngram_incremental_index_matches_naive_reference(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    drafter = NgramDrafter(min_n, max_n)
    for _ in range(100):
        vocab = rng.randint(2, 4)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        state = drafter.new_state(tokens)
        for _ in range(rng.randint(5, 25)):
            if rng.random() < 0.05 and tokens:  # a shrink (cannot happen, but must be safe)
                tokens = tokens[: rng.randrange(len(tokens))]
                drafter.commit(state, tokens)
            tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
            if rng.random() < 0.5:
                drafter.commit(state, tokens)
            k = rng.randint(0, 5)
            got = propose(drafter, tokens, k, state)
            assert got == naive_propose(tokens, k, min_n, max_n), (tokens, k)
        expected = [naive_index(tokens, n) for n in range(min_n, max_n + 1)]
        assert as_counts(state) == expected
        # incremental == from scratch
        assert as_counts(state) == as_counts(drafter.new_state(tokens))


def test_ngram_index_cost_is_incremental() -> None:
    # Counts record every indexing update: a rescan of the history would count its n-grams
    # again, so exact counts after 1000 one-token cycles show each position was indexed once.
    min_n, max_n, steps = 2, 4, 1000
    drafter = NgramDrafter(min_n, max_n)
    state: NgramState = drafter.new_state([])
    rng = random.Random(0)
    tokens: list[int] = []
    for _ in range(steps):  # one token per cycle, as in decode
        tokens.append(rng.randrange(50))
        drafter.commit(state, tokens)
        drafter.propose([DraftJob(state, tokens, 4, PARAMS, GEN)])
    updates = sum(f.total for table in state.index for f in table.values())
    assert updates == sum(min(max_n, end) - min_n + 1 for end in range(min_n, steps))
    assert as_counts(state) == [naive_index(tokens, n) for n in range(min_n, max_n + 1)]
