#!/usr/bin/env python3
"""Each workload's pick measured on every workload: tuned configs crossed with traffic workloads, in one run.

The command line of measure/workload_cross.py, where its docstring (`--help`) says what is measured and how.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.workload_cross import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
