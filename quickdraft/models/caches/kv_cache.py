"""Attention KV cache of one sequence: the rollback primitive.

Layout: k, v `[num_layers, num_kv_heads, capacity, head_dim]`, pre-allocated and grown by
doubling. `length` counts the tokens whose KV is committed. A forward writes the KV of its new
tokens at `[length, length + n)` without moving `length`; the caller then `commit(n_kept)`s.
Committing fewer tokens than were written is the rollback: O(1), nothing is copied or cleared
(the stale rows are overwritten by the next forward and never read before that).

The prefix cache copies committed rows out (`export_kv`). A fresh cache takes matched blocks as
its first tokens (`import_kv`) without copying them where the attention kernel reads blocks in
place (`kernels.attention.paged_kernel`): it keeps references to the shared, never-written
blocks (`shared`: their first `base` tokens), its own tensors hold the tokens from `base` on,
and `write` returns `Paged` keys and values. Elsewhere (a GPU, a head size the kernel does not
take) the blocks are copied in, as one tensor is what the fallback attention reads; and so
everywhere while `IN_PLACE` is False (bench/prefix_cache.py's A/B).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from quickdraft.kernels.attention import Paged, page_table, pageable, paged_kernel
from quickdraft.models.base import KVBlock, StateSnapshot

IN_PLACE = True  # False: `import_kv` copies blocks in everywhere (the copy-in A/B)


class KVCache:
    __slots__ = ("_blocks", "_pages", "base", "block", "capacity", "k", "length", "shared", "v")
    recurrent = False

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_kv_heads, max(capacity, 1), head_dim)
        self.k: Tensor = torch.empty(shape, dtype=dtype, device=device)
        self.v: Tensor = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = shape[2]  # tokens in all: the shared ones and room in k, v
        self.length = 0
        self.shared: tuple[KVBlock, ...] = ()  # the first `base` tokens, read in place
        self.base = 0  # k, v row i holds token base + i
        self.block = 1  # tokens per shared block
        self._pages: tuple[Tensor, Tensor] | None = None  # the blocks' addresses, k and v
        self._blocks: tuple[list[Tensor], list[Tensor]] = ([], [])  # the blocks' k and v

    def reserve(self, num_new: int) -> None:
        """Make room for `num_new` tokens past `length` (done before a forward writes them)."""
        need = self.length + num_new
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity) - self.base
        own = self.length - self.base
        for name in ("k", "v"):
            old: Tensor = getattr(self, name)
            grown = old.new_empty((old.shape[0], old.shape[1], new_cap, old.shape[3]))
            grown[:, :, :own] = old[:, :, :own]
            setattr(self, name, grown)
        self.capacity = self.base + new_cap

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor | Paged, Tensor | Paged]:
        """Store k, v `[num_kv_heads, n, head_dim]` of the new tokens of `layer`; return the
        keys/values visible to them: `[num_kv_heads, length + n, head_dim]` each, or `Paged`
        ones when the first tokens are shared blocks."""
        end = self.length + k.shape[1]
        assert end <= self.capacity, "reserve() before the forward"
        lo, hi = self.length - self.base, end - self.base
        self.k[layer, :, lo:hi] = k
        self.v[layer, :, lo:hi] = v
        if self._pages is None:
            return self.k[layer, :, :hi], self.v[layer, :, :hi]
        (pk, pv), (blocks_k, blocks_v) = self._pages, self._blocks
        return (
            Paged(blocks_k, pk, self.block, layer, self.k[layer, :, :hi]),
            Paged(blocks_v, pv, self.block, layer, self.v[layer, :, :hi]),
        )

    @property
    def pages(self) -> tuple[Tensor | None, Tensor | None, int]:
        """The shared blocks' k and v addresses and tokens per block (None: no shared blocks),
        for the C++ layers that call the paged kernel themselves."""
        if self._pages is None:
            return None, None, 1
        return self._pages[0], self._pages[1], self.block

    def commit(self, length: int) -> None:
        """Set the committed length (append: length grows; rollback: it shrinks). O(1)."""
        assert self.base <= length <= self.capacity, (self.base, length, self.capacity)
        self.length = length

    trim = commit  # mlx-lm's name for the same operation

    def nbytes(self) -> int:
        """This sequence's own bytes (shared blocks are the prefix cache's)."""
        return self.k.nbytes + self.v.nbytes

    def export_kv(self, start: int, end: int) -> KVBlock:
        """The committed rows [start, end) `[num_layers, num_kv_heads, n, head_dim]`, never
        written again: a shared block itself where the range is one, else a copy."""
        assert 0 <= start <= end <= self.length, (start, end, self.length)
        if end <= self.base and start % self.block == 0 and end - start == self.block:
            return self.shared[start // self.block]
        parts_k: list[Tensor] = []
        parts_v: list[Tensor] = []
        for i, b in enumerate(self.shared):  # the shared part of the range
            lo, hi = max(start, i * self.block), min(end, (i + 1) * self.block)
            if lo < hi:
                parts_k.append(b.k[:, :, lo - i * self.block : hi - i * self.block])
                parts_v.append(b.v[:, :, lo - i * self.block : hi - i * self.block])
        lo, hi = max(start, self.base) - self.base, end - self.base
        if lo < hi:
            parts_k.append(self.k[:, :, lo:hi])
            parts_v.append(self.v[:, :, lo:hi])
        if len(parts_k) == 1:
            fmt = torch.contiguous_format
            return KVBlock(parts_k[0].clone(memory_format=fmt), parts_v[0].clone(memory_format=fmt))
        return KVBlock(torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2))

    def import_kv(self, blocks: Sequence[KVBlock], state: StateSnapshot | None = None) -> None:
        """An empty cache takes `blocks`, in order, as its first committed tokens: by reference
        where the kernel reads them in place (blocks of one size), else copied in."""
        assert self.length == 0 and state is None, "import into an empty attention cache"
        if not blocks:
            return
        size = blocks[0].num_tokens
        _, heads, _, dim = self.k.shape
        in_place = (
            IN_PLACE
            and paged_kernel(dim, self.k.dtype, self.k.device)
            and all(
                b.num_tokens == size
                and pageable(b.k, dim)
                and pageable(b.v, dim)
                and b.k.dtype == self.k.dtype
                and b.k.shape == (self.k.shape[0], heads, size, dim)
                for b in blocks
            )
        )
        if not in_place:
            self.reserve(sum(b.num_tokens for b in blocks))
            for block in blocks:
                end = self.length + block.num_tokens
                self.k[:, :, self.length : end] = block.k
                self.v[:, :, self.length : end] = block.v
                self.length = end
            return
        self.shared, self.block = tuple(blocks), size
        self.base = self.length = size * len(blocks)
        self._blocks = ([b.k for b in blocks], [b.v for b in blocks])
        self._pages = (page_table(self._blocks[0]), page_table(self._blocks[1]))
        # the own rows: what is left of the room asked for at creation
        own = max(self.capacity - self.base, 1)
        self.k = self.k.new_empty((self.k.shape[0], heads, own, dim))
        self.v = self.v.new_empty((self.v.shape[0], heads, own, dim))
        self.capacity = self.base + own

    def state_at(self, position: int) -> StateSnapshot | None:
        return None  # attention only: the KV rows are the whole state


def kv_slots(
    shapes: Sequence[tuple[int, int] | None],
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(the distinct (kv heads, head_dim) shapes in layer order, every layer's slot (group,
    layer within the group); (-1, -1) for a layer without KV of its own)."""
    kinds = list(dict.fromkeys(s for s in shapes if s is not None))
    counts = [0] * len(kinds)
    slots: list[tuple[int, int]] = []
    for shape in shapes:
        if shape is None:
            slots.append((-1, -1))
            continue
        g = kinds.index(shape)
        slots.append((g, counts[g]))
        counts[g] += 1
    return kinds, slots


class GroupedKVCache:
    """The KV of one sequence for a model whose layers' KV differ in shape (Gemma 4's local
    and global layers: other head counts and sizes): one KVCache per shape, one length.
    Layer `i` of the model writes slot `slots[i]` = (group, layer within the group); a layer
    without KV of its own (shape None: it reads another's) has none.

    The prefix cache's blocks hold each token's KV of every group flattened (`[1, 1, tokens,
    sum of layers x heads x head_dim]`), so they slice and join by token as a KVCache's do;
    imported blocks are copied in (the attention kernel reads one shape per block)."""

    __slots__ = ("groups", "length", "slots")
    recurrent = False

    def __init__(
        self,
        shapes: Sequence[tuple[int, int] | None],  # per layer: (kv heads, head_dim) or None
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        kinds, self.slots = kv_slots(shapes)
        counts = [sum(1 for g, _ in self.slots if g == kind) for kind in range(len(kinds))]
        self.groups = [
            KVCache(n, heads, dim, capacity, dtype, device)
            for (heads, dim), n in zip(kinds, counts, strict=True)
        ]
        self.length = 0

    def reserve(self, num_new: int) -> None:
        for group in self.groups:
            group.reserve(num_new)

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor | Paged, Tensor | Paged]:
        """KVCache.write on layer `layer`'s group."""
        g, i = self.slots[layer]
        return self.groups[g].write(i, k, v)

    def read(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        """Keys and values `[kv_heads, end, head_dim]` of layer `layer`'s tokens [0, end),
        written earlier (a layer that reads another's KV, Gemma 4's shared layers)."""
        g, i = self.slots[layer]
        group = self.groups[g]
        assert end <= group.capacity and not group.shared, "rows of this cache's own"
        return group.k[i, :, :end], group.v[i, :, :end]

    def commit(self, length: int) -> None:
        self.length = length
        for group in self.groups:
            group.commit(length)

    trim = commit

    def nbytes(self) -> int:
        return sum(group.nbytes() for group in self.groups)

    def export_kv(self, start: int, end: int) -> KVBlock:
        parts = [g.export_kv(start, end) for g in self.groups]
        k = torch.cat([_token_major(p.k) for p in parts], dim=1)  # [tokens, features]
        v = torch.cat([_token_major(p.v) for p in parts], dim=1)
        return KVBlock(k[None, None], v[None, None])

    def import_kv(self, blocks: Sequence[KVBlock], state: StateSnapshot | None = None) -> None:
        assert self.length == 0 and state is None, "import into an empty attention cache"
        if not blocks:
            return
        k = torch.cat([b.k[0, 0] for b in blocks])  # [tokens, features]
        v = torch.cat([b.v[0, 0] for b in blocks])
        n, at = k.shape[0], 0
        self.reserve(n)
        for group in self.groups:
            layers, heads, _, dim = group.k.shape
            width = layers * heads * dim
            for mine, flat in ((group.k, k), (group.v, v)):
                part = flat[:, at : at + width].reshape(n, layers, heads, dim)
                mine[:, :, :n] = part.permute(1, 2, 0, 3)
            at += width
        assert at == k.shape[1], "blocks of this cache's layout"
        self.commit(n)

    def state_at(self, position: int) -> StateSnapshot | None:
        return None


def _token_major(kv: Tensor) -> Tensor:
    """[layers, heads, tokens, dim] -> [tokens, layers * heads * dim]."""
    return kv.permute(2, 0, 1, 3).reshape(kv.shape[2], -1)
