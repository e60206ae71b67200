"""Draft stage, suffix-tree drafter (over 400 lines: the tree, its cursor, the shared trees and
their budget in one place) (SuffixDecoding, Oliaro et al., arXiv 2411.04975; Snowflake
Arctic Inference's method, vLLM's "suffix"): propose the most frequent continuation of the
best-scoring match of the context's last tokens in suffix trees over the request's own tokens
and over its tenant's finished outputs. No model, no distribution (p_draft = None: one-hot drafts,
which `verify_sampled` handles losslessly). Strong on agentic loops: files, tool output and the
model's own earlier answers resent with small edits.

Contract (the `Drafter` protocol): per request a `SuffixTree` over the committed tokens (prompt +
output), extended with the tokens it has not seen when `propose` runs (amortised O(new tokens x
max_depth), never a rescan); `free` adds the request's output to its tenant's shared tree.

The tree: every substring of <= `max_depth` tokens of the inserted sequences, each node counting
the occurrences of its string, path-compressed (a node only where the substrings branch or an
inserted suffix ends; an edge's label a span of a sequence where its string occurs, copied only
when an evicted output held it). Appending a token moves each of the sequence's last max_depth
suffixes (the `Cursor`'s active nodes, each ending exactly at a node) one token down: a leaf only
this occurrence reached grows in place, an edge is split where the suffix stops inside it, and a
node left with one child and no suffix ending at it merges into that child, so the tree has
O(tokens) nodes, not O(tokens x depth). tests/test_suffix.py holds the naive references.

Drafting (SuffixDecoding sec. 4): for each match length m = 1, 2, ... (the context's last m
tokens found in a tree), walk down from the match, each step to the most frequent child; a
token's probability is the product of the steps' empirical probabilities (child count / the
occurrences that continued), and the walk stops below `min_token_prob` or after min(k, floor(
max_spec_factor x m)) tokens: a long match earns a long draft, a short one a short draft. A
draft's score is the sum of its tokens' probabilities (its expected accepted length under the
counts); the best-scoring draft of either tree wins (the request's own on a tie). Each drafted
token names its kind (the match length, its path probability, own or shared tree), by which
the policy prices it (drafters/confidence.py `ScoredLookup`).

Shared trees: the tenant scoping and the budget of the n-gram drafter's shared index
(drafters/ngram.py says why per tenant): a request drafts only from the finished outputs of its
own tenant; all tenants share one budget of `shared_tokens` output tokens and the oldest
outputs, whoever's, are removed from their trees (incrementally: no rebuild, no pause).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from quickdraft.config import (
    SUFFIX_MAX_DEPTH,
    SUFFIX_MAX_SPEC_FACTOR,
    SUFFIX_MIN_TOKEN_PROB,
    SUFFIX_SHARED_TOKENS,
)
from quickdraft.speculation.cost import StepShape
from quickdraft.speculation.drafters.confidence import Confidence, Peeked, ScoredLookup


class Node:
    """A tree node: its incoming edge's label `seq[start:start + length]`, the number of
    occurrences of its string (root to here), and when the latest of them entered the edge (the
    tree's clock at the label's first token: the tie-break between equally frequent children).
    `children` is keyed by their labels' first token."""

    __slots__ = ("children", "count", "last", "length", "parent", "seq", "start")

    def __init__(
        self, seq: Sequence[int], start: int, length: int, parent: Node | None, last: int = 0
    ) -> None:
        self.seq = seq
        self.start = start
        self.length = length
        self.count = 0
        self.last = last
        self.children: dict[int, Node] = {}
        self.parent = parent

    def label(self) -> tuple[int, ...]:
        return tuple(self.seq[self.start : self.start + self.length])


@dataclass(slots=True)
class Cursor:
    """A sequence being inserted: `seq[:size]` is in the tree, and active[n] is the node where
    its suffix of length n ends (active[0]: the root), for n < max_depth. seq[i] is the tree's
    token number base + i (its clock)."""

    seq: list[int]
    active: list[Node]
    base: int
    size: int = 0


@dataclass(slots=True)
class Match:
    """Where the context's last `length` tokens end in a tree: `used` tokens into `node`'s label."""

    length: int
    node: Node
    used: int


class SuffixTree:
    """Path-compressed suffix tree of depth <= max_depth (module docstring)."""

    def __init__(self, max_depth: int) -> None:
        assert max_depth >= 2
        self.max_depth = max_depth
        self.root = Node((), 0, 0, None)
        self.clock = 0  # tokens inserted so far

    def cursor(self, seq: list[int]) -> Cursor:
        """Insert `seq` (a list the caller may grow) with `extend`; nothing is inserted yet.
        One sequence grows at a time: a new cursor ends the last one's insertions."""
        return Cursor(seq, [self.root], self.clock)

    def extend(self, cursor: Cursor) -> None:
        """Insert cursor.seq[cursor.size:]: every substring ending there, up to max_depth long."""
        seq, active, root, depth = cursor.seq, cursor.active, self.root, self.max_depth
        assert cursor.base + cursor.size == self.clock, "another sequence was inserted since"
        self.clock += len(seq) - cursor.size
        for i in range(cursor.size, len(seq)):
            token = seq[i]
            moved = [root]
            for n, node in enumerate(active):  # node: where the suffix of length n ends
                if node.count == 1:  # a leaf only this occurrence reached: grow it in place
                    node.seq, node.start, node.length = seq, i - node.length, node.length + 1
                    after = node  # (the hot case, inlined: most long suffixes are unique)
                else:
                    after = self._advance(node, token, seq, i, cursor.base + i)
                if n + 1 < depth:  # a suffix of max_depth tokens stays counted, not extended
                    moved.append(after)
            active = moved
        cursor.active, cursor.size = active, len(seq)

    def _advance(self, node: Node, token: int, seq: Sequence[int], i: int, now: int) -> Node:
        """One occurrence ends at `node` (its string ends at seq[i - 1]); lengthen it by
        `token` = seq[i] (clock `now`) and return the node where it ends now."""
        assert node.count != 1  # a leaf only this occurrence reached: `extend` grows it
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = Node(seq, i, 1, node, now)
            child.count = 1
            return child
        if child.length > 1:  # the occurrence stops inside the edge: a node there
            child = self._split(child)
        child.count += 1
        child.last = now
        if node is not self.root and node.count == child.count and len(node.children) == 1:
            # every occurrence of node's string now continues into child: one edge, labelled
            # by this occurrence (child's string ends at seq[i])
            parent, key = node.parent, node.seq[node.start]
            assert parent is not None
            length = node.length + child.length
            child.seq, child.start, child.length = seq, i + 1 - length, length
            child.last = now + 1 - length
            child.parent = parent
            parent.children[key] = child
        return child

    def _split(self, node: Node) -> Node:
        """A new node for the first token of `node`'s label, between it and its parent."""
        parent = node.parent
        assert parent is not None and node.length > 1
        head = Node(node.seq, node.start, 1, parent, node.last)
        head.count = node.count
        parent.children[node.seq[node.start]] = head
        node.start += 1
        node.length -= 1
        node.last += 1  # its occurrences enter its edge a token later now
        node.parent = head
        head.children[node.seq[node.start]] = node
        return head

    def remove(self, seq: Sequence[int]) -> None:
        """Take out every substring a finished `extend` of `seq` put in (its cursor is gone)."""
        for s in range(len(seq)):
            end = min(s + self.max_depth, len(seq))
            node, pos = self.root, s
            while pos < end:
                key = seq[pos]
                child = node.children[key]
                child.count -= 1
                if child.count == 0:  # only this suffix went there: its whole subtree goes
                    del node.children[key]
                    break
                if child.seq is seq:  # other occurrences remain: keep the label, not `seq`
                    child.seq, child.start = child.label(), 0
                pos += child.length
                node = child
            self._merge_into_child(node)  # the suffix ended at `node`, or it lost a child

    def _merge_into_child(self, node: Node) -> None:
        if node is self.root or len(node.children) != 1:
            return
        (child,) = node.children.values()
        if child.count != node.count:
            return
        parent = node.parent
        assert parent is not None
        merged = node.label() + child.label()
        child.seq, child.start, child.length = merged, 0, len(merged)
        child.last = node.last
        child.parent = parent
        parent.children[merged[0]] = child

    def match(self, pattern: Sequence[int], length: int) -> Match | None:
        """Where pattern[-length:] ends in the tree, or None when it never occurred."""
        node, used = self.root, 0
        for token in pattern[len(pattern) - length :]:
            if used < node.length:
                if node.seq[node.start + used] != token:
                    return None
                used += 1
            else:
                child = node.children.get(token)
                if child is None:
                    return None
                node, used = child, 1
        return Match(length, node, used)

    def walk(self, at: Match, limit: int, min_prob: float) -> tuple[list[int], float, list[float]]:
        """Up to `limit` tokens following `at`, each step to the most frequent continuation
        (the most recently seen among equals), while the path's probability (the product of
        child count / the occurrences that continued) stays >= min_prob; the draft's score, the
        sum of its tokens' probabilities; and those probabilities."""
        node, used = at.node, at.used
        tokens: list[int] = []
        probs: list[float] = []
        prob, score = 1.0, 0.0
        while len(tokens) < limit:
            if used < node.length:  # inside an edge every occurrence goes on the same way
                token = node.seq[node.start + used]
                used += 1
            else:
                best, total = None, 0
                for child in node.children.values():
                    total += child.count
                    if best is None or (child.count, child.last) > (best.count, best.last):
                        best = child
                if best is None:
                    break
                prob *= best.count / total
                if prob < min_prob:
                    break
                node, used = best, 1
                token = best.seq[best.start]
            if token < 0:  # a fence (an image row, `SuffixDrafter.barrier`): never drafted
                break
            tokens.append(token)
            probs.append(prob)
            score += prob
        return tokens, score, probs

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every node's string -> its count (tests compare trees with it)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[Node, tuple[int, ...]]] = [(c, ()) for c in self.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            string = prefix + node.label()
            out[string] = node.count
            stack.extend((c, string) for c in node.children.values())
        return out


@dataclass(slots=True)
class SuffixState:
    tree: SuffixTree  # over the committed tokens
    cursor: Cursor  # cursor.seq: the request's own copy of what the tree holds
    tenant: str = ""  # whose shared tree it drafts from and joins at `free`
    prompt_len: int = 0
    tokens: list[int] = field(default_factory=list)  # the committed sequence (`commit`)
    peeked: Peeked = field(default_factory=Peeked)  # the last lookup (`ScoredLookup`)


@dataclass(slots=True)
class SharedTree:
    """One tenant's share of the shared trees: its kept outputs' substrings, and their size."""

    tree: SuffixTree
    size: int = 0  # tokens of its outputs kept


class SuffixDrafter(ScoredLookup):
    needs_hidden = False
    hidden_history = False
    hidden_layers: tuple[int, ...] = ()  # reads no hidden states

    def __init__(
        self,
        max_depth: int = SUFFIX_MAX_DEPTH,
        max_spec_factor: float = SUFFIX_MAX_SPEC_FACTOR,
        min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
        shared_tokens: int = SUFFIX_SHARED_TOKENS,
        barrier: frozenset[int] = frozenset(),  # token ids never matched nor drafted (images)
    ) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        if max_spec_factor <= 0:
            raise ValueError(f"max_spec_factor must be > 0, got {max_spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        if shared_tokens < 0:
            raise ValueError(f"shared_tokens must be >= 0, got {shared_tokens}")
        self.max_depth = max_depth
        # a barrier token (an image placeholder: equal ids, different pictures) enters the
        # trees as a negative id of its own, a "fence" no other position shares: no match runs
        # through it and `walk` stops at it
        self.barrier = barrier
        self._fences = itertools.count(-(1 << 40), -1)  # for learned outputs
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.forwards: list[StepShape] = []  # a lookup runs no model
        # the shared trees (module docstring), one per tenant; off at 0 tokens
        self.shared_tokens = shared_tokens
        self.shared: dict[str, SharedTree] = {}
        self.learned: deque[tuple[str, list[int]]] = deque()  # (tenant, output), oldest first
        self.shared_size = 0  # tokens kept, all tenants together
        self.confidence = Confidence()  # how often each kind of draft token was kept

    def new_state(self, prompt_ids: list[int], tenant: str = "") -> SuffixState:
        tree = SuffixTree(self.max_depth)
        state = SuffixState(tree, tree.cursor([]), tenant, len(prompt_ids))
        self._catch_up(state, prompt_ids)
        return state

    def _draft(
        self, state: SuffixState, tokens: list[int], k: int
    ) -> tuple[list[int], list[Hashable]]:
        """The best-scoring draft (module docstring) of at most k tokens from the request's
        own tree or its tenant's shared tree (none when neither saw the last token go on), and
        each token's kind (`Confidence`): the match length (1, 2, 3, 4-7, 8+), the token's path
        probability (1, >= 1/2, below), and the tree (own or shared)."""
        self._catch_up(state, tokens)
        draft, score, keys = self._best(state.tree, self._own_matches(state), k, True)
        shared = self.shared.get(state.tenant)
        if shared is not None:
            if self.barrier:  # the context's tail as the trees hold it
                tokens = self._fenced(
                    tokens[-self.max_depth :], max(len(tokens) - self.max_depth, 0)
                )
            matches = self._matches(shared.tree, tokens)
            other, other_score, other_keys = self._best(shared.tree, matches, k, False)
            if other_score > score:
                draft, keys = other, other_keys
        return draft, keys

    def _best(
        self, tree: SuffixTree, matches: Iterator[Match], k: int, own: bool
    ) -> tuple[list[int], float, list[Hashable]]:
        best: list[int] = []
        best_score = 0.0
        best_at: Match | None = None
        best_probs: list[float] = []
        for at in matches:
            limit = min(k, int(at.length * self.max_spec_factor + 1e-6))
            draft, score, probs = tree.walk(at, limit, self.min_token_prob)
            if draft and score >= best_score:  # a tie goes to the longer match
                best, best_score, best_at, best_probs = draft, score, at, probs
        if best_at is None:
            return best, best_score, []
        m = best_at.length
        length = m if m < 4 else 4 if m < 8 else 8
        keys: list[Hashable] = [(length, 2 if p >= 1.0 else int(p >= 0.5), own) for p in best_probs]
        return best, best_score, keys

    def _own_matches(self, state: SuffixState) -> Iterator[Match]:
        """The context's suffixes in the request's own tree: its cursor's active nodes (a
        suffix that never went on before has no longer one that did)."""
        for length, node in enumerate(state.cursor.active[1:], start=1):
            if not node.children:
                return
            yield Match(length, node, node.length)

    def _matches(self, tree: SuffixTree, tokens: list[int]) -> Iterator[Match]:
        for length in range(1, min(self.max_depth, len(tokens) + 1)):
            at = tree.match(tokens, length)
            if at is None or (at.used == at.node.length and not at.node.children):
                return  # never occurred, or never went on: no longer suffix did either
            yield at

    def commit(
        self, state: SuffixState, tokens: list[int], hidden: torch.Tensor | None = None
    ) -> None:
        # Committed tokens only grow and propose catches up with the new tail itself. A shorter
        # sequence cannot happen; if it does the tree counts tokens that are gone, so rebuild.
        if len(tokens) < state.cursor.size:
            self._rebuild(state, tokens)
        state.tokens = tokens

    def free(self, state: SuffixState) -> None:
        """End of a request: its output joins its tenant's shared tree; its own is dropped."""
        self.learn(state.tokens[state.prompt_len :], state.tenant)
        self._rebuild(state, [])

    def learn(self, output: Sequence[int], tenant: str = "") -> None:
        """Add one finished output to `tenant`'s shared tree, first removing the oldest outputs
        of any tenant until all of them together fit in `shared_tokens` tokens."""
        if not self.shared_tokens or len(output) < 2:
            return
        kept = list(output[-self.shared_tokens :])
        if self.barrier:
            kept = [next(self._fences) if t in self.barrier else t for t in kept]
        while self.learned and self.shared_size + len(kept) > self.shared_tokens:
            self._forget_oldest()
        mine = self.shared.get(tenant)
        if mine is None:
            mine = self.shared[tenant] = SharedTree(SuffixTree(self.max_depth))
        mine.tree.extend(mine.tree.cursor(kept))
        mine.size += len(kept)
        self.learned.append((tenant, kept))
        self.shared_size += len(kept)

    def _forget_oldest(self) -> None:
        tenant, output = self.learned.popleft()
        scope = self.shared[tenant]
        scope.tree.remove(output)
        scope.size -= len(output)
        self.shared_size -= len(output)
        if not scope.size:
            del self.shared[tenant]

    def _catch_up(self, state: SuffixState, tokens: list[int]) -> None:
        """Insert the tokens committed since the last call."""
        if len(tokens) < state.cursor.size:
            self._rebuild(state, tokens)
            return
        own = state.cursor.seq
        own.extend(self._fenced(tokens[len(own) :], len(own)))
        state.tree.extend(state.cursor)

    def _fenced(self, tokens: list[int], start: int) -> list[int]:
        """`tokens` (the sequence's from position `start` on) with each barrier token replaced
        by -1 - its position: a fence that matches nothing else in the request."""
        if not self.barrier:
            return tokens
        return [-1 - (start + i) if t in self.barrier else t for i, t in enumerate(tokens)]

    def _rebuild(self, state: SuffixState, tokens: list[int]) -> None:
        state.peeked = Peeked()
        state.tree = SuffixTree(self.max_depth)
        state.cursor = state.tree.cursor([])
        self._catch_up(state, tokens)
