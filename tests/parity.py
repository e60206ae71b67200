"""Greedy parity, the check every speculation test builds on: a request's output with
speculation equals its output with speculation off, token for token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.drafters.base import Drafter, DraftJob
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.sampling import TokenRng
from quickdraft.speculation.state import AnySpeculation

# code, prose, JSON, repeats, counting: prompts whose continuations drafts often guess
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(",
    "the cat sat on the mat. the cat sat on the",
    '{"name": "x", "id": 1}, {"name": "y", "id": 2}, {"name": ',
    "abcabcabcabc",
    "Hello, world! Hello, world! Hello",
    "1, 2, 3, 4, 5, 6, 7,",
    "for i in range(10):\n    print(i)\nfor j in range(",
    "zzz yyy xxx zzz yyy",
]


def generate(
    lm: LoadedModel,
    prompt: str,
    params: SamplingParams,
    cfg: SpeculativeConfig | AnySpeculation | None,
) -> Request:
    """One request with speculation `cfg`: a config (built fresh for it) or a Speculation
    built beforehand (shared across calls, e.g. one whose drafter a test adjusted)."""
    spec = make_speculation(lm, cfg) if isinstance(cfg, SpeculativeConfig) else cfg
    req = lm.new_request(lm.tokenizer.encode(prompt), params)
    for _ in stream(lm, req, spec):
        pass
    return req


def greedy_parity(
    lm: LoadedModel,
    prompts: list[str],
    params: SamplingParams,
    cfg: SpeculativeConfig | AnySpeculation,
) -> tuple[int, int]:
    """Every prompt's output with `cfg` equals speculation off's; -> (drafted, accepted)."""
    drafted = accepted = 0
    for prompt in prompts:
        plain = generate(lm, prompt, params, SpeculativeConfig())
        spec = generate(lm, prompt, params, cfg)
        assert spec.output_ids == plain.output_ids, prompt
        drafted += spec.spec.drafted
        accepted += spec.spec.accepted
    return drafted, accepted


def forced_draft(draft_dir: Path, k: int, **fields: Any) -> SpeculativeConfig:
    """A draft model of full precision drafting k tokens every cycle (no adaptive policy)."""
    return SpeculativeConfig(
        method="draft",
        num_draft_tokens=k,
        draft_model=str(draft_dir),
        draft_quantization="none",
        adaptive=False,
        **fields,
    )


def packed_propose_equals_alone(
    drafter: Drafter, prime: Callable[[list[int]], tuple[Any, list[int]]], k: int
) -> None:
    """Three jobs of different lengths, k (`k`, 2, 3) and sampling (greedy, seeded, greedy)
    packed into one `propose` draft what each drafts alone. `prime(prompt)` -> a drafter
    state after the prompt's prefill and the committed tokens."""
    prompts = [[5, 9, 77, 3], list(range(40, 61)), [200, 100]]
    params = [
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=8, temperature=0.8, seed=3),
        SamplingParams(max_tokens=8),
    ]
    ks = [k, 2, 3]

    def jobs() -> list[DraftJob]:
        out = []
        for prompt, p, n in zip(prompts, params, ks, strict=True):
            state, tokens = prime(prompt)
            out.append(DraftJob(state, tokens, n, p, TokenRng.for_params(p).generator))
        return out

    alone = [drafter.propose([job])[0] for job in jobs()]
    packed = drafter.propose(jobs())
    for a, b, n in zip(alone, packed, ks, strict=True):
        assert a.tokens == b.tokens and len(a.tokens) == n
        assert (a.p_draft is None) == (b.p_draft is None)
        if a.p_draft is not None and b.p_draft is not None:
            assert (a.p_draft - b.p_draft).abs().max().item() < 1e-5


def verify_rows_and_steps(model: Any, ids: Any, prefix: int) -> tuple[Any, list[Any]]:
    """`model`'s logits of ids[prefix:] after ids[:prefix], as one verify forward (its rows)
    and as one decode step each: the two a target must give the same bits."""
    import torch

    n = len(ids) - prefix
    decode = model.new_cache(len(ids) + 8)
    model(ids[:prefix], [decode], [prefix])
    decode.commit(prefix)
    steps = []
    for j in range(n):
        steps.append(model(ids[prefix + j : prefix + j + 1], [decode], [1]).logits[-1])
        decode.commit(prefix + j + 1)
    verify = model.new_cache(len(ids) + 8)
    model(ids[:prefix], [verify], [prefix])
    verify.commit(prefix)
    rows = model(ids[prefix:], [verify], [n], logit_rows=torch.arange(n)).logits
    return rows, steps


def c_layers_equal_python_layers(model: Any, tapped: int = 1) -> None:
    """A model's C++ layers (`_fused_layers`: kernels/dense_layer.py, gemma4_layer.py,
    hybrid_layer.py) give its Python layers' bits: logits, a tapped layer and every committed
    state (KV rows; a hybrid's conv windows and SSM states), over two sequences' prompts packed
    in one step, then steps of a few rows (verifies) at other lengths, each rolled back by 0,
    1 or 2 rows."""
    assert model._fused_layers() is not None, "every layer runs as one C++ call"

    def run(fused: bool) -> tuple[list[Tensor], list[Tensor]]:
        saved = model._fused
        model._fused = None if fused else False
        try:
            caches, outs = [model.new_cache(32), model.new_cache(32)], []
            for step, counts in enumerate(([9, 5], [1, 3], [2, 1])):
                ids = (torch.arange(sum(counts)) * 7 + step) % model.config.vocab_size
                rows = torch.arange(sum(counts))
                for cache, n in zip(caches, counts, strict=True):
                    cache.reserve(n)
                out = model(ids, caches, counts, logit_rows=rows, hidden_layers=[tapped])
                outs += [out.logits, out.layers]
                for cache, n in zip(caches, counts, strict=True):
                    cache.commit(cache.length + n - min(step, n - 1))  # rolled back
            return outs, [t for c in caches for t in _committed_state(c)]
        finally:
            model._fused = saved

    (fused, fused_kv), (python, python_kv) = run(True), run(False)
    assert model._fused_layers() is not None
    for a, b in zip(fused + fused_kv, python + python_kv, strict=True):
        assert torch.equal(a, b)


def _committed_state(cache: Any) -> list[Tensor]:
    """A cache's committed state: its KV rows, and a hybrid's conv windows and SSM states
    with their pending updates applied."""
    if hasattr(cache, "groups"):  # GroupedKVCache
        return [t[:, :, : cache.length] for g in cache.groups for t in (g.k, g.v)]
    if hasattr(cache, "ssm"):  # HybridCache
        kv = cache.kv
        out = [kv.k[:, :, : cache.length], kv.v[:, :, : cache.length]]
        for layer in range(cache.ssm.shape[0]):
            out += [t.clone() for t in cache.gdn_state(layer)]
        return out
    return [cache.k[:, :, : cache.length], cache.v[:, :, : cache.length]]
