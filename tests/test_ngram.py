"""N-gram drafter: lookup behaviour, and the incremental index against a naive reference."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from quickdraft.drafters.base import DraftJob
from quickdraft.drafters.ngram import NgramDrafter, NgramState
from quickdraft.sampling import SamplingParams

PARAMS = SamplingParams()
GEN = torch.Generator()


def propose(drafter: NgramDrafter, tokens: list[int], k: int, state: Any = None) -> list[int]:
    state = drafter.new_state(tokens) if state is None else state
    (draft,) = drafter.propose([DraftJob(state, tokens, k, PARAMS, GEN)])
    assert draft.p_draft is None  # n-gram drafts are one-hot
    return draft.tokens


# --- naive references: O(n^2) scans, written independently of the index ------------------------


def naive_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length:
            continue
        suffix = tokens[length - n :]
        # latest earlier occurrence that is followed by a token (so it ends before `length`)
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k] if k > 0 else []
    return []


def naive_index(tokens: list[int], n: int) -> dict[tuple[int, ...], int]:
    latest: dict[tuple[int, ...], int] = {}
    for start in range(len(tokens) - n):  # start + n < len: a follower exists
        gram = tuple(tokens[start : start + n])
        latest[gram] = max(latest.get(gram, 0), start + n)
    return latest


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
    # (1, 2) occurred before 3; what followed is 3 and then the current suffix itself
    assert propose(NgramDrafter(2, 2), [1, 2, 3, 1, 2], 5) == [3, 1, 2]


@pytest.mark.parametrize(
    ("min_n", "max_n"),
    [pytest.param(0, 2, id="min_zero"), pytest.param(3, 2, id="min_above_max")],
)
def test_ngram_rejects_bad_n_range(min_n: int, max_n: int) -> None:
    with pytest.raises(ValueError, match=f"min_n={min_n}, max_n={max_n}"):
        NgramDrafter(min_n, max_n)


def test_ngram_commit_of_shorter_tokens_rebuilds() -> None:
    drafter = NgramDrafter(2, 3)
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    state = drafter.new_state(tokens)
    assert propose(drafter, tokens, 1, state) == [4]
    drafter.commit(state, tokens[:5])  # [1, 2, 3, 1, 2]: the (1, 2) -> 4 entry is gone
    assert state.index == drafter.new_state(tokens[:5]).index
    assert propose(drafter, tokens[:5], 1, state) == [3]


def test_ngram_free_drops_index() -> None:
    drafter = NgramDrafter()
    state = drafter.new_state([1, 2, 3, 1, 2])
    drafter.free(state)
    assert state.index == [{}, {}, {}]
    assert state.indexed == 0


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
        assert state.index == expected
        assert state.index == drafter.new_state(tokens).index  # incremental == from scratch


class CountingDict(dict[tuple[int, ...], int]):
    """Counts every write, so a rescan of the history shows up as extra writes."""

    writes = 0

    def __setitem__(self, key: tuple[int, ...], value: int) -> None:
        CountingDict.writes += 1
        super().__setitem__(key, value)


def test_ngram_index_cost_is_incremental() -> None:
    min_n, max_n, steps = 2, 4, 1000
    drafter = NgramDrafter(min_n, max_n)
    state: NgramState = drafter.new_state([])
    state.index = [CountingDict() for _ in range(min_n, max_n + 1)]
    CountingDict.writes = 0
    rng = random.Random(0)
    tokens: list[int] = []
    for _ in range(steps):  # one token per cycle, as in decode
        tokens.append(rng.randrange(50))
        drafter.commit(state, tokens)
        drafter.propose([DraftJob(state, tokens, 4, PARAMS, GEN)])
    # every end position e < steps is written once per n <= e: ~steps x (max_n - min_n + 1)
    expected = sum(min(max_n, end) - min_n + 1 for end in range(min_n, steps))
    assert CountingDict.writes == expected
    assert expected < steps * (max_n - min_n + 1)
    assert state.index == [naive_index(tokens, n) for n in range(min_n, max_n + 1)]
