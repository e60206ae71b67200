"""Prefix cache (over 400 lines: one tree's matching, inserts, locks, pieces and budget).

The KV (and recurrent state) of token blocks that earlier requests computed, shared by every
request of one target model; a request whose prompt starts with cached blocks skips their
prefill.

Stage: beside the scheduler. The scheduler calls `admit` when a sequence gets its caches,
`chunk` when it sizes a prompt chunk and `leave` when the sequence leaves; the core calls
`extend` after each commit. It sees caches, token ids and the drafter state, never a request.

A radix tree of blocks of `block_size` tokens: a node is one block, found under its parent by
its token ids, and holds immutable copies of
  kv      the target's KV of the block's tokens (models/base.py `KVBlock`)
  state   hybrid targets, every `snapshot_every` blocks: the recurrent state after the block
          (`StateSnapshot`); a GDN state cannot be cut back, so a hit resumes from the deepest
          snapshot in the match (SGLang's extra state buffer, vLLM's "align" mode)
  drafts  per drafter that keeps per-position state (a draft model's KV, an MTP head's KV and
          hidden rows; drafters/base.py `PrefixDrafter`): its share of the block
A hit hands the matched blocks to the new sequence's cache, which reads them in place where
the attention kernel can (models/caches/kv_cache.py: no copy; the kernel's page table gives each
key's row, with the bits of one tensor) and copies them in elsewhere (a GPU). A sequence's committed
blocks enter the tree as copies of its rows, the blocks of one commit in one `Piece` (a tensor each
block is a token range of, so that a layer's rows of consecutive blocks lie together when read in
place); a piece's memory counts until its last block leaves. Nothing ever writes into a cached
block, so a rollback after a rejected draft (a shorter commit, never below the shared part, in the
sequence's own rows) cannot reach one: copy-on-write is implicit. Because every kernel is
batch-invariant, a block's KV does not depend on how its prompt was chunked or batched, and an
output with the cache equals the output without it bit for bit.

  admit(prompt, cache, spec, tenant) -> cursor
        the longest run of whole prompt blocks in the tenant's tree, leaving the prompt's last
        token to run (its logits give the first output token); recurrent targets: up to the
        deepest snapshot in it; a drafter that keeps state over the target's hidden states of
        every position (MTP): only blocks that carry its part too (it cannot catch up on
        positions the target skipped; the Gemma 4 assistant reads only the newest row).
        Gives them to `cache` and the drafter state, and locks them.
  extend(cursor, tokens, cache, spec)
        after a commit: the sequence's newly whole blocks join the tree (nodes other requests
        inserted are reused), with the snapshots and drafter parts the sequence can give
  chunk(cache, computed, n)
        recurrent targets: a prompt chunk ends at the next snapshot boundary (a long forward
        keeps only its final state)
  leave(cursor, spec, failed)
        the sequence is done with its path: unlocked
Tenants: each tenant (the request's, as the server names it: API key / `user`, or "" for all
when the server shares across them) has a tree of its own, as for the n-gram drafter's shared
index: a hit is visible (`cached_tokens`, the time to first token), so a shared tree would tell
one client whether another had sent a prompt.
Reference counts: a running sequence locks the deepest node of its path, so that node and its
ancestors stay; only unlocked leaves are evicted, least recently used first, when an insert
would pass the memory budget (a piece frees its memory with its last block, so eviction goes on
until one does). When the locked blocks hold the whole budget, nothing new is
cached (`stats.refused`): caching never fails a request and never exceeds its budget.
"""

from __future__ import annotations

import heapq
import itertools
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quickdraft.config import PrefixCacheConfig
from quickdraft.models.base import KVBlock, SequenceCache, StateSnapshot
from quickdraft.speculation.drafters.base import DraftBlock, PrefixDrafter
from quickdraft.speculation.drafters.draft_model import DraftModelDrafter
from quickdraft.speculation.drafters.mtp import MTPDrafter
from quickdraft.speculation.state import SpecState

# drafters whose per-request state the cache keeps beside the target's blocks (PrefixDrafter)
PREFIX_DRAFTERS = (DraftModelDrafter, MTPDrafter)
DEFAULT_SHARE = 0.25  # of the memory available when the engine starts...
DEFAULT_CAP_BYTES = 8 * 10**9  # ...up to this


def available_memory(device: torch.device) -> int:
    """Bytes the device can still give: free GPU memory, else the OS's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def budget_bytes(config: PrefixCacheConfig, device: torch.device) -> int:
    if config.max_gb is not None:
        return int(config.max_gb * 1e9)
    return int(min(DEFAULT_SHARE * available_memory(device), DEFAULT_CAP_BYTES))


@dataclass(slots=True)
class PrefixCacheStats:
    """Live counters of one model's prefix cache (read by metrics; tokens unless named)."""

    queries: int = 0  # prompt tokens looked up (vLLM: prefix_cache_queries)
    hits: int = 0  # of those, served from the cache (vLLM: prefix_cache_hits)
    blocks: int = 0  # nodes in the tree
    bytes: int = 0  # the memory they hold (KV, snapshots, drafter parts; `Piece`s whole)
    budget_bytes: int = 0
    inserted: int = 0  # blocks inserted
    evicted: int = 0  # blocks evicted
    refused: int = 0  # inserts given up: the budget was held by blocks in use


class Piece:
    """One tensor pair that several blocks are token ranges of (the new blocks of one commit,
    a drafter's parts made together): its memory lives, and its bytes count, until its last
    block leaves the tree."""

    __slots__ = ("blocks", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.blocks = 0  # blocks in the tree that are ranges of it


class Block:
    """One node: a block of token ids under its parent (None: a first block)."""

    __slots__ = (
        "children",
        "depth",
        "drafts",
        "kv",
        "last_used",
        "live",
        "nbytes",
        "parent",
        "pieces",
        "refs",
        "state",
        "tenant",
        "tokens",
    )

    def __init__(
        self, tenant: str, tokens: tuple[int, ...], parent: Block | None, kv: KVBlock, depth: int
    ) -> None:
        self.tenant = tenant
        self.tokens = tokens
        self.parent = parent
        self.depth = depth  # blocks from the root: this one covers tokens up to depth * size
        self.kv = kv
        self.state: StateSnapshot | None = None
        self.drafts: dict[int, DraftBlock] = {}  # drafter key -> its part
        self.children: dict[tuple[int, ...], Block] = {}
        self.refs = 0  # running sequences whose path ends here
        self.last_used = 0
        self.nbytes = kv.nbytes  # what it holds alone; a range of a piece counts with the piece
        self.pieces: list[Piece] = []
        self.live = True  # False once evicted

    def join(self, piece: Piece) -> None:
        """Its KV or a drafter part is a range of `piece`, whose bytes count there."""
        self.pieces.append(piece)
        piece.blocks += 1


@dataclass(slots=True, eq=False)
class PrefixCursor:
    """One sequence's place in the tree, from admission until it leaves."""

    tenant: str  # whose tree
    path: list[Block]  # its blocks in the tree, in order; the last one is locked
    drafter: PrefixDrafter | None  # its drafter, if the cache keeps that drafter's state
    key: int  # the drafter's key in `Block.drafts`
    drafted: int  # leading blocks of `path` that carry the drafter's part
    cached_tokens: int  # prompt tokens that came from the cache
    # the prompt's token ids where its block keys differ (image rows keyed by content): what
    # the drafter's state holds there; None: the keys are the ids
    prompt_ids: list[int] | None = None


class PrefixCache:
    def __init__(self, config: PrefixCacheConfig, device: torch.device) -> None:
        self.config = config
        self.size = config.block_size
        self.roots: dict[str, dict[tuple[int, ...], Block]] = {}  # tenant -> first blocks
        self.stats = PrefixCacheStats(budget_bytes=budget_bytes(config, device))
        self._tick = 0
        self._heap: list[tuple[int, int, Block]] = []  # (last_used, serial, node), lazy
        self._serial = itertools.count()
        # a drafter object -> its key (not id(): a later drafter could reuse a freed id)
        self._keys: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._drafter_keys = itertools.count()

    # ------------------------------------------------------------------ the scheduler's side

    def admit(
        self,
        prompt: list[int],
        cache: SequenceCache,
        spec: SpecState | None,
        tenant: str = "",
        keys: list[int] | None = None,
    ) -> PrefixCursor:
        """Match `prompt` (by `keys`, its block keys, where they differ from its ids: image
        rows keyed by content), copy the usable blocks into the empty `cache` (and the
        drafter's state) and lock them; the sequence then prefills only the rest."""
        size = self.size
        drafter = self._drafter(spec)
        key = 0 if drafter is None else self._key(drafter)
        keys = prompt if keys is None else keys
        path = self._match(self._children(tenant, None), keys, (len(prompt) - 1) // size)
        drafted = 0
        if drafter is not None:
            while drafted < len(path) and key in path[drafted].drafts:
                drafted += 1
        usable = len(path)
        if spec is not None and any(
            a.speculation.drafter.needs_hidden and a.speculation.drafter.hidden_history
            for a in spec.arms
        ):
            usable = drafted  # it could not catch up on positions the target skips
        if cache.recurrent:  # resume from the deepest state snapshot
            usable = max((i + 1 for i in range(usable) if path[i].state is not None), default=0)
        path, drafted = path[:usable], min(drafted, usable)
        state = path[-1].state if path and cache.recurrent else None
        cache.import_kv([b.kv for b in path], state)
        if drafter is not None:
            assert spec is not None
            parts = [b.drafts[key] for b in path[:drafted]]
            arm = spec.arm_of(drafter)
            arm.synced = drafter.import_blocks(arm.draft_state, prompt, parts, size)
        self._tick += 1
        for node in path:
            node.last_used = self._tick
        if path:
            path[-1].refs += 1
        self.stats.queries += len(prompt)
        self.stats.hits += usable * size
        ids = None if keys is prompt else list(prompt)
        return PrefixCursor(tenant, path, drafter, key, drafted, usable * size, ids)

    def chunk(self, cache: SequenceCache, computed: int, num_tokens: int) -> int:
        """Prompt rows to feed from `computed`: at most up to the next snapshot boundary for a
        recurrent cache (the state is kept at a chunk's end only), else `num_tokens`."""
        if not cache.recurrent:
            return num_tokens
        every = self.size * self.config.snapshot_every
        return min(num_tokens, (computed // every + 1) * every - computed)

    def leave(self, cur: PrefixCursor, spec: SpecState | None, failed: bool) -> None:
        """The sequence leaves: the drafter parts it produced last join (unless it failed:
        then its drafter state may be half-updated), and its path is unlocked."""
        try:
            if not failed:
                self._attach(cur, spec)
        finally:
            if cur.path:
                node = cur.path[-1]
                node.refs -= 1
                self._push_if_evictable(node)
            cur.path = []

    # ------------------------------------------------------------------ the core's side

    def extend(
        self, cur: PrefixCursor, tokens: list[int], cache: SequenceCache, spec: SpecState | None
    ) -> None:
        """After a commit: each committed block of `tokens` (the committed tokens' block keys,
        those the cache holds at least: `Request.key_ids`) not yet on the sequence's path
        joins the tree (or is found there), with its snapshot and drafter part if due."""
        size, every = self.size, self.config.snapshot_every
        whole = cache.length // size * size  # the committed tokens in whole blocks
        run: tuple[int, KVBlock, Piece] | None = None  # the new blocks' KV, in one piece
        tried = False
        while (len(cur.path) + 1) * size <= cache.length:
            depth = len(cur.path) + 1
            start, end = (depth - 1) * size, depth * size
            parent = cur.path[-1] if cur.path else None
            ids = tuple(tokens[start:end])
            node = self._children(cur.tenant, parent).get(ids)
            if node is None:
                # every later block is new too (its parent is): one copy for all of them, so
                # that a layer's rows of consecutive blocks lie together when a sequence reads
                # them in place (models/caches/kv_cache.py); each block is a token range of it.
                # Where the budget has no room for all of them, block by block as far as it goes
                if not tried and whole - start > size:
                    tried = True
                    kv = cache.export_kv(start, whole)
                    if self._reserve(kv.nbytes, 0):  # may evict (a failed try refuses nothing)
                        run = (start, kv, Piece(kv.nbytes))
                        self.stats.bytes += kv.nbytes
                if run is not None:
                    at, kv = start - run[0], run[1]
                    kv = KVBlock(kv.k[:, :, at : at + size], kv.v[:, :, at : at + size])
                else:
                    kv = cache.export_kv(start, end)
                    if not self._reserve(kv.nbytes):
                        break
                node = Block(cur.tenant, ids, parent, kv, depth)
                if run is not None:
                    node.nbytes = 0
                    node.join(run[2])
                if parent is None:
                    self.roots.setdefault(cur.tenant, {})[ids] = node
                else:
                    parent.children[ids] = node
                self.stats.blocks += 1
                self.stats.inserted += 1
                self.stats.bytes += node.nbytes
            node.refs += 1  # the lock moves down the path (the parent now has a child)
            if parent is not None:
                parent.refs -= 1
            self._tick += 1
            node.last_used = self._tick
            cur.path.append(node)
            if cache.recurrent and depth % every == 0 and node.state is None:
                snap = cache.state_at(end)  # None once the commit that reached `end` is past
                if snap is not None and self._reserve(snap.nbytes):
                    node.state = snap
                    self._grow(node, snap.nbytes)
        self._attach(cur, spec)

    # ------------------------------------------------------------------ inside

    def _match(
        self, siblings: dict[tuple[int, ...], Block], tokens: list[int], max_blocks: int
    ) -> list[Block]:
        path: list[Block] = []
        for i in range(max_blocks):
            node = siblings.get(tuple(tokens[i * self.size : (i + 1) * self.size]))
            if node is None:
                break
            path.append(node)
            siblings = node.children
        return path

    def _children(self, tenant: str, parent: Block | None) -> dict[tuple[int, ...], Block]:
        """The blocks under `parent` (None: the tenant's first blocks); read only."""
        return self.roots.get(tenant, {}) if parent is None else parent.children

    def _attach(self, cur: PrefixCursor, spec: SpecState | None) -> None:
        """The drafter's parts of the path's blocks, as far as its state holds them."""
        if cur.drafter is None or spec is None:
            return
        new: list[Block] = []
        while cur.drafted < len(cur.path):
            node = cur.path[cur.drafted]
            if cur.key not in node.drafts:
                start = cur.drafted * self.size
                state = spec.arm_of(cur.drafter).draft_state
                ids = list(node.tokens)
                if cur.prompt_ids is not None:  # the drafter holds token ids, not image keys
                    inside = cur.prompt_ids[start : start + self.size]
                    ids[: len(inside)] = inside
                part = cur.drafter.export_block(state, start, ids)
                if part is None or not self._reserve(part.nbytes):
                    break
                node.drafts[cur.key] = part
                self._grow(node, part.nbytes)
                new.append(node)
            cur.drafted += 1
        self._gather([node.drafts[cur.key] for node in new], new, cur.key)

    def _gather(self, parts: list[DraftBlock], nodes: list[Block], key: int) -> None:
        """Drafter parts made at once (of consecutive blocks, as a rule) move into one tensor,
        each a token range of it, as the target's blocks of one commit are (`extend`): a
        drafter that reads them in place then finds a layer's rows of those blocks together."""
        if len(parts) < 2:
            return
        k = torch.cat([p.kv.k for p in parts], dim=2)
        v = torch.cat([p.kv.v for p in parts], dim=2)
        piece = Piece(k.nbytes + v.nbytes)  # the parts' KV bytes, now counted once there
        at = 0
        for node, part in zip(nodes, parts, strict=True):
            n = part.kv.num_tokens
            kv = KVBlock(k[:, :, at : at + n], v[:, :, at : at + n])
            node.drafts[key] = DraftBlock(kv, part.hidden)
            node.nbytes -= part.kv.nbytes
            node.join(piece)
            at += n

    def _drafter(self, spec: SpecState | None) -> PrefixDrafter | None:
        """The request's drafter whose state the cache keeps (of several: the first such)."""
        if spec is None:
            return None
        drafters = (a.speculation.drafter for a in spec.arms)
        return next((d for d in drafters if isinstance(d, PREFIX_DRAFTERS)), None)

    def _key(self, drafter: object) -> int:
        key = self._keys.get(drafter)
        if key is None:
            key = self._keys[drafter] = next(self._drafter_keys)
        return key

    def _grow(self, node: Block, nbytes: int) -> None:
        node.nbytes += nbytes
        self.stats.bytes += nbytes

    def _reserve(self, nbytes: int, blocks: int = 1) -> bool:
        """Evict unlocked leaves, least recently used first, until `nbytes` more fit the
        budget; False if they cannot (the rest is locked by running sequences), counted as
        `blocks` refused (0: a try whose refusal gives nothing up)."""
        budget = self.stats.budget_bytes
        if nbytes > budget:
            self.stats.refused += blocks
            return False
        while self.stats.bytes + nbytes > budget:
            victim = self._pop_lru()
            if victim is None:
                self.stats.refused += blocks
                return False
            self._evict(victim)
        return True

    def _evict(self, node: Block) -> None:
        assert node.refs == 0 and not node.children, "only unlocked leaves are evicted"
        parent = node.parent
        siblings = self.roots[node.tenant] if parent is None else parent.children
        del siblings[node.tokens]
        if not siblings and parent is None:
            del self.roots[node.tenant]
        node.live = False
        self.stats.blocks -= 1
        self.stats.evicted += 1
        self.stats.bytes -= node.nbytes
        for piece in node.pieces:  # a piece's memory goes with its last block
            piece.blocks -= 1
            if piece.blocks == 0:
                self.stats.bytes -= piece.nbytes
        if parent is not None:
            self._push_if_evictable(parent)

    def _push_if_evictable(self, node: Block) -> None:
        if node.live and node.refs == 0 and not node.children:
            heapq.heappush(self._heap, (node.last_used, next(self._serial), node))
            if len(self._heap) > 2 * self.stats.blocks + 1024:
                self._rebuild_heap()

    def _pop_lru(self) -> Block | None:
        while self._heap:
            last_used, _, node = heapq.heappop(self._heap)
            # entries go stale when a node is touched, locked, gets a child or is evicted
            if node.live and node.refs == 0 and not node.children and node.last_used == last_used:
                return node
        return None

    def _rebuild_heap(self) -> None:
        self._heap = [
            (n.last_used, next(self._serial), n)
            for n in self._nodes()
            if n.refs == 0 and not n.children
        ]
        heapq.heapify(self._heap)

    def _nodes(self) -> Iterator[Block]:
        stack = [node for roots in self.roots.values() for node in roots.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
