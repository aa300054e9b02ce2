"""tuning/ keeps its rooms: its modules import one another without a circle, counting the imports made inside
functions (a lazy import that closes a circle hides it from the interpreter, not from a reader), and the tuner
reaches the serving app only through its deployment's handles, never through the routes or the app module.

Read from the source with ast: nothing is imported, so an import made by another test cannot hide an edge."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TUNING = Path(__file__).resolve().parents[1] / "tuning"
FORBIDDEN = ("serving.app", "serving.openai.routes", "serving.replica.server")  # the routes and the app


def _imported(path: Path) -> set[str]:
    """Every module `path` imports, at the top, under TYPE_CHECKING or inside a function; `from tuning import x`
    counts as importing tuning.x."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _module(path: Path) -> str:
    return "tuning" if path.stem == "__init__" else f"tuning.{path.stem}"


def _graph() -> dict[str, set[str]]:
    """tuning's modules, each with the tuning modules it imports."""
    modules = {_module(path): path for path in sorted(TUNING.glob("*.py"))}
    return {name: (_imported(path) & modules.keys()) - {name} for name, path in modules.items()}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, as the modules along it, or None when the graph has none (depth-first search)."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            found = visit(imported, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    return next((found for module in sorted(graph) if (found := visit(module, []))), None)


def test_the_import_graph_sees_lazy_imports_and_finds_a_circle(tmp_path: Path) -> None:
    """The check itself: imports inside a function and under TYPE_CHECKING are edges, and a circle is found."""
    source = tmp_path / "a.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tuning.b import B\n\n"
                      "def later() -> None:\n    from tuning import c\n    import tuning.d\n")
    assert {"tuning.b", "tuning.c", "tuning.d"} <= _imported(source)
    assert _circle({"tuning.a": {"tuning.b"}, "tuning.b": {"tuning.a"}}) == ["tuning.a", "tuning.b", "tuning.a"]
    assert _circle({"tuning.a": {"tuning.b"}, "tuning.b": set()}) is None


def test_tuning_has_no_import_circle() -> None:
    graph = _graph()
    assert "tuning.search" in graph and graph["tuning.search"], "the graph was read"
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])


def test_tuning_never_imports_the_routes_or_the_app() -> None:
    """The tuner drives the replicas through their deployment's handles (serving/replica/control.py, trials.py):
    the HTTP routes and the app module are the serving side's, and loading them would build the app."""
    offenders = sorted(f"{path.name} imports {name}" for path in TUNING.glob("*.py") for name in _imported(path)
                       if any(name == f or name.startswith(f"{f}.") for f in FORBIDDEN))
    assert offenders == []
