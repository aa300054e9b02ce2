"""The server's own settings (not llama.cpp's, which are EngineConfig's): replicas, queueing, auth, pacing, where
HTTP enters. Validated once, where the app is built (serving/app.py's AppArgs), and handed to every replica as
a plain dict (Serve's init args), which each validates again into this model."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serving.engine.config import EngineConfig

INTERVAL_MS = 50.0  # stream_interval_ms=auto where HTTP work has a core of its own (a GPU, or a spare core)
# ... and where the decode threads take every core: docs/log/2026-12-04-cpu-http-pacing.md
CPU_BOUND_INTERVAL_MS = 200.0


MAX_REPLICAS = 256  # num_replicas auto or load without max_replicas: Serve needs a bound
DEFAULT_TARGET_ONGOING = 4.0  # num_replicas load, n_parallel auto: llama-server's 4 slots


class ReplicaCount(str, Enum):
    """How many engine replicas run, where num_replicas is not a number."""

    auto = "auto"  # as many as the cluster's GPUs hold, followed as nodes join or leave
    load = "load"  # Serve's autoscaling on ongoing requests, within what the GPUs hold


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

    num_replicas: int | ReplicaCount = Field(ReplicaCount.auto, description="engine replicas: a number, fixed; "
                                             "'auto', as many as the cluster's GPUs hold (gpus_per_replica each), "
                                             "followed as nodes join or leave (1 on CPU); 'load', Serve's "
                                             "autoscaling on ongoing requests, within what the GPUs hold")
    gpus_per_replica: int | Literal["auto"] = Field("auto", description="GPUs each engine replica holds, all on "
                                                    "one node (llama.cpp spreads the model over them by split_mode "
                                                    "and tensor_split); 'auto': 1 where the cluster has a GPU when "
                                                    "the app is built, else 0 (the CPU)")
    min_replicas: int = Field(1, ge=0, description="num_replicas auto or load: the fewest engine replicas (a "
                              "replica that no GPU can hold yet waits for one, e.g. for a worker to join)")
    max_replicas: int | None = Field(None, ge=1, description="num_replicas auto or load: the most engine "
                                     f"replicas; none: what the GPUs hold, up to {MAX_REPLICAS}")
    target_ongoing_requests: float | None = Field(None, gt=0, description="num_replicas load: the requests "
                                                  "(running and queued) a replica should have; Serve adds "
                                                  "replicas above it and removes them below. None: the "
                                                  "config's n_parallel (its slots), else "
                                                  f"{DEFAULT_TARGET_ONGOING:g}")
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
    prefix_affinity: bool = Field(True, description="route a request to the replica that already holds the "
                                  "longest start of its prompt (a conversation's earlier turns: in a slot or the "
                                  "host-RAM prompt cache), within affinity_max_imbalance; false: by load alone. "
                                  "Needs ingress=relay (Serve's proxy routes without the body)")
    affinity_max_imbalance: int = Field(4, ge=0, description="prefix affinity gives way to load when the replica "
                                        "holding the prompt has more than this many requests in flight beyond the "
                                        "least loaded replica's")
    slot_save_path: Path | None = Field(None, description="directory of slot files (POST /slots/{id}?action="
                                        "save|restore|erase, llama-server's --slot-save-path), on each replica's "
                                        "node; none: those answer 400")

    @field_validator("gpus_per_replica", mode="after")
    @classmethod
    def _not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("gpus_per_replica: 0 (the CPU), 1 or more, or 'auto'")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> ServerOptions:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})")
        return self

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
    of the in-process engine at 50 ms against 0.96-0.97x at 200 ms (paired rounds,
    docs/log/2026-12-04-cpu-http-pacing.md).
    `threads` is the default thread count where the config sets none (else every one of `cpus`)."""
    if setting != "auto":
        return setting
    on_cpu = config.n_gpu_layers == 0 or not gpu_offload
    every_core = (config.n_threads or threads or cpus) >= cpus
    return CPU_BOUND_INTERVAL_MS if on_cpu and every_core else INTERVAL_MS


