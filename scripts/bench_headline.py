#!/usr/bin/env python3
"""The headline benchmark: goodput on traces, ours (tuned) vs llama-server as a user starts it vs the article's flags.

The command line of measure/headline.py, where its docstring (`--help`) says what is measured and how.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.headline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
