"""Per-sequence cache of a hybrid model: attention KV + Gated DeltaNet state with checkpoints.

Stage: the rollback primitive for recurrent layers (models/qwen3_next.py reads and writes it).
Attention layers keep their KV in a `KVCache` (rollback = a length). A GDN layer overwrites its
state per token, so a rejected draft cannot be un-applied; instead every forward writes the
state after each of its tokens into a checkpoint SLOT and `commit` picks one (vLLM's design):

  conv [gdn_layers, slots, K-1, C]       causal-conv window (the last K-1 inputs), model dtype
  ssm  [gdn_layers, slots, H, dk, dv]    delta-rule state, fp32
  committed                              the slot holding the state after the committed tokens

A forward over n tokens reads slot `committed` and writes the state after its token t into
slot (committed + 1 + t) % slots, so it never touches the committed state. Then
`commit(length)` with length = self.length + m selects the slot of token m - 1 (m = 0 keeps the
committed slot): O(1), no copy, whatever m is. Slots are allocated once and reused; their
number grows on demand to n + 1 for forwards of n <= MAX_CHECKPOINTS tokens (speculative
verify sizes). Longer forwards (prompt chunks) keep only their final state, so only the full
length may be committed after them. A committed token can never be rolled back (its older
states are gone): `commit` below the committed length is an error, except 0 (reset).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quickdraft.kv_cache import KVCache

# Largest forward whose every per-token state is kept: k + 1 for the largest k that
# SpeculativeConfig allows (32).
MAX_CHECKPOINTS = 33


@dataclass(frozen=True, slots=True)
class GDNStateShape:
    num_layers: int  # GDN layers in the model
    conv_dim: int  # C: channels entering the causal conv (q, k and v)
    conv_kernel: int  # K
    num_heads: int  # value heads H
    key_dim: int  # dk
    value_dim: int  # dv


class HybridCache:
    __slots__ = (
        "_written",
        "committed",
        "conv",
        "kv",
        "length",
        "shape",
        "slots",
        "ssm",
    )

    def __init__(
        self,
        num_attention_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        shape: GDNStateShape,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.kv = KVCache(num_attention_layers, num_kv_heads, head_dim, capacity, dtype, device)
        self.shape = shape
        self.slots = 2  # the committed state + one checkpoint; grown by reserve()
        s = shape
        self.conv: Tensor = torch.zeros(
            s.num_layers, self.slots, s.conv_kernel - 1, s.conv_dim, dtype=dtype, device=device
        )
        self.ssm: Tensor = torch.zeros(
            s.num_layers,
            self.slots,
            s.num_heads,
            s.key_dim,
            s.value_dim,
            dtype=torch.float32,
            device=device,
        )
        self.committed = 0
        self.length = 0
        # _written[t]: slot holding the state after token t of the last forward (-1: not kept)
        self._written: list[int] = []

    # -- the forward's side --------------------------------------------------------------------

    def reserve(self, num_new: int) -> None:
        """Before a forward of `num_new` tokens: room for their KV, and their checkpoint slots."""
        self.kv.reserve(num_new)
        kept = num_new if num_new <= MAX_CHECKPOINTS else 1
        if kept + 1 > self.slots:
            self._grow(kept + 1)
        first = num_new - kept
        self._written = [-1] * first + [(self.committed + 1 + i) % self.slots for i in range(kept)]

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Attention KV of full-attention layer `layer` (see KVCache.write)."""
        return self.kv.write(layer, k, v)

    def gdn_state(self, layer: int) -> tuple[Tensor, Tensor]:
        """The committed conv window `[K-1, C]` and SSM state `[H, dk, dv]` of GDN `layer`."""
        return self.conv[layer, self.committed], self.ssm[layer, self.committed]

    def gdn_dest(self, layer: int) -> tuple[list[Tensor | None], list[Tensor | None]]:
        """Where the forward writes the conv window / SSM state after each of its tokens."""
        conv, ssm = self.conv[layer], self.ssm[layer]
        return (
            [None if s < 0 else conv[s] for s in self._written],
            [None if s < 0 else ssm[s] for s in self._written],
        )

    # -- the caller's side ---------------------------------------------------------------------

    def commit(self, length: int) -> None:
        """Keep the first `length` tokens: the committed length or up to all of the last
        forward's tokens (the slot of token length - self.length - 1 becomes the state)."""
        kept = length - self.length
        if length == 0:
            self.conv[:, self.committed].zero_()
            self.ssm[:, self.committed].zero_()
        elif kept > 0:
            if kept > len(self._written):
                raise AssertionError(
                    f"commit({length}): the last forward wrote tokens up to "
                    f"{self.length + len(self._written)}, committed length is {self.length}"
                )
            slot = self._written[kept - 1]
            if slot < 0:
                raise AssertionError(
                    f"commit({length}): no recurrent checkpoint inside a forward of "
                    f"{len(self._written)} tokens (> {MAX_CHECKPOINTS}); only "
                    f"{self.length + len(self._written)} can be committed"
                )
            self.committed = slot
        elif kept < 0:
            raise AssertionError(
                f"commit({length}) below the committed length {self.length}: recurrent state "
                "rolls back only within the last forward"
            )
        self.kv.commit(length)
        self.length = length
        self._written = []

    trim = commit

    def nbytes(self) -> int:
        return self.kv.nbytes() + self.conv.nbytes + self.ssm.nbytes

    def _grow(self, slots: int) -> None:
        """More checkpoint slots; the committed state moves to slot 0 (one copy, rare)."""
        conv = self.conv.new_zeros(self.conv.shape[0], slots, *self.conv.shape[2:])
        ssm = self.ssm.new_zeros(self.ssm.shape[0], slots, *self.ssm.shape[2:])
        conv[:, 0] = self.conv[:, self.committed]
        ssm[:, 0] = self.ssm[:, self.committed]
        self.conv, self.ssm, self.slots, self.committed = conv, ssm, slots, 0
