"""The HTTP room: what every request meets before any route, shared by the ingress that holds no model
(so importing this loads no libllama: tests/test_rooms.py says so) and the engine replicas' app.

The body limit, the API key (Bearer or llama-server's X-Api-Key, compared in constant time), the request id,
OpenAI's error JSON, CORS for browsers, the catch-all 500 that names the request id, and the SSE `[DONE]`.
With $LLAMA_SERVE_TUNE_HTTP_TRACE set to a directory, each request's stamps (reached the app, handed to the
engine, first body bytes written, done) go there as JSON lines: where a first token's time goes on the server.
Routes live in serving/openai/routes.py; grammars in serving/openai/structured.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.front.errors import APIError, ErrorDialect, internal_error

log = logging.getLogger("serving")

MAX_BODY_BYTES = 16 * 1024 * 1024  # far more than any slot's context as JSON; a 413 beyond it
PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
REQUEST_ID_HEADER = "x-request-id"  # set by Serve's proxy on every request, echoed to the client
DONE = "data: [DONE]\n\n"  # the last event of every stream
TRACE_ENV = "LLAMA_SERVE_TUNE_HTTP_TRACE"  # a directory: every request's stamps, as JSON lines (StampLog)
STAMPS_KEY = "llama_serve_tune.stamps"  # where a traced request's RequestStamps ride in its ASGI scope


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: whatever an error message echoes (a model name, a bad value) encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """`err` as JSON in the error shape the clients of `path` read (ErrorDialect: Anthropic's under
    /v1/messages, else OpenAI's)."""
    return SafeJSONResponse(err.body_in(ErrorDialect.of(path)), status_code=err.status, headers=err.headers)


def request_id(headers: Headers) -> str:
    return headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


def api_key_matches(authorization: str | None, key: str, x_api_key: str | None = None) -> bool:
    """`Authorization: Bearer <key>`, or llama-server's `X-Api-Key: <key>` when no Authorization header
    came (as llama-server reads them), compared in constant time: both sides are hashed first, so neither
    the content nor the length of the key shows in how long a wrong guess takes to reject."""
    if authorization is None:
        token = x_api_key
    else:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
    if token is None:
        return False
    try:
        given = token.strip().encode("latin-1")  # header values arrive latin-1 decoded: the raw bytes
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(hashlib.sha256(given).digest(), hashlib.sha256(key.encode("utf-8")).digest())


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'X-Api-Key: <key>')",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def too_large() -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")


def route_path(scope: Scope) -> str:
    """The path within the app (Serve mounts it under its route prefix, given as root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


def refusal_of(scope: Scope, key: str | None) -> APIError | None:
    """Why a request is refused before its body is read: a declared body over the limit, or (when the
    server has an API key) a missing or wrong key on any route but PUBLIC_PATHS."""
    headers = Headers(scope=scope)
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        return too_large()
    if key and route_path(scope) not in PUBLIC_PATHS and not api_key_matches(headers.get("authorization"), key,
                                                                             headers.get("x-api-key")):
        return unauthorized()
    return None


@dataclass
class RequestStamps:
    """When one request met each stage in this process, in time.perf_counter() seconds: CLOCK_MONOTONIC on
    Linux, one clock for every process of a host, so a client on the same machine can set its own stamps
    beside these (scripts/bench_http_path.py --server-trace) and see what came before the app and after it."""

    received: float  # the app's front door first saw it (after the HTTP server and Serve)
    submitted: float | None = None  # the route handed it to the engine (template and tokens done)
    first_body: float | None = None  # the first bytes of its body went to the HTTP server
    finished: float | None = None


def mark_submitted(scope: Scope) -> None:
    """Stamp a traced request as handed to the engine (nothing when the app is not tracing)."""
    stamps = scope.get(STAMPS_KEY)
    if isinstance(stamps, RequestStamps):
        stamps.submitted = time.perf_counter()


class StampLog:
    """Each traced request's stamps as one JSON line in DIR/<pid>.jsonl, written when it is done: a
    diagnostic, off unless $LLAMA_SERVE_TUNE_HTTP_TRACE names a directory (each write opens the file: a
    few tens of microseconds a request, nothing held between them)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{os.getpid()}.jsonl"

    @classmethod
    def from_env(cls) -> StampLog | None:
        directory = os.environ.get(TRACE_ENV)
        return cls(Path(directory)) if directory else None

    def write(self, rid: str, path: str, stamps: RequestStamps) -> None:
        line = json.dumps({"request_id": rid, "path": path, **asdict(stamps)})
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


@dataclass(frozen=True)
class HttpRules:
    """What the app's front door enforces, fixed when the app is built (ServerOptions' api_key and
    cors_origins): the ingress holds them, so no request looks anything up at run time."""

    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()

    def around(self, app: ASGIApp) -> ASGIApp:
        """`app` behind these rules: CORS outermost (a browser's preflight needs no key), then the guard."""
        guarded = GuardMiddleware(app, key=self.api_key, stamps=StampLog.from_env())
        if not self.cors_origins:
            return guarded
        return CORSMiddleware(guarded, allow_origins=list(self.cors_origins), allow_methods=["*"],
                              allow_headers=["*"], expose_headers=["Retry-After", "X-Request-ID"])


class GuardMiddleware:
    """Pure ASGI, around every route (no per-chunk cost on streams, unlike BaseHTTPMiddleware):

    1. the catch-all: an exception nothing else handled is logged with its request id, and the client gets
       a generic 500 naming that id, no exception text (not re-raised, unlike Starlette's own handler);
    2. a body larger than MAX_BODY_BYTES is a JSON 413: at once when Content-Length says so, else when
       reading it passes the limit (FastAPI's own max_body_size answers the first case in plain text);
    3. with an API key, every route but PUBLIC_PATHS needs it, checked before the body is read: an
       unauthenticated client learns nothing about what a valid request looks like.
    """

    def __init__(self, app: ASGIApp, key: str | None = None, stamps: StampLog | None = None) -> None:
        self.app, self.key, self.stamps = app, key, stamps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.stamps is None:
            await self._guarded(scope, receive, send, None)
            return
        stamps = scope[STAMPS_KEY] = RequestStamps(time.perf_counter())
        try:
            await self._guarded(scope, receive, send, stamps)
        finally:
            stamps.finished = time.perf_counter()
            self.stamps.write(request_id(Headers(scope=scope)), route_path(scope), stamps)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, stamps: RequestStamps | None) -> None:
        started = False
        received = 0

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            if stamps is not None and stamps.first_body is None and message.get("body"):
                stamps.first_body = time.perf_counter()
            await send(message)

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise StarletteHTTPException(413, too_large().message)  # answered by the app's handler
            return message

        try:
            refusal = refusal_of(scope, self.key)
            if refusal is not None:
                await error_response(refusal, route_path(scope))(scope, receive, send)
                return
            await self.app(scope, limited_receive, tracking_send)
        except StarletteHTTPException as exc:  # from limited_receive, in an app with no handler for it
            if not started:
                err = too_large() if exc.status_code == 413 else APIError(exc.status_code, str(exc.detail))
                await error_response(err, route_path(scope))(scope, receive, send)
        except Exception:
            rid = request_id(Headers(scope=scope))
            log.exception("unhandled error on %s %s (request id %s)", scope.get("method"), scope.get("path"), rid)
            if not started:  # else the response is under way and can only be cut
                await error_response(internal_error(rid), route_path(scope))(scope, receive, send)


class AsgiAnswer(Response):
    """A Serve deployment's answer that is a whole ASGI app run on the request (Serve calls a returned
    Response with the request's own scope, receive and send): how the ingress puts its rules around it."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__()
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


def responses_error(err: APIError) -> dict[str, Any]:
    """The fields of a Responses API `error` event: its `type` is the event's ("error"), not the error's."""
    return {"code": err.code, "message": err.message, "param": err.param}
