"""What the engine, drafters and benchmarks may assume of any model and its per-sequence cache.

Every model file (llama.py for dense decoders, hybrid files later) implements `LanguageModel`;
nothing outside `models/` names a concrete model class. A forward runs N new tokens of one or
more sequences packed together (prefill, decode, or a k+1-token verify) and writes their cache
entries past `cache.length` WITHOUT moving it; the caller then `commit`s the length it keeps.
Committing fewer tokens than the forward wrote is the rollback, O(1) for every cache kind
(attention KV: a length; recurrent state: a checkpoint slot).

For the prefix cache (engine/prefix_cache.py) a cache also hands the KV of committed tokens out
(`export_kv`, an immutable `KVBlock`) and a fresh cache takes such blocks as its first tokens
(`import_kv`: by reference where its attention reads blocks in place, models/caches/kv_cache.py); a
recurrent cache cannot be cut back, so it also hands out the state after a recent position
(`state_at`, a `StateSnapshot`) and resumes from one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from quickdraft.images import ImageRows


@dataclass(slots=True)
class ForwardOutput:
    logits: Tensor  # [len(logit_rows), vocab] fp32
    hidden: Tensor | None = None  # [num_tokens, hidden] post-final-norm, if asked for
    # [num_tokens, len(hidden_layers), hidden]: the outputs of the decoder layers listed in
    # `hidden_layers` (0-based), if any were asked for: HF's output_hidden_states[i + 1], so
    # the last layer's after the final norm (models/layers.py `tapped_layers`)
    layers: Tensor | None = None


def refuse_images(model: Any, images: ImageRows | None) -> None:
    """A model without a vision path: image input is an error, never silently dropped."""
    if images is not None:
        raise ValueError(f"{type(model).__name__} takes no image input")


@dataclass(frozen=True, slots=True)
class KVBlock:
    """Attention KV of a run of committed tokens, copied out of a sequence's cache and never
    written again (sequences that import it may read it in place): k, v `[num_layers,
    num_kv_heads, tokens, head_dim]`, rows contiguous; possibly token ranges of one larger
    tensor (the blocks one commit made whole: engine/prefix_cache.py)."""

    k: Tensor
    v: Tensor

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """The recurrent (GDN) state of every recurrent layer after some token, copied:
    conv windows `[layers, K-1, C]` and delta-rule states `[layers, H, dk, dv]` (fp32)."""

    conv: Tensor
    ssm: Tensor

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


class SequenceCache(Protocol):
    """The cache of one sequence. `length` = committed tokens."""

    length: int

    @property
    def recurrent(self) -> bool:
        """It holds recurrent state (cannot be cut back to an arbitrary length)."""
        ...

    def reserve(self, num_new: int) -> None:
        """Make room for `num_new` tokens past `length` (called by the model's forward)."""
        ...

    def commit(self, length: int) -> None:
        """Keep the first `length` tokens: append (after a forward) and rollback alike."""
        ...

    def nbytes(self) -> int: ...

    def export_kv(self, start: int, end: int) -> KVBlock:
        """The KV of committed tokens [start, end), never written again (a copy, or a block
        the cache itself imported)."""
        ...

    def import_kv(self, blocks: Sequence[KVBlock], state: StateSnapshot | None = None) -> None:
        """An empty cache takes `blocks` as its first tokens, committed; a recurrent cache also
        takes `state`, the recurrent state after them."""
        ...

    def state_at(self, position: int) -> StateSnapshot | None:
        """A copy of the recurrent state after the first `position` tokens, if it can still be
        had: `position` within the last commit (None otherwise, and for attention-only caches)."""
        ...


def packed_positions(
    caches: Sequence[SequenceCache], num_new: Sequence[int], context: int, device: torch.device
) -> Tensor:
    """Start of every model forward: refuse a sequence that would outgrow the `context`, make
    room in each cache, and return the positions of the packed new tokens `[sum(num_new)]`."""
    for cache, n in zip(caches, num_new, strict=True):
        if cache.length + n > context:
            raise ValueError(
                f"sequence of {cache.length + n} tokens exceeds the model context ({context})"
            )
        cache.reserve(n)
    if len(caches) == 1:
        return torch.arange(caches[0].length, caches[0].length + num_new[0], device=device)
    return torch.cat(
        [
            torch.arange(c.length, c.length + n, device=device)
            for c, n in zip(caches, num_new, strict=True)
        ]
    )


def module_of(model: Any) -> nn.Module:
    """The torch module holding a model's parameters: the model itself, or the one a device
    wrapper runs (models/graphs.py's GraphModel keeps it as `inner`)."""
    inner = getattr(model, "inner", model)
    assert isinstance(inner, nn.Module), "model classes are torch modules"
    return inner


class ModelShape(Protocol):
    """The config fields code outside the model reads."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class LanguageModel(Protocol):
    config: ModelShape
    dtype: torch.dtype
    device: torch.device

    def new_cache(self, capacity: int) -> SequenceCache:
        """An empty cache with room for `capacity` tokens (it grows past that on demand)."""
        ...

    def pack_(self) -> None:
        """bf16 GEMM operands -> the panel layout the CPU kernel streams (same values)."""
        ...

    def quantize_(self, fmt: str) -> None:
        """GEMM operands -> `fmt` ("int8" / "int4") in place; ValueError where unsupported."""
        ...

    def restrict_vocab_(self, keep: int, extra: Sequence[int] = ()) -> None:
        """Score only token ids [0, keep) and `extra`, -inf for the rest (a draft model)."""
        ...

    @property
    def vocab_kept(self) -> int | None:
        """Token ids the head scores after `restrict_vocab_`, else None."""
        ...

    def __call__(
        self,
        input_ids: Tensor,  # [N] new tokens of all sequences, packed in `caches` order
        caches: Sequence[SequenceCache],
        num_new: Sequence[int],  # new tokens per sequence; sums to N
        logit_rows: Tensor | None = None,  # rows of N to score; default: last row of each seq
        return_hidden: bool = False,
        hidden_layers: Sequence[int] = (),  # decoder layers whose outputs to return (`layers`)
        images: ImageRows | None = None,  # image rows and M-RoPE positions (VLM targets only)
    ) -> ForwardOutput: ...
