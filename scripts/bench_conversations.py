#!/usr/bin/env python3
"""Conversations that come back: how long does a returning turn wait for its first token, against a first turn?

The command line of measure/conversations.py, where its docstring (`--help`) says what is measured and how.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.conversations import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
