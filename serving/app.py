"""The composition root: `serve run serving.app:main [config=FILE] [KEY=VALUE ...]` builds the Ray Serve app from
its parts. An ingress (serving/front/ingress.py) takes every HTTP request, answers /health from what the engine
replicas last told its background watch, and relays every other request to an engine replica
(serving/replica/server.py), each one Engine behind the OpenAI routes (serving/openai/) and its control routes
/slots, /props, /metrics and /traffic. With `ingress=engine` there is no ingress: the engine replicas take HTTP
themselves. A replica holds gpus_per_replica GPUs of one node; with `num_replicas=auto` there are as many as the
cluster's GPUs hold, followed as nodes join or leave (serving/replica/scaling.py), with no redeploy.

KEYs are EngineConfig fields (serving/engine/config.py) or ServerOptions fields (serving/replica/options.py). A
model named on the hub (`model=OWNER/REPO:QUANT`) is resolved here, once, to a commit and its files; each replica
fetches exactly those into its node's cache before it loads (serving/engine/model_store.py). The
engine config travels as the deployment's `user_config` (the first load, and `serve deploy` with a new file);
live changes (the tuner's write-back) come through the app's ConfigChannel (serving/replica/control.py), which
every replica follows: drain, rebuild the llama.cpp context in place, acknowledge. No replica restart, no weight
reload, no failed request.

Admission control is the engine's bounded queue, not Serve's `max_ongoing_requests`. A replica takes up
to n_parallel running requests and `max_queued_requests` waiting ones; the next completion gets a 503 with
OpenAI's error JSON and Retry-After from the engine. Serve's limit is set above anything the engine can
hold (the most slots any config may have, plus the queue, plus headroom), so it never binds on
completions: control routes are never queued behind them, the engine's 503 fires before Serve's, and a
live n_parallel change takes effect in the engine at once, with nothing in Serve to redeploy. Serve still
routes each request to the replica with the fewest ongoing requests, which now counts queued ones too: a
replica with a backlog (or one draining for a config change) gets less.
"""

import logging
import os
import socket
from pathlib import Path
from typing import Any

from serving.engine import llama as _llama  # noqa: F401  (load order: ray before libllama, see serving/engine/llama.py)

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve

from serving.engine.chat_template import check_name
from serving.engine.config import AutoSetting, EngineConfig, load_engine_config
from serving.engine.model_store import HubModel, resolve
from serving.front.http import HttpRules
from serving.front.ingress import OpenAIIngress
from serving.replica.control import ConfigChannel
from serving.replica.options import (DEFAULT_TARGET_ONGOING, MAX_REPLICAS, IngressMode, ReplicaCount,
                                     ServerOptions)
from serving.replica.routing import ROUTER, ROUTING_STATS_PERIOD_S
from serving.replica.scaling import FOLLOW_DOWNSCALE_DELAY_S, FOLLOW_UPSCALE_DELAY_S, POLICY
from serving.replica.server import ENGINE_AS_INGRESS, ENGINE_REPLICA

log = logging.getLogger("serving")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"
TUNED_CONFIG = REPO_ROOT / "configs" / "tuned.yaml"
HEAD_NODE = "node:__internal_head__"  # Ray's resource of the head node
SEPARATE_LOOP_VAR = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"  # Serve's switch, read by each replica
HUB_VARS = ("HF_ENDPOINT", "HF_TOKEN")  # where a named model was resolved, and with what right: replicas fetch so


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


def engine_env(engine_config: EngineConfig) -> dict[str, Any]:
    """The engine replicas' runtime environment: replica_env's, and for a model named on the hub the hub's
    endpoint and token as set where the app is built, so that a replica on another node fetches the resolved
    files from the same place with the same right (Ray starts replicas with their node's environment, not this
    one's). The cache and HF_HUB_OFFLINE stay each node's own."""
    env = replica_env()
    if isinstance(engine_config.model, HubModel):
        env["env_vars"].update({var: os.environ[var] for var in HUB_VARS if os.environ.get(var)})
    return env


def resolve_model(engine_config: EngineConfig) -> EngineConfig:
    """The config with a model named on the hub pinned to one commit and its files, once, here: every replica
    then fetches exactly those, on whatever node it runs (serving/engine/model_store.py)."""
    if not isinstance(engine_config.model, HubModel) or engine_config.model.resolved:
        return engine_config
    return engine_config.model_copy(update={"model": resolve(engine_config.model)})


def gpus_per_replica(options: ServerOptions, gpus: int) -> int:
    """The GPUs each engine replica asks Ray for: the setting, or where auto 1 when the cluster (or this machine)
    has a GPU as the app is built, else 0 (the CPU)."""
    if options.gpus_per_replica == "auto":
        return 1 if gpus > 0 else 0
    return int(options.gpus_per_replica)


def replica_scaling(options: ServerOptions, engine_config: EngineConfig, gpus: int, per_replica: int
                    ) -> dict[str, Any]:
    """The engine deployment's replica options: a fixed `num_replicas`, or an `autoscaling_config` whose policy
    follows the cluster's GPUs (auto) or the load within them (load; serving/replica/scaling.py). Replicas on the
    CPU (no GPU to count) are one where auto."""
    count = options.num_replicas
    if isinstance(count, int):
        return {"num_replicas": count}
    if count is ReplicaCount.auto and per_replica == 0:
        return {"num_replicas": 1}
    most = options.max_replicas or MAX_REPLICAS
    held_now = gpus // per_replica if per_replica else options.min_replicas
    autoscaling: dict[str, Any] = {"min_replicas": options.min_replicas, "max_replicas": most,
                                   "initial_replicas": min(max(held_now, options.min_replicas), most)}
    if count is ReplicaCount.load:
        autoscaling["target_ongoing_requests"] = options.target_ongoing_requests or (
            DEFAULT_TARGET_ONGOING if AutoSetting.n_parallel in engine_config.auto else engine_config.n_parallel)
    else:
        autoscaling.update(upscale_delay_s=FOLLOW_UPSCALE_DELAY_S, downscale_delay_s=FOLLOW_DOWNSCALE_DELAY_S)
    if per_replica:
        autoscaling["policy"] = {"policy_function": POLICY, "policy_kwargs": {
            "gpus_per_replica": per_replica, "follow_load": count is ReplicaCount.load}}
    return {"autoscaling_config": autoscaling}


def build_app(engine_config: EngineConfig, options: ServerOptions) -> serve.Application:
    """The Serve application for one engine config: the ingress with its HTTP rules bound, the engine
    replicas (routing limits, resources, how many), the config channel. The ingress and the channel hold no
    model and live on the head node: a cluster that loses another node keeps its front door and its config.
    With `ingress=engine` the engine replicas are the app's ingress (the rules around their own routes).

    A replica of several GPUs asks Ray for all of them as one actor, which Ray places on one node (llama.cpp
    cannot spread a model over nodes); CUDA_VISIBLE_DEVICES then lists them and the engine splits the model
    by split_mode and tensor_split."""
    gpus = _gpus_available()
    per_replica = gpus_per_replica(options, gpus)
    scaling = replica_scaling(options, engine_config, gpus, per_replica)
    actor_options: dict[str, Any] = {"num_cpus": options.cpus_per_replica, "runtime_env": engine_env(engine_config)}
    if per_replica > 0:
        actor_options["num_gpus"] = per_replica
    engine_deployment: Any = ENGINE_AS_INGRESS if options.ingress is IngressMode.engine else ENGINE_REPLICA
    deployment = engine_deployment.options(
        **scaling,
        max_ongoing_requests=options.max_ongoing_requests,
        max_queued_requests=options.max_queued_requests,
        ray_actor_options=actor_options,
        user_config={"engine": engine_config.to_yaml_dict()},
        request_router_config={"request_router_class": ROUTER,
                               "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
                               "request_router_kwargs": {"affinity": options.prefix_affinity,
                                                         "max_imbalance": options.affinity_max_imbalance}},
    )
    on_head: dict[str, Any] = {"num_cpus": 0, "resources": {HEAD_NODE: 0.001}}  # the node a cluster never loses
    channel = ConfigChannel.options(ray_actor_options=on_head)  # type: ignore[attr-defined]
    engines = deployment.bind(options.model_dump(), channel.bind())
    if options.ingress is IngressMode.engine:
        return engines
    first = scaling.get("num_replicas") or scaling["autoscaling_config"]["initial_replicas"]
    most = scaling.get("num_replicas") or scaling["autoscaling_config"]["max_replicas"]
    ingress = OpenAIIngress.options(  # type: ignore[attr-defined]
        ray_actor_options={**on_head, "runtime_env": replica_env()},
        max_ongoing_requests=int(most) * options.max_ongoing_requests + options.control_headroom)
    return ingress.bind(engines, HttpRules(options.api_key, tuple(options.cors_origins)), int(first))


def main(args: AppArgs) -> serve.Application:
    """App builder for `serve run serving.app:main [config=FILE] [KEY=VALUE ...]` (AppArgs says what they
    are; called directly, a plain dict of the same words does too).

    Loads configs/tuned.yaml when the tuner has written one, else configs/default.yaml.
    """
    args = AppArgs.model_validate(args)
    check_name(args.engine.chat_template, _llama.builtin_chat_templates())  # a wrong name fails here, not in a replica
    engine = resolve_model(args.engine)  # a name that resolves to no model fails here too
    model = engine.model if isinstance(engine.model, HubModel) else engine.model_path
    log.info("serving %s with %s (from %s)", model, engine, args.config)
    return build_app(engine, args.server)
