"""The hybrid cache (state_cache.py): after a k+1-token verify, committing any number of its
tokens and continuing equals recomputing from scratch (conv window, SSM state and logits, fp32),
for every accept count 0..k; the slot index arithmetic (including the first slot after the
committed one, n_accepted = 0) across many cycles; impossible commits are refused."""

from __future__ import annotations

import pytest
import torch
from hybrid_models import random_hybrid

from quickdraft.models.qwen3_next import HybridLM
from quickdraft.state_cache import MAX_CHECKPOINTS, GDNStateShape, HybridCache

K = 4  # drafts per verify: forwards of K + 1 tokens


@pytest.fixture(scope="module")
def model() -> HybridLM:
    return random_hybrid("qwen3_next", seed=11)


def run(model: HybridLM, cache: HybridCache, ids: list[int]) -> torch.Tensor:
    """Forward `ids` and commit all of them; logits of the last row."""
    out = model(torch.tensor(ids), [cache], [len(ids)])
    cache.commit(cache.length + len(ids))
    return out.logits[-1]


def states(cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor]:
    conv = torch.stack([cache.gdn_state(g)[0] for g in range(cache.shape.num_layers)])
    ssm = torch.stack([cache.gdn_state(g)[1] for g in range(cache.shape.num_layers)])
    return conv, ssm


@pytest.mark.parametrize("kept", range(K + 2), ids=lambda m: f"kept{m}")
def test_state_cache_rollback_then_continue_equals_recompute(model: HybridLM, kept: int) -> None:
    """kept = rows of the verify [last, d_1..d_K] that are committed: 0 (none, e.g. a cancelled
    cycle), 1 + accepted for accepted = 0..K."""
    gen = torch.Generator().manual_seed(kept)
    prompt = torch.randint(0, 320, (11,), generator=gen).tolist()
    verify = torch.randint(0, 320, (K + 1,), generator=gen).tolist()
    after = torch.randint(0, 320, (3,), generator=gen).tolist()
    cache = model.new_cache(32)
    run(model, cache, prompt)
    model(torch.tensor(verify), [cache], [K + 1], logit_rows=torch.arange(K + 1))
    cache.commit(len(prompt) + kept)
    fresh = model.new_cache(32)
    run(model, fresh, prompt + verify[:kept])
    for a, b in zip(states(cache), states(fresh), strict=True):
        assert (a - b).abs().max().item() < 1e-5
    # ... and both go on identically: a 3-token forward, then a one-token step
    for ids in (after, [7]):
        got, expected = run(model, cache, ids), run(model, fresh, ids)
        assert (got - expected).abs().max().item() < 1e-5
    for a, b in zip(states(cache), states(fresh), strict=True):
        assert (a - b).abs().max().item() < 1e-5


def test_state_cache_many_cycles_equal_recompute(model: HybridLM) -> None:
    """Twelve verify cycles whose commits cycle through every count (so the slot ring wraps
    around many times), then the next step's logits equal a from-scratch run of the kept tokens."""
    gen = torch.Generator().manual_seed(99)
    cache = model.new_cache(8)
    kept_tokens = torch.randint(0, 320, (6,), generator=gen).tolist()
    run(model, cache, kept_tokens)
    slot_tensors = None
    for cycle in range(12):
        verify = torch.randint(0, 320, (K + 1,), generator=gen).tolist()
        model(torch.tensor(verify), [cache], [K + 1], logit_rows=torch.arange(K + 1))
        kept = 1 + (cycle * 3) % (K + 1)  # 1, 4, 2, 5, 3, ...: every accept count
        cache.commit(cache.length + kept)
        kept_tokens += verify[:kept]
        if slot_tensors is None:  # slots are allocated once and then reused
            slot_tensors = (cache.conv.data_ptr(), cache.ssm.data_ptr(), cache.slots)
        assert (cache.conv.data_ptr(), cache.ssm.data_ptr(), cache.slots) == slot_tensors
    fresh = model.new_cache(64)
    run(model, fresh, kept_tokens)
    got, expected = run(model, cache, [3]), run(model, fresh, [3])
    assert (got - expected).abs().max().item() < 1e-5


SHAPE = GDNStateShape(num_layers=2, conv_dim=3, conv_kernel=4, num_heads=1, key_dim=2, value_dim=2)


def mark_forward(cache: HybridCache, n: int, first_value: float) -> None:
    """A fake forward: the state after its token t is filled with first_value + t."""
    cache.reserve(n)
    for g in range(SHAPE.num_layers):
        conv_dest, ssm_dest = cache.gdn_dest(g)
        for t, (c, s) in enumerate(zip(conv_dest, ssm_dest, strict=True)):
            if c is not None and s is not None:
                c.fill_(first_value + t)
                s.fill_(first_value + t)


def committed_value(cache: HybridCache) -> float:
    conv, ssm = cache.gdn_state(1)
    assert bool((conv == conv.flatten()[0]).all()) and bool((ssm == conv.flatten()[0]).all())
    return float(conv.flatten()[0])


def test_state_cache_slot_arithmetic_every_accept_count() -> None:
    """The state after committed token i always holds value i, whatever was accepted before,
    and a forward never writes into the committed slot (kept = 0 keeps it)."""
    cache = HybridCache(1, 1, 4, 64, SHAPE, torch.float32)
    mark_forward(cache, 3, 0.0)
    cache.commit(3)
    assert committed_value(cache) == 2.0
    pattern = [0, 1, 5, 2, 0, 3, 4, 1, 1, 5, 5, 0, 2]  # rows kept of 5
    for kept in pattern:
        base = cache.length
        mark_forward(cache, K + 1, float(base))
        assert cache.committed not in [s for s in cache._written if s >= 0]
        cache.commit(base + kept)
        assert committed_value(cache) == float(cache.length - 1)
    assert cache.slots == K + 2


def test_state_cache_refuses_impossible_commits() -> None:
    cache = HybridCache(1, 1, 4, 256, SHAPE, torch.float32)
    mark_forward(cache, 5, 0.0)
    with pytest.raises(AssertionError, match="wrote tokens up to 5"):
        cache.commit(6)
    cache.commit(5)
    with pytest.raises(AssertionError, match="below the committed length"):
        cache.commit(4)
    long = MAX_CHECKPOINTS + 7  # a prompt chunk: only its final state is kept
    mark_forward(cache, long, 100.0)
    with pytest.raises(AssertionError, match="no recurrent checkpoint"):
        cache.commit(5 + long - 1)
    cache.commit(5 + long)
    assert committed_value(cache) == 100.0 + long - 1
    cache.commit(0)  # reset: the empty state
    assert committed_value(cache) == 0.0 and cache.length == 0
