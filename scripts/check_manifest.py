#!/usr/bin/env python3
"""Check a RayService manifest against KubeRay's own CRD: the command line of measure/manifest.py, whose
docstring (`--help`) says how.

    python scripts/check_manifest.py --crd crd.yaml [--manifest deploy/kuberay/rayservice.yaml]
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.manifest import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
