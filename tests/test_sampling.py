"""Sampling filters and RNG behaviour."""

from __future__ import annotations

import pytest
import torch

from quickdraft.request import SamplingParams
from quickdraft.speculation.sampling import (
    TokenRng,
    probabilities,
    reference_top_p_drop,
    sample,
    top_p_drop,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_probabilities_greedy_is_one_hot_argmax() -> None:
    probs = probabilities(LOGITS, SamplingParams())
    assert probs.tolist() == [[1.0, 0, 0, 0, 0, 0]]


def test_probabilities_temperature_one_is_softmax() -> None:
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0))
    assert torch.allclose(probs, torch.softmax(LOGITS, -1))


def test_probabilities_top_k_keeps_k_largest() -> None:
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0, 2:] == 0).all()
    expected = torch.softmax(LOGITS[0, :2], -1)
    assert torch.allclose(probs[0, :2], expected)


def test_probabilities_top_p_keeps_smallest_prefix_reaching_p() -> None:
    full = torch.softmax(LOGITS, -1)[0]  # ~[0.61, 0.22, 0.14, ...]
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    kept = (probs[0] > 0).nonzero().flatten().tolist()
    assert kept == [0, 1]  # 0.61 < 0.7, 0.61 + 0.22 >= 0.7
    assert torch.allclose(probs[0, :2], full[:2] / full[:2].sum())


@pytest.mark.parametrize("top_p", [1e-300, 0.3, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("spread", [0.3, 1.0, 4.0])  # flat rows (the fall-back) to peaked
def test_top_p_among_candidates_drops_what_the_full_sort_drops(top_p: float, spread: float) -> None:
    """top_p_drop ranks only the TOP_P_CANDIDATES likeliest tokens of a row when they hold the
    mass, else sorts the row: either way the same tokens as the full sort
    (reference_top_p_drop), on SmolLM2-sized rows, ties and mixed batches included."""
    gen = torch.Generator().manual_seed(int(spread * 10) + int(top_p * 1000))
    logits = torch.randn(16, 49152, generator=gen) * spread
    logits[3, :40] = logits[3, 0]  # a run of tied likeliest tokens
    logits[5] = torch.randn(49152, generator=gen) * 0.3  # a flat row among peaked ones
    probs = torch.softmax(logits, -1)
    assert torch.equal(top_p_drop(probs, top_p), reference_top_p_drop(probs, top_p))


def test_probabilities_min_p_drops_below_fraction_of_max() -> None:
    full = torch.softmax(LOGITS, -1)[0]
    probs = probabilities(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))
    assert ((probs[0] > 0) == (full >= 0.3 * full.max())).all()


def test_sample_seeded_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, 1000)
    probs = probabilities(logits, params)

    def draws() -> list[int]:
        g = TokenRng.for_params(params).generator
        return [int(sample(probs, g)[0]) for _ in range(20)]

    a, b = draws(), draws()
    assert a == b and len(set(a)) > 1


def test_sample_frequencies_match_probabilities() -> None:
    probs = torch.softmax(torch.tensor([[1.0, 0.2, -0.5, 0.7]]), -1)
    gen = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(50_000, 4).contiguous(), gen)
    freq = torch.bincount(draws, minlength=4).float() / 50_000
    assert torch.allclose(freq, probs[0], atol=0.01)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("top_k", -1),
        ("min_p", 1.5),
    ],
    ids=lambda v: str(v),
)
def test_sampling_params_reject_out_of_range(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_sampling_params_reject_bad_stop_lists() -> None:
    with pytest.raises(ValueError, match="at most 4"):
        SamplingParams(stop=("a", "b", "c", "d", "e"))
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=("",))


# Legal but extreme values: each must give a valid distribution (finite, >= 0, sums to 1) that
# keeps the argmax, and where the limit is greedy, exactly the one-hot argmax.
EXTREME_LOGITS = torch.cat([LOGITS, torch.tensor([[30.0, -30.0, 29.5, 0.0, -1e4, 1e4]])])
TINY = 5e-324  # the smallest float64 above 0 (0 in fp32)
EXTREMES: list[tuple[str, dict[str, float], bool]] = [
    ("temperature-3e-38", {"temperature": 3e-38}, True),
    ("temperature-1e-45", {"temperature": 1e-45}, True),
    ("temperature-min-float", {"temperature": TINY}, True),
    ("top-p-min-float", {"temperature": 1.0, "top_p": TINY}, True),
    ("top-p-1e-300", {"temperature": 0.5, "top_p": 1e-300}, True),
    ("min-p-1", {"temperature": 1.0, "min_p": 1.0}, True),
    ("min-p-near-1", {"temperature": 1.0, "min_p": 1 - 2**-53}, True),
    ("top-k-huge", {"temperature": 1.0, "top_k": 10**30}, False),
    ("temperature-2", {"temperature": 2.0}, False),
    ("all-at-once", {"temperature": 1e-40, "top_p": TINY, "top_k": 10**9, "min_p": 1.0}, True),
]


@pytest.mark.parametrize(("kwargs", "greedy"), [pytest.param(k, g, id=i) for i, k, g in EXTREMES])
def test_probabilities_extreme_params_give_a_valid_distribution(
    kwargs: dict[str, float], greedy: bool
) -> None:
    probs = probabilities(EXTREME_LOGITS, SamplingParams(**kwargs))  # type: ignore[arg-type]
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    argmax = EXTREME_LOGITS.argmax(-1)
    assert (probs.argmax(-1) == argmax).all()
    if greedy:
        assert probs.tolist() == probabilities(EXTREME_LOGITS, SamplingParams()).tolist()
    gen = torch.Generator().manual_seed(0)
    draws = sample(probs.repeat(200, 1), gen)
    assert (probs.repeat(200, 1).gather(-1, draws[:, None]) > 0).all()  # never a dropped token
    if greedy:
        assert (draws == argmax.repeat(200)).all()
