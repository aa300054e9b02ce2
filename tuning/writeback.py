"""Write-back: the winning config to configs/tuned.yaml (atomically), and to a running Serve app (live).

The file is what `serve run serving.app:main` loads next time. The live path publishes the config on the
app's ConfigChannel (serving/replica/control.py) and waits until every LlamaServer replica has drained, rebuilt its
context and acknowledged; requests arriving meanwhile wait in the engine's queue and none fails.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from serving.engine.config import EngineConfig
from tuning.serving_app import engine_apps, named_app

if TYPE_CHECKING:  # the channel's records; importing the channel module loads Ray
    from serving.replica.control import Ack, Version


def write_config(path: Path, config: EngineConfig, header: str = "") -> None:
    """Write `config` as an `engine:` YAML file; readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Written by python -m tuning.search on {stamp}."] + [f"# {line}" for line in header.splitlines()]
    text = "\n".join(lines) + "\n" + yaml.safe_dump({"engine": config.to_yaml_dict()}, sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class ApplyResult:
    """What happened when applying to a live app."""

    applied: bool
    message: str
    replicas: dict[str, Ack] | None = None  # each replica's acknowledgement of the published version


def apply_to_serve(config: EngineConfig, app_name: str | None = None, address: str | None = "auto",
                   timeout_s: float = 600.0) -> ApplyResult:
    """Publish `config` to the running app `app_name` (default: the one serving LlamaServer) and wait for
    all its replicas to switch.

    Connects to the Ray cluster at `address` unless this process is already connected. Returns
    applied=False with the reason when no such app is running (then only the file was written).
    """
    import ray
    from ray import serve

    from serving.replica.control import CHANNEL_NAME, DEPLOYMENT_NAME

    if not ray.is_initialized():
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except (ConnectionError, RuntimeError) as exc:
            return ApplyResult(False, f"no running Ray cluster at {address!r} ({exc}); only the file was written")
    apps = engine_apps()
    app_name = named_app(apps, app_name)
    if app_name not in apps:
        running = sorted(apps) or "none"
        named = f" {app_name}" if app_name else ""
        return ApplyResult(False, f"no Serve app{named} with a {DEPLOYMENT_NAME} deployment to apply to "
                                  f"(running: {running}); only the file was written")
    channel = serve.get_deployment_handle(CHANNEL_NAME, app_name=app_name)
    published: Version = channel.publish.remote(config).result()
    return _wait_for_acks(channel, published, app_name, DEPLOYMENT_NAME, timeout_s)


def _wait_for_acks(channel: Any, published: Version, app_name: str, deployment: str,
                   timeout_s: float) -> ApplyResult:
    from ray import serve
    from ray.serve.schema import ReplicaState

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = serve.status().applications[app_name].deployments[deployment].replica_states
        running = states.get(ReplicaState.RUNNING, 0)
        acks: dict[str, Ack] = channel.acks.remote().result()
        done = {r: a for r, a in acks.items() if a.at == published}
        errors = {r: a.error for r, a in done.items() if a.error}
        if errors:
            return ApplyResult(False, f"replicas rejected the config: {errors}", done)
        if running and len(done) >= running:
            return ApplyResult(True, f"applied to {len(done)} replica(s) of app {app_name!r}", done)
        time.sleep(0.5)
    return ApplyResult(False, f"timed out after {timeout_s:.0f}s waiting for replicas to switch")
