"""The Drafter protocol: what every drafter (n-gram, draft model, MTP head, block drafter) does.

Per request, a drafter keeps a state object. The engine calls, per speculative cycle:
  propose(state, tokens, k, params, generator) -> Draft   guess up to k next tokens
  commit(state, tokens)                                    sync to the committed tokens
and free(state) when the request ends. `tokens` is always the full committed sequence
(prompt + output); a drafter trims or extends its own state to match it, so rejected guesses,
the target's recovered/bonus token and phases where speculation was off (k = 0) all resync the
same way, and no separate undo path exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from quickdraft.sampling import SamplingParams


@dataclass(slots=True)
class Draft:
    tokens: list[int]  # d_1..d_k proposed ids (len <= requested k; may be empty)
    p_draft: Tensor | None = None  # [len(tokens), vocab] draft distributions; None = one-hot


class Drafter(Protocol):
    name: str

    def new_state(self, prompt_ids: list[int]) -> Any: ...

    def propose(
        self,
        state: Any,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft: ...

    def commit(self, state: Any, tokens: list[int]) -> None: ...

    def free(self, state: Any) -> None: ...
