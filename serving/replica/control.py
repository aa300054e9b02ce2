"""ConfigChannel: a tiny deployment in the app that carries live engine-config changes to every replica,
and ConfigFollower, the replica's side of it.

Serve's own `user_config` reaches all replicas in place only for apps deployed from a config file
(`serve deploy`); an app started with `serve run serving.app:main` is redeployed with fresh replicas on
every change, which would reload the weights. This channel works for both: the tuner (or an operator)
publishes a config here, each LlamaServer replica polls it, drains, rebuilds its llama.cpp context and
acknowledges, and the publisher waits for every replica's acknowledgement. It lives and dies with the app.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

from serving.engine.config import EngineConfig

log = logging.getLogger(__name__)

CHANNEL_NAME = "ConfigChannel"
DEPLOYMENT_NAME = "LlamaServer"  # the engine replicas' deployment (serving/replica/server.py), named for tuning/


@dataclass(frozen=True)
class Version:
    """A published config's place in the channel's history: the epoch changes when the channel restarts, so a
    restarted channel's version 1 is never taken for an old one."""

    epoch: str
    version: int


@dataclass(frozen=True)
class Latest:
    """What a replica polls: the latest published config (None before any) and its version."""

    at: Version
    engine: EngineConfig | None


@dataclass(frozen=True)
class Ack:
    """A replica's acknowledgement: the version it applied, or tried to (`error` says why it could not)."""

    at: Version
    error: str | None = None


@serve.deployment(name=CHANNEL_NAME, num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0})
class ConfigChannel:
    """Holds the latest published engine config and each replica's acknowledgement of it."""

    def __init__(self) -> None:
        self._at = Version(uuid.uuid4().hex, 0)  # a restarted channel never looks like an old version
        self._engine: EngineConfig | None = None
        self._acks: dict[str, Ack] = {}

    def publish(self, engine: EngineConfig | dict[str, Any]) -> Version:
        """Announce a new engine config: the typed config (the tuner's write-back), or an operator's dict of
        settings, validated here so a bad one never reaches a replica."""
        self._engine = engine if isinstance(engine, EngineConfig) else EngineConfig(**engine)
        self._at = Version(self._at.epoch, self._at.version + 1)
        return self._at

    def adopt(self, engine: EngineConfig) -> Version:
        """A config Serve's `user_config` gave the replicas (`serve deploy` with a changed file), published unless
        it is the latest already (each replica reports it): so a replica that starts later loads it, not an
        older publish. The tuner's `publish` always makes a new version, since a version ends a study."""
        if engine != self._engine:
            return self.publish(engine)
        return self._at

    def latest(self) -> Latest:
        return Latest(self._at, self._engine)

    def ack(self, replica: str, ack: Ack) -> None:
        self._acks[replica] = ack

    def acks(self) -> dict[str, Ack]:
        return dict(self._acks)


class ConfigFollower:
    """A replica's loop over the channel: apply each newly published config once, acknowledge it.

    Nothing stops it but cancellation. Any round can fail (the channel restarting, an ack lost, a config
    the engine cannot take): the failure is logged and the next round goes on. A config is applied once
    per (epoch, version), whether that worked or not (a failing config is reported, not retried in a
    loop that would drain the engine again and again); its acknowledgement is retried every round until
    the channel has it, since the publisher waits for it.

    `channel` is the ConfigChannel's DeploymentHandle (anything with awaitable `latest.remote()` and
    `ack.remote(...)`); `apply` switches the engine and raises if it cannot.
    """

    def __init__(self, channel: Any, replica: str, apply: Callable[[EngineConfig], Awaitable[None]],
                 poll_s: float) -> None:
        self._channel, self._replica, self._apply, self._poll_s = channel, replica, apply, poll_s
        self.applied: Version | None = None  # the last version applied (or tried)
        self.acked: Version | None = None  # the last version the channel has an ack for
        self._error: str | None = None

    async def published(self, timeout_s: float) -> EngineConfig | None:
        """The config published last, for a replica about to load its first: one that starts after a publish
        (scaled up, restarted, back with its node) loads it at once rather than serve the app's build config
        until its first poll. Taken as applied (the next round acknowledges it). None when nothing was
        published, or the channel does not answer within `timeout_s` (then the next round applies it)."""
        try:
            latest: Latest = await asyncio.wait_for(self._latest(), timeout_s)
            key, engine = latest.at, latest.engine
        except Exception:
            log.warning("config channel unreachable at start; loading the app's config, following the channel "
                        "from the next round", exc_info=True)
            return None
        if engine is not None:
            self.applied = key
        return engine

    async def adopt(self, engine: EngineConfig) -> None:
        """Tell the channel of a config Serve gave this replica after its start (ConfigChannel.adopt); a
        failure is logged: the replica switched, only a later replica's start would miss it."""
        try:
            await self._channel.adopt.remote(engine)
        except Exception:
            log.warning("telling the config channel of Serve's new user_config failed", exc_info=True)

    async def _latest(self) -> Latest:
        latest: Latest = await self._channel.latest.remote()
        return latest

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        """One round; never raises (except CancelledError, which ends the loop)."""
        try:
            latest = await self._latest()
            key, engine = latest.at, latest.engine
        except Exception:
            log.warning("config channel unreachable or its answer malformed; trying again next round",
                        exc_info=True)
            return
        if engine is None:
            return
        if key != self.applied:
            self.applied, self._error = key, None
            try:
                await self._apply(engine)
            except Exception as exc:
                log.exception("applying the published config %s failed", key)
                self._error = f"{type(exc).__name__}: {exc}"
        if key != self.acked:
            try:
                await self._channel.ack.remote(self._replica, Ack(key, self._error))
            except Exception:
                log.warning("acknowledging config %s failed; retrying next round", key, exc_info=True)
                return
            self.acked = key
