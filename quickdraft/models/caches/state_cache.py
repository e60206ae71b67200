"""Per-sequence cache of a hybrid model: attention KV + Gated DeltaNet state with checkpoints.

Stage: the rollback primitive for recurrent layers (models/families/qwen3_next.py reads and writes
it). Attention layers keep their KV in a `KVCache` (rollback = a length). A GDN layer overwrites its
state per token, so a rejected draft cannot be un-applied; instead a forward never touches the
committed state and keeps, for each of its tokens, what it takes to reach the state after that
token. Per GDN layer:

  conv [2, K-1, C], ssm [2, H, dk, dv]   the committed conv window / delta-rule state (fp32)
                                         in slot `committed`; the other slot receives the final
                                         state of a long forward (a prompt chunk)
  checkpoint slots, one per token t of a forward of n <= MAX_CHECKPOINTS tokens (a decode
  step or a verify of k + 1), pre-allocated and reused:
      inputs [t, C]                      its conv input (the window after t = last K-1 inputs)
      k [H, t, dk], d [H, t, dv], g [H, t]   its delta-rule update (kernels/gdn.py)

`commit(length)` keeps m = length - self.length tokens of the last forward in O(1): after a
short forward it records m (the m updates are applied to the committed state, token by token,
when the next forward first reads that layer: one pass over the state whatever m is, and the
same arithmetic the verify used for its in-chunk states); after a long forward only m = n (swap
the slots) or m = 0 are
possible. m = 0 keeps the committed state as it was. Committed tokens can never be rolled back
(older states are gone): commit below the committed length is an error, except 0 (reset).
A forward that fails half-way leaves the committed state intact: applying a pending update is
value-preserving and nothing else is written to it.

vLLM keeps k + 1 full state snapshots per request (a slot per verified token); keeping the
updates instead makes a checkpoint a few KB rather than the whole state (MBs per layer) and
keeps a verify's state traffic equal to a decode step's.

Prefix cache (engine/prefix_cache.py): the recurrent state cannot be cut back, so the prefix
cache keeps snapshots of it at block boundaries. `state_at(p)` copies the state after token p
for any p the last commit reached (the committed slot after a long forward; the committed state
advanced by the first m kept updates after a short one: the bits the next forward will
compute); `import_kv` resumes a fresh cache from KV blocks and a snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from quickdraft.kernels.attention import Paged
from quickdraft.kernels.gdn import DeltaUpdates, advance_state, conv_window
from quickdraft.kernels.linear_bf16 import streamed_zeros
from quickdraft.models.base import KVBlock, StateSnapshot
from quickdraft.models.caches.kv_cache import KVCache

# Largest forward whose every token can be committed: k + 1 for the largest k that
# SpeculativeConfig allows (32). Longer forwards (prompt chunks) keep only their final state.
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
        "_forward",
        "_long",
        "committed",
        "conv",
        "cp_d",
        "cp_g",
        "cp_inputs",
        "cp_k",
        "kv",
        "length",
        "pending",
        "shape",
        "ssm",
    )
    recurrent = True

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
        s = shape
        self.kv = KVCache(num_attention_layers, num_kv_heads, head_dim, capacity, dtype, device)
        self.shape = shape
        f32 = torch.float32
        self.conv: Tensor = torch.zeros(
            s.num_layers, 2, s.conv_kernel - 1, s.conv_dim, dtype=dtype, device=device
        )
        self.ssm: Tensor = streamed_zeros(
            (s.num_layers, 2, s.num_heads, s.key_dim, s.value_dim), f32, device
        )
        self.committed = 0  # slot of conv / ssm holding the committed state
        slots = 1 + 4  # a decode step and a verify of k = 4 without growing
        self.cp_inputs: Tensor = torch.empty(
            s.num_layers, slots, s.conv_dim, dtype=dtype, device=device
        )
        self.cp_k: Tensor = torch.empty(
            s.num_layers, s.num_heads, slots, s.key_dim, dtype=f32, device=device
        )
        self.cp_d: Tensor = torch.empty(
            s.num_layers, s.num_heads, slots, s.value_dim, dtype=f32, device=device
        )
        self.cp_g: Tensor = torch.empty(s.num_layers, s.num_heads, slots, dtype=f32, device=device)
        # pending[g]: tokens of the checkpoint slots committed but not yet applied to layer g
        self.pending = [0] * s.num_layers
        self.length = 0
        self._forward = 0  # tokens of the last forward (0: none since the last commit)
        self._long = False  # the last forward kept only its final state

    # -- the forward's side --------------------------------------------------------------------

    def reserve(self, num_new: int) -> None:
        """Before a forward of `num_new` tokens: room for their KV and their checkpoints."""
        self.kv.reserve(num_new)
        self._forward = num_new
        self._long = num_new > MAX_CHECKPOINTS
        if not self._long and num_new > self.cp_k.shape[2]:
            self._grow(num_new)

    @property
    def keeps_checkpoints(self) -> bool:
        """The running forward keeps every token's update (else only its final state)."""
        return not self._long

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor | Paged, Tensor | Paged]:
        """Attention KV of full-attention layer `layer` (see KVCache.write)."""
        return self.kv.write(layer, k, v)

    def gdn_state(self, layer: int) -> tuple[Tensor, Tensor]:
        """The committed conv window `[K-1, C]` and SSM state `[H, dk, dv]` of GDN `layer`
        (applying its pending committed update first). Read only for the forward."""
        conv, ssm, pending = self.gdn_state_deferred(layer)
        if pending is not None:
            advance_state(ssm, pending.k, pending.d, pending.g)
        return conv, ssm

    def gdn_state_deferred(self, layer: int) -> tuple[Tensor, Tensor, DeltaUpdates | None]:
        """`gdn_state` for a forward that advances the SSM state itself: the conv window with
        its pending inputs applied, the SSM state NOT yet advanced, and the pending updates
        (None: none) that the caller must apply to it in place (`recurrent_updates` does, in
        its pass over the state) before anything else reads it."""
        conv, ssm = self.conv[layer, self.committed], self.ssm[layer, self.committed]
        m = self.pending[layer]
        if not m:
            return conv, ssm, None
        conv.copy_(conv_window(conv, self.cp_inputs[layer, :m]))
        self.pending[layer] = 0
        updates = DeltaUpdates(
            self.cp_k[layer, :, :m], self.cp_d[layer, :, :m], self.cp_g[layer, :, :m]
        )
        return conv, ssm, updates

    def keep_checkpoints(self, layer: int, inputs: Tensor, updates: DeltaUpdates) -> None:
        """Store the forward's per-token conv inputs [n, C] and delta-rule updates."""
        n = inputs.shape[0]
        self.cp_inputs[layer, :n] = inputs
        self.cp_k[layer, :, :n] = updates.k
        self.cp_d[layer, :, :n] = updates.d
        self.cp_g[layer, :, :n] = updates.g

    def final_state(self, layer: int) -> tuple[Tensor, Tensor]:
        """Where a long forward writes its final conv window / SSM state (the spare slot)."""
        spare = 1 - self.committed
        return self.conv[layer, spare], self.ssm[layer, spare]

    # -- the caller's side ---------------------------------------------------------------------

    def commit(self, length: int) -> None:
        """Keep the first `length` tokens: the committed length or up to all of the last
        forward's tokens. O(1)."""
        kept = length - self.length
        if length == 0:
            self.conv[:, self.committed].zero_()
            self.ssm[:, self.committed].zero_()
            self.pending = [0] * len(self.pending)
        elif kept > 0:
            if kept > self._forward:
                raise AssertionError(
                    f"commit({length}): the last forward wrote tokens up to "
                    f"{self.length + self._forward}, committed length is {self.length}"
                )
            assert not any(self.pending), "a forward reads (and so applies) every layer"
            if not self._long:
                self.pending = [kept] * len(self.pending)
            elif kept == self._forward:
                self.committed = 1 - self.committed
            else:
                raise AssertionError(
                    f"commit({length}): no recurrent checkpoint inside a forward of "
                    f"{self._forward} tokens (> {MAX_CHECKPOINTS}); only "
                    f"{self.length + self._forward} can be committed"
                )
        elif kept < 0:
            raise AssertionError(
                f"commit({length}) below the committed length {self.length}: recurrent state "
                "rolls back only within the last forward"
            )
        self.kv.commit(length)
        self.length = length
        self._forward = 0

    trim = commit

    def nbytes(self) -> int:
        cps = (self.cp_inputs, self.cp_k, self.cp_d, self.cp_g)
        return self.kv.nbytes() + self.conv.nbytes + self.ssm.nbytes + sum(t.nbytes for t in cps)

    # -- the prefix cache's side ---------------------------------------------------------------

    def export_kv(self, start: int, end: int) -> KVBlock:
        return self.kv.export_kv(start, end)

    def import_kv(self, blocks: Sequence[KVBlock], state: StateSnapshot | None = None) -> None:
        """An empty cache takes `blocks` as its first tokens and `state`, the recurrent state
        after them (required unless there are no blocks)."""
        assert self.length == 0 and self._forward == 0, "import into an empty cache"
        if not blocks:
            return
        assert state is not None, "a recurrent cache resumes only from a state snapshot"
        self.kv.import_kv(blocks)
        self.conv[:, self.committed].copy_(state.conv)
        self.ssm[:, self.committed].copy_(state.ssm)
        self.pending = [0] * len(self.pending)
        self.length = self.kv.length

    def state_at(self, position: int) -> StateSnapshot | None:
        """The state after the first `position` tokens if the last commit reached it: the
        committed state with the first m of its layer's pending updates applied (to a copy),
        as the next forward's `gdn_state` will apply them. None for an older position."""
        base = [self.length - pending for pending in self.pending]
        if not all(b <= position <= self.length for b in base):
            return None
        conv = self.conv[:, self.committed].clone()  # [G, K-1, C]
        ssm = self.ssm[:, self.committed].clone()  # [G, H, dk, dv]
        for g, start in enumerate(base):
            m = position - start
            if m:
                advance_state(ssm[g], self.cp_k[g, :, :m], self.cp_d[g, :, :m], self.cp_g[g, :, :m])
                conv[g] = conv_window(conv[g], self.cp_inputs[g, :m])
        return StateSnapshot(conv, ssm)

    def _grow(self, slots: int) -> None:
        """More checkpoint slots (rare: a larger k). Pending updates are kept."""
        for name, dim in (("cp_inputs", 1), ("cp_k", 2), ("cp_d", 2), ("cp_g", 2)):
            old: Tensor = getattr(self, name)
            shape = list(old.shape)
            shape[dim] = slots
            grown = old.new_empty(shape)
            grown.narrow(dim, 0, old.shape[dim]).copy_(old)
            setattr(self, name, grown)
