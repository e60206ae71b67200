"""The hybrid cache (state_cache.py): after a k+1-token verify, committing any number of its
tokens and continuing equals recomputing from scratch (conv window, SSM state and logits, fp32),
for every accept count 0..k; the slot index arithmetic (including the first slot after the
committed one, n_accepted = 0) across many cycles; impossible commits are refused."""

from __future__ import annotations

import pytest
import torch
from hybrid_models import (
    one_thread,  # noqa: F401 (autouse fixture)
    random_hybrid,
)

from quickdraft.kernels.gdn import DeltaUpdates, conv_window
from quickdraft.models.caches.state_cache import MAX_CHECKPOINTS, GDNStateShape, HybridCache
from quickdraft.models.families.qwen3_next import HybridLM

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
    """Twelve verify cycles whose commits cycle through every count, then the next step's
    logits equal a from-scratch run of the kept tokens."""
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
        if slot_tensors is None:  # state and checkpoint slots are allocated once and reused
            slot_tensors = (cache.ssm.data_ptr(), cache.cp_k.data_ptr(), cache.cp_d.data_ptr())
        assert (cache.ssm.data_ptr(), cache.cp_k.data_ptr(), cache.cp_d.data_ptr()) == slot_tensors
    fresh = model.new_cache(64)
    run(model, fresh, kept_tokens)
    got, expected = run(model, cache, [3]), run(model, fresh, [3])
    assert (got - expected).abs().max().item() < 1e-5


SHAPE = GDNStateShape(num_layers=2, conv_dim=3, conv_kernel=4, num_heads=1, key_dim=2, value_dim=2)


def fake_forward(cache: HybridCache, n: int) -> None:
    """A forward of n tokens as a GDN layer makes it, with updates that count: token j adds 1
    to ssm[0, 0, 0] (k = e_0, d = e_0, no decay) and feeds conv input (its position)."""
    cache.reserve(n)
    positions = torch.arange(cache.length, cache.length + n, dtype=torch.float32)
    for g in range(SHAPE.num_layers):
        window, state = cache.gdn_state(g)
        if cache.keeps_checkpoints:
            k = torch.zeros(1, n, 2)
            k[..., 0] = 1.0
            updates = DeltaUpdates(k, k.clone(), torch.zeros(1, n))
            cache.keep_checkpoints(g, positions[:, None].expand(n, 3), updates)
        else:
            final_conv, final_state = cache.final_state(g)
            final_state.copy_(state)
            final_state[0, 0, 0] += n
            final_conv.copy_(conv_window(window, positions[:, None].expand(n, 3)))


def committed(cache: HybridCache) -> tuple[float, float]:
    """(tokens counted by the SSM state, position of the last conv input) of layer 1."""
    window, state = cache.gdn_state(1)
    return float(state[0, 0, 0]), float(window[-1, 0])


def test_state_cache_checkpoint_arithmetic_every_accept_count() -> None:
    """After every commit the state is that after exactly the committed tokens, whatever was
    kept before: 1 of 5 (n_accepted = 0), all 5, and 0 (the committed state untouched)."""
    cache = HybridCache(1, 1, 4, 64, SHAPE, torch.float32)
    fake_forward(cache, 3)
    cache.commit(3)
    assert committed(cache) == (3.0, 2.0)
    for kept in [0, 1, 5, 2, 0, 3, 4, 1, 1, 5, 5, 0, 2]:  # rows kept of a verify of K + 1
        before = cache.length
        fake_forward(cache, K + 1)
        cache.commit(before + kept)
        assert cache.pending == ([kept] * 2 if kept else [0, 0])  # O(1): nothing applied yet
        assert committed(cache) == (float(cache.length), float(cache.length - 1))
    assert cache.cp_k.shape[2] == K + 1  # checkpoint slots allocated once, reused


def test_state_cache_refuses_impossible_commits() -> None:
    cache = HybridCache(1, 1, 4, 256, SHAPE, torch.float32)
    fake_forward(cache, 5)
    with pytest.raises(AssertionError, match="wrote tokens up to 5"):
        cache.commit(6)
    cache.commit(5)
    with pytest.raises(AssertionError, match="below the committed length"):
        cache.commit(4)
    long = MAX_CHECKPOINTS + 7  # a prompt chunk: only its final state is kept
    fake_forward(cache, long)
    with pytest.raises(AssertionError, match="no recurrent checkpoint"):
        cache.commit(5 + long - 1)
    fake_forward(cache, long)
    cache.commit(5)  # keep: the committed state is untouched by the long forward
    assert committed(cache) == (5.0, 4.0)
    fake_forward(cache, long)
    cache.commit(5 + long)
    assert committed(cache) == (5.0 + long, 4.0 + long)
    cache.commit(0)  # reset: the empty state
    assert committed(cache) == (0.0, 0.0) and cache.length == 0
