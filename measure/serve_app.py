"""Our Serve app as a benchmark target: Ray and Serve started here, the app deployed with one engine config,
/health awaited, the served config read back, the app deleted afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from measure.targets import HttpTarget, Tokenizer, free_loopback_port

REPO_ROOT = Path(__file__).resolve().parents[1]
APP_NAME = "llama"


def start_serve(num_gpus: int, preload: str | None) -> int:
    """Start Ray (with the GPUs NVML counted) and Serve's HTTP proxy on a free loopback port; the port.

    Replicas are Ray worker processes: they inherit this environment, so the repository goes on PYTHONPATH
    (the GPU machine's copy is not pip-installed). `preload` puts libllama.so into the workers' LD_PRELOAD:
    a Ray worker imports numpy before our code runs, the order that crashed a large-vocab load on the GPU
    machine (serving/engine/llama.py).
    """
    import ray
    from ray import serve

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    runtime_env = {"env_vars": {"LD_PRELOAD": preload}} if preload else None
    ray.init(num_gpus=num_gpus, num_cpus=max(os.cpu_count() or 1, 4), include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False, runtime_env=runtime_env)
    port = free_loopback_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def stop_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def app_problem(name: str) -> str | None:
    """Serve's word when the app is DEPLOY_FAILED or UNHEALTHY (e.g. a replica that crashed loading)."""
    from ray import serve

    app = serve.status().applications.get(name)
    status = str(getattr(app.status, "value", app.status)) if app is not None else ""
    if status not in ("DEPLOY_FAILED", "UNHEALTHY"):
        return None
    assert app is not None
    details = [app.message] + [d.message for d in app.deployments.values() if d.message]
    return f"{status}: " + " | ".join(m for m in details if m)[:1500]


async def wait_healthy(base: str, timeout_s: float, name: str = APP_NAME) -> None:
    """Poll GET /health until 200. A failed model load, or an app Serve calls failed or unhealthy, fails at
    once instead of waiting out the timeout."""
    import httpx

    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        while asyncio.get_running_loop().time() < deadline:
            problem = await asyncio.to_thread(app_problem, name)
            if problem:
                raise RuntimeError(f"Serve app {problem}")
            try:
                resp = await client.get(f"{base}/health")
                if resp.status_code == 200:
                    return
                if resp.headers.get("content-type", "").startswith("application/json") \
                        and resp.json().get("status") == "error":
                    raise RuntimeError(f"the replica failed to load the model: {resp.json().get('error')}")
            except httpx.TransportError:
                pass
            await asyncio.sleep(1.0)
    raise TimeoutError(f"Serve app not healthy after {timeout_s:.0f} s")


async def served_config(base: str) -> dict[str, Any] | None:
    """The config the replica runs (GET /slots), to show it is the other targets'."""
    import httpx

    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        resp = await client.get(f"{base}/slots")
    return resp.json().get("config") if resp.status_code == 200 else None


def _with_env(app: Any, env: dict[str, str]) -> Any:
    """The app with `env` in its ingress's and engine replicas' environment (process-level settings such as
    Serve's own RAY_SERVE_* switches are read when a replica starts)."""
    if env:
        ingress = app._bound_deployment
        engines = ingress.init_args[0]._bound_deployment
        for deployment in (ingress, engines):
            deployment._replica_config.ray_actor_options["runtime_env"] = {"env_vars": dict(env)}
    return app


@asynccontextmanager
async def deployed(port: int, args: dict[str, Any], load_timeout_s: float, request_timeout_s: float,
                   name: str = APP_NAME, env: dict[str, str] | None = None, tokenizer: Tokenizer | None = None
                   ) -> AsyncIterator[HttpTarget]:
    """The app built from `args` (`serve run serving.app:main KEY=VALUE` words, over configs/default.yaml)
    deployed as `name` under the route prefix /`name` (`/` for the default name), with `env` in its replicas'
    environment; an HttpTarget named `name` (with `tokenizer` for token-id prompts) once its /health says 200;
    the app deleted afterwards."""
    from ray import serve

    from serving.app import AppArgs, main as build_app

    prefix = "/" if name == APP_NAME else f"/{name}"
    base = f"http://127.0.0.1:{port}{prefix.rstrip('/')}"
    words = {"config": str(REPO_ROOT / "configs" / "default.yaml"), **args}
    app = _with_env(build_app(AppArgs.model_validate(words)), env or {})
    target = None
    try:
        await asyncio.to_thread(serve.run, app, name=name, route_prefix=prefix)
        await wait_healthy(base, load_timeout_s, name)
        target = HttpTarget(name, f"{base}/v1", request_timeout_s, tokenizer)
        await target.preflight()
        target.extra = {"served_config": await served_config(base), "env": env or {}}
        yield target
    finally:
        if target is not None:
            await target.aclose()
        await asyncio.wait_for(asyncio.to_thread(serve.delete, name), 180)
