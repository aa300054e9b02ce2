"""The serving rooms keep their rules: what a module may load is checked in a fresh interpreter (an import
made by another test would hide it here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

LIBLLAMA = ("llama_cpp", "serving.llama", "serving.engine", "serving.structured")


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["serving.http", "serving.ingress", "serving.relay", "serving.api",
                                    "serving.slot_files", "serving.prompt_cache"])
def test_the_rooms_without_a_model_load_no_libllama(module: str) -> None:
    """The ingress holds no model: importing it (or the HTTP room, the request shapes, the relay) must not
    load libllama, the engine or the grammar compiler."""
    loaded = _loaded_after(module)
    assert not loaded & set(LIBLLAMA), f"{module} loads {sorted(loaded & set(LIBLLAMA))}"


def test_binding_calls_live_in_serving_llama_alone() -> None:
    """Every llama.cpp binding call goes through serving/llama.py (checked there against the vendored llama.h):
    no other module of serving/ imports the bindings, from llama_cpp or through serving.llama."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "serving"
    offenders = []
    for path in sorted(root.glob("*.py")):
        if path.name == "llama.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "llama_cpp" or n.startswith("llama_cpp.") for n in names):
                offenders.append(f"{path.name}:{node.lineno} imports {names}")
            if isinstance(node, ast.ImportFrom) and node.module == "serving.llama" and any(
                    a.name in ("llama_cpp", "ll") for a in node.names):
                offenders.append(f"{path.name}:{node.lineno} takes the raw bindings from serving.llama")
    assert offenders == []
