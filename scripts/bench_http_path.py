#!/usr/bin/env python3
"""What the HTTP path costs, and what a deployment setting wins back (variants of our Serve app side by side).

The command line of measure/http_path.py, where its docstring (`--help`) says what is measured and how.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.http_path import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
