"""Single-stream generation: load a model by name/path, then prefill + decode one request.

Stage: the decode loop used by `quickdraft generate` and the benchmarks. One cycle:
    k = policy.choose()                      (0 when speculation is off or cannot pay)
    draft = drafter.propose([job(tokens, k)])
    out = target([last, d_1..d_k])          one forward, k+1 logit rows
    verdict = verify(draft, out)             accepted drafts + one recovered/bonus token
    cache.commit(length + 1 + accepted)      rollback of the rejected rows is this commit
    request.append(verdict.tokens); drafter.commit(tokens, hidden of the kept rows)
Plain decoding is the same cycle with k = 0, so both paths share every line.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quickdraft import hub
from quickdraft.config import parse_dtype
from quickdraft.drafters.base import Draft, DraftJob
from quickdraft.models.base import ForwardOutput, LanguageModel, SequenceCache
from quickdraft.models.loader import load_model
from quickdraft.policy import AdaptiveK, measure_verify_cost
from quickdraft.request import Request
from quickdraft.sampling import SamplingParams, probabilities
from quickdraft.tokenizer import Tokenizer
from quickdraft.verify import Verdict, verify_greedy, verify_sampled

if TYPE_CHECKING:
    from quickdraft.speculate import Speculation

PREFILL_CHUNK = 512  # bounds the [chunk, context] attention mask and activations of long prompts


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    dtype_name: str
    model: LanguageModel
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    _verify_cost: list[float] = field(default_factory=list)

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings

    def new_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str = ""
    ) -> Request:
        total = len(prompt_ids) + params.max_tokens
        if total > self.context_length:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model context of {self.context_length} tokens"
            )
        return Request(prompt_ids, params, self.tokenizer, self.eos_ids, request_id)

    def verify_cost(self, max_tokens: int) -> list[float]:
        """Measured cost of a forward over n tokens relative to 1 (n = 1..max_tokens); cached."""
        if len(self._verify_cost) <= max_tokens:
            self._verify_cost = measure_verify_cost(self.model, max_tokens)
        return self._verify_cost


def load(
    model: str, dtype: str = "bf16", device: str = "cpu", progress: bool = True
) -> LoadedModel:
    path = hub.resolve(model, dtype, progress=progress)
    net = load_model(path, parse_dtype(dtype), device)
    tokenizer = Tokenizer(path)
    eos = set(net.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return LoadedModel(model, path, dtype, net, tokenizer, tuple(sorted(eos)))


def prefill(
    model: LanguageModel, cache: SequenceCache, ids: list[int], return_hidden: bool = False
) -> ForwardOutput:
    """Run `ids` into `cache` in chunks and commit them; returns the last chunk's logits and,
    if asked, the hidden states of every row of `ids` `[len(ids), hidden]`."""
    out = None
    hidden = []
    for start in range(0, len(ids), PREFILL_CHUNK):
        chunk = ids[start : start + PREFILL_CHUNK]
        ids_t = torch.tensor(chunk, device=model.device)
        out = model(ids_t, [cache], [len(chunk)], return_hidden=return_hidden)
        cache.commit(cache.length + len(chunk))
        if out.hidden is not None:
            hidden.append(out.hidden)
    assert out is not None, "empty prompt"
    if len(hidden) > 1:
        out.hidden = torch.cat(hidden)
    return out


def verify(
    draft: Draft, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> Verdict:
    """logits `[k + 1, vocab]` for inputs [last, d_1..d_k] -> accepted drafts + one token."""
    if params.greedy:
        return verify_greedy(draft.tokens, logits)
    return verify_sampled(draft.tokens, draft.p_draft, probabilities(logits, params), gen)


def stream(
    lm: LoadedModel, req: Request, spec: Speculation | None = None
) -> Generator[str, None, None]:
    """Generate for `req`, yielding text deltas (stop-string safe) until it finishes."""
    model, params = lm.model, req.params
    k_max = spec.config.num_draft_tokens if spec else 0
    cache = model.new_cache(len(req.prompt_ids) + params.max_tokens + k_max + 1)
    gen = params.generator(model.device)
    state = spec.drafter.new_state(req.prompt_ids) if spec else None
    policy = AdaptiveK(k_max, spec.cost, spec.config.adaptive) if spec else None
    req.spec.method = spec.config.method if spec else "none"
    want_hidden = spec is not None and spec.drafter.needs_hidden
    try:
        out = prefill(model, cache, req.prompt_ids, return_hidden=want_hidden)
        hidden = out.hidden  # [committed rows just run, hidden] or None
        verdict = verify(Draft([]), out.logits[-1:], params, gen)
        while True:
            req.append(verdict.tokens)
            if spec is not None:
                spec.drafter.commit(state, req.all_ids, hidden)
            delta = req.stream_delta()
            if delta:
                yield delta
            if req.finished:
                return
            # cache holds every committed token but the last one, which this cycle feeds
            last = verdict.tokens[-1]
            room = (
                min(params.max_tokens - len(req.output_ids), lm.context_length - cache.length) - 1
            )
            k = min(policy.choose(), room) if policy is not None else 0
            t0 = time.perf_counter()
            draft = (
                spec.drafter.propose([DraftJob(state, req.all_ids, k, params, gen)])[0]
                if spec and k > 0
                else Draft([])
            )
            t1 = time.perf_counter()
            n = 1 + len(draft.tokens)
            ids = torch.tensor([last, *draft.tokens], device=model.device)
            rows = torch.arange(n, device=model.device)
            out = model(ids, [cache], [n], logit_rows=rows, return_hidden=want_hidden)
            verdict = verify(draft, out.logits, params, gen)
            cache.commit(cache.length + 1 + verdict.accepted)
            hidden = None if out.hidden is None else out.hidden[: 1 + verdict.accepted]
            req.spec.draft_seconds += t1 - t0
            req.spec.verify_seconds += time.perf_counter() - t1
            req.spec.record(len(draft.tokens), verdict.accepted)
            if policy is not None:
                policy.update(len(draft.tokens), verdict.accepted)
    finally:
        req.abort()  # no-op when finished; marks a consumer that stopped early
        if spec is not None:
            spec.drafter.free(state)
