"""Shared fixtures: one in-process engine, and one Ray Serve instance for the whole session.

Everything runs on CPU with the embedded SmolLM2-135M model. Ray starts once per session (10-40 s) and
is shut down at the end.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from serving import llama as _llama  # noqa: F401  (load order: libllama before numpy)
from serving.config import EngineConfig
from serving.engine import Engine

N_PARALLEL = 4
N_CTX = 4096  # 1024 tokens per slot


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    eng = Engine(EngineConfig(n_parallel=N_PARALLEL, n_ctx=N_CTX, seed=1234))
    yield eng
    eng.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy in {timeout}s")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_session: None) -> str:
    """The app as `serve run serving.app:main n_parallel=4 n_ctx=4096` builds it, on a free loopback port."""
    from ray import serve

    from serving.app import main

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(main({"n_parallel": N_PARALLEL, "n_ctx": N_CTX, "seed": 1234, "config_poll_s": 0.2}),
              name="llama", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return url
