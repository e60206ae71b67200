"""Attention KV cache of one sequence: the rollback primitive.

Layout: k, v `[num_layers, num_kv_heads, capacity, head_dim]`, pre-allocated and grown by
doubling. `length` counts the tokens whose KV is committed. A forward writes the KV of its new
tokens at `[length, length + n)` without moving `length`; the caller then `commit(n_kept)`s.
Committing fewer tokens than were written is the rollback: O(1), nothing is copied or cleared
(the stale rows are overwritten by the next forward and never read before that).
The prefix cache copies committed rows out (`export_kv`) and into a fresh cache (`import_kv`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from quickdraft.models.base import KVBlock, StateSnapshot


class KVCache:
    __slots__ = ("capacity", "k", "length", "v")
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
        self.capacity = shape[2]
        self.length = 0

    def reserve(self, num_new: int) -> None:
        """Make room for `num_new` tokens past `length` (done before a forward writes them)."""
        need = self.length + num_new
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        for name in ("k", "v"):
            old: Tensor = getattr(self, name)
            grown = old.new_empty((old.shape[0], old.shape[1], new_cap, old.shape[3]))
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)
        self.capacity = new_cap

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v `[num_kv_heads, n, head_dim]` of the new tokens of `layer`; return the
        keys/values visible to them: `[num_kv_heads, length + n, head_dim]` each."""
        end = self.length + k.shape[1]
        assert end <= self.capacity, "reserve() before the forward"
        self.k[layer, :, self.length : end] = k
        self.v[layer, :, self.length : end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def commit(self, length: int) -> None:
        """Set the committed length (append: length grows; rollback: it shrinks). O(1)."""
        assert 0 <= length <= self.capacity, (length, self.capacity)
        self.length = length

    trim = commit  # mlx-lm's name for the same operation

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def export_kv(self, start: int, end: int) -> KVBlock:
        """Copies of the committed rows [start, end) `[num_layers, num_kv_heads, n, head_dim]`."""
        assert 0 <= start <= end <= self.length, (start, end, self.length)
        return KVBlock(self.k[:, :, start:end].clone(), self.v[:, :, start:end].clone())

    def import_kv(self, blocks: Sequence[KVBlock], state: StateSnapshot | None = None) -> None:
        """An empty cache takes `blocks`, in order, as its first committed tokens."""
        assert self.length == 0 and state is None, "import into an empty attention cache"
        self.reserve(sum(b.num_tokens for b in blocks))
        for block in blocks:
            end = self.length + block.num_tokens
            self.k[:, :, self.length : end] = block.k
            self.v[:, :, self.length : end] = block.v
            self.length = end

    def state_at(self, position: int) -> StateSnapshot | None:
        return None  # attention only: the KV rows are the whole state
