#!/usr/bin/env python3
"""Device benchmark: bandwidth roofline, llama-server vs our engine (in-process and over Ray Serve), memory.

The command line of measure/device_bench.py, where its docstring (`--help`) says what is measured and how.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.device_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
