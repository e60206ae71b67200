"""Draft-model drafter: a small model with the target's tokenizer proposes k tokens greedily or
by sampling (then its distributions go to rejection sampling).

State per request: its own KVCache and the list of tokens whose KV that cache holds. `propose`
first syncs each cache to its committed tokens — trim to the common prefix (O(1) rollback), feed
the tokens it has not seen (the target's recovered/bonus token, anything committed while
speculation was off) — then runs k-1 more one-token steps. The requests of one engine step go
through the draft model together, packed into one forward per draft position, so a batch of B
requests streams the draft weights k times, not B x k times. No re-prefill, ever.

A draft model with recurrent layers (a small Qwen3.5 for a larger one) cannot commit its drafts
one step at a time: its Gated-DeltaNet state rolls back only within the last forward
(models/caches/state_cache.py). Its chain therefore commits nothing: draft position j runs the j - 1
drafts so far as one forward from the committed state (on a CPU as cheap as one row: the weights
stream once), and after the verify `commit` keeps the accepted drafts out of that last forward in
O(1); the next propose feeds the committed tokens the draft has not seen (the bonus token, or the
last draft and the bonus) and commits them.

Image turns: a text-only draft model sees an image's rows as their placeholder ids at plain
positions. A draft model that is a vision-language model of the target's family (a smaller
Qwen2.5-VL for a larger one) gets the image: its own tower encodes it (`encoder`, cached by
digest), and its forwards take those rows and the target's M-RoPE positions (the layouts agree:
the same preprocessing and merge size, checked at load).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from quickdraft.config import PREFILL_CHUNK
from quickdraft.image_encoder import ImageEncoder
from quickdraft.images import ImageLayout, ImageRows, pack_image_rows
from quickdraft.kernels.pointwise import greedy_pick
from quickdraft.models.base import LanguageModel, SequenceCache
from quickdraft.speculation.cost import StepShape
from quickdraft.speculation.drafters.base import Draft, DraftBlock, DraftJob, draft_position


@dataclass(slots=True)
class DraftState:
    cache: SequenceCache
    fed: list[int] = field(default_factory=list)  # tokens whose KV is in `cache`
    stable: int = 0  # fed[:stable] are committed tokens: they never change, skip comparing them
    # the request's images as this draft model sees them (its own tower's embeddings); None:
    # a text-only request, or a text-only draft model
    layout: ImageLayout | None = None
    # a recurrent draft model: the drafts of its last forward, run but not committed
    pending: list[int] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelDrafter:
    needs_hidden = False
    hidden_history = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        model: LanguageModel,
        target_vocab_size: int,
        encoder: ImageEncoder | None = None,  # a vision-language draft model's own tower
    ) -> None:
        # The target's embedding table may be padded past the tokenizer (Qwen: 151936 rows for
        # 151665 tokens); what must agree is every id either model can emit.
        if model.config.vocab_size != target_vocab_size:
            raise ValueError(
                f"draft model vocabulary ({model.config.vocab_size}) differs from the target's "
                f"({target_vocab_size}): a draft model must share the target's tokenizer"
            )
        # a recurrent state rolls back only within the last forward: the chain commits nothing
        self.recurrent = model.new_cache(1).recurrent
        self.model = model
        self.encoder = encoder
        self.forwards: list[StepShape] = []  # the forwards of the last propose (drafters/base.py)
        # greedy chains of a fixed length run on the device without reading a token back until
        # their end (`_device_chain`): on a GPU, where each read is a sync
        self.device_chain = model.device.type == "cuda" and not self.recurrent

    def new_state(self, prompt_ids: list[int], tenant: str = "") -> DraftState:
        # nothing crosses requests: the tenant does not matter
        return DraftState(self.model.new_cache(len(prompt_ids) + 64))

    def _sync_rows(self, state: DraftState, tokens: list[int]) -> list[int]:
        """Trim the cache to what it shares with `tokens` (O(1)) and return the tokens it must
        still be fed: at least the last one, whose logits the first draft comes from."""
        if self.recurrent:  # every token fed is committed; `commit` kept one unfed
            if state.pending:
                self.commit(state, tokens)
            assert len(state.fed) < len(tokens), "the draft state is ahead of the request"
            return tokens[len(state.fed) :]
        keep = min(common_prefix(state.fed, tokens, state.stable), len(tokens) - 1)
        state.stable = min(state.stable, keep)
        state.cache.commit(keep)
        del state.fed[keep:]
        return tokens[keep:]

    def _attach_images(self, state: DraftState, job: DraftJob) -> None:
        """A vision-language draft model's view of `job`'s images, made once per request."""
        if self.encoder is None or job.images is None or state.layout is not None:
            return
        target = job.images
        state.layout = ImageLayout(
            target.spans,
            target.positions,
            target.delta,
            [None] * len(target.spans),
            target.two_way,
        )
        self.encoder.fill(state.layout)

    def _images(self, states: Sequence[DraftState], num_new: Sequence[int]) -> ImageRows | None:
        if self.encoder is None:
            return None
        return pack_image_rows(
            [s.layout for s in states],
            [s.cache.length for s in states],
            num_new,
            self.model.config.hidden_size,
            self.model.device,
        )

    def _run(self, states: Sequence[DraftState], rows: list[list[int]]) -> torch.Tensor:
        """One packed forward of each state's `rows` past its cache, committing nothing;
        returns the logits after each state's last row `[len(states), vocab]`."""
        ids = torch.tensor([t for r in rows for t in r], device=self.model.device)
        num_new = [len(r) for r in rows]
        out = self.model(
            ids, [s.cache for s in states], num_new, images=self._images(states, num_new)
        )
        self.forwards.append(StepShape(len(ids), len(rows), sum(n > 1 for n in num_new)))
        logits: torch.Tensor = out.logits
        return logits

    def _feed(self, states: list[DraftState], rows: list[list[int]]) -> torch.Tensor:
        """`_run`, then the rows are committed into the caches."""
        logits = self._run(states, rows)
        for state, r in zip(states, rows, strict=True):
            state.cache.commit(state.cache.length + len(r))
            state.fed.extend(r)
        return logits

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        """All jobs advance together: one packed forward brings every draft cache up to its
        committed tokens (long catch-ups in chunks first), then one packed one-token forward
        per draft position for the jobs that still want more."""
        self.forwards = []
        states: list[DraftState] = [job.state for job in jobs]
        for state, job in zip(states, jobs, strict=True):
            self._attach_images(state, job)
        rows = [self._sync_rows(s, job.tokens) for s, job in zip(states, jobs, strict=True)]
        # Catch-ups longer than a chunk (a prompt, a long k = 0 phase) go first, chunk by chunk,
        # so the packed forward below stays small.
        for state, r in zip(states, rows, strict=True):
            while len(r) > PREFILL_CHUNK:
                self._feed([state], [r[:PREFILL_CHUNK]])
                del r[:PREFILL_CHUNK]
        logits = self._feed(states, rows)  # [B, vocab]
        if self.recurrent:
            return self._uncommitted_chain(jobs, states, logits)
        if self.device_chain and all(
            job.params.greedy and job.controls is None and job.min_prob <= 0.0 for job in jobs
        ):
            return self._device_chain(jobs, states, logits)
        drafts: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in jobs]
        chains = [1.0] * len(jobs)  # each draft's probability so far, by the draft model
        active = list(range(len(jobs)))  # jobs (indices) whose logits row is in `logits`
        while True:
            active = [active[r] for r in draft_position(logits, jobs, active, drafts, chains)]
            if not active:
                break
            logits = self._feed([states[j] for j in active], [[drafts[j][0][-1]] for j in active])
        return [Draft(d, torch.stack(p) if p else None) for d, p in drafts]

    def _uncommitted_chain(
        self, jobs: Sequence[DraftJob], states: list[DraftState], logits: torch.Tensor
    ) -> list[Draft]:
        """`propose`'s draft positions for a recurrent draft model: position j runs the drafts
        so far as one forward from the committed state, committing nothing; each state keeps
        the drafts its last forward ran (`pending`) for `commit`."""
        drafts: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in jobs]
        chains = [1.0] * len(jobs)
        active = list(range(len(jobs)))
        while True:
            active = [active[r] for r in draft_position(logits, jobs, active, drafts, chains)]
            if not active:
                break
            logits = self._run([states[j] for j in active], [drafts[j][0] for j in active])
        for state, (tokens, _) in zip(states, drafts, strict=True):
            state.pending = tokens[:-1]  # the last forward ran every draft but the last
        return [Draft(d, torch.stack(p) if p else None) for d, p in drafts]

    def _device_chain(
        self, jobs: Sequence[DraftJob], states: list[DraftState], logits: torch.Tensor
    ) -> list[Draft]:
        """`propose`'s draft positions for greedy jobs that draft exactly k tokens with no logit
        controls: each position's argmax stays on the device and is the next forward's input,
        and the tokens are read back once, at the end (one sync per propose, not one per
        token). The forwards are the ones the per-token loop runs, so are the drafts."""
        ks = [job.k for job in jobs]
        chain = getattr(self.model, "greedy_chain", None)
        if chain is not None and len(set(ks)) == 1 and ks[0] > 1 and self.encoder is None:
            return self._graph_chain(chain, states, logits, ks[0])
        picks = [greedy_pick(logits)[0]]  # per position: the argmax of the jobs drafting there
        at = [list(range(len(jobs)))]  # per position: those jobs, in `picks` order
        for step in range(1, max(ks)):
            active = [j for j in at[-1] if ks[j] > step]
            where = torch.tensor([at[-1].index(j) for j in active], device=logits.device)
            ids = picks[-1].index_select(0, where)
            chain = [states[j] for j in active]
            ones = [1] * len(active)
            out = self.model(ids, [s.cache for s in chain], ones, images=self._images(chain, ones))
            self.forwards.append(StepShape(len(active), len(active)))
            for j in active:
                states[j].cache.commit(states[j].cache.length + 1)
            picks.append(greedy_pick(out.logits)[0])
            at.append(active)
        values = torch.cat(picks).tolist()  # the one read back
        tokens: list[list[int]] = [[] for _ in jobs]
        for jobs_at, start in zip(at, itertools.accumulate([0, *map(len, at)]), strict=False):
            for offset, j in enumerate(jobs_at):
                tokens[j].append(values[start + offset])
        for state, drafted in zip(states, tokens, strict=True):
            state.fed.extend(drafted[:-1])  # every draft but the last was fed
        return [Draft(t) for t in tokens]

    def _graph_chain(
        self, chain: Any, states: list[DraftState], logits: torch.Tensor, k: int
    ) -> list[Draft]:
        """`_device_chain` where every job drafts k tokens and the model runs its k - 1 steps as
        one call (GraphModel.greedy_chain: one captured graph on a GPU)."""
        first = greedy_pick(logits)[0]
        rest = chain(first, [s.cache for s in states], k - 1)  # [k - 1, B]
        self.forwards.extend([StepShape(len(states), len(states))] * (k - 1))
        values = torch.cat([first[None], rest]).T.tolist()  # the one read back
        for state, drafted in zip(states, values, strict=True):
            state.cache.commit(state.cache.length + k - 1)
            state.fed.extend(drafted[:-1])
        return [Draft(t) for t in values]

    def commit(
        self, state: DraftState, tokens: list[int], hidden: torch.Tensor | None = None
    ) -> None:
        # Roll back now what the target rejected (O(1)); the new tokens are fed at next propose.
        if self.recurrent:  # keep the accepted drafts of the last forward, one token unfed
            base, kept = len(state.fed), 0
            while (
                kept < len(state.pending)
                and base + kept < len(tokens) - 1
                and tokens[base + kept] == state.pending[kept]
            ):
                kept += 1
            state.cache.commit(base + kept)
            state.fed.extend(state.pending[:kept])
            state.pending = []
            state.stable = len(state.fed)
            return
        keep = common_prefix(state.fed, tokens, state.stable)
        state.cache.commit(keep)
        del state.fed[keep:]
        state.stable = keep

    def free(self, state: DraftState) -> None:
        state.fed.clear()
        state.pending.clear()

    def export_block(self, state: DraftState, start: int, ids: Sequence[int]) -> DraftBlock | None:
        end = start + len(ids)
        # fed[:stable] are committed tokens whose KV the cache holds (set by commit)
        if end > min(state.stable, state.cache.length) or state.cache.recurrent:
            return None
        assert state.fed[start:end] == list(ids), "the draft KV is of other tokens"
        return DraftBlock(state.cache.export_kv(start, end))

    def import_blocks(
        self, state: DraftState, tokens: list[int], blocks: Sequence[DraftBlock], block_size: int
    ) -> int:
        assert state.cache.length == 0 and not state.fed, "a new request's state"
        state.cache.import_kv([b.kv for b in blocks])
        state.stable = state.cache.length
        state.fed = tokens[: state.stable]
        return state.stable
