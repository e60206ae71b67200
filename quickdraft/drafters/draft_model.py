"""Draft-model drafter: a small model with the target's tokenizer proposes k tokens greedily or
by sampling (then its distributions go to rejection sampling).

State per request: its own KVCache and the list of tokens whose KV that cache holds. `propose`
first syncs that cache to the committed tokens — trim to the common prefix (O(1) rollback), feed
the tokens it has not seen (the target's recovered/bonus token, anything committed while
speculation was off) in one forward — then runs k-1 more one-token steps. No re-prefill, ever.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quickdraft.drafters.base import Draft
from quickdraft.models.base import LanguageModel, SequenceCache
from quickdraft.sampling import SamplingParams, probabilities, sample

PREFILL_CHUNK = 512


@dataclass(slots=True)
class DraftState:
    cache: SequenceCache
    fed: list[int] = field(default_factory=list)  # tokens whose KV is in `cache`
    stable: int = 0  # fed[:stable] are committed tokens: they never change, skip comparing them


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelDrafter:
    name = "draft"
    needs_hidden = False

    def __init__(self, model: LanguageModel, target_vocab_size: int) -> None:
        # The target's embedding table may be padded past the tokenizer (Qwen: 151936 rows for
        # 151665 tokens); what must agree is every id either model can emit.
        if model.config.vocab_size != target_vocab_size:
            raise ValueError(
                f"draft model vocabulary ({model.config.vocab_size}) differs from the target's "
                f"({target_vocab_size}): a draft model must share the target's tokenizer"
            )
        self.model = model

    def new_state(self, prompt_ids: list[int]) -> DraftState:
        return DraftState(self.model.new_cache(len(prompt_ids) + 64))

    def _sync(self, state: DraftState, tokens: list[int]) -> torch.Tensor:
        """Feed the cache what it lacks of `tokens` (at least the last token, whose logits we
        need) and return the logits after tokens[-1]: `[1, vocab]`."""
        # re-feed at least the last token: its logits are what the first draft comes from
        keep = min(common_prefix(state.fed, tokens, state.stable), len(tokens) - 1)
        state.stable = min(state.stable, keep)
        state.cache.commit(keep)
        del state.fed[keep:]
        out = None
        for start in range(keep, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            out = self.model(
                torch.tensor(chunk, device=self.model.device), [state.cache], [len(chunk)]
            )
            state.cache.commit(state.cache.length + len(chunk))
            state.fed.extend(chunk)
        assert out is not None
        return out.logits[-1:]  # [1, vocab]

    def propose(
        self,
        state: DraftState,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        if k == 0:
            return Draft([])
        logits = self._sync(state, tokens)
        drafted: list[int] = []
        dists: list[torch.Tensor] = []
        for i in range(k):
            if params.greedy:
                tok = int(logits[0].argmax())
            else:
                p_draft = probabilities(logits, params)  # [1, vocab]
                tok = int(sample(p_draft, generator)[0])
                dists.append(p_draft[0])
            drafted.append(tok)
            if i == k - 1:
                break
            out = self.model(torch.tensor([tok], device=self.model.device), [state.cache], [1])
            state.cache.commit(state.cache.length + 1)
            state.fed.append(tok)
            logits = out.logits
        return Draft(drafted, torch.stack(dists) if dists else None)

    def commit(
        self, state: DraftState, tokens: list[int], hidden: torch.Tensor | None = None
    ) -> None:
        # Roll back now what the target rejected (O(1)); the new tokens are fed at next propose.
        keep = common_prefix(state.fed, tokens, state.stable)
        state.cache.commit(keep)
        del state.fed[keep:]
        state.stable = keep

    def free(self, state: DraftState) -> None:
        state.fed.clear()
