"""The relay between the ingress and an engine replica (serving/front/relay.py), without Ray or a model: a
small app run through `run_relayed`, and `RelayResponse` replaying parts, including parts cut short by a
lost replica."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

if TYPE_CHECKING:
    from serving.front.relay import RelayedPart, RelayedRequest

pytestmark = pytest.mark.engine  # in-process; the relay's imports load Ray's library and libllama


def _request(path: str, body: bytes = b"", method: str = "POST") -> RelayedRequest:
    from serving.front.relay import RelayedRequest

    return RelayedRequest(method=method, path=path, root_path="", query_string=b"a=1",
                          headers=[(b"content-type", b"application/json"), (b"x-request-id", b"rid-1")],
                          body=body)


def _app(events: asyncio.Event | None = None, seen: list[str] | None = None) -> Starlette:
    """/echo answers the body and query it got; /burst streams 5 events at once, then 1 after a pause;
    /hang streams one event and then waits for the client to leave."""

    async def echo(request: Request) -> Response:
        return JSONResponse({"body": (await request.body()).decode(), "query": request.url.query,
                             "rid": request.headers["x-request-id"]})

    async def burst(_: Request) -> Response:
        async def gen() -> AsyncIterator[str]:
            for i in range(5):
                yield f"data: {i}\n\n"
            await asyncio.sleep(0.05)
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def hang(_: Request) -> Response:
        async def gen() -> AsyncIterator[str]:
            try:
                yield "data: first\n\n"
                await asyncio.sleep(60)
                yield "data: never\n\n"
            finally:
                assert seen is not None and events is not None
                seen.append("closed")
                events.set()
        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/burst", burst),
                             Route("/hang", hang)])


async def _all(parts: AsyncIterator[RelayedPart]) -> list[RelayedPart]:
    return [part async for part in parts]


def test_a_whole_answer_is_one_part_with_its_status() -> None:
    from serving.front.relay import run_relayed

    parts = asyncio.run(_all(run_relayed(_app(), _request("/echo", b'{"x": 1}'))))
    assert len(parts) == 1
    assert parts[0].status == 200 and not parts[0].more
    assert json.loads(parts[0].body) == {"body": '{"x": 1}', "query": "a=1", "rid": "rid-1"}


def test_a_stream_comes_in_runs_and_ends() -> None:
    from serving.front.relay import run_relayed

    parts = asyncio.run(_all(run_relayed(_app(), _request("/burst", method="GET"))))
    assert parts[0].status == 200 and all(p.status is None for p in parts[1:])
    assert b"".join(p.body for p in parts) == b"".join(f"data: {i}\n\n".encode() for i in range(5)) + \
        b"data: [DONE]\n\n"
    assert len(parts) < 6, "events queued together travel together"
    assert [p.more for p in parts] == [True] * (len(parts) - 1) + [False]


def _trickling(path: str, events: int) -> Starlette:
    """An app whose `path` streams `events` SSE events, `data: 0` ..., 10 ms apart."""
    async def trickle(_: Request) -> Response:
        async def gen() -> AsyncIterator[str]:
            for i in range(events):
                await asyncio.sleep(0.01)
                yield f"data: {i}\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route(path, trickle)])


def test_an_interval_groups_a_streams_events_and_keeps_its_bytes() -> None:
    from serving.front.relay import run_relayed

    app = _trickling("/trickle", 10)
    plain = asyncio.run(_all(run_relayed(app, _request("/trickle", method="GET"))))
    grouped = asyncio.run(_all(run_relayed(app, _request("/trickle", method="GET"), spacing=lambda: 0.05)))
    assert b"".join(p.body for p in grouped) == b"".join(p.body for p in plain)
    assert grouped[0].body == b"data: 0\n\n", "the first bytes are not held back"
    assert grouped[1].body == b"data: 1\n\n", "nor the second (a chat stream's first token, after its opening)"
    assert len(grouped) <= 6 < len(plain)


def test_the_end_of_a_stream_is_not_held_for_the_interval() -> None:
    """A stream that ends while the relay waits out a long interval goes at once, its end included."""
    from serving.front.relay import run_relayed

    async def timed() -> tuple[list[RelayedPart], float]:
        app = _trickling("/short", 4)
        start = time.monotonic()
        parts = await _all(run_relayed(app, _request("/short", method="GET"), spacing=lambda: 5.0))
        return parts, time.monotonic() - start

    parts, took = asyncio.run(timed())
    assert b"".join(p.body for p in parts) == b"".join(f"data: {i}\n\n".encode() for i in range(4))
    assert [p.more for p in parts] == [True] * (len(parts) - 1) + [False]
    assert took < 2.5  # far below the 5 s interval (what it takes is not measured here)


def test_closing_the_relay_ends_the_apps_stream() -> None:
    from serving.front.relay import run_relayed

    async def scenario() -> list[str]:
        closed, seen = asyncio.Event(), []
        parts = run_relayed(_app(closed, seen), _request("/hang", method="GET"))
        first = await parts.__anext__()
        assert first.body == b"data: first\n\n"
        await parts.aclose()  # what a client's disconnect does to the generator
        await asyncio.wait_for(closed.wait(), 5)
        return seen

    assert asyncio.run(scenario()) == ["closed"]


def test_an_unknown_route_is_relayed_as_the_apps_404() -> None:
    from serving.front.relay import run_relayed

    parts = asyncio.run(_all(run_relayed(_app(), _request("/nowhere", method="GET"))))
    assert parts[0].status == 404


# -- the ingress side ----------------------------------------------------------------------------------
class Parts:
    """Stands in for Serve's DeploymentResponseGenerator: replays parts, then raises `failure` (or waits
    forever when `hang`); records a cancel."""

    def __init__(self, parts: list[RelayedPart], failure: Exception | None = None, hang: bool = False) -> None:
        self.parts, self.failure, self.hang, self.cancelled = parts, failure, hang, False

    async def _gen(self) -> AsyncIterator[RelayedPart]:
        for part in self.parts:
            yield part
        if self.hang:
            await asyncio.sleep(3600)
        if self.failure is not None:
            raise self.failure

    def __aiter__(self) -> AsyncIterator[RelayedPart]:
        return self._gen()

    def cancel(self) -> None:
        self.cancelled = True


def _replay(parts: list[RelayedPart], failure: Exception | None, path: str = "/v1/chat/completions",
            lost: list[str] | None = None) -> httpx.Response:
    from serving.front.relay import RelayResponse

    async def endpoint(_: Request) -> Response:
        sink = lost if lost is not None else []
        return RelayResponse(Parts(parts, failure), path, "rid-2", lambda: sink.append("lost"))

    async def go() -> httpx.Response:
        app = Starlette(routes=[Route(path, endpoint, methods=["POST"])])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path)

    return asyncio.run(go())


SSE = [(b"content-type", b"text/event-stream")]


def test_replayed_parts_reach_the_client_unchanged() -> None:
    from serving.front.relay import RelayedPart

    r = _replay([RelayedPart(b"data: a\n\n", True, 200, SSE), RelayedPart(b"data: [DONE]\n\n", False)], None)
    assert r.status_code == 200 and r.text == "data: a\n\ndata: [DONE]\n\n"
    assert r.headers["content-type"] == "text/event-stream"


def test_a_replica_lost_before_answering_is_a_503_with_openai_json() -> None:
    from ray.exceptions import ActorDiedError

    lost: list[str] = []
    r = _replay([], ActorDiedError(), lost=lost)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "replica_unavailable"
    assert lost == ["lost"], "the ingress's /health hears of it at once"
    assert _replay([], RuntimeError("bug"), lost=lost).status_code == 500 and lost == ["lost"]


def test_a_full_serve_queue_is_a_503_overloaded() -> None:
    from ray.serve.exceptions import BackPressureError

    r = _replay([], BackPressureError(num_queued_requests=64, max_queued_requests=64))
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"


def test_a_relay_bug_is_a_500_naming_the_request_id_only() -> None:
    r = _replay([], RuntimeError("secret internals"))
    assert r.status_code == 500 and "rid-2" in r.json()["error"]["message"]
    assert "secret" not in r.text


def test_a_stream_cut_by_a_lost_replica_ends_with_an_error_event_and_done() -> None:
    from ray.exceptions import ActorDiedError
    from serving.front.relay import RelayedPart

    r = _replay([RelayedPart(b'data: {"x": 1}\n\n', True, 200, SSE)], ActorDiedError())
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] == 'data: {"x": 1}'
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == "replica_unavailable"
    assert events[2] == "data: [DONE]"


def test_a_cut_responses_stream_ends_with_a_typed_error_event() -> None:
    from ray.exceptions import ActorDiedError
    from serving.front.relay import RelayedPart

    r = _replay([RelayedPart(b"event: response.created\ndata: {}\n\n", True, 200, SSE)], ActorDiedError(),
                path="/v1/responses")
    last = r.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\n")
    assert json.loads(last.split("data: ", 1)[1])["type"] == "error"


def test_on_anthropics_route_a_lost_replica_is_anthropics_error_json_and_event() -> None:
    """/v1/messages' clients read Anthropic's error shape: before the answer started, and as the `error` event
    that ends a cut stream (no `[DONE]`: Anthropic's streams have none)."""
    from ray.exceptions import ActorDiedError
    from serving.front.relay import RelayedPart

    refused = _replay([], ActorDiedError(), path="/v1/messages")
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded_error"
    cut = _replay([RelayedPart(b"event: message_start\ndata: {}\n\n", True, 200, SSE)], ActorDiedError(),
                  path="/v1/messages")
    last = cut.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\n") and "[DONE]" not in cut.text
    event = json.loads(last.split("data: ", 1)[1])
    assert event["type"] == "error" and event["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("more", [True, False])
def test_a_cut_whole_answer_is_not_padded(more: bool) -> None:
    from ray.exceptions import ActorDiedError
    from serving.front.relay import RelayedPart

    r = _replay([RelayedPart(b'{"a"', more, 200, [(b"content-type", b"application/json")])],
                ActorDiedError() if more else None)
    assert r.status_code == 200 and r.text == '{"a"'


def test_a_client_that_goes_away_cancels_the_engine_replicas_request() -> None:
    from serving.front.relay import RelayResponse, RelayedPart

    async def scenario() -> Parts:
        parts = Parts([RelayedPart(b"data: a\n\n", True, 200, SSE)], hang=True)
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        task = asyncio.create_task(RelayResponse(parts, "/v1/completions", "rid-3")({"type": "http"}, receive, send))
        while len(sent) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return parts

    assert asyncio.run(scenario()).cancelled


# -- the ingress's health watch ------------------------------------------------------------------------
class Asked:
    """A fake handle call: resolves to `report`, raises `failure`, or never resolves (`hang`)."""

    def __init__(self, report: object = None, failure: Exception | None = None, hang: bool = False) -> None:
        self.report, self.failure, self.hang, self.cancelled = report, failure, hang, False

    def __await__(self):  # type: ignore[no-untyped-def]
        return self._wait().__await__()

    async def _wait(self) -> object:
        if self.hang:
            await asyncio.sleep(3600)
        if self.failure is not None:
            raise self.failure
        return self.report

    def cancel(self) -> None:
        self.cancelled = True


def test_health_is_what_a_replica_last_said_until_it_goes_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.exceptions import ActorDiedError

    from serving.front import ingress
    from serving.front.ingress import NO_REPLICA, HealthReport, HealthWatch

    now = [100.0]
    ok = HealthReport(200, {"status": "ok"})
    answers = [Asked(ok), Asked(hang=True), Asked(failure=ActorDiedError())]
    watch = HealthWatch(lambda: answers.pop(0), clock=lambda: now[0])
    assert watch.report() == NO_REPLICA, "nothing heard yet"
    asyncio.run(watch.ask_once())
    assert watch.report() == ok
    monkeypatch.setattr(ingress, "ASK_DEADLINE_S", 0.01)
    hung = answers[0]
    asyncio.run(watch.ask_once())  # no answer in time: the last one stands until it is stale
    assert hung.cancelled and watch.report() == ok
    now[0] += ingress.STALE_AFTER_S + 0.1
    assert watch.report() == NO_REPLICA
    now[0] = 100.0
    asyncio.run(watch.ask_once())  # the replica was lost while answering: unavailable at once
    assert watch.report() == NO_REPLICA and NO_REPLICA.status == 503
    answers.append(Asked(ok))
    asyncio.run(watch.ask_once())
    assert watch.report() == ok
    watch.lost()  # a relayed request saw the replica die
    assert watch.report() == NO_REPLICA


def test_health_of_every_replica_is_ok_degraded_or_the_replicas_own_answer() -> None:
    """/health over several engine replicas (a cluster): all serving is ok; some is `degraded`, 200, with the
    counts, also while a lost replica is not yet back (fewer answers than the app was built with); none serving
    is the replicas' own answer, or unavailable when none answered."""
    from ray.exceptions import ActorDiedError

    from serving.front.ingress import DEGRADED, NO_REPLICA, HealthReport, combined

    ok = HealthReport(200, {"status": "ok"})
    loading = HealthReport(503, {"status": "loading"}, {"Retry-After": "2"})
    assert combined([ok, ok], expected=2) == HealthReport(200, {"status": "ok", "replicas": 2})
    assert combined([ok, ActorDiedError()], expected=2).body == {"status": DEGRADED, "replicas": 2,
                                                                 "replicas_serving": 1}
    assert combined([ok, loading], expected=2).body["status"] == DEGRADED
    lost = combined([ok], expected=2)  # Serve dropped the dead replica; its node is not back yet
    assert lost.status == 200 and lost.body == {"status": DEGRADED, "replicas": 2, "replicas_serving": 1}
    assert combined([loading, ActorDiedError()], expected=2) == loading
    assert combined([], expected=2) == NO_REPLICA and combined([TimeoutError()], expected=1) == NO_REPLICA
