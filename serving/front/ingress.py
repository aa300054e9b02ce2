"""The app's front door: a light deployment apart from the engine replicas (Ray Serve LLM's ingress /
engine-host split) that takes every HTTP request.

- `/health` is answered here, from what every engine replica last said (all asked at once every 0.5 s in the
  background): ok, `degraded` when some replicas do not serve (a lost node: requests go to the others), or
  503 when none does. How many should serve is Serve's current count of the engine replicas, read every
  TARGET_EVERY_S (with num_replicas=auto it follows the cluster's GPUs): a replica still starting because the
  count grew (a GPU node joined) is `replicas_starting` of an ok app, not a degraded one; one that served and
  is gone, or failed, is degraded until Serve's count drops it. /health answers at once even while the only
  engine replica is dead or restarting, where Serve's proxy would hold a request for that replica until a new
  one exists, and while an engine replica's event loop is busy with a flood of requests.
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
TARGET_EVERY_S = 2.0  # how often the ingress reads Serve's count of engine replicas
LIVE_STATES = ("STARTING", "UPDATING", "RECOVERING", "RUNNING", "PENDING_MIGRATION")  # Serve's, all but stopping


@dataclass(frozen=True)
class HealthReport:
    """An engine replica's answer to /health (serving/replica/server.py's LlamaServer.health_report)."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers or None)


NO_REPLICA = HealthReport(503, {"status": "unavailable", "error": "no engine replica is up; one is starting"},
                          {"Retry-After": "1"})
DEGRADED = "degraded"


def combined(answers: list[HealthReport | BaseException], expected: int = 1, target: int | None = None
             ) -> HealthReport:
    """One /health for the app from every engine replica's answer (an exception: that replica was lost or did
    not answer), the replicas expected to serve and Serve's count of them (`target`, default `expected`). All
    expected serving and none failed: ok, with `replicas_starting` for the rest of the target (loading, or not
    placed yet). Fewer, or one failed: 200 `degraded`, saying how many of how many serve (requests go to those
    that do; Serve starts the others again where it can, e.g. when a lost node comes back). None well: the first
    replica's own answer (loading, failed), or NO_REPLICA if none answered."""
    reports = [a for a in answers if isinstance(a, HealthReport)]
    well = sum(r.status == 200 for r in reports)
    failed = sum(not isinstance(a, HealthReport) or a.body.get("status") == "error" for a in answers)
    wanted = max(target if target is not None else expected, len(answers))
    if well and well >= expected and not failed:
        starting = wanted - well
        return HealthReport(200, {"status": "ok", "replicas": well, **({"replicas_starting": starting}
                                                                        if starting else {})})
    if well:
        return HealthReport(200, {"status": DEGRADED, "replicas": max(wanted, expected), "replicas_serving": well})
    return reports[0] if reports else NO_REPLICA


@dataclass
class Expectation:
    """How many engine replicas should serve: Serve's count of them (`target`, which follows the cluster), but
    only as many as have served together since: a replica that starts because the count grew is expected once
    it has served, while one that served and is gone is missed until Serve's count drops it."""

    target: int
    served: int = 0  # the most replicas that served at once, within the target

    def retarget(self, target: int) -> None:
        self.target, self.served = target, min(self.served, target)

    def heard(self, answers: list[HealthReport | BaseException]) -> None:
        well = sum(isinstance(a, HealthReport) and a.status == 200 for a in answers)
        self.served = max(self.served, min(well, self.target))

    @property
    def expected(self) -> int:
        return min(self.target, self.served) if self.served else self.target


def live_replicas(states: dict[Any, int]) -> int:
    """Serve's count of a deployment's replicas from its status's replica_states: every one not stopping."""
    return sum(n for state, n in states.items() if str(getattr(state, "value", state)) in LIVE_STATES)


class HealthOfAll:
    """One question to every engine replica at once (Serve's broadcast); awaited, the combined answer."""

    def __init__(self, engines: DeploymentHandle, expectation: Expectation) -> None:
        self._response = engines.broadcast("health_report")
        self._expectation = expectation

    def __await__(self) -> Any:
        return self._combined().__await__()

    async def _combined(self) -> HealthReport:
        answers = list(await self._response.results_async(timeout_s=ASK_DEADLINE_S, return_exceptions=True))
        self._expectation.heard(answers)
        return combined(answers, self._expectation.expected, self._expectation.target)

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
        engine replicas the app was built with, expected until Serve's own count is read."""
        self._streaming = engines.options(stream=True)
        expectation = Expectation(replicas)
        self._health = HealthWatch(lambda: HealthOfAll(engines, expectation))
        loop = asyncio.get_running_loop()
        self._watch = loop.create_task(self._health.run(), name="health-watch")
        self._count = loop.create_task(_follow_count(engines, expectation), name="replica-count")
        self._front = (rules or HttpRules()).around(self._answer)

    def check_health(self) -> None:
        """Serve's liveness probe: an ingress that stopped watching its engines is replaced."""
        if self._watch.done() or self._count.done():
            raise RuntimeError("the engine health watch stopped")

    def __del__(self) -> None:
        for task in ("_watch", "_count"):
            if hasattr(self, task):
                getattr(self, task).cancel()

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


async def _follow_count(engines: DeploymentHandle, expectation: Expectation) -> None:
    """Keeps `expectation` on Serve's count of the engine replicas (serve.status() is a blocking call: a
    thread). A read that fails keeps the last count."""
    while True:
        try:
            status = await asyncio.to_thread(serve.status)
            states = status.applications[engines.app_name].deployments[engines.deployment_name].replica_states
            expectation.retarget(live_replicas(states))
        except Exception as exc:  # the controller busy or restarting: the next read
            log.info("/health: could not read Serve's replica count (%s)", type(exc).__name__)
        await asyncio.sleep(TARGET_EVERY_S)


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
