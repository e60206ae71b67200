"""The KV of every sequence of a model on a GPU in one static pool, a slot per sequence
(models/graphs.py replays CUDA graphs over it): `SlotPool` holds k, v `[layers, slots + 1,
kv_heads, capacity, head_dim]`, zero-filled, the last slot scratch; `SlotCache` is one
sequence's slot and committed length, the SequenceCache contract of models/base.py (`commit`
is the O(1) rollback). A slot goes back to the pool when its cache is garbage; the pool grows
(more slots, longer slots) by reallocation and bumps its `generation`, so that whoever holds
its old addresses (captured graphs) knows to drop them.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from quickdraft.models.base import KVBlock, StateSnapshot


class SlotPool:
    """The KV of every sequence of one model: k, v `[layers, slots + 1, kv_heads, capacity,
    head_dim]`, zero-filled (masked keys must not be NaN: softmax weight 0 times NaN is NaN).
    The last slot is scratch: padded rows write there."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        slots: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.dims = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k, self.v = self._alloc(slots, capacity)
        self.free = list(range(slots - 1, -1, -1))
        self.generation = 0  # bumped by every reallocation (captured graphs hold the old one)

    def _alloc(self, slots: int, capacity: int) -> tuple[Tensor, Tensor]:
        layers, kv_heads, head_dim = self.dims
        shape = (layers, slots + 1, kv_heads, capacity, head_dim)
        z = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return z, torch.zeros_like(z)

    @property
    def slots(self) -> int:
        return self.k.shape[1] - 1

    @property
    def scratch(self) -> int:
        return self.slots

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def slot_bytes(self) -> int:
        return 2 * self.k[:, 0].nbytes

    def take(self) -> int:
        if not self.free:
            gc.collect()  # caches of finished sequences nobody holds any more
        if not self.free:
            self._grow(2 * self.slots, self.capacity)
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def fit(self, tokens: int, limit: int) -> None:
        """Make every slot hold `tokens` (doubling, at most `limit`)."""
        if tokens > self.capacity:
            self._grow(self.slots, min(max(tokens, 2 * self.capacity), limit))

    def _grow(self, slots: int, capacity: int) -> None:
        old_k, old_v = self.k, self.v
        old_slots, old_cap = old_k.shape[1] - 1, old_k.shape[3]
        self.k, self.v = self._alloc(slots, capacity)
        for new, old in ((self.k, old_k), (self.v, old_v)):
            new[:, :old_slots, :, :old_cap] = old[:, :old_slots]
        self.free = list(range(slots - 1, old_slots - 1, -1)) + self.free
        self.generation += 1


class SlotCache:
    """One sequence's KV: a slot of a SlotPool and the committed length (base.SequenceCache)."""

    recurrent = False

    def __init__(self, pool: SlotPool, limit: int) -> None:
        self.pool, self.limit = pool, limit
        self.slot = pool.take()
        self.length = 0
        weakref.finalize(self, pool.give, self.slot)

    def reserve(self, num_new: int) -> None:
        self.pool.fit(self.length + num_new, self.limit)

    def commit(self, length: int) -> None:
        assert 0 <= length <= self.pool.capacity, (length, self.pool.capacity)
        self.length = length

    trim = commit

    def nbytes(self) -> int:
        return self.pool.slot_bytes()

    def export_kv(self, start: int, end: int) -> KVBlock:
        assert 0 <= start <= end <= self.length, (start, end, self.length)
        k, v = self.pool.k[:, self.slot, :, start:end], self.pool.v[:, self.slot, :, start:end]
        return KVBlock(k.clone(), v.clone())

    def import_kv(self, blocks: Sequence[KVBlock], state: StateSnapshot | None = None) -> None:
        assert self.length == 0 and state is None, "import into an empty attention cache"
        self.reserve(sum(b.num_tokens for b in blocks))
        for block in blocks:
            end = self.length + block.num_tokens
            self.pool.k[:, self.slot, :, self.length : end] = block.k
            self.pool.v[:, self.slot, :, self.length : end] = block.v
            self.length = end

    def state_at(self, position: int) -> StateSnapshot | None:
        return None
