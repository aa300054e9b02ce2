"""One HTTP exchange carried across a Serve deployment handle: the ingress (serving/front/ingress.py) sends a
`RelayedRequest`, an engine replica runs it through its own FastAPI app (`run_relayed`) and streams back
`RelayedPart`s, which the ingress replays to the client (`RelayResponse`).

Why relay bytes rather than call typed methods: the routes, SSE formatting and per-token work stay in the
process that holds the engine, so only finished bytes cross processes, and every part carries whatever the
app produced since the last one (under load many SSE events per hop, never fewer than one).

What the relay adds is what a lost engine replica needs: a request whose replica dies before answering gets
OpenAI's error JSON (503, Retry-After) instead of a plain-text 500, and a stream it cuts ends with an error
event and `[DONE]` rather than a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.front.errors import APIError, ErrorDialect, internal_error
from serving.front.http import DONE, error_response, responses_error, route_path

log = logging.getLogger("serving")

RawHeaders = list[tuple[bytes, bytes]]
EVENT_STREAM = "text/event-stream"
RESPONSES_PATH = "/v1/responses"
REPLICA_LOST = "replica_unavailable"


@dataclass(frozen=True)
class RelayedRequest:
    """What the engine replica's app needs of the client's request (the body already read and bounded)."""

    method: str
    path: str
    root_path: str
    query_string: bytes
    headers: RawHeaders
    body: bytes
    client: tuple[str, int] | None = None

    @classmethod
    def of(cls, scope: Scope, body: bytes) -> RelayedRequest:
        client = scope.get("client")
        return cls(method=scope["method"], path=scope["path"], root_path=scope.get("root_path", ""),
                   query_string=scope.get("query_string", b""), headers=list(scope.get("headers", [])),
                   body=body, client=(client[0], client[1]) if client else None)

    def scope(self) -> Scope:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "root_path": self.root_path, "query_string": self.query_string, "headers": self.headers,
                "client": self.client, "server": None, "state": {}}


UNHELD_PARTS = 2  # a stream's first parts are never held for company (its opening, its first token)


@dataclass(frozen=True)
class RelayedPart:
    """A run of the app's response: the status line and headers (first part only), then body bytes;
    `more` is False on the last part."""

    body: bytes
    more: bool
    status: int | None = None
    headers: RawHeaders | None = None


async def run_relayed(app: ASGIApp, request: RelayedRequest,
                      spacing: Callable[[], float] = lambda: 0.0) -> AsyncIterator[RelayedPart]:
    """Run `request` through `app`; yield its response in parts, each holding all it sent since the last.

    The status is never sent alone: it travels with the first body bytes, so a whole (non-streaming) answer
    is one part and a replica that dies before the body leaves nothing half-sent. After the first
    UNHELD_PARTS parts, parts are at least `spacing()` seconds apart (asked before each part; what comes in
    between travels together): every part costs Python work in two Serve hops that, on a small CPU, preempts
    the decode threads. The first two go at once: a chat stream's first part is its opening (the role
    frame), and the first token, the second, must not wait behind it; nor does the last (the answer's end
    is never held back). When the caller goes away (the generator is closed or cancelled) the app sees
    `http.disconnect` and its task is cancelled.
    """
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    ended = asyncio.Event()  # the app sent its last bytes, or returned

    async def send(message: Message) -> None:
        messages.put_nowait(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            ended.set()

    async def answer() -> None:
        await app(request.scope(), receive, send)

    def done(_: asyncio.Task[None]) -> None:
        messages.put_nowait(None)
        ended.set()

    task: asyncio.Task[None] = asyncio.create_task(answer())
    task.add_done_callback(done)
    try:
        async for part in _parts(messages, spacing, ended):
            yield part
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _parts(messages: asyncio.Queue[Message | None], spacing: Callable[[], float],
                 ended: asyncio.Event) -> AsyncIterator[RelayedPart]:
    """Group the app's ASGI messages: wait for one, then (once started) until `spacing()` has passed since
    the last part or the app has ended if sooner, and take every one queued by then."""
    loop = asyncio.get_running_loop()
    status: int | None = None
    headers: RawHeaders | None = None
    sent, last = 0, 0.0
    while True:
        batch = [await messages.get()]
        wait = last + spacing() - loop.time() if sent >= UNHELD_PARTS and not ended.is_set() else 0.0
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), wait)
        while not messages.empty():
            batch.append(messages.get_nowait())
        body, more, returned = [], True, False
        for message in batch:
            if message is None:
                returned = True
            elif message["type"] == "http.response.start":
                status, headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                more = bool(message.get("more_body", False))
        if returned and status is None:  # the app returned (or failed) without answering
            raise RuntimeError("the app ended without a response")
        if returned:
            more = False
        if not body and more:  # the status waits for the first body bytes
            continue
        yield RelayedPart(b"".join(body), more, *((status, headers) if not sent else (None, None)))
        sent, last = sent + 1, loop.time()
        if not more:
            return


class PartStream(Protocol):
    """The ingress's end of a relay (a Serve DeploymentResponseGenerator of RelayedParts)."""

    def __aiter__(self) -> AsyncIterator[RelayedPart]: ...

    def cancel(self) -> None: ...


class RelayResponse(Response):
    """Replays an engine replica's `RelayedPart`s to the client, and ends what a lost replica cut cleanly."""

    def __init__(self, parts: PartStream, path: str, rid: str, on_lost: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self._parts, self._path, self._rid, self._on_lost = parts, path, rid, on_lost

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = streaming = False
        try:
            async for part in self._parts:
                if part.status is not None:
                    streaming = Headers(raw=part.headers or []).get("content-type", "").startswith(EVENT_STREAM)
                    await send({"type": "http.response.start", "status": part.status, "headers": part.headers})
                    started = True
                await send({"type": "http.response.body", "body": part.body, "more_body": part.more})
        except asyncio.CancelledError:  # the client went away: so does the engine replica's request
            self._parts.cancel()
            raise
        except Exception as exc:  # the replica was lost, or Serve refused the request
            err = relay_error(exc, self._rid)
            if err.code == REPLICA_LOST:
                self._on_lost()
            path = route_path(scope)
            if not started:
                await error_response(err, path)(scope, receive, send)
            else:
                tail = self._error_event(err, path) if streaming else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _error_event(self, err: APIError, path: str) -> bytes:
        """The end of a cut stream, as the route would have ended it (serving/openai/routes.py,
        serving/openai/anthropic_routes.py)."""
        if self._path.endswith(RESPONSES_PATH):  # the Responses API: a typed error event, no [DONE]
            return f"event: error\ndata: {json.dumps({'type': 'error', **responses_error(err)})}\n\n".encode()
        if ErrorDialect.of(path) is ErrorDialect.anthropic:  # Anthropic's `error` event, no [DONE]
            return f"event: error\ndata: {json.dumps(err.anthropic_body())}\n\n".encode()
        return f"data: {json.dumps(err.body())}\n\n{DONE}".encode()


def relay_error(exc: Exception, rid: str) -> APIError:
    """What a client is told when its request could not be carried to an engine replica and back."""
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import BackPressureError

    if isinstance(exc, BackPressureError):
        log.info("request %s refused: Serve's queue for the engine replicas is full", rid)
        return APIError(503, "the server is at capacity; retry in 1 s", type_="server_error",
                        code="server_overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, RayActorError | ActorUnavailableError):
        log.warning("request %s: its engine replica was lost (%s)", rid, type(exc).__name__)
        return APIError(503, "the engine replica serving this request stopped; retry shortly",
                        type_="server_error", code=REPLICA_LOST, headers={"Retry-After": "1"})
    log.error("relaying request %s failed", rid, exc_info=exc)
    return internal_error(rid)

