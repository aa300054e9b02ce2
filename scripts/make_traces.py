#!/usr/bin/env python3
"""Synthetic traces in Mooncake's format of the public traces' shapes (chat, agent), seeded.

The command line of measure/traces.py, where its docstring (`--help`) says what each shape imitates.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.traces import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
