"""Step-cost tables are measured once per machine: `model_cost` stores what it measured under
QUICKDRAFT_HOME keyed by model, format and host, reads it back for a new model object of the
same kind, measures again when the key changes or on request, and survives a broken file."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from quickdraft.kernels.gemm import Weight
from quickdraft.kernels.linear_gguf import FORMATS, GGUFWeight, random_blocks
from quickdraft.loading import LoadedModel, load
from quickdraft.models.layers import convert_operands_
from quickdraft.speculation import cost
from quickdraft.speculation.cost import StepCost, cost_key, model_cost


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from quickdraft.kernels import build

    build.kernels_available()  # built (or found) under the usual home, not the empty one
    monkeypatch.setenv("QUICKDRAFT_HOME", str(tmp_path))
    monkeypatch.delenv(cost.REMEASURE_ENV, raising=False)
    return tmp_path


@pytest.fixture()
def measured(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Counts the real measurements (each one still runs)."""
    calls: list[object] = []
    real = cost.measure_step_cost

    def counting(model: object, *args: object, **kwargs: object) -> StepCost:
        calls.append(model)
        return real(model, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cost, "measure_step_cost", counting)
    yield calls


def fresh(tiny_model_dir: Path, dtype: str = "fp32") -> LoadedModel:
    return load(str(tiny_model_dir), dtype, progress=False)


def test_cost_table_is_measured_once_and_read_back(
    home: Path, measured: list[object], tiny_model_dir: Path
) -> None:
    first = model_cost(fresh(tiny_model_dir).model)
    assert len(measured) == 1
    assert len(list((home / "step-cost").glob("*.json"))) == 1
    second = model_cost(fresh(tiny_model_dir).model)  # another object, same kind: from disk
    assert len(measured) == 1 and second == first


def test_cost_table_is_measured_again_when_the_key_changes(
    home: Path, measured: list[object], tiny_model_dir: Path
) -> None:
    model_cost(fresh(tiny_model_dir).model)
    bf16 = fresh(tiny_model_dir, "bf16").model
    assert cost_key(bf16) != cost_key(fresh(tiny_model_dir).model)
    model_cost(bf16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        model_cost(fresh(tiny_model_dir).model)
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 3
    assert len(list((home / "step-cost").glob("*.json"))) == 3


def test_cost_key_changes_with_the_python_sources(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The key holds a digest of the package's Python sources: a table stored by other code
    (an upgrade, an edit) is measured again."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    before = cost.python_digest(tmp_path)
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    cost.python_digest.cache_clear()
    assert cost.python_digest(tmp_path) != before
    assert cost_key(fresh(tiny_model_dir).model)["code"] == cost.python_digest()


def test_cost_key_names_a_gguf_weights_block_formats(tiny_model_dir: Path) -> None:
    """Two GGUF models of one architecture in different block formats are different keys."""

    def as_gguf(fmt: str) -> dict[str, object]:
        net = fresh(tiny_model_dir).model

        def convert(w: Weight) -> Weight:
            assert isinstance(w, torch.Tensor)
            n, k = w.shape
            raw = random_blocks(FORMATS[fmt], n, k)
            return GGUFWeight.from_raw(fmt, raw, k)

        convert_operands_(net, convert)
        return cost_key(net)

    q8, q4 = as_gguf("Q8_0"), as_gguf("Q4_0")
    assert q8 != q4 and q8 == as_gguf("Q8_0")
    assert any("GGUFWeight[Q8_0]" in name for name, _ in q8["operands"])


def test_cost_table_remeasures_on_request(
    home: Path, measured: list[object], tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_cost(fresh(tiny_model_dir).model)
    monkeypatch.setenv(cost.REMEASURE_ENV, "1")
    model_cost(fresh(tiny_model_dir).model)
    assert len(measured) == 2


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("{not json", id="not-json"),
        pytest.param('{"key": 1}', id="missing-fields"),
        pytest.param("", id="empty"),
    ],
)
def test_cost_table_broken_file_is_measured_again(
    home: Path, measured: list[object], tiny_model_dir: Path, content: str
) -> None:
    first = model_cost(fresh(tiny_model_dir).model)
    (path,) = (home / "step-cost").glob("*.json")
    path.write_text(content)
    again = model_cost(fresh(tiny_model_dir).model)
    assert len(measured) == 2 and again.rows == first.rows
    assert cost._read_table(path, cost_key(fresh(tiny_model_dir).model)) == again  # rewritten


def test_step_cost_table_pools_a_slow_timing_with_its_neighbours() -> None:
    from quickdraft.speculation.cost import monotone

    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # one slow timing at 4 rows is averaged with the rows after it, not carried to all of them
    pooled = monotone([6.5, 7.0, 8.4, 16.3, 9.0, 9.2, 9.6, 9.9])
    assert pooled == pytest.approx([6.5, 7.0, 8.4] + [(16.3 + 9.0 + 9.2 + 9.6 + 9.9) / 5] * 5)
    assert all(b >= a for a, b in itertools.pairwise(pooled))
    assert monotone([3.0, 1.0]) == [2.0, 2.0]
