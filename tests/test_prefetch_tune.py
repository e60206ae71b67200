"""kernels/prefetch.py: the prefetch distance measured over a model's own operands at load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from quickdraft.kernels import build, prefetch, project
from quickdraft.kernels.linear_gguf import FORMATS, GGUFWeight, random_blocks
from quickdraft.kernels.linear_int import Int4Weight

pytestmark = pytest.mark.skipif(not build.kernels_available(), reason="no CPU kernels here")


@pytest.fixture()
def untuned(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """No environment setting and nothing tuned; the extension's distances in effect before
    (what an earlier load measured, if one did) restored after."""
    ext = build.extension()
    default, default_32 = build.prefetch_bytes(), build.prefetch_bytes_32()
    monkeypatch.setattr(build, "_prefetch_setting", None)
    monkeypatch.setattr(build, "_tuned", None)
    yield ext
    ext.set_prefetch_bytes(default, default_32)


def operands() -> list[Any]:
    k = 512
    ops: list[Any] = [
        GGUFWeight.from_raw(f, random_blocks(FORMATS[f], n, k, seed=i), k)
        for i, (f, n) in enumerate((("Q4_K", 96), ("Q6_K", 64), ("Q4_0", 80), ("MXFP4", 48)))
    ]
    ops.append(Int4Weight.quantize(torch.randn(64, k)))
    ops.append(torch.randn(32, k).bfloat16())  # not a panel operand: not timed
    return ops


def test_tune_sets_measured_distances_and_changes_no_bits(untuned: Any) -> None:
    """Each candidate gets a rate, the best is set for its group (the 32-value formats apart),
    `prefetch_bytes()` reports it, and every operand's output is the same bits as before."""
    ops = operands()
    x = torch.randn(1, 512).bfloat16()
    before = [project(x, w) for w in ops]
    got = prefetch.tune(ops, rounds=2, min_bytes=0)
    assert got is not None
    assert set(got.gbs) == set(prefetch.CANDIDATES)
    assert set(got.gbs_32) == set(prefetch.CANDIDATES_32)
    assert all(v > 0 for v in [*got.gbs.values(), *got.gbs_32.values()])
    assert got.gbs[got.distance] == max(got.gbs.values())
    assert got.gbs_32[got.distance_32] == max(got.gbs_32.values())
    assert (build.prefetch_bytes(), build.prefetch_bytes_32()) == (got.distance, got.distance_32)
    assert got.model_bytes == sum(prefetch.operand_bytes(w) for w in ops) > 0
    assert prefetch.operand_bytes(ops[-1]) == 0
    assert untuned.set_prefetch_bytes(got.distance, got.distance_32) == got.distance
    for b, w in zip(before, ops, strict=True):
        assert torch.equal(b, project(x, w))


def test_without_32_value_operands_they_follow_the_vendor_rule(untuned: Any) -> None:
    ops = [w for w in operands() if not (isinstance(w, GGUFWeight) and w.parts[0].fmt.block == 32)]
    got = prefetch.tune(ops, rounds=1, min_bytes=0)
    assert got is not None and got.gbs_32 == {}
    vendor = build.cpu_vendor()
    assert got.distance_32 == build.PREFETCH_BYTES_32.get(vendor, got.distance)


def test_what_is_not_tuned(untuned: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the size floor, after a larger model, or with the environment's setting: nothing
    measured, the distances in effect unchanged."""
    ops = operands()
    distances = (build.prefetch_bytes(), build.prefetch_bytes_32())
    assert prefetch.tune(ops, rounds=1) is None  # a few KB: under MIN_BYTES
    assert build.tuned() is None
    assert (build.prefetch_bytes(), build.prefetch_bytes_32()) == distances
    big = prefetch.tune(ops, rounds=1, min_bytes=0)
    assert big is not None
    assert prefetch.tune(ops[:2], rounds=1, min_bytes=0) is None  # a draft after its target
    assert build.tuned() is big
    monkeypatch.setattr(build, "_tuned", None)
    monkeypatch.setattr(build, "_prefetch_setting", "2048")
    assert prefetch.tune(ops, rounds=1, min_bytes=0) is None
    assert build.prefetch_bytes() == build.prefetch_bytes_32() == 2048
