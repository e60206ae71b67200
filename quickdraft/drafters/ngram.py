"""Draft stage, n-gram (prompt lookup) drafter: propose what followed earlier occurrences of
the current suffix in the committed tokens. No model, no distribution (p_draft = None: one-hot
drafts, which `verify_sampled` handles losslessly). Strong on code edits, JSON, repetition.

Contract (the `Drafter` protocol): per request the state is an incremental index over the
committed tokens (prompt + output): for each n in [min_n, max_n], each n-gram that has a
following token maps to the counts of the tokens that followed it (`Followers`). `propose`
indexes only the tokens it has not seen (amortised O(new tokens x (max_n - min_n + 1)) updates,
never a rescan of the history), then drafts one token at a time: the longest suffix (n = max_n
down to min_n) of the committed tokens plus the drafts so far that occurred before votes for
its most frequent follower (the most recently seen among equals), and drafting stops when no
suffix occurred or when that follower won less than `min_share` of the suffix's occurrences.

Why votes and a stop: a suffix that was followed by different tokens is a branch point (the
next JSON value, the name after `def `): guessing there wastes a verify row on a likely
rejection, while a suffix that was always followed by the same token (copying an input span,
a repeated structure) is a safe bet. Measured on Qwen2.5-Coder-1.5B (96 tokens, greedy), the
acceptance rate of the drafted tokens rose from 0.54 to 0.57 (code) and 0.56 to 0.60 (JSON) over
proposing the latest occurrence's continuation, at the same acceptance length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quickdraft.drafters.base import Draft, DraftJob


class Followers:
    """The tokens that followed one n-gram, with counts. Dict order is the recency of each
    token's last sighting (a sighting moves it to the end)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0

    def add(self, token: int) -> None:
        self.counts[token] = self.counts.pop(token, 0) + 1
        self.total += 1

    def vote(self) -> tuple[int, float]:
        """The most frequent follower (the most recently seen among equals) and its share."""
        best = max(reversed(self.counts), key=self.counts.__getitem__)
        return best, self.counts[best] / self.total


NgramIndex = dict[tuple[int, ...], Followers]  # n-gram -> what followed its occurrences


@dataclass(slots=True)
class NgramState:
    index: list[NgramIndex]  # index[n - min_n] for n in [min_n, max_n]
    # len(tokens) at the last catch-up: n-grams ending below it are indexed. Those ending at
    # len(tokens) are not, since nothing follows them yet; that is also what keeps the
    # current suffix from matching itself.
    indexed: int = 0


class NgramDrafter:
    name = "ngram"
    needs_hidden = False

    def __init__(self, min_n: int = 2, max_n: int = 4, min_share: float = 0.5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share}")
        self.min_n = min_n
        self.max_n = max_n
        self.min_share = min_share

    def new_state(self, prompt_ids: list[int]) -> NgramState:
        state = NgramState([{} for _ in range(self.min_n, self.max_n + 1)])
        self._catch_up(state, prompt_ids)
        return state

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        return [self.lookup(job.state, job.tokens, job.k) for job in jobs]

    def lookup(self, state: NgramState, tokens: list[int], k: int) -> Draft:
        """Up to k tokens, each the voted follower of the longest earlier-seen suffix of
        `tokens` + the drafts before it; empty when no suffix of length >= min_n occurred."""
        self._catch_up(state, tokens)
        context = tokens[-self.max_n :]
        draft: list[int] = []
        while len(draft) < k:
            followers = self._longest_match(state, context)
            if followers is None:
                break
            token, share = followers.vote()
            if share < self.min_share:
                break
            draft.append(token)
            context.append(token)
        return Draft(draft)

    def _longest_match(self, state: NgramState, context: list[int]) -> Followers | None:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            followers = state.index[n - self.min_n].get(tuple(context[len(context) - n :]))
            if followers is not None:
                return followers
        return None

    def commit(
        self, state: NgramState, tokens: list[int], hidden: torch.Tensor | None = None
    ) -> None:
        # Committed tokens only grow, and propose catches up with the new tail itself. A shorter
        # sequence cannot happen; if it does the index counts tokens that are gone, so rebuild.
        if len(tokens) < state.indexed:
            self._rebuild(state, tokens)

    def free(self, state: NgramState) -> None:
        for table in state.index:
            table.clear()
        state.indexed = 0

    def _catch_up(self, state: NgramState, tokens: list[int]) -> None:
        """Index the n-grams that gained a following token since the last call."""
        if len(tokens) < state.indexed:
            self._rebuild(state, tokens)
            return
        # Each end position e < len(tokens) is counted once: the n-grams tokens[e-n:e] gain the
        # follower tokens[e].
        for end in range(state.indexed, len(tokens)):
            follower = tokens[end]
            for n in range(self.min_n, min(self.max_n, end) + 1):
                table = state.index[n - self.min_n]
                gram = tuple(tokens[end - n : end])
                followers = table.get(gram)
                if followers is None:
                    table[gram] = followers = Followers()
                followers.add(follower)
        state.indexed = len(tokens)

    def _rebuild(self, state: NgramState, tokens: list[int]) -> None:
        self.free(state)
        self._catch_up(state, tokens)  # from indexed = 0: a full build
