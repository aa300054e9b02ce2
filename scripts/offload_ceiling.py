#!/usr/bin/env python3
"""What VRAM would a mixture of experts need to run R times as fast as llama-server `--fit` does?

The command line of measure/offload_ceiling.py, where its docstring (`--help`) says what is measured and how.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.offload_ceiling import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
