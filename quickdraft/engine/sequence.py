"""One request inside the engine: where it is (waiting, running, finished) and how far its
tokens have been through the target.

Token bookkeeping only: the prompt and output ids live on the `Request`, the KV (or hybrid)
cache holds what the target has computed, and a speculating request's drafter state and
acceptance live in its `SpecState` (speculation/state.py), which this record only carries; so
does its place in the prefix cache (engine/prefix_cache.py).
A sequence's pending tokens are `all_ids[num_computed:]`: the rest of the prompt while
prefilling, exactly one token (the last committed) while decoding, so prefill and decode are
the same operation.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from quickdraft.engine.prefix_cache import PrefixCursor
from quickdraft.models.base import SequenceCache
from quickdraft.request import Request
from quickdraft.speculation.logits import LogitControls
from quickdraft.speculation.sampling import TokenRng
from quickdraft.speculation.state import AnySpeculation, SpecState


class SeqStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request: Request
    speculation: AnySpeculation | None  # what it was submitted with (None: no speculation)
    rng: TokenRng  # the request's sampling randomness (verify and drafters draw from it)
    spec: SpecState | None = None  # its share of `speculation`, from admission until it leaves
    status: SeqStatus = SeqStatus.WAITING
    cache: SequenceCache | None = None  # allocated on admission, dropped when it leaves
    error: BaseException | None = None  # why the request failed, if it did
    controls: LogitControls | None = None  # bias / penalties / grammar, if the request has any
    prefix: PrefixCursor | None = None  # its path in the prefix cache, while it runs
    cached_tokens: int = 0  # prompt tokens the prefix cache served (set at admission)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.request.output_ids)

    @property
    def num_computed(self) -> int:
        """Committed tokens whose KV is in the cache."""
        return 0 if self.cache is None else self.cache.length

    @property
    def pending(self) -> int:
        """Committed tokens not yet run through the target (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def decoding(self) -> bool:
        return self.pending == 1 and bool(self.request.output_ids)
