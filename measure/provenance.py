"""Where and when a figure was measured: machine, date, commit, versions, the command. Every benchmark
writes this next to its numbers, so a figure can be compared (or not) later."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMIT_ENV = "LLAMA_SERVE_TUNE_COMMIT"  # the commit that runs, where the tree's git metadata is a stale copy


def commit() -> str:
    """The commit under measurement: $LLAMA_SERVE_TUNE_COMMIT when set (the GPU machine gets a copy of the
    working tree whose .git may be an older one), else `git rev-parse --short HEAD`."""
    return os.environ.get(COMMIT_ENV) or _run(["git", "rev-parse", "--short", "HEAD"])


def _run(cmd: Sequence[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO_ROOT).stdout.strip()
    except OSError:
        return ""


def provenance() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in _run(["lscpu"]).splitlines() if ln.startswith("Model name")),
               platform.processor())
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "cpu": cpu,
            "cpus": len(os.sched_getaffinity(0)), "commit": commit(),
            "dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])),
            "llama_cpp_python": _bindings_version(), "command": " ".join(sys.argv)}


def _bindings_version() -> str:
    """The installed package's version; a source tree on PYTHONPATH (the GPU recipe) has no metadata."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        module = sys.modules.get("llama_cpp")
        return str(getattr(module, "__version__", "unknown"))


def write_report(path: Path, report: dict[str, Any]) -> None:
    """A benchmark's results (with their provenance) as JSON at `path`, its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


def machine_info() -> dict[str, Any]:
    """The soak's and the fuzz's machine fields (their summaries' form, older than `provenance`'s)."""
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "python": platform.python_version()}


def git_commit() -> str:
    """The soak's and the fuzz's commit field: the short hash, flagged where serving/ or tuning/ (what they test)
    has uncommitted changes."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "serving", "tuning"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + (" (serving/ or tuning/ has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
