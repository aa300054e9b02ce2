"""The app's front door: a light deployment apart from the engine replicas (Ray Serve LLM's ingress /
engine-host split) that takes every HTTP request.

- `/health` is answered here, from what every engine replica last said (all asked at once every 0.5 s in the
  background): ok, `degraded` when some replicas do not serve (a lost node: requests go to the others), or
  503 when none does. It answers at once even while the only engine replica is dead or restarting, where
  Serve's proxy would hold a request for that replica until a new one exists, and while an engine replica's
  event loop is busy with a flood of requests.
- The HTTP rules are kept here, bound when the app is built (serving/front/http.py's HttpRules): CORS, the API
  key, the body limit. Every request that passes them is relayed to an engine replica (serving/front/relay.py),
  whose own app answers it; CORS wraps the relayed answer and every refusal alike, so a browser can read
  both. Serve routes each relayed request to the replica with the fewest ongoing requests.
- A lost engine replica is a clean error: 503 with OpenAI's error JSON and Retry-After before the answer
  started, an error event and `[DONE]` in a stream it cut.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from serving.front.http import AsgiAnswer, HttpRules, request_id, route_path
from serving.front.relay import PartStream, RelayedRequest, RelayResponse

log = logging.getLogger("serving")

INGRESS_NAME = "OpenAIIngress"
HEALTH_PATH = "/health"
ASK_EVERY_S = 0.5    # how often the ingress asks an engine replica how it is
ASK_DEADLINE_S = 5.0  # an answer later than this counts as none (a replica that is gone, or far too busy)
STALE_AFTER_S = 3.0  # /health says "unavailable" when no replica has answered for this long


@dataclass(frozen=True)
class HealthReport:
    """An engine replica's answer to /health (serving/app.py's LlamaServer.health_report)."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers or None)


NO_REPLICA = HealthReport(503, {"status": "unavailable", "error": "no engine replica is up; one is starting"},
                          {"Retry-After": "1"})
DEGRADED = "degraded"


def combined(answers: list[HealthReport | BaseException], expected: int = 1) -> HealthReport:
    """One /health for the app from every engine replica's answer (an exception: that replica was lost or did
    not answer) and the replicas the app was built with. All of them well: ok. Some well: 200 `degraded`,
    saying how many of how many serve (requests go to those that do; Serve starts the others again where it
    can, e.g. when a lost node comes back). None well: the first replica's own answer (loading, failed), or
    NO_REPLICA if none answered."""
    reports = [a for a in answers if isinstance(a, HealthReport)]
    well = sum(r.status == 200 for r in reports)
    wanted = max(expected, len(answers))
    if well and well == wanted:
        return HealthReport(200, {"status": "ok", "replicas": well})
    if well:
        return HealthReport(200, {"status": DEGRADED, "replicas": wanted, "replicas_serving": well})
    return reports[0] if reports else NO_REPLICA


class HealthOfAll:
    """One question to every engine replica at once (Serve's broadcast); awaited, the combined answer."""

    def __init__(self, engines: DeploymentHandle, expected: int) -> None:
        self._response = engines.broadcast("health_report")
        self._expected = expected

    def __await__(self) -> Any:
        return self._combined().__await__()

    async def _combined(self) -> HealthReport:
        answers = await self._response.results_async(timeout_s=ASK_DEADLINE_S, return_exceptions=True)
        return combined(list(answers), self._expected)

    def cancel(self) -> None:
        """Nothing to stop: the broadcast ends within its own deadline."""


class HealthWatch:
    """The engine replicas' health as last heard, kept fresh by a background task: /health reads it without
    a remote call, so neither a dead replica nor a replica whose event loop is busy with 96 requests can
    make a poller wait. A replica lost while answering (this watch's question, or a relayed request), or
    none answering for STALE_AFTER_S, reads as NO_REPLICA until a replica answers again."""

    def __init__(self, ask: Callable[[], Any], clock: Callable[[], float] = time.monotonic) -> None:
        self._ask, self._clock = ask, clock
        self._latest: tuple[HealthReport, float] | None = None

    def lost(self) -> None:
        """A relayed request saw its replica die: /health says so now, not at the next answer."""
        self._latest = (NO_REPLICA, self._clock())

    def report(self) -> HealthReport:
        if self._latest is None or self._clock() - self._latest[1] > STALE_AFTER_S:
            return NO_REPLICA
        return self._latest[0]

    async def run(self) -> None:
        while True:
            await self.ask_once()
            await asyncio.sleep(ASK_EVERY_S)

    async def ask_once(self) -> None:
        response = self._ask()
        try:
            report: HealthReport = await asyncio.wait_for(_result(response), ASK_DEADLINE_S)
        except TimeoutError:  # nobody answered in time: the report goes stale by itself
            response.cancel()
            return
        except Exception as exc:  # the replica asked was lost while answering
            log.info("/health: the engine replica was lost (%s)", type(exc).__name__)
            report = NO_REPLICA
        self._latest = (report, self._clock())


@serve.deployment(name=INGRESS_NAME, ray_actor_options={"num_cpus": 0}, health_check_period_s=10)
class OpenAIIngress:
    """Takes every HTTP request of the app; holds no model, so it is never the one that is down."""

    async def __init__(self, engines: DeploymentHandle, rules: HttpRules | None = None,  # type: ignore[misc]
                       replicas: int = 1) -> None:
        """Async, as Serve allows: the health watch starts on the replica's own event loop. `replicas`: the
        engine replicas the app was built with (fewer serving is `degraded`)."""
        self._streaming = engines.options(stream=True)
        self._health = HealthWatch(lambda: HealthOfAll(engines, replicas))
        self._watch = asyncio.get_running_loop().create_task(self._health.run(), name="health-watch")
        self._front = (rules or HttpRules()).around(self._answer)

    def check_health(self) -> None:
        """Serve's liveness probe: an ingress that stopped watching its engines is replaced."""
        if self._watch.done():
            raise RuntimeError("the engine health watch stopped")

    def __del__(self) -> None:
        if hasattr(self, "_watch"):
            self._watch.cancel()

    async def __call__(self, request: Request) -> Response:
        return AsgiAnswer(self._front)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Past the rules: /health from the watch, anything else relayed (its body read through the rules'
        bound on receive)."""
        if scope["method"] == "GET" and route_path(scope) == HEALTH_PATH:
            await self._health.report().response()(scope, receive, send)
            return
        body = await _body(receive)
        if body is None:  # the client left before its request arrived: nobody to answer
            return
        parts = self._streaming.forward.remote(RelayedRequest.of(scope, body))
        rid = request_id(Headers(scope=scope))
        await RelayResponse(cast(PartStream, parts), scope["path"], rid, self._health.lost)(scope, receive, send)


async def _result(response: Any) -> Any:
    return await response


async def _body(receive: Receive) -> bytes | None:
    """The whole request body (the rules' receive refuses one over the limit as it passes it); None if the
    client went away first."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)
