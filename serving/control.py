"""ConfigChannel: a tiny deployment in the app that carries live engine-config changes to every replica.

Serve's own `user_config` reaches all replicas in place only for apps deployed from a config file
(`serve deploy`); an app started with `serve run serving.app:main` is redeployed with fresh replicas on
every change, which would reload the weights. This channel works for both: the tuner (or an operator)
publishes a config here, each LlamaServer replica polls it, drains, rebuilds its llama.cpp context and
acknowledges, and the publisher waits for every replica's acknowledgement. It lives and dies with the app.
"""

from __future__ import annotations

import uuid
from typing import Any

from ray import serve

from serving.config import EngineConfig

CHANNEL_NAME = "ConfigChannel"


@serve.deployment(name=CHANNEL_NAME, num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0})
class ConfigChannel:
    """Holds the latest published engine config and each replica's acknowledgement of it."""

    def __init__(self) -> None:
        self._epoch = uuid.uuid4().hex  # a restarted channel never looks like an old version
        self._version = 0
        self._engine: dict[str, Any] | None = None
        self._acks: dict[str, dict[str, Any]] = {}

    def publish(self, engine: dict[str, Any]) -> dict[str, Any]:
        """Announce a new engine config (validated here, so a bad one never reaches a replica)."""
        EngineConfig(**engine)
        self._version += 1
        self._engine = engine
        return {"epoch": self._epoch, "version": self._version}

    def latest(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "version": self._version, "engine": self._engine}

    def ack(self, replica: str, epoch: str, version: int, error: str | None = None) -> None:
        self._acks[replica] = {"epoch": epoch, "version": version, "error": error}

    def acks(self) -> dict[str, dict[str, Any]]:
        return dict(self._acks)

    def forget(self, replica: str) -> None:
        """A replica shutting down stops counting."""
        self._acks.pop(replica, None)
