"""Start and stop the Serve app on loopback for the soak and fuzz scripts (scripts/soak.py, scripts/fuzz_api.py).

The app is built exactly as `serve run serving.app:main KEY=VALUE ...` builds it, but in this process: a
private local Ray cluster (its own temp dir; RAY_ADDRESS is ignored, so no running cluster is touched), the
HTTP proxy on 127.0.0.1 and a free port. Running the driver here lets the soak find the replica's worker
process (to SIGKILL it) and publish live configs on the app's ConfigChannel the way the tuner does (the
publishing is the tuner's: scripts/soak.py calls it on `APP_NAME`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
APP_NAME = "llama"
DEFAULT_APP_ARGS: dict[str, Any] = {"config": str(REPO_ROOT / "configs" / "default.yaml"),
                                    "n_parallel": 4, "n_ctx": 4096}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` words (as `serve run` takes them) into a dict; values stay strings, as serve run passes them."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _descendants(root: int) -> set[int]:
    """PIDs of every process below `root` (from /proc), so only this run's Ray workers are ever matched."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class LoopbackApp:
    """The app on http://127.0.0.1:<port>, in a private Ray cluster owned by this process."""

    def __init__(self, app_args: dict[str, Any] | None = None, port: int | None = None, num_cpus: int = 4,
                 log_copy_dir: Path | None = None) -> None:
        self.app_args = {**DEFAULT_APP_ARGS, **(app_args or {})}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_cpus = num_cpus
        self.log_copy_dir = log_copy_dir
        self._tmp: str | None = None

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> float:
        """Start Ray, Serve and the app; return the seconds until /health answered 200."""
        os.environ.pop("RAY_ADDRESS", None)
        from serving.engine import llama as _llama  # noqa: F401  (load order: ray before libllama, see serving/engine/llama.py)
        import ray
        from ray import serve

        from serving.app import AppArgs, main

        t0 = time.monotonic()
        self._tmp = tempfile.mkdtemp(prefix="lst-ray-", dir="/tmp")  # short: Ray's socket paths are length-limited
        ray.init(address="local", num_cpus=self.num_cpus, include_dashboard=False, _temp_dir=self._tmp,
                 logging_level=logging.ERROR, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        serve.run(main(AppArgs.model_validate(dict(self.app_args))), name=APP_NAME, route_prefix="/")
        self.wait_healthy(timeout_s - (time.monotonic() - t0))
        return time.monotonic() - t0

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + max(timeout_s, 1.0)
        last = "no answer"
        with httpx.Client(timeout=5) as http:
            while time.monotonic() < deadline:
                try:
                    r = http.get(f"{self.url}/health")
                    if r.status_code == 200:
                        return
                    last = f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                time.sleep(0.5)
        raise TimeoutError(f"{self.url}/health not 200 within {timeout_s:.0f} s (last: {last})")

    def stop(self) -> None:
        """Shut down Serve and Ray; copy Serve's logs (replica tracebacks) first if asked; remove the temp dir."""
        import ray

        if not ray.is_initialized():
            return
        try:
            from ray import serve

            serve.shutdown()
        except Exception as exc:  # still shut Ray down
            print(f"serve.shutdown failed: {exc!r}", flush=True)
        self.copy_logs()
        ray.shutdown()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def copy_logs(self) -> None:
        if not (self.log_copy_dir and self._tmp):
            return
        for logs in Path(self._tmp).glob("session_*/logs/serve"):
            dest = self.log_copy_dir / "serve-logs"
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(logs, dest, ignore=shutil.ignore_patterns("*.sock"))

    def __enter__(self) -> LoopbackApp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- the replica process -------------------------------------------------------------------------
    def replica_pids(self) -> list[int]:
        """Worker processes of this run's LlamaServer replicas (their titles are `ray::ServeReplica:<app>:...`)."""
        from serving.replica.control import DEPLOYMENT_NAME

        tag = f"ServeReplica:{APP_NAME}:{DEPLOYMENT_NAME}"
        return sorted(pid for pid in _descendants(os.getpid()) if tag in _cmdline(pid))

    def kill_replica(self) -> int:
        """SIGKILL one replica's worker process; return its pid."""
        pids = self.replica_pids()
        if not pids:
            raise RuntimeError("no LlamaServer replica process found among this run's Ray workers")
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]
