"""The engine replica on Ray Serve: one Engine per GPU, kept by an EngineHost (serving/replica/host.py: loading,
config following, trials, metrics), behind one FastAPI app that this replica composes from the OpenAI routes
(serving/openai/routes.py) and its control routes (serving/replica/control_routes.py).

HTTP reaches the app in one of two ways: the ingress (serving/front/ingress.py) relays each request through a
handle (`forward`), or, with `ingress=engine`, Serve's proxy hands it to the replica itself (EngineAsIngress,
with the app's HTTP rules around it). Serve's hooks (reconfigure, check_health, routing stats) and what the
tuner and the other replicas ask through handles (served_config, tune_trial, replica_summary, metrics_text,
traffic_summary) are methods here, called by name.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict
from collections.abc import AsyncIterator
from typing import Any

from serving.engine import llama as _llama  # load order: ray before libllama, see serving/engine/llama.py

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.engine.config import EngineConfig, available_cpus, default_threads
from serving.engine.core import Engine
from serving.engine.traffic import TrafficSummary
from serving.front.http import HttpRules
from serving.front.ingress import HealthReport
from serving.front.relay import RelayedPart, RelayedRequest, run_relayed
from serving.openai.anthropic_routes import MessagesRoutes
from serving.openai.routes import OpenAIRoutes, build_api
from serving.replica.affinity import RouteNote, RoutedBy
from serving.replica.control import DEPLOYMENT_NAME
from serving.replica.control_routes import ControlRoutes, gather_traffic
from serving.replica.host import LOAD_FAILED, EngineHost, HostLimits, HostState
from serving.replica.metrics import ReplicaMetrics
from serving.replica.node import here
from serving.replica.options import ServerOptions, stream_interval_ms
from serving.replica.routing import IN_TRIAL
from serving.replica.trials import Measure, TrialRun

log = logging.getLogger("serving")

MAX_PART_SPACING_S = 0.25  # a stream's bytes never wait longer than this for company
HEALTH_CHECK_PERIOD_S = 10


def health_report(state: HostState) -> HealthReport:
    """The host's state as /health answers it (the ingress combines every replica's)."""
    if state is HostState.ok:
        return HealthReport(200, {"status": "ok"})
    if state is HostState.stopped:
        return HealthReport(503, {"status": "error", "error": "the engine has stopped"})
    if state is HostState.load_failed:
        return HealthReport(503, {"status": "error", "error": LOAD_FAILED})
    return HealthReport(503, {"status": "loading"}, {"Retry-After": "2"})


class LlamaServer:
    """One engine replica: Serve's hooks, the relay from the ingress and the app it composes, around an
    EngineHost that loads the engine, follows config changes and hosts tuning trials."""

    def __init__(self, options: dict[str, Any], channel: DeploymentHandle) -> None:
        self._options = ServerOptions(**options)
        replica = serve.get_replica_context().replica_id.unique_id
        place = here(replica, _llama.gpu_offload_supported())
        node = f"node {place.hostname} ({place.node_ip or 'no Ray node'})"
        self.host = EngineHost(replica, HostLimits(self._options.max_queued_requests, self._options.traffic_record,
                                                   self._options.tuning_lease_s, self._options.config_poll_s,
                                                   self._options.load_timeout_s),
                               channel, node)
        self.metrics: ReplicaMetrics = self.host.metrics
        self.slot_save_path = self._options.slot_save_path
        self.build_info = f"llama-cpp-python {_llama.BINDINGS_VERSION}"
        self._relays = 0  # requests in flight here (relayed, or HTTP with ingress=engine): their streams share the pace
        self._peers: DeploymentHandle | None = None  # this deployment's handle, for /traffic (made on first use)
        self.api: FastAPI = build_api(OpenAIRoutes(self).router(), MessagesRoutes(self).router(),
                                      ControlRoutes(self).router())

    # -- Serve's hooks -------------------------------------------------------------------------------
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve calls this with the `user_config` at start and on every change of it."""
        await self.host.take(EngineConfig(**user_config["engine"]))

    def check_health(self) -> None:
        """Serve's liveness probe: a replica whose step thread died, or whose config follower or metrics
        sampler stopped, is restarted."""
        failure = self.host.failure()
        if failure is not None:
            raise RuntimeError(failure)

    def __del__(self) -> None:
        """Serve calls this on shutdown."""
        if hasattr(self, "host"):  # absent if __init__ failed early
            self.host.close()

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve polls this for the request router (serving/replica/routing.py): whether a trial holds the engine."""
        return {IN_TRIAL: self.host.trials.busy_with_trials}

    # -- for the routes ------------------------------------------------------------------------------
    def ready_engine(self) -> Engine:
        return self.host.ready_engine()

    @contextlib.asynccontextmanager
    async def engine_turn(self) -> AsyncIterator[Engine]:
        async with self.host.engine_turn() as engine:
            yield engine

    def stream_spacing(self) -> float:
        """Seconds between a stream's events (serving/openai/routes.py) and relayed parts: `stream_interval_ms` per
        stream that can be generating (relayed requests, at most one per slot), so this replica sends about
        1000 / stream_interval_ms events and parts a second however many streams share it; never over
        MAX_PART_SPACING_S."""
        engine = self.host.engine
        if engine is None:
            return 0.0
        generating = min(self._relays, engine.config.n_parallel)
        interval = stream_interval_ms(self._options.stream_interval_ms, engine.config,
                                      _llama.gpu_offload_supported(), available_cpus(),
                                      default_threads())
        return min(interval / 1000 * max(1, generating), MAX_PART_SPACING_S)

    def health_report(self) -> HealthReport:
        """What /health and the ingress's health watch (every 0.5 s) read."""
        return health_report(self.host.state())

    # -- in-place tuning (tuning/inplace.py calls these through a handle) -----------------------------
    async def served_config(self) -> EngineConfig:
        return self.host.served_config()

    async def tune_trial(self, study: str, trials: int, config: EngineConfig, measure: Measure) -> TrialRun:
        """A trial of an in-place study, on this replica's engine and weights (serving/replica/trials.py)."""
        return await self.host.tune_trial(study, trials, config, measure)

    # -- the relay from the ingress ------------------------------------------------------------------
    async def forward(self, request: RelayedRequest, routed: RouteNote | None = None) -> AsyncIterator[RelayedPart]:
        """A request the ingress relayed, answered by this replica's own app (serving/front/relay.py); `routed`:
        why the router sent it here (serving/replica/routing.py), counted in /metrics."""
        if routed is not None:
            self.metrics.record_routed(routed.by if routed.replica == self.host.replica else RoutedBy.overflow)
        self._relays += 1
        try:
            async for part in run_relayed(self.api, request, self.stream_spacing):
                yield part
        finally:
            self._relays -= 1

    # -- what the other replicas' control routes ask through a handle --------------------------------
    def place(self) -> dict[str, Any]:
        """This replica's node, the GPUs Ray gave it and their memory now (serving/replica/node.py)."""
        return here(self.host.replica, _llama.gpu_offload_supported()).as_dict()

    def replica_summary(self) -> dict[str, Any]:
        """What /slots lists for this replica among all of them (Serve's broadcast asks every one)."""
        engine = self.host.engine
        return {"replica": self.host.replica, "node": self.place(), "health": self.health_report().body,
                "config": engine.config.to_yaml_dict() if engine is not None else None,
                "counters": asdict(engine.snapshot().counters) if engine is not None else {},
                "load_error": self.host.load_error}

    async def metrics_text(self) -> str:
        """This replica's Prometheus text, its gauges refreshed from the engine now. Async, so a broadcast runs
        it on the replica's event loop, the one writer of the shapes the metrics took (`record_shapes`)."""
        engine, stats = self.host.engine, None
        if engine is not None:
            try:
                stats = engine.snapshot()
                self.host.record_shapes(engine)
            except Exception:
                log.warning("reading the engine's stats for /metrics failed", exc_info=True)
        return self.metrics.exposition(stats).decode()

    async def all_traffic(self) -> tuple[TrafficSummary, int | None]:
        """Every engine replica's traffic merged, and how many did not answer (what /traffic shows, and what
        the tuner's `--workload live` replays)."""
        return await gather_traffic(self.peers(), await self.traffic_summary())

    async def traffic_summary(self) -> TrafficSummary:
        """This replica's traffic record as a value (what /traffic asks every replica for)."""
        return self.host.traffic_summary()

    def peers(self) -> DeploymentHandle | None:
        """A handle on this replica's own deployment, to ask all its replicas; None outside a Serve app."""
        if self._peers is None:
            try:
                context = serve.get_replica_context()
                self._peers = serve.get_deployment_handle(context.replica_id.deployment_id.name,
                                                          app_name=context.app_name)
            except Exception:
                log.warning("no handle on this deployment: /traffic answers for this replica alone", exc_info=True)
        return self._peers


class _EngineAsIngress(LlamaServer):
    """An engine replica that takes HTTP itself (`ingress=engine`): the app's rules around its own app, as the
    ingress holds them otherwise; its requests in flight share the stream pace, as relayed ones do. Serve asks
    for the app once the replica is made (`serve.ingress()` without an app: the app is late-bound)."""

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return HttpRules(self._options.api_key, tuple(self._options.cors_origins)).around(self._counted)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._relays += 1
        try:
            await self.api(scope, receive, send)
        finally:
            self._relays -= 1


ENGINE_REPLICA = serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=HEALTH_CHECK_PERIOD_S)(LlamaServer)
ENGINE_AS_INGRESS = serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=HEALTH_CHECK_PERIOD_S)(
    serve.ingress()(_EngineAsIngress))
