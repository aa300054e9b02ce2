"""The Ray Serve app: one replica per GPU, each one Engine behind OpenAI-compatible FastAPI routes.

`serve run serving.app:main [config=FILE] [KEY=VALUE ...]` builds it: KEYs are EngineConfig fields or
ServerOptions fields. The engine config travels as the deployment's `user_config`, so changing it (the
tuner's write-back, or `serve deploy` with a new file) reaches every replica through `reconfigure()`,
which rebuilds the llama.cpp context in place: no replica restart, no weight reload, no failed request.
"""


import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from serving import llama as _llama  # noqa: F401  (load order: libllama before numpy)

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api import (
    APIError, ChatCompletionRequest, CompletionRequest, ResponseBuilder, finish_reason, validation_error,
)
from serving.chat_template import ChatTemplateError
from serving.config import EngineConfig, load_engine_config
from serving.control import ConfigChannel
from serving.engine import Engine, PromptTooLongError
from serving.metrics import ReplicaMetrics
from serving.request import FINISH_ERROR, GenerationChunk, RequestHandle

log = logging.getLogger("serving")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"
TUNED_CONFIG = REPO_ROOT / "configs" / "tuned.yaml"
APP_NAME = "llama"
DEPLOYMENT_NAME = "LlamaServer"


class ServerOptions(BaseModel):
    """Deployment-level settings (not llama.cpp's): replicas, queueing, auth."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int | str = Field("auto", description="'auto' = one per GPU in the cluster (1 on CPU)")
    max_queued_requests: int = Field(64, ge=1, description="requests Serve holds beyond the replicas; then 503")
    control_headroom: int = Field(4, ge=1, description="requests a replica takes beyond its slots, so "
                                  "/health and /slots answer while every slot is busy")
    api_key: str | None = Field(None, description="if set, requests need 'Authorization: Bearer <key>'")
    cpus_per_replica: float = Field(1.0, gt=0)
    config_poll_s: float = Field(1.0, gt=0, description="how often replicas look for a published config")


# -- the HTTP routes --------------------------------------------------------------------------------
api = FastAPI(title="llama-serve-tune", description="OpenAI-compatible llama.cpp serving")


@api.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    err = validation_error(list(exc.errors()))
    return JSONResponse(err.body(), status_code=err.status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    err = APIError(exc.status_code, str(exc.detail), code=code)
    return JSONResponse(err.body(), status_code=exc.status_code)


@api.exception_handler(Exception)
async def _crash(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    err = APIError(500, f"internal error: {exc}", type_="server_error")
    return JSONResponse(err.body(), status_code=500)


@serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=10)
@serve.ingress(api)
class LlamaServer:
    """One replica: loads its engine in the background (so /health can say 503 while loading), then
    follows config changes from Serve's user_config and from the app's ConfigChannel."""

    def __init__(self, options: dict[str, Any], channel: DeploymentHandle) -> None:
        self._options = ServerOptions(**options)
        self._channel = channel
        self._engine: Engine | None = None
        self._load_error: str | None = None
        self._loaded = threading.Event()
        self._metrics: ReplicaMetrics | None = None
        self._lock = asyncio.Lock()  # one config change at a time
        self._replica = serve.get_replica_context().replica_id.unique_id

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve calls this with the `user_config` at start and on every change of it."""
        config = EngineConfig(**user_config["engine"])
        if self._metrics is None:  # first call: start loading, return at once (the replica is up)
            self._metrics = ReplicaMetrics(config.served_name)
            threading.Thread(target=self._load, args=(config,), daemon=True, name="engine-load").start()
            loop = asyncio.get_running_loop()
            loop.create_task(self._sample_metrics())
            loop.create_task(self._follow_channel())
            return
        await self._apply(config)

    async def _apply(self, config: EngineConfig) -> None:
        """Switch the engine to `config`: drain, rebuild the context (weights kept if the model is the same)."""
        async with self._lock:
            await asyncio.to_thread(self._loaded.wait)
            if self._engine is None:  # the first load failed: try again with the new config
                self._loaded.clear()
                self._load_error = None
                await asyncio.to_thread(self._load, config)
                if self._engine is None:
                    raise RuntimeError(self._load_error)
            elif config != self._engine.config:
                await asyncio.to_thread(self._engine.reconfigure, config)

    async def _follow_channel(self) -> None:
        """Poll the ConfigChannel; apply each newly published config once, and acknowledge it."""
        seen = None
        while True:
            await asyncio.sleep(self._options.config_poll_s)
            try:
                latest = await self._channel.latest.remote()
            except Exception:  # the channel restarting: try again next round
                log.warning("config channel unreachable", exc_info=True)
                continue
            key = (latest["epoch"], latest["version"])
            if latest["engine"] is None or key == seen:
                continue
            seen, error = key, None
            try:
                await self._apply(EngineConfig(**latest["engine"]))
            except Exception as exc:
                log.exception("applying the published config failed")
                error = str(exc)
            await self._channel.ack.remote(self._replica, latest["epoch"], latest["version"], error)

    def _load(self, config: EngineConfig) -> None:
        try:
            self._engine = Engine(config)
        except Exception as exc:  # reported by /health and every request, never a crash loop
            log.exception("engine load failed")
            self._load_error = str(exc)
        finally:
            self._loaded.set()

    async def _sample_metrics(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self._engine is not None:
                self._metrics.record_snapshot(self._engine.stats())

    def check_health(self) -> None:
        """Serve's own liveness probe: a replica whose step thread died is restarted."""
        engine = self._engine
        if engine is not None and not engine.alive:
            raise RuntimeError("the engine's step thread has stopped")

    def __del__(self) -> None:
        if self._engine is not None:
            self._engine.close()

    # -- helpers -------------------------------------------------------------------------------------
    def _ready_engine(self, request: Request) -> Engine:
        self._authorize(request)
        if self._engine is None:
            if self._load_error:
                raise APIError(503, f"the model failed to load: {self._load_error}", type_="server_error")
            raise APIError(503, "the model is still loading; retry shortly", type_="server_error")
        return self._engine

    def _authorize(self, request: Request) -> None:
        key = self._options.api_key
        if key and request.headers.get("authorization", "") != f"Bearer {key}":
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type_="invalid_request_error", code="invalid_api_key")

    @staticmethod
    def _check_model(engine: Engine, requested: str | None) -> None:
        name = engine.config.served_name
        if requested and requested != name:
            raise APIError(404, f"the model '{requested}' does not exist; this server serves '{name}'",
                           param="model", code="model_not_found")

    def _submit(self, engine: Engine, tokens: list[int], body: Any) -> RequestHandle:
        try:
            return engine.submit(tokens, body.sampling_params())
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param="messages" if hasattr(body, "messages") else "prompt",
                           code="context_length_exceeded") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    # -- routes --------------------------------------------------------------------------------------
    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        engine = self._ready_engine(request)
        self._check_model(engine, body.model)
        try:
            prompt = engine.render_chat([m.as_template_dict() for m in body.messages])
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        tokens = engine.tokenize_prompt(prompt)
        return await self._respond(engine, tokens, body, chat=True)

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        engine = self._ready_engine(request)
        self._check_model(engine, body.model)
        prompt = body.prompt
        tokens = list(prompt) if isinstance(prompt, list) else engine.tokenize_prompt(prompt)
        if any(not 0 <= t < engine.model.n_vocab for t in tokens):
            raise APIError(400, f"prompt token ids must be in [0, {engine.model.n_vocab})", param="prompt")
        return await self._respond(engine, tokens, body, chat=False)

    async def _respond(self, engine: Engine, tokens: list[int], body: Any, chat: bool) -> Any:
        handle = self._submit(engine, tokens, body)
        builder = ResponseBuilder(chat, engine.config.served_name)
        if body.stream:
            return StreamingResponse(self._sse(handle, builder, body.include_usage),
                                     media_type="text/event-stream")
        try:
            parts, last = [], GenerationChunk()
            async for chunk in handle:
                parts.append(chunk.text)
                last = chunk
        finally:
            if not handle.finished:
                handle.cancel()
        self._metrics.record_request(last.usage, last.finish_reason or "unknown")
        if last.finish_reason == FINISH_ERROR:
            raise APIError(500, last.error or "generation failed", type_="server_error")
        return builder.whole("".join(parts), finish_reason(last), last.usage)

    async def _sse(self, handle: RequestHandle, builder: ResponseBuilder, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events; every chunk available when the client is ready goes out as one event."""
        first = True
        try:
            async for chunk in handle:
                if chunk.finish_reason == FINISH_ERROR:
                    err = APIError(500, chunk.error or "generation failed", type_="server_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
                reason = finish_reason(chunk)
                if chunk.text or reason or first:
                    yield f"data: {json.dumps(builder.stream_chunk(chunk.text, reason, first))}\n\n"
                    first = False
                if chunk.finish_reason is not None:
                    self._metrics.record_request(chunk.usage, chunk.finish_reason)
                    if include_usage:
                        yield f"data: {json.dumps(builder.usage_chunk(chunk.usage))}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (CancelledError/GeneratorExit): free the slot at the next step
            if not handle.finished:
                handle.cancel()

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        engine = self._ready_engine(request)
        return {"object": "list", "data": [{
            "id": engine.config.served_name, "object": "model", "created": 0, "owned_by": "llama-serve-tune",
            "meta": {"n_ctx_slot": engine.n_ctx_slot, "n_parallel": engine.config.n_parallel,
                     "n_vocab": engine.model.n_vocab, "n_ctx_train": engine.model.n_ctx_train},
        }]}

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """Never takes a slot: reads the engine's state only. 503 while loading or after a failed load."""
        if self._engine is not None:
            return JSONResponse({"status": "ok"})
        if self._load_error:
            return JSONResponse({"status": "error", "error": self._load_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @api.get("/slots")
    async def slots(self, request: Request) -> dict[str, Any]:
        """Slots, queue, counters and the running config, like llama-server's /slots plus /props."""
        engine = self._ready_engine(request)
        return {"replica": self._replica, **engine.stats()}


def _split_args(args: dict[str, Any]) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Separate `config=FILE`, EngineConfig overrides and ServerOptions from the builder's args."""
    args = dict(args)
    config_path = _resolve(args.pop("config", None) or (TUNED_CONFIG if TUNED_CONFIG.exists() else DEFAULT_CONFIG))
    engine_keys = set(EngineConfig.model_fields)
    server_keys = set(ServerOptions.model_fields)
    unknown = set(args) - engine_keys - server_keys
    if unknown:
        raise ValueError(f"unknown argument(s) {sorted(unknown)}; engine settings are {sorted(engine_keys)}, "
                         f"server settings are {sorted(server_keys)}")
    return (config_path, {k: v for k, v in args.items() if k in engine_keys},
            {k: v for k, v in args.items() if k in server_keys})


def _resolve(path: str | Path) -> Path:
    """A config path as given, else relative to the repository (`serve deploy` runs from elsewhere)."""
    path = Path(path)
    return path if path.exists() or path.is_absolute() else REPO_ROOT / path


def _gpus_available() -> int:
    """GPUs in the Ray cluster if connected, else on this machine (NVML); 0 means the CPU fallback."""
    import ray

    if ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def build_app(engine_config: EngineConfig, options: ServerOptions) -> serve.Application:
    """The Serve application for one engine config: replicas, routing limits, resources."""
    gpus = _gpus_available()
    replicas = options.num_replicas
    if replicas == "auto":
        replicas = max(gpus, 1)
    actor_options: dict[str, Any] = {"num_cpus": options.cpus_per_replica}
    if gpus > 0:
        actor_options["num_gpus"] = 1
    deployment = LlamaServer.options(
        num_replicas=int(replicas),
        max_ongoing_requests=engine_config.n_parallel + options.control_headroom,
        max_queued_requests=options.max_queued_requests,
        ray_actor_options=actor_options,
        user_config={"engine": engine_config.to_yaml_dict()},
    )
    return deployment.bind(options.model_dump(), ConfigChannel.bind())


def main(args: dict[str, Any] | None = None) -> serve.Application:
    """App builder for `serve run serving.app:main [config=FILE] [KEY=VALUE ...]`.

    Loads configs/tuned.yaml when the tuner has written one, else configs/default.yaml.
    """
    config_path, engine_overrides, server_args = _split_args(args or {})
    engine_config = load_engine_config(config_path, engine_overrides)
    log.info("serving %s with %s (from %s)", engine_config.model_path, engine_config, config_path)
    return build_app(engine_config, ServerOptions(**server_args))
