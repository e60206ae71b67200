"""Draft stage, n-gram (prompt lookup) drafter: propose what followed an earlier occurrence of
the current suffix in the committed tokens. No model, no distribution (p_draft = None: one-hot
drafts, which `verify_sampled` handles losslessly). Strong on code edits, JSON, repetition.

Contract (the `Drafter` protocol): per request the state is an incremental index over the
committed tokens (prompt + output). For each n in [min_n, max_n] it maps an n-gram to the END
position (exclusive) of its most recent occurrence that has at least one following token, so
`tokens[end]` is the first token to propose. `propose` indexes only the tokens it has not seen
(amortised O(new tokens x (max_n - min_n + 1)) dict writes, never a rescan of the history), then
looks the last n tokens up for n = max_n down to min_n and proposes up to k tokens that followed
the hit. Longer matches first: a longer shared context predicts the continuation better.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quickdraft.drafters.base import Draft, DraftJob

NgramIndex = dict[tuple[int, ...], int]  # n-gram -> end (exclusive) of its latest occurrence


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

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def new_state(self, prompt_ids: list[int]) -> NgramState:
        state = NgramState([{} for _ in range(self.min_n, self.max_n + 1)])
        self._catch_up(state, prompt_ids)
        return state

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        return [self.lookup(job.state, job.tokens, job.k) for job in jobs]

    def lookup(self, state: NgramState, tokens: list[int], k: int) -> Draft:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix of `tokens`; empty when no suffix of length >= min_n occurred before."""
        self._catch_up(state, tokens)
        if k <= 0:
            return Draft([])
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = state.index[n - self.min_n].get(tuple(tokens[length - n :]))
            if end is not None:
                # may run on into the current suffix: that is real history, and it makes a
                # repeating pattern propose its next period
                return Draft(tokens[end : end + k])
        return Draft([])

    def commit(
        self, state: NgramState, tokens: list[int], hidden: torch.Tensor | None = None
    ) -> None:
        # Committed tokens only grow, and propose catches up with the new tail itself. A shorter
        # sequence cannot happen; if it does the index points past the end, so rebuild it.
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
        # Each end position e < len(tokens) is indexed once: the n-grams tokens[e-n:e] now have
        # the follower tokens[e]. Overwriting keeps the most recent occurrence, which is the
        # better guess (locality: recent text is what the model is repeating or editing).
        for end in range(state.indexed, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                state.index[n - self.min_n][tuple(tokens[end - n : end])] = end
        state.indexed = len(tokens)

    def _rebuild(self, state: NgramState, tokens: list[int]) -> None:
        self.free(state)
        self._catch_up(state, tokens)  # from indexed = 0: a full build
