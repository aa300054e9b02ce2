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
