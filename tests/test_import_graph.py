"""The package's import graph has no cycle, counting every import: module level, inside
functions, and type-only ones under `if TYPE_CHECKING:` (docs/architecture.md: each room imports
only the rooms below it). Read from the source with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "quickdraft"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules `path` imports. `from pkg import sub` names the submodule when
    one exists, else the package's __init__."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif base in known:
                    out.add(base)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_import_graph_has_no_cycle() -> None:
    g = graph()
    assert len(g) > 30 and "quickdraft.engine.core" in g  # the scan saw the package
    assert cycles(g) == []


@pytest.mark.parametrize(
    ("g", "expected"),
    [
        pytest.param({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]], id="two-cycle"),
        pytest.param({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]], id="three-cycle"),
        pytest.param({"a": {"b"}, "b": {"c"}, "c": set()}, [], id="chain"),
    ],
)
def test_import_graph_cycle_finder(g: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(g) == expected


def test_import_graph_counts_type_only_and_function_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from quickdraft.engine.core import EngineCore\n"
        "def f():\n    from quickdraft.kernels import build\n"
    )
    known = {"quickdraft.engine.core", "quickdraft.kernels", "quickdraft.kernels.build"}
    got = imports_of(src, "quickdraft.m", known)
    assert got == {"quickdraft.engine.core", "quickdraft.kernels.build"}
