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
Each drafted token names its kind (the match length, a unanimous vote or not, own or shared
index), by which the policy prices it (drafters/confidence.py `ScoredLookup`).

Why votes and a stop: a suffix that was followed by different tokens is a branch point (the
next JSON value, the name after `def `): guessing there wastes a verify row on a likely
rejection, while a suffix that was always followed by the same token (copying an input span,
a repeated structure) is a safe bet. Why n from 1: a one-token suffix is weak evidence, but the
vote and `min_share` already stop at the branch points, and at batch 1 a rejected verify row
costs ~3% of a step.

Shared index (llama.cpp's "dynamic" lookup cache): a drafter also learns from the outputs of
the requests it served. `free` adds a finished request's output to the shared index of the
request's tenant (n-grams within one output only, never across two). Where no suffix of the
request's own tokens occurred, its tenant's shared index is asked the same way: a model
answering similar requests repeats its own phrasing (JSON keys and layout, code scaffolding).
Drafts never change the output (verification is lossless), only how many target forwards it
takes. docs/speculation.md has the replays behind these choices.

Why per tenant: drafts do not change the text, but they show in how many were accepted (the
response's `speculative` block, the timing), so a request drafting from another client's output
learns whether that client's text continues its own: a read of someone else's text, a token at a
time. A request drafts only from the outputs of requests of its own tenant (`new_state`'s
`tenant`; the server decides who that is, server/access.py); one tenant "" for all = the old
global index. All tenants share one budget of `shared_tokens` output tokens (the oldest outputs,
whoever's, are dropped and their tenants' indexes rebuilt), so many tenants cost no more memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from quickdraft.config import NGRAM_MAX, NGRAM_MIN, NGRAM_SHARED_TOKENS
from quickdraft.speculation.cost import StepShape
from quickdraft.speculation.drafters.confidence import Confidence, Peeked, ScoredLookup


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
    tenant: str = ""  # whose shared index it drafts from and joins at `free`
    # len(tokens) at the last catch-up: n-grams ending below it are indexed. Those ending at
    # len(tokens) are not, since nothing follows them yet; that is also what keeps the
    # current suffix from matching itself.
    indexed: int = 0
    prompt_len: int = 0
    tokens: list[int] = field(default_factory=list)  # the committed sequence (`commit`)
    peeked: Peeked = field(default_factory=Peeked)  # the last lookup (`ScoredLookup`)


def index_tokens(
    index: list[NgramIndex],
    min_n: int,
    tokens: Sequence[int],
    begin: int,
    barrier: frozenset[int] = frozenset(),
) -> None:
    """Add to `index` (index[n - min_n] for n in [min_n, min_n + len(index))) every n-gram of
    `tokens` that ends at a position in [begin, len(tokens)), with the token there as its
    follower. Each end position is counted once over successive calls with growing `begin`.
    An n-gram holding a `barrier` token (an image placeholder: equal ids, different pictures),
    or followed by one, is never indexed, so nothing matches or drafts inside an image."""
    max_n = min_n + len(index) - 1
    fence = -1  # the last barrier position before `end` (only the last max_n matter)
    for i in range(max(begin - max_n, 0), begin) if barrier else ():
        if tokens[i] in barrier:
            fence = i
    for end in range(begin, len(tokens)):
        follower = tokens[end]
        if follower in barrier:
            fence = end
            continue
        for n in range(min_n, min(max_n, end - fence - 1) + 1):
            table = index[n - min_n]
            gram = tuple(tokens[end - n : end])
            followers = table.get(gram)
            if followers is None:
                table[gram] = followers = Followers()
            followers.add(follower)


@dataclass(slots=True)
class SharedIndex:
    """One tenant's share of the shared index: its kept outputs (oldest first) and their
    n-grams, index[n - min_n] as in a request's own."""

    index: list[NgramIndex]
    outputs: deque[list[int]] = field(default_factory=deque)
    size: int = 0  # tokens in outputs


class NgramDrafter(ScoredLookup):
    needs_hidden = False
    hidden_history = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        min_n: int = NGRAM_MIN,
        max_n: int = NGRAM_MAX,
        min_share: float = 0.5,
        shared_tokens: int = NGRAM_SHARED_TOKENS,
        barrier: frozenset[int] = frozenset(),  # token ids never matched nor drafted (images)
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share}")
        if shared_tokens < 0:
            raise ValueError(f"shared_tokens must be >= 0, got {shared_tokens}")
        self.min_n = min_n
        self.max_n = max_n
        self.barrier = barrier
        self.forwards: list[StepShape] = []  # a lookup runs no model
        self.min_share = min_share
        # the shared index (module docstring), one per tenant; off at 0 tokens
        self.shared_tokens = shared_tokens
        self.shared: dict[str, SharedIndex] = {}
        self.learned: deque[str] = deque()  # the tenant of every kept output, oldest first
        self.shared_size = 0  # tokens kept, all tenants together
        self.confidence = Confidence()  # how often each kind of draft token was kept

    def new_state(self, prompt_ids: list[int], tenant: str = "") -> NgramState:
        state = NgramState([{} for _ in range(self.min_n, self.max_n + 1)], tenant)
        state.prompt_len = len(prompt_ids)
        self._catch_up(state, prompt_ids)
        return state

    def _draft(
        self, state: NgramState, tokens: list[int], k: int
    ) -> tuple[list[int], list[Hashable]]:
        """Up to k tokens, each the voted follower of the longest earlier-seen suffix of
        `tokens` + the drafts before it (none when no suffix of length >= min_n occurred), and
        each one's kind (`Confidence`): (n, unanimous) for a match of n tokens in the request's
        own index, (0, unanimous) for one in the shared index, where unanimous: every
        occurrence of the suffix went on with the drafted token."""
        self._catch_up(state, tokens)
        shared = self.shared.get(state.tenant)
        context = tokens[-self.max_n :]
        draft: list[int] = []
        keys: list[Hashable] = []
        while len(draft) < k:
            n, followers = self._longest_match(state.index, context)
            if followers is None and shared is not None:
                n, followers = self._longest_match(shared.index, context)
                n = 0
            if followers is None:
                break
            token, share = followers.vote()
            if share < self.min_share:
                break
            draft.append(token)
            keys.append((n, share == 1.0))
            context.append(token)
        return draft, keys

    def _longest_match(
        self, index: list[NgramIndex], context: list[int]
    ) -> tuple[int, Followers | None]:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            followers = index[n - self.min_n].get(tuple(context[len(context) - n :]))
            if followers is not None:
                return n, followers
        return 0, None

    def commit(
        self, state: NgramState, tokens: list[int], hidden: torch.Tensor | None = None
    ) -> None:
        # Committed tokens only grow, and propose catches up with the new tail itself. A shorter
        # sequence cannot happen; if it does the index counts tokens that are gone, so rebuild.
        if len(tokens) < state.indexed:
            self._rebuild(state, tokens)
        state.tokens = tokens

    def free(self, state: NgramState) -> None:
        """End of a request: its output joins its tenant's shared index; its own is dropped."""
        self.learn(state.tokens[state.prompt_len :], state.tenant)
        self._clear(state)

    def learn(self, output: Sequence[int], tenant: str = "") -> None:
        """Add one finished output to `tenant`'s shared index, dropping the oldest outputs of
        any tenant (and rebuilding those tenants' indexes from the rest) once all of them
        together would exceed `shared_tokens` tokens."""
        if not self.shared_tokens or len(output) <= self.min_n:
            return
        output = list(output[-self.shared_tokens :])
        mine = self.shared.get(tenant)
        if mine is None:
            mine = self.shared[tenant] = SharedIndex(
                [{} for _ in range(self.min_n, self.max_n + 1)]
            )
        mine.outputs.append(output)
        mine.size += len(output)
        self.learned.append(tenant)
        self.shared_size += len(output)
        if self.shared_size <= self.shared_tokens:
            index_tokens(mine.index, self.min_n, output, self.min_n, self.barrier)
            return
        # over budget: keep the newest outputs that fit in half of it (a rebuild then happens
        # at most once per shared_tokens / 2 tokens learned: amortised O(1) per token)
        touched = {tenant}
        while self.shared_size > self.shared_tokens // 2 and len(self.learned) > 1:
            oldest = self.learned.popleft()
            scope = self.shared[oldest]
            dropped = len(scope.outputs.popleft())
            scope.size -= dropped
            self.shared_size -= dropped
            touched.add(oldest)
        for name in touched:
            scope = self.shared[name]
            if not scope.outputs:
                del self.shared[name]
                continue
            for table in scope.index:
                table.clear()
            for kept in scope.outputs:
                index_tokens(scope.index, self.min_n, kept, self.min_n, self.barrier)

    def _clear(self, state: NgramState) -> None:
        for table in state.index:
            table.clear()
        state.indexed = 0
        state.peeked = Peeked()

    def _catch_up(self, state: NgramState, tokens: list[int]) -> None:
        """Index the n-grams that gained a following token since the last call."""
        if len(tokens) < state.indexed:
            self._rebuild(state, tokens)
            return
        # Each end position e < len(tokens) is counted once: the n-grams tokens[e-n:e] gain the
        # follower tokens[e].
        index_tokens(state.index, self.min_n, tokens, state.indexed, self.barrier)
        state.indexed = len(tokens)

    def _rebuild(self, state: NgramState, tokens: list[int]) -> None:
        self._clear(state)
        self._catch_up(state, tokens)  # from indexed = 0: a full build
