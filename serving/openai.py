"""The OpenAI-compatible HTTP surface: the FastAPI app, its error handling, API-key middleware, SSE, and
the /v1 routes. Shapes live in serving/api.py; the Serve deployment that hosts these routes (loading,
config following, the control routes /health, /slots, /metrics) in serving/app.py.

What a client can get wrong is a 4xx with OpenAI's error JSON; a full server is a 503 with Retry-After;
anything else is a 500 whose body holds only a request id, the one the log line carries (and Serve's
X-Request-ID response header). One request's failure stays its own: the routes catch what a request can
raise, and a stream that an engine error cuts ends with an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.api import (
    APIError, ChatCompletionRequest, CompletionRequest, ErrorBody, ResponseBuilder, finish_reason, internal_error,
    validation_error,
)
from serving.chat_template import ChatTemplateError
from serving.errors import EngineStoppedError, PromptTooLongError, QueueFullError
from serving.request import FinishReason, GenerationChunk, RequestHandle, SamplingParams, Usage

if TYPE_CHECKING:
    from serving.engine import Engine

log = logging.getLogger("serving")

MAX_BODY_BYTES = 16 * 1024 * 1024  # far more than any slot's context as JSON; a 413 beyond it
PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
REQUEST_ID_HEADER = "x-request-id"  # set by Serve's proxy on every request, echoed to the client


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: whatever an error message echoes (a model name, a bad value) encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: APIError) -> JSONResponse:
    return SafeJSONResponse(err.body(), status_code=err.status, headers=err.headers)


def request_id(headers: Headers) -> str:
    return headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


class _App(FastAPI):
    def openapi(self) -> dict[str, Any]:
        """The schema says what the server answers: 400 with OpenAI's error JSON, not FastAPI's 422."""
        if self.openapi_schema is None:
            schema = super().openapi()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
            self.openapi_schema = schema
        return self.openapi_schema


api = _App(title="llama-serve-tune", description="OpenAI-compatible llama.cpp serving")


# -- error handling ----------------------------------------------------------------------------------
@api.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


@api.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(list(exc.errors())))


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail), code=_HTTP_CODES.get(exc.status_code),
                                   headers=dict(exc.headers) if exc.headers else None))


def api_key_matches(authorization: str | None, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time: both sides are hashed first, so neither
    the content nor the length of the key shows in how long a wrong guess takes to reject."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        given = token.strip().encode("latin-1")  # header values arrive latin-1 decoded: the raw bytes
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(hashlib.sha256(given).digest(), hashlib.sha256(key.encode("utf-8")).digest())


def _unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _too_large() -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")


def _route_path(scope: Scope) -> str:
    """The path within the app (Serve mounts it under its route prefix, given as root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


class GuardMiddleware:
    """Pure ASGI, around every route (no per-chunk cost on streams, unlike BaseHTTPMiddleware):

    1. the catch-all: an exception nothing else handled is logged with its request id, and the client gets
       a generic 500 naming that id, no exception text (not re-raised, unlike Starlette's own handler);
    2. a body larger than MAX_BODY_BYTES is a JSON 413: at once when Content-Length says so, else when
       reading it passes the limit (FastAPI's own max_body_size answers the first case in plain text);
    3. when the replica has an API key (`key_of()`), every route but PUBLIC_PATHS needs it, checked before
       the body is read: an unauthenticated client learns nothing about what a valid request looks like.
    """

    def __init__(self, app: ASGIApp, key_of: Callable[[], str | None]) -> None:
        self.app, self.key_of = app, key_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        received = 0

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise StarletteHTTPException(413, _too_large().message)  # answered by _http_error
            return message

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
            await self.app(scope, limited_receive, tracking_send)
        except Exception:
            rid = request_id(Headers(scope=scope))
            log.exception("unhandled error on %s %s (request id %s)", scope.get("method"), scope.get("path"), rid)
            if not started:  # else the response is under way and can only be cut
                await error_response(internal_error(rid))(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return _too_large()
        if _route_path(scope) not in PUBLIC_PATHS:
            key = self.key_of()
            if key and not api_key_matches(headers.get("authorization"), key):
                return _unauthorized()
        return None


def install_middleware(key_of: Callable[[], str | None]) -> None:
    api.add_middleware(GuardMiddleware, key_of=key_of)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text} for code, text in (
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model or route"),
        (413, "request body too large"), (500, "internal error (the message holds a request id)"),
        (503, "model loading, or the server is full (Retry-After says when to retry)"),
    )
}


# -- SSE ---------------------------------------------------------------------------------------------
class RequestRecorder(Protocol):
    def record_request(self, usage: Usage | None, reason: FinishReason | str) -> None: ...
    def record_rejected(self, cause: str) -> None: ...


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
GENERATION_FAILED = "generation failed"


async def sse_events(chunks: AsyncIterable[GenerationChunk], builder: ResponseBuilder, include_usage: bool,
                     metrics: RequestRecorder, rid: str) -> AsyncIterator[str]:
    """Server-sent events for one generation; always ends with `[DONE]` unless the client went away.

    An error chunk (the engine failed this request) sends the text it carries, then OpenAI's error JSON as
    an event. Anything raised here (a bug) becomes the same error event with a generic message, since the
    200 status and headers are already out.
    """
    first = True
    try:
        async for chunk in chunks:
            failed = chunk.finish_reason == FinishReason.error
            reason = finish_reason(chunk)
            if chunk.text or reason or first:
                yield _event(builder.stream_chunk(chunk.text, reason, first))
                first = False
            if failed:
                metrics.record_request(chunk.usage, FinishReason.error)
                err = APIError(500, chunk.error or GENERATION_FAILED, type_="server_error", code="generation_failed")
                yield _event(err.body())
                break
            if chunk.finish_reason is not None:
                metrics.record_request(chunk.usage, chunk.finish_reason)
                if include_usage:
                    yield _event(builder.usage_chunk(chunk.usage))
                break
        yield DONE
    except Exception:
        log.exception("streaming failed (request id %s)", rid)
        yield _event(internal_error(rid).body())
        yield DONE


# -- the /v1 routes ----------------------------------------------------------------------------------
class OpenAIRoutes:
    """The /v1 routes, as methods of the Serve deployment that inherits them (serving/app.py's LlamaServer).

    The host provides `ready_engine()` (the engine, or an APIError 503 while there is none) and `metrics`
    (a RequestRecorder). The routes use the engine's public API only.
    """

    metrics: RequestRecorder

    def ready_engine(self) -> Engine:
        raise NotImplementedError

    @api.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        engine = self.ready_engine()
        _check_model(engine, body.model)
        messages = [m.as_template_dict() for m in body.messages]
        tokens = await _off_loop(lambda: engine.tokenize_prompt(_render(engine, messages, request)))
        return await self._respond(engine, tokens, body, request, chat=True)

    @api.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        engine = self.ready_engine()
        _check_model(engine, body.model)
        prompt = body.prompt
        if isinstance(prompt, list):
            n_vocab = engine.n_vocab
            if any(not 0 <= t < n_vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {n_vocab})", param="prompt")
            tokens = list(prompt)
        else:
            tokens = await _off_loop(lambda: engine.tokenize_prompt(prompt))
        return await self._respond(engine, tokens, body, request, chat=False)

    @api.get("/v1/models", responses=ERROR_RESPONSES)
    async def models(self) -> dict[str, Any]:
        engine = self.ready_engine()
        return {"object": "list", "data": [{
            "id": engine.config.served_name, "object": "model", "created": 0, "owned_by": "llama-serve-tune",
            "meta": {"n_ctx_slot": engine.n_ctx_slot, "n_parallel": engine.config.n_parallel,
                     "n_vocab": engine.n_vocab, "n_ctx_train": engine.n_ctx_train},
        }]}

    # -- helpers -------------------------------------------------------------------------------------
    async def _respond(self, engine: Engine, tokens: list[int], body: Any, request: Request, chat: bool) -> Any:
        params = body.sampling_params(engine.n_ctx_slot)
        handle = self._submit(engine, tokens, params, param="messages" if chat else "prompt")
        builder = ResponseBuilder(chat, engine.config.served_name)
        rid = request_id(request.headers)
        if body.stream:
            return StreamingResponse(self._stream(handle, builder, body.include_usage, rid),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        parts: list[str] = []
        last = GenerationChunk()
        async with _cancel_unless_finished(handle, self.metrics):
            async for chunk in handle:
                parts.append(chunk.text)
                last = chunk
        if last.finish_reason == FinishReason.error:
            self.metrics.record_request(last.usage, FinishReason.error)
            raise APIError(500, last.error or GENERATION_FAILED, type_="server_error", code="generation_failed")
        self.metrics.record_request(last.usage, last.finish_reason or FinishReason.stop)
        return builder.whole("".join(parts), finish_reason(last), last.usage)

    async def _stream(self, handle: RequestHandle, builder: ResponseBuilder, include_usage: bool,
                      rid: str) -> AsyncIterator[str]:
        async with _cancel_unless_finished(handle, self.metrics):
            async for event in sse_events(handle, builder, include_usage, self.metrics, rid):
                yield event

    def _submit(self, engine: Engine, tokens: list[int], params: SamplingParams, param: str) -> RequestHandle:
        try:
            return engine.submit(tokens, params)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from exc
        except QueueFullError as exc:
            self.metrics.record_rejected("queue_full")
            raise APIError(503, f"the server is at capacity ({exc.queued} requests waiting); retry in "
                                f"{exc.retry_after_s} s", type_="server_error", code="server_overloaded",
                           headers={"Retry-After": str(exc.retry_after_s)}) from exc
        except EngineStoppedError as exc:
            self.metrics.record_rejected("engine_stopped")
            raise engine_unavailable() from exc
        except ValueError as exc:  # the engine's own checks (an empty prompt): its message is for the client
            raise APIError(400, str(exc), param=param) from exc


def engine_unavailable() -> APIError:
    return APIError(503, "the engine is restarting or reloading its model; retry shortly", type_="server_error",
                    code="engine_unavailable", headers={"Retry-After": "1"})


@contextlib.asynccontextmanager
async def _cancel_unless_finished(handle: RequestHandle, metrics: RequestRecorder) -> AsyncIterator[None]:
    """Whatever ends the reading of a handle early (the client went away: CancelledError or GeneratorExit;
    a bug) cancels the request, so its slot is free at the next step, and counts it as cancelled."""
    try:
        yield
    finally:
        if not handle.finished:
            handle.cancel()
            metrics.record_request(None, FinishReason.cancelled)


def _check_model(engine: Engine, requested: str | None) -> None:
    name = engine.config.served_name
    if requested and requested != name:
        raise APIError(404, f"the model '{requested}' does not exist; this server serves '{name}'",
                       param="model", code="model_not_found")


def _render(engine: Engine, messages: list[dict[str, Any]], request: Request) -> str:
    try:
        return engine.render_chat(messages)
    except ChatTemplateError as exc:  # the template's own message (roles out of order, ...)
        raise APIError(400, str(exc), param="messages") from exc
    except EngineStoppedError:
        raise
    except Exception as exc:  # a template that trips over these messages some other way
        log.warning("the chat template failed (request id %s)", request_id(request.headers), exc_info=True)
        raise APIError(400, "the model's chat template could not render these messages", param="messages") from exc


async def _off_loop(work: Callable[[], list[int]]) -> list[int]:
    """Template rendering and tokenising run in a worker thread: a long prompt never stalls the event
    loop that answers /health and streams every other request's tokens."""
    try:
        return await asyncio.to_thread(work)
    except EngineStoppedError as exc:
        raise engine_unavailable() from exc
