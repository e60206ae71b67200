"""Single-stream generation: load a model by name/path, then prefill + decode one request.

Stage: the plain (speculation-off) decode loop, used by `quickdraft generate` and the benchmark.
Each cycle: forward the last token -> pick the next -> Request.append (stop checks) -> commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quickdraft import hub
from quickdraft.config import parse_dtype
from quickdraft.kv_cache import KVCache
from quickdraft.models.llama import CausalLM, ForwardOutput
from quickdraft.models.loader import load_model
from quickdraft.request import Request
from quickdraft.sampling import SamplingParams, next_tokens
from quickdraft.tokenizer import Tokenizer

PREFILL_CHUNK = 512  # bounds the [chunk, context] attention mask and activations of long prompts


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    model: CausalLM
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings

    def new_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "") -> Request:
        total = len(prompt_ids) + params.max_tokens
        if total > self.context_length:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model context of {self.context_length} tokens"
            )
        return Request(prompt_ids, params, self.tokenizer, self.eos_ids, request_id)


def load(model: str, dtype: str = "bf16", device: str = "cpu", progress: bool = True) -> LoadedModel:
    path = hub.resolve(model, dtype if dtype != "fp16" else "fp32", progress=progress)
    net = load_model(path, parse_dtype(dtype), device)
    tokenizer = Tokenizer(path)
    eos = set(net.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return LoadedModel(model, path, net, tokenizer, tuple(sorted(eos)))


def prefill(model: CausalLM, cache: KVCache, ids: list[int]) -> ForwardOutput:
    """Run `ids` into `cache` in chunks and commit them; returns the last chunk's output."""
    out = None
    for start in range(0, len(ids), PREFILL_CHUNK):
        chunk = ids[start : start + PREFILL_CHUNK]
        out = model(torch.tensor(chunk, device=model.device), [cache], [len(chunk)])
        cache.commit(cache.length + len(chunk))
    assert out is not None, "empty prompt"
    return out


def stream(lm: LoadedModel, req: Request) -> Iterator[str]:
    """Generate for `req`, yielding text deltas (stop-string safe) until it finishes."""
    model = lm.model
    cache = model.new_cache(len(req.prompt_ids) + req.params.max_tokens + 1)
    gen = req.params.generator(model.device)
    try:
        out = prefill(model, cache, req.prompt_ids)
        while True:
            token = int(next_tokens(out.logits[-1:], req.params, gen)[0])
            req.append([token])
            delta = req.stream_delta()
            if delta:
                yield delta
            if req.finished:
                return
            out = model(torch.tensor([token], device=model.device), [cache], [1])
            cache.commit(cache.length + 1)
    finally:
        req.abort()  # no-op when finished; marks a consumer that stopped early
        del cache
