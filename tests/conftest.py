"""Shared fixtures: one in-process engine, and one Ray Serve instance for the whole session; the test lanes.

Everything runs on CPU with the embedded SmolLM2-135M model. Ray starts once per session (10-40 s) and
is shut down at the end.

Lanes (markers registered in pyproject.toml): every test is in exactly one of `unit`, `engine`, `serve`,
checked at collection, so `python -m pytest -m unit` runs the fast lane. That lane stays fast because
collecting a test module imports neither Ray nor libllama (checked below: heavy imports go inside the
fixture or test that needs them) and a unit test imports neither while it runs (checked after each one).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from serving.engine.core import Engine

LANES = ("unit", "engine", "serve", "cluster")
HEAVY = ("ray", "llama_cpp")  # what collecting, and the unit lane, never imports (seconds each on 2 cores)
RAY_FIXTURES = frozenset({"ray_session", "serve_url", "client", "model"})
_HEAVY_BEFORE = pytest.StashKey[frozenset[str]]()
_heavy_collections: list[str] = []


def _heavy_loaded() -> frozenset[str]:
    return frozenset(m for m in HEAVY if m in sys.modules)


def pytest_configure(config: pytest.Config) -> None:
    """Every engine the suite starts (in-process, in a replica, in a tuner child) decodes on one thread unless
    the caller sets $LLAMA_SERVE_TUNE_THREADS: with a thread on each core, a busy neighbour stalls the others
    at llama.cpp's barriers and the suite ran several times slower; with one it runs as it does alone."""
    from serving.engine.config import THREADS_ENV

    os.environ.setdefault(THREADS_ENV, "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    before = _heavy_loaded()
    yield
    if isinstance(collector, pytest.Module) and (new := _heavy_loaded() - before):
        _heavy_collections.append(f"{collector.nodeid} imports {', '.join(sorted(new))} at import time")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every run checks every collected test
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    wrong = list(_heavy_collections)
    for item in items:
        lanes = sorted({m.name for m in item.iter_markers() if m.name in LANES})
        if len(lanes) != 1:
            wrong.append(f"{item.nodeid}: lanes {lanes or 'none'}; mark it with exactly one of {', '.join(LANES)}")
        elif (ray := RAY_FIXTURES & set(item.fixturenames)) and lanes != ["serve"]:
            wrong.append(f"{item.nodeid}: lane {lanes[0]} but uses {', '.join(sorted(ray))} (Ray): lane serve")
        elif "engine" in item.fixturenames and lanes == ["unit"]:
            wrong.append(f"{item.nodeid}: lane unit but uses the engine fixture: lane engine")
    if wrong:
        raise pytest.UsageError("tests/conftest.py, lanes:\n  " + "\n  ".join(wrong))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_HEAVY_BEFORE] = _heavy_loaded()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if item.get_closest_marker("unit") is not None and _HEAVY_BEFORE in item.stash:
        if new := _heavy_loaded() - item.stash[_HEAVY_BEFORE]:
            pytest.fail(f"a unit test imported {', '.join(sorted(new))}: it belongs in lane engine or serve",
                        pytrace=False)


N_PARALLEL = 4
N_CTX = 4096  # 1024 tokens per slot


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    from serving.engine.config import EngineConfig
    from serving.engine.core import Engine  # through serving.engine.llama: ray before libllama (the load order)

    eng = Engine(EngineConfig(n_parallel=N_PARALLEL, n_ctx=N_CTX, seed=1234))
    yield eng
    eng.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy in {timeout}s")


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, Any]:
    """Until no slot is busy and nothing waits (what cancelled requests must come back to); the last /slots."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{url}/slots", timeout=30).json()
        if stats["slots_busy"] == 0 and stats["queue_depth"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} still busy after {timeout}s: {stats['slots_busy']} slots, "
                               f"{stats['queue_depth']} queued")
        time.sleep(0.2)


# -- every test that collects a generation fails on an error chunk or error event --------------------
FINISHED = ("stop", "length", "tool_calls")


def sse_events(lines: Iterable[str], allow_error: bool = False) -> list[dict[str, Any]]:
    """The JSON events of one SSE response, which must end with `[DONE]` (and nothing after it).

    An error event fails the test unless `allow_error` (then it is returned among the events)."""
    events: list[dict[str, Any]] = []
    done = False
    for line in lines:
        if not line.startswith("data: "):
            continue
        assert not done, f"an event after [DONE]: {line!r}"
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        assert allow_error or "error" not in event, f"the stream carried an error event: {event}"
        events.append(event)
    assert done, f"the stream ended without [DONE] after {events[-1:] or 'no events'}"
    return events


def assert_generated(body: dict[str, Any]) -> dict[str, Any]:
    """A whole (non-streamed) completion that finished normally: no error, finish_reason stop, length or
    tool_calls."""
    assert "error" not in body, f"error instead of a completion: {body}"
    reason = body["choices"][0]["finish_reason"]
    assert reason in FINISHED, f"finish_reason {reason!r}: {body}"
    return body


def routed_counts(base: str) -> dict[tuple[str, str], float]:
    """llm_requests_routed from the app's /metrics (every replica's), by (why, replica)."""
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=60).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("llm_requests_routed_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            counts[(labels["by"], labels["replica"])] = float(line.rsplit(" ", 1)[1])
    return counts


def assert_stream_finished(events: list[dict[str, Any]]) -> str:
    """The text of parsed completion/chat events whose last choice finished normally."""
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert reasons and reasons[-1] in FINISHED, f"no normal finish in {events[-2:]}"
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for e in events for c in e["choices"])


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared app's slot_save_path (POST /slots/{id}?action=...)."""
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="session")
def serve_url(ray_session: None, slot_dir: Path) -> str:
    """The app as `serve run serving.app:main n_parallel=4 n_ctx=4096` builds it, on a free loopback port."""
    from ray import serve

    from serving.app import main

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(main({"n_parallel": N_PARALLEL, "n_ctx": N_CTX, "seed": 1234, "config_poll_s": 0.2,
                    "slot_save_path": str(slot_dir)}),
              name="llama", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return url


@pytest.fixture(scope="session")
def client(serve_url: str) -> Any:
    """The official openai client on the shared app (no retries: a failure must show)."""
    import openai

    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="session")
def model(client: Any) -> str:
    return str(client.models.list().data[0].id)
