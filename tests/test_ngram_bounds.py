"""bench/ngram_bounds.py's replay: the arithmetic behind the n-gram bound it reports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from quickdraft.speculation.cost import StepCost

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bounds() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ngram_bounds", BENCH / "ngram_bounds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("ngram_bounds", module)
    spec.loader.exec_module(module)
    return module


def test_tree_paths_follow_successors_with_static_widths() -> None:
    nb = bounds()
    successors = {1: [2, 3, 7], 2: [4, 8], 3: [5, 6]}
    assert nb.tree_paths(successors, 1, (2, 1)) == [[2, 4], [3, 5]]
    assert nb.tree_paths(successors, 1, (1,)) == [[2]]
    # a token never scored ends its branch early; an unknown root gives no path
    assert nb.tree_paths({1: [9]}, 1, (1, 1)) == [[9]]
    assert nb.tree_paths(successors, 42, (2,)) == []


def test_replay_counts_accepted_tokens_rows_and_cost() -> None:
    nb = bounds()
    prompt, output = [10, 11, 12], [13, 14]
    # the target predicted 13 after 12 (prompt position 2); other rows predict nothing useful
    top = [[90, 91], [91, 92], [13, 99], [14, 98], [97, 96]]
    sample = nb.Sample("code/0", prompt, output, top)
    cost = StepCost((1, 2), (1.0, 1.5))
    # no n-gram occurred before: two plain steps, one row each
    chain = nb.replay([sample], 5, (), cost)["code"]
    assert chain == {"acceptance_length": 1.0, "rows_per_step": 1.0, "estimated_speedup": 1.0}
    # the tree guesses 13 from the target's prediction: one step of 2 rows emits both tokens
    tree = nb.replay([sample], 5, (1,), cost)["code"]
    assert tree["acceptance_length"] == 2.0
    assert tree["rows_per_step"] == 2.0
    assert tree["estimated_speedup"] == round(2 * 1.0 / 1.5, 3)


def test_replay_chain_copies_a_repeated_span() -> None:
    nb = bounds()
    prompt = [5, 6, 7, 8, 5, 6]
    output = [7, 8, 5, 6]  # continues the repetition: the n-gram chain drafts all of it
    sample = nb.Sample("json/0", prompt, output, [[0]] * (len(prompt) + len(output)))
    flat = StepCost((1, 8), (1.0, 1.0))
    result = nb.replay([sample], 3, (), flat)["json"]
    # step 1: drafts 7 8 5, all accepted, plus the target's 6 -> 4 tokens in one step
    assert result["acceptance_length"] == 4.0
    assert result["rows_per_step"] == 4.0
    assert result["estimated_speedup"] == 4.0
