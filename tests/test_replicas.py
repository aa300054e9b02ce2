"""Several replicas: where the app places them (one per GPU; GPUs faked, this machine has none), and two
real replicas on CPU serving one app: load spread, per-replica /slots, and recovery from a killed replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from serving import llama as _llama  # noqa: F401  (load order: libllama before numpy)
from serving import app as serving_app
from serving.config import EngineConfig
from serving.control import CHANNEL_NAME

APP = "two"
RECOVERY_S = 120.0


def deployment_of(application):  # Ray Serve's Application keeps the bound Deployment here (ray 2.x)
    return application._bound_deployment


# -- placement (no Ray needed: building the app only describes it) -----------------------------------
def test_one_replica_per_gpu_each_holding_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 2)
    config = EngineConfig(n_parallel=3, n_ctx=3072)
    d = deployment_of(serving_app.build_app(config, serving_app.ServerOptions(max_queued_requests=17)))
    assert d.name == serving_app.DEPLOYMENT_NAME
    assert d.num_replicas == 2
    assert d.ray_actor_options["num_gpus"] == 1 and d.ray_actor_options["num_cpus"] == 1.0
    assert d.max_ongoing_requests == 3 + 4  # n_parallel + control_headroom
    assert d.max_queued_requests == 17
    assert d.user_config == {"engine": config.to_yaml_dict()}
    # the replicas' second argument is the app's ConfigChannel
    channel = deployment_of(d.init_args[1])
    assert channel.name == CHANNEL_NAME and channel.num_replicas == 1


def test_cpu_fallback_is_one_replica_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 0)
    d = deployment_of(serving_app.build_app(EngineConfig(n_parallel=4),
                                            serving_app.ServerOptions(control_headroom=2, cpus_per_replica=0.5)))
    assert d.num_replicas == 1
    assert "num_gpus" not in d.ray_actor_options and d.ray_actor_options["num_cpus"] == 0.5
    assert d.max_ongoing_requests == 4 + 2
    assert d.max_queued_requests == 64


@pytest.mark.parametrize("gpus", [0, 4])
def test_explicit_replica_count_is_respected(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    monkeypatch.setattr(serving_app, "_gpus_available", lambda: gpus)
    for given in (3, "3"):  # `serve run ... num_replicas=3` passes a string
        d = deployment_of(serving_app.main({"num_replicas": given, "n_parallel": 2, "n_ctx": 2048}))
        assert d.num_replicas == 3 and d.max_ongoing_requests == 2 + 4
        assert ("num_gpus" in d.ray_actor_options) == (gpus > 0)


def test_gpu_count_comes_from_the_ray_cluster(ray_session: None) -> None:
    assert serving_app._gpus_available() == 0  # the test session's Ray has 8 CPUs and no GPU


# -- two replicas on CPU ---------------------------------------------------------------------------
def slots_by_replica(base: str, attempts: int = 40, want: int = 2) -> dict[str, dict]:
    """/slots reaches one replica at random: ask until `want` replicas answered (or `attempts` asks)."""
    seen: dict[str, dict] = {}
    with httpx.Client(timeout=10) as http:
        for _ in range(attempts):
            try:
                r = http.get(f"{base}/slots")
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                body = r.json()
                seen[body["replica"]] = body
                if len(seen) >= want:
                    break
    return seen


def wait_for_replicas(base: str, timeout: float, exclude: frozenset[str] = frozenset()) -> dict[str, dict]:
    """Until two replicas (none of them in `exclude`) answer /slots with a loaded engine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = {k: v for k, v in slots_by_replica(base, attempts=20).items() if k not in exclude}
        if len(seen) >= 2:
            return seen
        time.sleep(0.5)
    raise TimeoutError(f"{base}: two replicas did not serve within {timeout:.0f}s")


def replica_actors() -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if APP in a["name"] and serving_app.DEPLOYMENT_NAME in a["name"]]


@pytest.fixture(scope="module")
def two(serve_url: str) -> Iterator[str]:
    from ray import serve

    t0 = time.monotonic()
    serve.run(serving_app.main({"num_replicas": 2, "n_parallel": 1, "n_ctx": 1024, "cpus_per_replica": 0.5,
                                "config_poll_s": 0.5}),
              name=APP, route_prefix=f"/{APP}")
    base = f"{serve_url}/{APP}"
    try:
        wait_for_replicas(base, RECOVERY_S)
        print(f"two replicas serving after {time.monotonic() - t0:.1f} s")
        yield base
    finally:
        serve.delete(APP)


async def complete(http: httpx.AsyncClient, base: str, i: int) -> httpx.Response:
    return await http.post(f"{base}/v1/completions",
                           json={"prompt": f"Request {i}: a short note about rivers", "max_tokens": 8})


@pytest.mark.timeout(300)
def test_two_replicas_share_the_load(two: str) -> None:
    before = slots_by_replica(two)
    assert len(before) == 2
    assert all(s["config"]["n_parallel"] == 1 and len(s["slots"]) == 1 for s in before.values())

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(complete(http, two, i) for i in range(8)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)

    # each replica's counters, read (at random) until both have answered after the burst
    after = slots_by_replica(two)
    assert len(after) == 2, f"only {sorted(after)} answered /slots"
    finished = {k: after[k]["counters"]["requests_finished"] - before.get(k, {}).get("counters", {}).get(
        "requests_finished", 0) for k in after}
    print(f"requests finished per replica: {finished}")
    assert sum(finished.values()) >= 8
    assert all(s["weight_loads"] == 1 for s in after.values())


@pytest.mark.timeout(300)
def test_killed_replica_is_replaced_and_no_request_hangs(two: str) -> None:
    import ray

    actors = replica_actors()
    assert len(actors) == 2, actors
    victim = actors[0]
    victim_id = victim["name"].rsplit("#", 1)[-1]
    serving = slots_by_replica(two)
    assert victim_id in serving, f"replica id {victim_id} not among {sorted(serving)}"

    async def traffic(killed: asyncio.Event) -> list[tuple[int, str]]:
        """Requests before, during and after the kill; each ends (a status) or times out (-1)."""
        results: list[tuple[int, str]] = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=10)) as http:
            async def one(i: int) -> None:
                try:
                    r = await asyncio.wait_for(complete(http, two, i), timeout=90)
                    results.append((r.status_code, r.text))
                except asyncio.TimeoutError:
                    results.append((-1, "hung"))
                except httpx.HTTPError as exc:
                    results.append((-2, repr(exc)))

            tasks = []
            for i in range(24):
                tasks.append(asyncio.create_task(one(i)))
                if i == 8:
                    await asyncio.to_thread(ray.kill, ray.get_actor(victim["name"], namespace=victim["namespace"]),
                                            no_restart=True)
                    killed.set()
                await asyncio.sleep(0.1)
            await asyncio.gather(*tasks)
        return results

    t_kill = time.monotonic()
    results = asyncio.run(traffic(asyncio.Event()))
    codes = [c for c, _ in results]
    failed = [(c, t[:200]) for c, t in results if c != 200]
    print(f"around the kill: {codes.count(200)} of {len(codes)} requests answered 200; failures: {failed}")
    assert -1 not in codes, "a request hung"
    assert -2 not in codes, [t for c, t in results if c == -2][:3]
    # only what was in flight on the killed replica may fail (its slot and its queue: max_ongoing_requests);
    # the survivor takes the rest
    assert len(failed) <= 1 + 4 and codes.count(200) >= len(codes) - 5
    for code, text in failed:
        # a clean error status: ours is OpenAI-style JSON; Serve's proxy answers a dead replica's
        # requests itself, with a plain-text 500 "Internal Server Error"
        assert 500 <= code < 600, (code, text)
        assert text.startswith('{"error"') or text == "Internal Server Error", text
    # the app recovers: a new replica replaces the killed one and both serve again
    recovered = wait_for_replicas(two, RECOVERY_S, exclude=frozenset({victim_id}))
    recovery_s = time.monotonic() - t_kill
    print(f"recovered from the killed replica in {recovery_s:.1f} s: replicas {sorted(recovered)}")
    assert victim_id not in recovered and len(recovered) == 2
    assert len(replica_actors()) == 2

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as http:
            return [r.status_code for r in await asyncio.gather(*(complete(http, two, i) for i in range(4)))]

    assert asyncio.run(burst()) == [200] * 4
