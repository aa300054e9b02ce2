"""The Ray Serve app: an ingress (serving/front/ingress.py) that takes every HTTP request, and one engine replica
per GPU (LlamaServer here), each one Engine behind the OpenAI-compatible routes of serving/openai/routes.py plus
the control routes /slots, /props, /metrics and /traffic. The ingress answers /health itself, from what the engine
replicas last told its background watch, and relays every other request to one (serving/front/relay.py). With
`ingress=engine` there is no ingress: the engine replicas take HTTP themselves (EngineAsIngress).

`serve run serving.app:main [config=FILE] [KEY=VALUE ...]` builds it: KEYs are EngineConfig fields or
ServerOptions fields. The engine config travels as the deployment's `user_config` (the first load, and
`serve deploy` with a new file); live changes (the tuner's write-back) come through the app's
ConfigChannel (serving/replica/control.py), which every replica follows: drain, rebuild the llama.cpp context in
place, acknowledge. No replica restart, no weight reload, no failed request.

Admission control is the engine's bounded queue, not Serve's `max_ongoing_requests`. A replica takes up
to n_parallel running requests and `max_queued_requests` waiting ones; the next completion gets a 503 with
OpenAI's error JSON and Retry-After from the engine. Serve's limit is set above anything the engine can
hold (the most slots any config may have, plus the queue, plus headroom), so it never binds on
completions: control routes are never queued behind them, the engine's 503 fires before Serve's, and a
live n_parallel change takes effect in the engine at once, with nothing in Serve to redeploy. Serve still
routes each request to the replica with the fewest ongoing requests, which now counts queued ones too: a
replica with a backlog (or one draining for a config change) gets less.
"""


import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import asdict
from enum import Enum
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal

from serving.engine import llama as _llama  # load order: ray before libllama, see serving/engine/llama.py

from fastapi import Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.front.errors import APIError
from serving.engine.config import EngineConfig, available_cpus, default_threads, load_engine_config
from serving.replica.control import DEPLOYMENT_NAME, ConfigChannel
from serving.engine.core import Engine
from serving.replica.host import EngineHost, HostLimits
from serving.engine.errors import EngineError
from serving.front.http import HttpRules
from serving.front.ingress import HealthReport, OpenAIIngress
from serving.replica.metrics import CONTENT_TYPE, ReplicaMetrics, merge_expositions
from serving.replica.node import here
from serving.openai.routes import ERROR_RESPONSES, OpenAIRoutes, api
from serving.front.relay import RelayedPart, RelayedRequest, run_relayed
from serving.engine.request import SamplingParams
from serving.replica.routing import IN_TRIAL, ROUTER, ROUTING_STATS_PERIOD_S
from serving.openai.slot_files import (SlotAction, SlotFileBody, erased_answer, restored_answer, saved_answer,
                                slot_file)
from serving.engine.traffic import TrafficSummary, merge_summaries
from serving.replica.trials import Measure, TrialRun

log = logging.getLogger("serving")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"
TUNED_CONFIG = REPO_ROOT / "configs" / "tuned.yaml"
MAX_PART_SPACING_S = 0.25  # a stream's bytes never wait longer than this for company
INTERVAL_MS = 50.0  # stream_interval_ms=auto where HTTP work has a core of its own (a GPU, or a spare core)
CPU_BOUND_INTERVAL_MS = 200.0  # ... and where the decode threads take every core (docs/performance.md)
TRAFFIC_DEADLINE_S = 5.0  # /traffic waits this long for every replica's summary
SLOT_WAIT_S = 60.0  # a slot file action waits this long for its slot to be idle
HEAD_NODE = "node:__internal_head__"  # Ray's resource of the head node
SEPARATE_LOOP_VAR = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"  # Serve's switch, read by each replica


class IngressMode(str, Enum):
    """Where HTTP enters the app."""

    relay = "relay"  # the ingress deployment, which relays to an engine replica (errors for a lost replica)
    engine = "engine"  # the engine replicas themselves: one Serve hop less each way


def _n_parallel_limit() -> int:
    """The most slots any EngineConfig may ask for (its n_parallel bound)."""
    return next(m.le for m in EngineConfig.model_fields["n_parallel"].metadata if getattr(m, "le", None))


class ServerOptions(BaseModel):
    """Deployment-level settings (not llama.cpp's): replicas, queueing, auth."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int | str = Field("auto", description="'auto' = one per GPU in the cluster (1 on CPU)")
    max_queued_requests: int = Field(64, ge=1, description="completions a replica's engine holds waiting for "
                                     "a slot; beyond it 503 with Retry-After (also the bound of Serve's own "
                                     "queue in front of the replicas, a backstop)")
    control_headroom: int = Field(16, ge=1, description="requests a replica takes beyond what its engine can "
                                  "hold, so /health, /slots and /metrics never wait behind completions")
    api_key: str | None = Field(None, description="if set, requests need 'Authorization: Bearer <key>'")
    cors_origins: list[str] = Field(default_factory=list, description="origins browsers may call from "
                                    "(CORS), e.g. ['*'] or 'https://a.example,https://b.example'; none: no CORS")
    stream_interval_ms: Annotated[float, Field(ge=0, le=1000)] | Literal["auto"] = Field(
        "auto", description="streams: after the first token, a replica sends about one SSE event (and relays one "
        "part) per this many ms over all its streams, each event holding the tokens generated since the last (a "
        "stream asking for logprobs: an event per token); fewer events cost the decode threads less CPU. 'auto': "
        f"{CPU_BOUND_INTERVAL_MS:g} while the model decodes on the CPU with a thread on every core, where each "
        f"event takes CPU from decoding, else {INTERVAL_MS:g}")
    cpus_per_replica: float = Field(1.0, gt=0)
    ingress: IngressMode = Field(IngressMode.relay, description="where HTTP enters: 'relay', the ingress "
                                 "deployment, which answers /health for every replica and turns a replica lost "
                                 "mid-request into OpenAI errors; 'engine', the engine replicas themselves (no "
                                 "ingress hop: the thinnest path, with Serve's direct ingress or HAProxy in front; "
                                 "a lost replica drops its connections, and /health is the answering replica's)")
    config_poll_s: float = Field(1.0, gt=0, description="how often replicas look for a published config")
    load_timeout_s: float = Field(900.0, gt=0, description="a replica whose engine has not loaded after this "
                                  "many seconds reports itself unhealthy and Serve replaces it (a load that "
                                  "hangs never leaves a replica loading forever); raise it for weights on slow "
                                  "storage")
    tuning_lease_s: float = Field(300.0, gt=0, description="an in-place study whose tuner sent no trial for "
                                  "this long is over: the replica goes back to its serving config")
    traffic_record: int = Field(4096, ge=1, description="finished client requests whose shapes (token counts, "
                                "kind, arrival time; never text) each replica keeps for /traffic")
    slot_save_path: Path | None = Field(None, description="directory of slot files (POST /slots/{id}?action="
                                        "save|restore|erase, llama-server's --slot-save-path), on each replica's "
                                        "node; none: those answer 400")

    @field_validator("slot_save_path", mode="after")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        """Replicas may run in another working directory than the one the app was built in."""
        return value.expanduser().resolve() if value is not None else None

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        """`serve run ... cors_origins=a,b` passes one string."""
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's per-replica limit: above the engine's own (any n_parallel + the queue), never binding."""
        return _n_parallel_limit() + self.max_queued_requests + self.control_headroom


def stream_interval_ms(setting: float | Literal["auto"], config: EngineConfig, gpu_offload: bool, cpus: int,
                       threads: int | None = None) -> float:
    """The interval a replica paces its streams by. `auto` paces harder where the model decodes on the CPU
    with a thread on every core: there every event's Python work (the replica, Serve's hops, the client)
    preempts a decode thread and stalls the others at llama.cpp's barriers: one stream measured 0.86-0.90x
    of the in-process engine at 50 ms against 0.96-0.97x at 200 ms (paired rounds, docs/performance.md).
    `threads` is the default thread count where the config sets none (else every one of `cpus`)."""
    if setting != "auto":
        return setting
    on_cpu = config.n_gpu_layers == 0 or not gpu_offload
    every_core = (config.n_threads or threads or cpus) >= cpus
    return CPU_BOUND_INTERVAL_MS if on_cpu and every_core else INTERVAL_MS


async def gather_replicas(peers: Any, own: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
    """Every engine replica's summary (`own` stands in for this one if the broadcast missed it), and how many did
    not answer in time; None for that count where every replica could not be asked."""
    try:
        answers = await peers.broadcast("replica_summary").results_async(timeout_s=TRAFFIC_DEADLINE_S,
                                                                         return_exceptions=True)
    except Exception as exc:  # no handle (outside a Serve app), or no replica listed yet
        log.info("/slots could not ask every replica (%s)", type(exc).__name__)
        return [own], None
    summaries = {a["replica"]: a for a in answers if isinstance(a, dict)}
    summaries.setdefault(own["replica"], own)
    return sorted(summaries.values(), key=lambda a: a["replica"]), len(answers) - sum(isinstance(a, dict)
                                                                                       for a in answers)


async def gather_traffic(peers: Any, own: TrafficSummary) -> tuple[TrafficSummary, int | None]:
    """Every engine replica's traffic summary merged (`own` stands in for this replica if the broadcast
    missed it), and how many replicas did not answer in time. Where every replica cannot be asked (a Ray
    without DeploymentHandle.broadcast, or the broadcast itself failed), `own` alone and None: the
    answer then says which replica it is for, and that the others are unknown.

    Defined above LlamaServer on purpose: Serve's ingress freezes the routes (a cloudpickle copy) as the
    class is decorated, and a route finds only the module's names defined by then."""
    broadcast = getattr(peers, "broadcast", None)
    if broadcast is None:
        return own, None
    try:
        answers = await broadcast("traffic_summary").results_async(timeout_s=TRAFFIC_DEADLINE_S,
                                                                   return_exceptions=True)
    except Exception as exc:  # no replica listed yet, or one that never answered within the deadline
        log.warning("/traffic could not ask every replica (%s: %s); answering for this one", type(exc).__name__, exc)
        return own, None
    summaries = {s.replicas: s for s in answers if isinstance(s, TrafficSummary)}
    summaries.setdefault(own.replicas, own)
    return merge_summaries(summaries.values()), len(answers) - sum(isinstance(s, TrafficSummary) for s in answers)


@serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=10)
@serve.ingress(api)
class LlamaServer(OpenAIRoutes):
    """One engine replica: Serve's hooks, the relay from the ingress and the routes, around an EngineHost
    (serving/replica/host.py) that loads the engine, follows config changes and hosts tuning trials."""

    app: ASGIApp  # this replica's FastAPI app (`api` bound to it), provided by Serve's ingress wrapper
    metrics: ReplicaMetrics

    def __init__(self, options: dict[str, Any], channel: DeploymentHandle) -> None:
        self._options = ServerOptions(**options)
        replica = serve.get_replica_context().replica_id.unique_id
        place = here(replica, _llama.gpu_offload_supported())
        node = f"node {place.hostname} ({place.node_ip or 'no Ray node'})"
        self.host = EngineHost(replica, HostLimits(self._options.max_queued_requests, self._options.traffic_record,
                                                   self._options.tuning_lease_s, self._options.config_poll_s,
                                                   self._options.load_timeout_s),
                               channel, node)
        self.metrics = self.host.metrics
        self._relays = 0  # requests in flight here (relayed, or HTTP with ingress=engine): their streams share the pace
        self._peers: DeploymentHandle | None = None  # this deployment's handle, for /traffic (made on first use)

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

    # -- in-place tuning (tuning/inplace.py calls these through a handle) -----------------------------
    async def served_config(self) -> dict[str, Any]:
        return self.host.served_config()

    async def tune_trial(self, study: str, trials: int, config: dict[str, Any], measure: Measure) -> TrialRun:
        """A trial of an in-place study, on this replica's engine and weights (serving/replica/trials.py)."""
        return await self.host.tune_trial(study, trials, config, measure)

    # -- the relay from the ingress ------------------------------------------------------------------
    def health_report(self) -> HealthReport:
        """What the ingress's health watch asks every 0.5 s."""
        return self.host.health_report()

    async def forward(self, request: RelayedRequest) -> AsyncIterator[RelayedPart]:
        """A request the ingress relayed, answered by this replica's own routes (serving/front/relay.py)."""
        self._relays += 1
        try:
            async for part in run_relayed(self.app, request, self.stream_spacing):
                yield part
        finally:
            self._relays -= 1

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

    @api.get("/health", responses={503: {"description": "loading, the model failed to load, or no replica is up"}})
    async def health(self) -> JSONResponse:
        """200 once the engine serves; 503 while loading, after a failed load, or if the engine stopped.
        (The app's ingress answers /health from health_report; this route answers with ingress=engine.)"""
        return self.host.health_report().response()

    # -- control routes: they read state only, never take a slot or wait for the engine --------------
    @api.get("/slots", responses=ERROR_RESPONSES)
    async def slots(self) -> dict[str, Any]:
        """Slots, queue, counters and the running config, like llama-server's /slots plus /props; where this
        replica runs (`node`), and every replica of the app (`replicas`: node, devices, health, config)."""
        replicas, missing = await gather_replicas(self._peer_handle(), self.replica_summary())
        return {"replica": self.host.replica, **self.ready_engine().stats(), "tuning": self.host.trials.state(),
                "node": self.place(), "replicas": replicas, "replicas_missing": missing}

    def place(self) -> dict[str, Any]:
        """This replica's node, the GPUs Ray gave it and their memory now (serving/replica/node.py)."""
        return here(self.host.replica, _llama.gpu_offload_supported()).as_dict()

    def replica_summary(self) -> dict[str, Any]:
        """What /slots lists for this replica among all of them (Serve's broadcast asks every one)."""
        engine = self.host.engine
        return {"replica": self.host.replica, "node": self.place(), "health": self.host.health_report().body,
                "config": engine.config.to_yaml_dict() if engine is not None else None,
                "counters": engine.stats()["counters"] if engine is not None else {},
                "load_error": self.host.load_error}

    @api.post("/slots/{slot_id}", responses=ERROR_RESPONSES)
    async def slot_action(self, slot_id: int, action: SlotAction, body: SlotFileBody | None = None
                          ) -> dict[str, Any]:
        """llama-server's slot files: `save` a slot's cells and tokens to a file of the slot directory,
        `restore` one into a slot, `erase` a slot. Waits for that slot to be idle (new requests wait
        meanwhile; running ones go on), and for an in-place trial to give the engine back."""
        path = slot_file(self._options.slot_save_path, body, action)
        try:
            async with self.engine_turn() as engine:
                if path is None:
                    return erased_answer(slot_id, await asyncio.to_thread(engine.erase_slot, slot_id, SLOT_WAIT_S))
                if action is SlotAction.save:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    done = await asyncio.to_thread(engine.save_slot, slot_id, path, SLOT_WAIT_S)
                    return saved_answer(done.slot_id, done.filename, done.n_tokens, done.n_bytes, done.ms)
                done = await asyncio.to_thread(engine.restore_slot, slot_id, path, SLOT_WAIT_S)
                return restored_answer(done.slot_id, done.filename, done.n_tokens, done.n_bytes, done.ms)
        except ValueError as exc:
            raise APIError(400, str(exc), param="slot_id" if "slot id" in str(exc) else "filename") from None
        except TimeoutError:
            raise APIError(503, f"slot {slot_id} stayed busy for {SLOT_WAIT_S:.0f} s: retry later",
                           type_="server_error", code="slot_busy", headers={"Retry-After": "5"}) from None
        except (EngineError, OSError) as exc:
            raise APIError(500, f"the slot file could not be written or read: {exc}", type_="server_error") from None

    @api.get("/props", responses=ERROR_RESPONSES)
    async def props(self) -> dict[str, Any]:
        """llama-server's /props: the generation defaults, slots, model and chat template."""
        engine = self.ready_engine()
        config = engine.config
        return {
            "default_generation_settings": {"n_ctx": engine.n_ctx_slot,
                                            "params": {**asdict(SamplingParams()), "seed": config.seed}},
            "total_slots": config.n_parallel, "model_path": str(config.model_path), "model_alias": config.served_name,
            "chat_template": engine.chat_template.source, "n_vocab": engine.n_vocab, "n_ctx_train": engine.n_ctx_train,
            "config": config.to_yaml_dict(), "build_info": f"llama-cpp-python {_llama.BINDINGS_VERSION}",
        }

    @api.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def prometheus(self) -> Response:
        """Prometheus text exposition of every replica's metrics (each labelled with its replica; queue and slot
        gauges read now); a replica that does not answer in time is left out, this one never."""
        peers, answers = self._peer_handle(), []
        if peers is not None:
            try:
                answers = await peers.broadcast("metrics_text").results_async(timeout_s=TRAFFIC_DEADLINE_S,
                                                                              return_exceptions=True)
            except Exception:  # no replica listed yet: this one's alone
                answers = []
        texts = [a for a in answers if isinstance(a, str)]
        if not any(f'replica="{self.host.replica}"' in text for text in texts):
            texts.append(await self.metrics_text())
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE)

    async def metrics_text(self) -> str:
        """This replica's Prometheus text, its gauges refreshed from the engine now. Async, so a broadcast runs
        it on the replica's event loop, the one writer of the shapes the metrics took (`record_shapes`)."""
        engine, stats = self.host.engine, None
        if engine is not None:
            try:
                stats = engine.stats()
                self.host.record_shapes(engine)
            except Exception:
                log.warning("reading the engine's stats for /metrics failed", exc_info=True)
        return self.metrics.exposition(stats).decode()

    @api.get("/traffic", responses=ERROR_RESPONSES)
    async def traffic(self, recent: Annotated[int | None, Query(ge=0, description="list only the latest this "
                                                                "many request shapes (0: none)")] = None
                      ) -> dict[str, Any]:
        """The shape of the client traffic served (token counts, kinds, arrival times; never text), merged
        over every engine replica: totals, histograms and the recent arrivals, for the tuner to replay."""
        summary, missing = await self.all_traffic()
        return {**summary.as_dict(recent), "replicas_missing": missing}

    async def all_traffic(self) -> tuple[TrafficSummary, int | None]:
        """Every engine replica's traffic merged, and how many did not answer (what /traffic shows, and what
        the tuner's `--workload live` replays)."""
        return await gather_traffic(self._peer_handle(), await self.traffic_summary())

    async def traffic_summary(self) -> TrafficSummary:
        """This replica's traffic record as a value (what /traffic asks every replica for)."""
        return self.host.traffic_summary()

    def _peer_handle(self) -> DeploymentHandle | None:
        """A handle on this replica's own deployment, to ask all its replicas; None outside a Serve app."""
        if self._peers is None:
            try:
                context = serve.get_replica_context()
                self._peers = serve.get_deployment_handle(context.replica_id.deployment_id.name,
                                                          app_name=context.app_name)
            except Exception:
                log.warning("no handle on this deployment: /traffic answers for this replica alone", exc_info=True)
        return self._peers


class AppArgs(BaseModel):
    """The app's arguments, validated in one place: `serve run serving.app:main [config=FILE] [KEY=VALUE ...]`
    (Serve validates its words into this model before calling the builder) or `main({...})`. A KEY is an
    EngineConfig field (over the config file's) or a ServerOptions field; anything else is an error that
    lists both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: Path = Field(description="the engine config file")
    engine: EngineConfig
    server: ServerOptions

    @model_validator(mode="before")
    @classmethod
    def _from_words(cls, words: Any) -> Any:
        """Flat words (what `serve run` passes) become the three parts; an already split dict passes."""
        if not isinstance(words, dict) or "engine" in words and isinstance(words["engine"], EngineConfig):
            return words
        words = dict(words)
        config = _resolve(words.pop("config", None) or (TUNED_CONFIG if TUNED_CONFIG.exists() else DEFAULT_CONFIG))
        engine_keys, server_keys = set(EngineConfig.model_fields), set(ServerOptions.model_fields)
        unknown = set(words) - engine_keys - server_keys
        if unknown:
            raise ValueError(f"unknown argument(s) {sorted(unknown)}; engine settings are {sorted(engine_keys)}, "
                             f"server settings are {sorted(server_keys)}")
        return {"config": config,
                "engine": load_engine_config(config, {k: v for k, v in words.items() if k in engine_keys}),
                "server": {k: v for k, v in words.items() if k in server_keys}}


def _resolve(path: str | Path) -> Path:
    """A config path as given, else relative to the repository (`serve deploy` runs from elsewhere)."""
    path = Path(path)
    return path if path.exists() or path.is_absolute() else REPO_ROOT / path


def _gpus_available() -> int:
    """GPUs in the Ray cluster the app will run on, else on this machine (NVML); 0 means the CPU fallback.

    `serve run` builds the app before it connects to Ray, so when a cluster is already running (RAY_ADDRESS, or
    one started on this machine with `ray start`), the builder connects to it briefly to count every node's
    GPUs, not only this machine's; then it disconnects, and `serve run` connects as it always does."""
    import ray

    if ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    counted = _running_cluster_gpus()
    return counted if counted is not None else _local_gpus()


def _running_cluster_gpus() -> int | None:
    """The GPUs of an already running Ray cluster (RAY_ADDRESS, else the last `ray start` on this machine), or
    None when none answers. A stale address (a cluster long gone) is ruled out by a quick TCP connect first, so
    building the app never waits on Ray's own connect timeouts."""
    import ray
    from ray._private.services import canonicalize_bootstrap_address

    try:
        address = canonicalize_bootstrap_address(os.environ.get("RAY_ADDRESS") or "auto")
    except Exception:  # no address anywhere: `serve run` will start a local Ray
        return None
    if not address or not _answers(address):
        return None
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as exc:
        log.warning("could not connect to the Ray cluster at %s to count its GPUs (%s); counting this machine's",
                    address, exc)
        return None
    try:
        return int(ray.cluster_resources().get("GPU", 0))
    finally:
        ray.shutdown()


def _answers(address: str, timeout_s: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class _EngineAsIngress(LlamaServer.func_or_class):  # type: ignore[name-defined]
    """An engine replica that takes HTTP itself (`ingress=engine`): the app's rules around its own routes, as the
    ingress holds them otherwise; its requests in flight share the stream pace, as relayed ones do. (Serve
    allows no `__call__` on a class it makes an ingress of: this subclass of that ingress adds it.)"""

    async def __init__(self, options: dict[str, Any], channel: DeploymentHandle) -> None:  # type: ignore[misc]
        await super().__init__(options, channel)  # Serve's wrapper sets `app` in it
        self._front = HttpRules(self._options.api_key, tuple(self._options.cors_origins)).around(self.app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._relays += 1
        try:
            await self._front(scope, receive, send)
        finally:
            self._relays -= 1


EngineAsIngress = serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=10)(_EngineAsIngress)


def _local_gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def replica_env() -> dict[str, Any]:
    """The runtime environment of the replicas that take requests: Serve runs their routes on its own event
    loop, the one that reads and writes their sockets, instead of a loop of their own in another thread (Serve's
    default), so a request's way in and each streamed event's way out cross no thread. Our routes never block
    their loop (long work goes to threads), which is what Serve's separate loop guards against. An operator's
    own RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, set where the app is built, wins."""
    own = os.environ.get(SEPARATE_LOOP_VAR)
    return {"env_vars": {SEPARATE_LOOP_VAR: own if own is not None else "0"}}


def build_app(engine_config: EngineConfig, options: ServerOptions) -> serve.Application:
    """The Serve application for one engine config: the ingress with its HTTP rules bound, the engine
    replicas (routing limits, resources), the config channel. The ingress and the channel hold no model and
    live on the head node: a cluster that loses another node keeps its front door and its config. With
    `ingress=engine` the engine replicas are the app's ingress (the rules around their own routes)."""
    gpus = _gpus_available()
    replicas = options.num_replicas
    if replicas == "auto":
        replicas = max(gpus, 1)
    actor_options: dict[str, Any] = {"num_cpus": options.cpus_per_replica, "runtime_env": replica_env()}
    if gpus > 0:
        actor_options["num_gpus"] = 1
    engine_deployment: Any = EngineAsIngress if options.ingress is IngressMode.engine else LlamaServer
    deployment = engine_deployment.options(
        num_replicas=int(replicas),
        max_ongoing_requests=options.max_ongoing_requests,
        max_queued_requests=options.max_queued_requests,
        ray_actor_options=actor_options,
        user_config={"engine": engine_config.to_yaml_dict()},
        request_router_config={"request_router_class": ROUTER,
                               "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S},
    )
    on_head: dict[str, Any] = {"num_cpus": 0, "resources": {HEAD_NODE: 0.001}}  # the node a cluster never loses
    channel = ConfigChannel.options(ray_actor_options=on_head)  # type: ignore[attr-defined]
    engines = deployment.bind(options.model_dump(), channel.bind())
    if options.ingress is IngressMode.engine:
        return engines
    ingress = OpenAIIngress.options(  # type: ignore[attr-defined]
        ray_actor_options={**on_head, "runtime_env": replica_env()},
        max_ongoing_requests=int(replicas) * options.max_ongoing_requests + options.control_headroom)
    return ingress.bind(engines, HttpRules(options.api_key, tuple(options.cors_origins)), int(replicas))


def main(args: AppArgs) -> serve.Application:
    """App builder for `serve run serving.app:main [config=FILE] [KEY=VALUE ...]` (AppArgs says what they
    are; called directly, a plain dict of the same words does too).

    Loads configs/tuned.yaml when the tuner has written one, else configs/default.yaml.
    """
    args = AppArgs.model_validate(args)
    log.info("serving %s with %s (from %s)", args.engine.model_path, args.engine, args.config)
    return build_app(args.engine, args.server)
