"""A Ray cluster of several nodes on this machine: a head and more raylets (`ray start --address ...`), each
declaring its own resources (`--num-gpus 1` is accepted without a GPU: Ray only schedules by it), as Ray's own
tests build clusters. For the cluster tests and the soak's node-loss phase.

Ray turns on token authentication for `ray start --head` here, so every node and client of the cluster runs
with RAY_AUTH_MODE=token and a token of the cluster's own (`env`: RAY_AUTH_TOKEN_PATH; `ray start` looks for
~/.ray/auth_token otherwise, which only a machine that ran Ray before has). The cluster keeps its files under
a temp dir of its own, and `stop` ends only its processes (never `ray stop`, which would end every Ray on the
machine: a test session's too).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from measure.targets import free_loopback_port

START_TIMEOUT_S = 180.0
TOKEN_FILE = "auth_token"  # the cluster's own Ray token, in its temp dir (RAY_AUTH_TOKEN_PATH)
# runs a command with SIGINT's default action restored: a process started in the background by a
# non-interactive shell ignores SIGINT, its children inherit that, and `serve run` shuts Serve down only on Ctrl-C
WITH_CTRL_C = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
               "os.execvp(sys.argv[1], sys.argv[1:])")
REPO = Path(__file__).resolve().parents[1]


def cli(name: str) -> str:
    """The console script `name` (ray, serve, schemathesis) of this interpreter's environment, where a venv that
    is not activated keeps it; else the one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else name


@dataclass
class LocalCluster:
    """The cluster's address and environment, and its worker nodes by name (`node_a` is the head)."""

    temp_dir: Path
    port: int
    ip: str
    nodes: list[str] = field(default_factory=list)
    dashboard_port: int | None = None  # the head's dashboard (what `serve deploy` talks to), when started
    settings: dict[str, str] = field(default_factory=dict)  # environment every node starts with (Serve's switches)

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a client of this cluster (`serve run`, the tuner, the soak) runs with."""
        dashboard = {"RAY_DASHBOARD_ADDRESS": f"http://127.0.0.1:{self.dashboard_port}"} if self.dashboard_port else {}
        return {**os.environ, "RAY_TMPDIR": str(self.temp_dir), "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN_PATH": str(self.temp_dir / TOKEN_FILE),
                "RAY_ADDRESS": self.address, "RAY_USAGE_STATS_ENABLED": "0", **dashboard, **self.settings}

    @classmethod
    def start(cls, gpus_per_node: int = 1, cpus_per_node: int = 2, workers: int = 1,
              dashboard: bool = False, settings: dict[str, str] | None = None) -> LocalCluster:
        """A head and `workers` more nodes; each node has a resource named after it (`node_a`, `node_b`, ...).
        With `dashboard`, the head runs Ray's dashboard, which `serve deploy` needs (~250 MB more). `settings`:
        environment every node starts with, as an operator sets Serve's cluster-wide switches at `ray start`."""
        temp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths are length-limited
        token = temp / TOKEN_FILE
        token.write_text(secrets.token_hex(32))  # as `ray get-auth-token --generate` makes one
        token.chmod(0o600)
        board_port = free_loopback_port() if dashboard else None
        cluster = cls(temp, free_loopback_port(), _node_ip(), dashboard_port=board_port, settings=dict(settings or {}))
        board = ["--include-dashboard=false"]
        if dashboard:
            board = ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                     f"--dashboard-port={cluster.dashboard_port}"]
        cluster._ray_start(["--head", f"--port={cluster.port}", *board], gpus_per_node, cpus_per_node)
        for _ in range(workers):
            cluster.add_node(gpus_per_node, cpus_per_node)
        return cluster

    def add_node(self, gpus: int = 1, cpus: int = 2) -> str:
        """One more raylet joining the head; its name."""
        self._ray_start([f"--address={self.address}"], gpus, cpus)
        return self.nodes[-1]

    def _ray_start(self, args: list[str], gpus: int, cpus: int) -> None:
        name = f"node_{chr(ord('a') + len(self.nodes))}"
        env = {**self.env, "RAY_ADDRESS": ""}
        subprocess.run([cli("ray"), "start", *args, f"--num-gpus={gpus}", f"--num-cpus={cpus}", "--disable-usage-stats",
                        f"--resources={json.dumps({name: 1})}"], env=env, check=True, timeout=START_TIMEOUT_S,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.nodes.append(name)

    def raylet_pid(self, node: str) -> int | None:
        """The raylet of the node that declared resource `node`, if it runs."""
        for pid, args in _processes():
            if "raylet/raylet" in args and str(self.temp_dir) in args and f"--static_resource_list={node}," in args:
                return pid
        return None

    def kill_node(self, node: str) -> None:
        """A node lost: its raylet killed (SIGKILL); its workers, replicas included, die with it."""
        pid = self.raylet_pid(node)
        if pid is None:
            raise LookupError(f"no raylet of {node} runs")
        os.kill(pid, signal.SIGKILL)
        self.nodes.remove(node)

    def stop(self) -> None:
        """Every process of this cluster (by its temp dir), then its files."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            mine = [pid for pid, args in _processes() if str(self.temp_dir) in args]
            for pid in mine:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if mine and sig == signal.SIGTERM:
                time.sleep(3)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class ClusterApp:
    """`serve run` of the shipped configs/serve.yaml (its port, app args and proxy location changed) against a
    cluster, in a subprocess, as a user runs it there."""

    def __init__(self, cluster: LocalCluster, work_dir: Path, args: dict[str, Any], port: int | None = None) -> None:
        shipped = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
        self.port = port or free_loopback_port()
        shipped["http_options"]["port"] = self.port
        # every node of this cluster is this machine: their proxies would all listen on the one port, the kernel
        # would spread connections over them, and a lost node would take its proxy's connections with it. On
        # a real cluster clients reach a node by its own address (or through a load balancer that drops it).
        shipped["proxy_location"] = "HeadOnly"
        shipped["applications"][0]["args"] = args
        tag = f"{self.port}-{time.monotonic_ns()}"
        config = work_dir / f"serve-{tag}.yaml"
        config.write_text(yaml.safe_dump(shipped))
        self.log = work_dir / f"serve-{tag}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", WITH_CTRL_C, cli("serve"), "run", str(config)],
                                         cwd=REPO, env=cluster.env, stdout=log, stderr=subprocess.STDOUT)

    def health(self, url: str | None = None) -> dict[str, Any]:
        """/health's body ({} when it does not answer), at the app's port or at `url` (a replica's own port)."""
        try:
            return dict(httpx.get(f"{url or self.url}/health", timeout=5).json())
        except (httpx.HTTPError, ValueError):
            return {}

    def wait(self, check: Callable[[dict[str, Any]], bool], what: str, timeout_s: float,
             url: str | None = None) -> dict[str, Any]:
        """/health (at `url` if given) once `check` holds; RuntimeError when `serve run` ended or time ran out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            health = self.health(url)
            if check(health):
                return health
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run ended ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        raise RuntimeError(f"no {what} within {timeout_s:.0f} s; /health {self.health(url)}")

    def slots(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}/slots", timeout=30)
        resp.raise_for_status()
        return dict(resp.json())

    def stop(self) -> None:
        """As a user stops `serve run`, with Ctrl-C: it shuts Serve down, so the replicas give their GPUs back (a
        SIGTERM would leave the app running on the cluster); then harder if it does not end."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


DIRECT_PORTS = 20  # ports Serve may give the ingress replicas under direct ingress, from the first


def direct_ingress_settings(first_port: int) -> dict[str, str]:
    """Serve's direct ingress (cluster-wide, at `ray start`): the ingress replica answers HTTP on a port of its own,
    from `first_port` on."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first_port + DIRECT_PORTS)}


def direct_url(app: ClusterApp, first_port: int, timeout_s: float) -> str:
    """The URL of the ingress replica under direct ingress: the first port of its range that answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for port in range(first_port, first_port + DIRECT_PORTS):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                return f"http://127.0.0.1:{port}"
            except httpx.HTTPError:
                continue
        if app.proc.poll() is not None:
            raise RuntimeError(f"serve run ended: {app.log.read_text()[-3000:]}")
        time.sleep(1)
    raise RuntimeError(f"no ingress replica answered on ports {first_port}+ within {timeout_s:.0f} s")


def all_serving(replicas: int) -> Callable[[dict[str, Any]], bool]:
    """A /health check: ok, with this many replicas serving."""
    return lambda health: health.get("status") == "ok" and health.get("replicas") == replicas


def _processes() -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append((int(entry.name), args))
    return found


def _node_ip() -> str:
    """The address Ray's nodes use on this machine (what `ray start` picks)."""
    from ray._private.services import get_node_ip_address

    return str(get_node_ip_address())
