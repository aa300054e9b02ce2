"""measure/ and scripts/ keep their rooms (scripts/ -> tuning/ -> measure/ -> serving/):

- measure/ imports neither tuning/ nor a script, at the top, under TYPE_CHECKING or inside a function;
- no script imports another: no `scripts.` import, no import of a sibling script by its name, and the only path a
  script puts on sys.path is the repository root (the one that reaches measure/ and serving/);
- tests import no script as a module, except the tools named below.

Read from the source with ast: nothing is imported, so an import made by another test cannot hide an edge."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
MEASURE, SCRIPTS, TESTS = REPO / "measure", REPO / "scripts", REPO / "tests"
SCRIPT_NAMES = frozenset(path.stem for path in SCRIPTS.glob("*.py"))

# Tools, not benches: they write model files, and tests write theirs with them.
TOOLS = frozenset({"make_synthetic_gguf", "make_draft_gguf"})
IMPORTABLE = TOOLS

# How a script names the repository root: its own folder's parent.
REPO_ROOT_FORMS = frozenset({"Path(__file__).resolve().parents[1]", "Path(__file__).resolve().parent.parent"})
# Calls that import a module given by name (the first argument): the test helper, importlib's loaders.
IMPORTING_CALLS = frozenset({"script_module", "spec_from_file_location", "import_module"})
COMPUTED = "<a name computed at run time>"
HELPERS = "helpers.py"  # script_module's own import takes its callers' names, checked where they call it


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _imports(tree: ast.Module) -> Iterator[str]:
    """Every absolute module an import statement anywhere in `tree` names (`from a import b` names a and a.b)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _roots(tree: ast.Module) -> set[str]:
    return {name.split(".")[0] for name in _imports(tree)}


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _assigned(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = expression, as source text."""
    return {target.id: ast.unparse(node.value) for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def _sys_path_entries(tree: ast.Module) -> list[str]:
    """What each sys.path.insert/append in `tree` adds, as source text, a module-level name resolved once and a
    str(...) around it dropped."""
    names = _assigned(tree)
    entries = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
                and node.func.attr in ("insert", "append") and ast.unparse(node.func.value) == "sys.path"):
            arg = node.args[-1]
            if isinstance(arg, ast.Call) and _call_name(arg) == "str" and arg.args:
                arg = arg.args[0]
            text = ast.unparse(arg)
            entries.append(names.get(text, text))
    return entries


def _scripts_imported_by(tree: ast.Module) -> set[str]:
    """Scripts a test loads as modules: `scripts.` imports, and a script's name given to an importing call."""
    modules = set(_imports(tree))
    named = {name.split(".")[1] for name in modules if name.startswith("scripts.")} | ({"scripts"} & modules)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) in IMPORTING_CALLS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                named.add(first.value)
            else:  # a name worked out at run time: which script it loads cannot be told here
                named.add(COMPUTED)
    return named & (SCRIPT_NAMES | {"scripts", COMPUTED})


@pytest.mark.parametrize("path", sorted(MEASURE.glob("*.py")), ids=lambda p: p.name)
def test_measure_imports_neither_tuning_nor_a_script(path: Path) -> None:
    tree = _tree(path)
    wrong = _roots(tree) & ({"tuning", "scripts"} | SCRIPT_NAMES)
    assert not wrong, f"measure/{path.name} imports {sorted(wrong)}"
    assert not _sys_path_entries(tree), f"measure/{path.name} changes sys.path: it is a package, imported as one"


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_no_script_imports_another(path: Path) -> None:
    tree = _tree(path)
    siblings = _roots(tree) & ((SCRIPT_NAMES - {path.stem}) | {"scripts"})
    assert not siblings, f"scripts/{path.name} imports {sorted(siblings)}: shared logic belongs in measure/"
    elsewhere = [entry for entry in _sys_path_entries(tree) if entry not in REPO_ROOT_FORMS]
    assert not elsewhere, f"scripts/{path.name} puts {elsewhere} on sys.path: only the repository root may go there"


@pytest.mark.parametrize("path", sorted(p for p in TESTS.glob("*.py") if p.name != HELPERS), ids=lambda p: p.name)
def test_tests_import_measure_not_scripts(path: Path) -> None:
    loaded = _scripts_imported_by(_tree(path)) - IMPORTABLE
    assert not loaded, f"tests/{path.name} imports the script(s) {sorted(loaded)}: test what they use in measure/"


def test_the_named_scripts_exist() -> None:
    """A script renamed or moved leaves no stale exception behind."""
    assert IMPORTABLE <= SCRIPT_NAMES, sorted(IMPORTABLE - SCRIPT_NAMES)
