"""The engine's keeper inside one replica: it loads the engine in the background, switches it to new configs
(from Serve's user_config and the app's ConfigChannel), lends it to in-place tuning trials, samples its
metrics and says how it is. serving/replica/server.py's LlamaServer composes one and adds what is Serve's:
the deployment's lifecycle hooks, the relay from the ingress, and the routes.

Kept apart so each job has one home: the host knows nothing of HTTP or Serve (it is given its replica id and
the channel's handle), and the replica class knows nothing of loading, locks or trials.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from serving.engine.config import EngineConfig
from serving.replica.control import ConfigFollower
from serving.engine.core import Engine
from serving.engine.errors import EngineUnavailableError, Unavailable
from serving.engine.model_store import HubModel, fetch
from serving.replica.metrics import ReplicaMetrics
from serving.engine.traffic import TrafficSummary
from serving.replica.trials import Measure, TrialHost, TrialRun

log = logging.getLogger("serving")

METRICS_SAMPLE_S = 1.0
LEASE_CHECK_S = 1.0
CHANNEL_AT_START_S = 10.0  # how long a starting replica waits for the channel's last publish before loading
LOAD_FAILED = "the model failed to load; the reason is in the server log"


class HostState(str, Enum):
    """How the host's engine is, as /health reports it (serving/replica/server.py makes the HTTP answer)."""

    ok = "ok"
    loading = "loading"
    load_failed = "load_failed"
    stopped = "stopped"


@dataclass(frozen=True)
class HostLimits:
    """The deployment settings the host needs (ServerOptions' fields of the same names)."""

    max_queued_requests: int
    traffic_record: int
    tuning_lease_s: float
    config_poll_s: float
    load_timeout_s: float = 900.0


class BackgroundTasks:
    """The host's long-running asyncio tasks. The event loop keeps only weak references to tasks, so
    these are held here; they are cancelled together on shutdown, and `ended()` names any that stopped
    (the replica then reports itself unhealthy rather than running on half-working)."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        task.add_done_callback(_log_end)
        self._tasks[name] = task

    def ended(self) -> list[str]:
        return [name for name, task in self._tasks.items() if task.done()]

    def cancel_all(self) -> None:
        """Cancel every task; safe from any thread (Serve calls __del__ on the replica's loop)."""
        for task in self._tasks.values():
            if task.done():
                continue
            loop = task.get_loop()
            try:
                if _running_loop() is loop:
                    task.cancel()
                elif not loop.is_closed():
                    loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed in between: the task is gone with it
                pass


def fetch_model(config: EngineConfig) -> None:
    """A model named on the hub into this node's cache: the commit and files resolved where the app was built
    (a progress bar per file in the replica's log; nothing asked of the network once they are there)."""
    if isinstance(config.model, HubModel):
        fetch(config.model)


def _log_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s stopped", task.get_name(), exc_info=task.exception())


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class EngineHost:
    """One replica's engine, its config changes, its trials and its metrics."""

    def __init__(self, replica: str, limits: HostLimits, channel: Any, node: str = "this machine") -> None:
        self.replica, self._limits, self._node = replica, limits, node
        self.metrics = ReplicaMetrics(replica)
        self.engine: Engine | None = None  # None while loading, or after a failed load
        self._load_error: str | None = None  # for the operator (log, Serve, acks); clients see LOAD_FAILED
        self._loaded = threading.Event()
        self._loader: threading.Thread | None = None
        self._load_started: float | None = None  # monotonic time of the load under way (the first, or a retry)
        self._closing = False
        self._lock = asyncio.Lock()  # one config change at a time
        self._tasks = BackgroundTasks()
        self.trials = TrialHost(self.ready_engine, self._lock, limits.max_queued_requests, limits.tuning_lease_s)
        self._follower = ConfigFollower(channel, replica, self.apply, limits.config_poll_s)
        self._shapes_seen = 0  # the traffic record's count the metrics have taken shapes up to

    # -- config ----------------------------------------------------------------------------------------
    async def take(self, config: EngineConfig) -> None:
        """Serve's user_config, at start and on every change: the first starts loading (the channel's last
        publish instead, where there is one, and returns at once: the replica is up, /health says loading);
        later ones switch the engine and are told to the channel."""
        if self._loader is not None:
            await self.apply(config)
            await self._follower.adopt(config)
            return
        published = await self._follower.published(CHANNEL_AT_START_S)
        if published is not None and published != config:
            log.info("loading the config last published on the app's channel, not the app's build config")
            config = published
        self.metrics.model = config.served_name
        self._load_started = time.monotonic()
        self._loader = threading.Thread(target=self._load, args=(config,), daemon=True, name="engine-load")
        self._loader.start()
        self._tasks.start("metrics-sampler", self._sample_metrics())
        self._tasks.start("config-follower", self._follower.run())
        self._tasks.start("tuning-lease", self._expire_studies())

    async def apply(self, config: EngineConfig) -> None:
        """Switch the engine to `config`: drain, rebuild the context (weights kept if the model is the same)."""
        self.trials.abandon()  # a trial still measuring gives the engine back (the lock) within a round
        async with self._lock:
            await asyncio.to_thread(self._loaded.wait)
            if self.engine is None:  # the first load failed: try again with the new config
                self._loaded.clear()
                self._load_error = None
                self._load_started = time.monotonic()
                await asyncio.to_thread(self._load, config)
                if self.engine is None:
                    raise RuntimeError(self._load_error)
            elif config != self.engine.requested:  # the same config again: nothing to size or rebuild
                await asyncio.to_thread(fetch_model, config)  # a model newly named on the hub, before the swap
                await asyncio.to_thread(self.engine.reconfigure, config)
            self.metrics.model = config.served_name
            self.trials.finish()  # a published config ends an in-place study: it is the pick, or the old one

    def _load(self, config: EngineConfig) -> None:
        try:
            fetch_model(config)  # /health says loading meanwhile; a stalled transfer fails on the hub's timeouts
            self._load_started = time.monotonic()  # load_timeout_s bounds the load, not a long download
            if not config.model_path.is_file():  # a node of a cluster without the file: say which, and where
                raise FileNotFoundError(f"the model file {config.model_path} is not on {self._node}: copy it there "
                                        "(every node that runs a replica needs it at the same path)")
            engine = Engine(config, max_queued=self._limits.max_queued_requests,
                            traffic_limit=self._limits.traffic_record)
        except Exception as exc:  # reported by /health and every request, never a crash loop
            log.exception("engine load failed")
            self._load_error = f"{type(exc).__name__}: {exc}"
        else:
            if self._closing:  # shut down while loading: nobody else will close it
                engine.close()
            else:
                self.engine = engine
        finally:
            self._loaded.set()

    # -- background ------------------------------------------------------------------------------------
    async def _expire_studies(self) -> None:
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            await self.trials.expire()

    async def _sample_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_SAMPLE_S)
            engine = self.engine
            if engine is None:
                continue
            try:
                self.metrics.record_snapshot(engine.snapshot())
                self.record_shapes(engine)
            except Exception:
                log.warning("sampling the engine's metrics failed", exc_info=True)

    def record_shapes(self, engine: Engine) -> None:
        """The request histograms take the shapes the traffic record got since they last looked (on the
        event loop only: the sampler and /metrics, so `_shapes_seen` has one writer at a time)."""
        shapes, self._shapes_seen = engine.traffic_since(self._shapes_seen)
        self.metrics.record_shapes(shapes)

    # -- state -----------------------------------------------------------------------------------------
    def failure(self) -> str | None:
        """Why the replica should be restarted (its step thread died, a background task stopped, its engine
        has been loading longer than load_timeout_s: a load that hangs must not leave the replica loading
        forever, a fresh one may load), if so."""
        engine = self.engine
        if engine is not None and not engine.alive:
            return "the engine's step thread has stopped"
        started = self._load_started
        if engine is None and started is not None and not self._loaded.is_set():
            waited, limit = time.monotonic() - started, self._limits.load_timeout_s
            if waited > limit:
                return f"the engine has not loaded after {waited:.0f} s (load_timeout_s {limit:g})"
        ended = self._tasks.ended()
        if ended and not self._closing:
            return f"background task(s) {ended} stopped"
        return None

    def close(self) -> None:
        """Stop the background tasks, then the engine (a load still running closes what it loads)."""
        self._closing = True
        self._tasks.cancel_all()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def ready_engine(self) -> Engine:
        engine = self.engine
        if engine is None:
            if self._loaded.is_set() and self._load_error:
                raise EngineUnavailableError(Unavailable.load_failed, LOAD_FAILED)
            raise EngineUnavailableError(Unavailable.loading, "the model is still loading; retry shortly", 2)
        return engine

    @contextlib.asynccontextmanager
    async def engine_turn(self) -> AsyncIterator[Engine]:
        """A client request's turn on the engine: it waits while an in-place trial has it."""
        async with self.trials.client_turn():
            yield self.ready_engine()

    def state(self) -> HostState:
        """This replica's state for /health: read only, never waits for the engine."""
        engine = self.engine
        if engine is not None and engine.alive:
            return HostState.ok
        if engine is not None:
            return HostState.stopped
        if self._loaded.is_set() and self._load_error:
            return HostState.load_failed
        return HostState.loading

    @property
    def load_error(self) -> str | None:
        """Why the engine did not load (for the operator: /slots, the log, config acks), if it did not."""
        return self._load_error

    def traffic_summary(self) -> TrafficSummary:
        engine = self.engine
        if engine is None:
            return TrafficSummary.empty(self.replica, self._limits.traffic_record)
        return engine.traffic_summary(self.replica)

    # -- in-place tuning -------------------------------------------------------------------------------
    def served_config(self) -> EngineConfig:
        """The config this replica serves (outside a study's trials)."""
        study = self.trials.study
        return study.serving if study is not None else self.ready_engine().config

    async def tune_trial(self, study: str, trials: int, config: EngineConfig, measure: Measure) -> TrialRun:
        return await self.trials.run_trial(study, trials, config, measure)
