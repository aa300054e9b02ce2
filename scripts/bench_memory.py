#!/usr/bin/env python3
"""The memory model (serving/engine/memory.py) term by term against what llama.cpp says it allocated.

The command line of measure/memory_terms.py, where its docstring (`--help`) says what is measured and how.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.memory_terms import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
