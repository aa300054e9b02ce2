"""Several replicas: where the app places them (one per GPU; GPUs faked, this machine has none), Serve's
per-replica limits, how each replica follows the app's config channel and holds its background tasks, and
two real replicas on CPU serving one app: load spread, per-replica /slots, and recovery from a killed
replica."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from serving.engine.config import EngineConfig
from tests.conftest import assert_generated, routed_counts

APP = "two"
RECOVERY_S = 120.0


def deployment_of(application):  # Ray Serve's Application keeps the bound Deployment here (ray 2.x)
    return application._bound_deployment


def engines_of(application):  # the engine replicas' deployment: the ingress's first argument
    return deployment_of(deployment_of(application).init_args[0])


# -- placement (no Ray needed: building the app only describes it) -----------------------------------
@pytest.mark.engine
def test_one_replica_per_gpu_each_holding_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.replica.control import DEPLOYMENT_NAME
    from serving import app as serving_app
    from serving.replica.control import CHANNEL_NAME
    from serving.front.ingress import INGRESS_NAME

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 2)
    config = EngineConfig(n_parallel=3, n_ctx=3072)
    ingress = deployment_of(serving_app.build_app(config, serving_app.ServerOptions(max_queued_requests=17)))
    # the app's front door holds no model and no CPU; it can hold every request the engines can
    assert ingress.name == INGRESS_NAME and ingress.ray_actor_options["num_cpus"] == 0
    assert ingress.max_ongoing_requests == 256 * (256 + 17 + 16) + 16  # as many replicas as the policy may start
    d = deployment_of(ingress.init_args[0])
    assert d.name == DEPLOYMENT_NAME
    # one per GPU: Serve's autoscaling, whose policy follows the cluster's GPUs (tests/test_scaling.py)
    assert d._deployment_config.autoscaling_config.initial_replicas == 2
    assert d.ray_actor_options["num_gpus"] == 1 and d.ray_actor_options["num_cpus"] == 1.0
    # above anything the engine can hold (the most slots any config may have + its queue) + headroom
    assert d.max_ongoing_requests == 256 + 17 + 16
    assert d.max_queued_requests == 17
    assert d.user_config == {"engine": config.to_yaml_dict()}
    # routed by prefix affinity, around replicas running an in-place trial (serving/replica/routing.py)
    assert d._deployment_config.request_router_config.request_router_class == "serving.replica.routing:EngineRouter"
    assert d._deployment_config.request_router_config.request_router_kwargs == {"affinity": True, "max_imbalance": 4}
    # the replicas' second argument is the app's ConfigChannel
    channel = deployment_of(d.init_args[1])
    assert channel.name == CHANNEL_NAME and channel.num_replicas == 1


@pytest.mark.engine
@pytest.mark.parametrize("ingress", ["relay", "engine"])
@pytest.mark.parametrize("operator", [None, "1"])
def test_the_replicas_that_take_requests_run_their_routes_on_serves_loop(
        monkeypatch: pytest.MonkeyPatch, ingress: str, operator: str | None) -> None:
    """The replicas that take requests (the ingress, or the engine replicas with ingress=engine) get Serve's
    switch in their runtime env: routes on Serve's own loop, unless the operator set it where the app is built."""
    from serving import app as serving_app

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 0)
    if operator is None:
        monkeypatch.delenv(serving_app.SEPARATE_LOOP_VAR, raising=False)
    else:
        monkeypatch.setenv(serving_app.SEPARATE_LOOP_VAR, operator)
    front = deployment_of(serving_app.main({"ingress": ingress}))
    takers = [front] if ingress == "engine" else [front, deployment_of(front.init_args[0])]
    for d in takers:
        assert d.ray_actor_options["runtime_env"] == {"env_vars": {serving_app.SEPARATE_LOOP_VAR: operator or "0"}}


@pytest.mark.engine
def test_cpu_fallback_is_one_replica_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving import app as serving_app

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 0)
    d = engines_of(serving_app.build_app(EngineConfig(n_parallel=4),
                                            serving_app.ServerOptions(control_headroom=2, cpus_per_replica=0.5)))
    assert d.num_replicas == 1
    assert "num_gpus" not in d.ray_actor_options and d.ray_actor_options["num_cpus"] == 0.5
    assert d.max_ongoing_requests == 256 + 64 + 2
    assert d.max_queued_requests == 64


@pytest.mark.engine
@pytest.mark.parametrize("gpus", [0, 4])
def test_explicit_replica_count_is_respected(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    from serving import app as serving_app

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: gpus)
    for given in (3, "3"):  # `serve run ... num_replicas=3` passes a string
        d = engines_of(serving_app.main({"num_replicas": given, "n_parallel": 2, "n_ctx": 2048}))
        assert d.num_replicas == 3 and d.max_ongoing_requests == 256 + 64 + 16
        assert ("num_gpus" in d.ray_actor_options) == (gpus > 0)


@pytest.mark.engine
def test_serve_limit_does_not_depend_on_the_engine_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A live n_parallel change cannot redeploy Serve's limit, so the limit must not depend on it: the
    engine's queue is the admission control, and Serve's limit stays above anything the engine can hold."""
    from serving import app as serving_app

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 0)
    options = serving_app.ServerOptions(max_queued_requests=8, control_headroom=3)
    limits = {engines_of(serving_app.build_app(EngineConfig(n_parallel=n, n_ctx=256 * n), options))
              .max_ongoing_requests for n in (1, 4, 64, 256)}
    assert limits == {256 + 8 + 3}
    with pytest.raises(ValueError):  # no config can hold more slots than the limit was built on
        EngineConfig(n_parallel=257, n_ctx=257 * 256)


@pytest.mark.serve
def test_gpu_count_comes_from_the_ray_cluster(ray_session: None) -> None:
    from serving import app as serving_app

    assert serving_app._gpus_available() == 0  # the test session's Ray has 8 CPUs and no GPU


# -- following the config channel (a fake channel: no Ray) -------------------------------------------
class FakeChannel:
    """Stands in for the ConfigChannel's DeploymentHandle (`latest.remote()`, `ack.remote(...)` awaitables),
    with failures to inject: `fail_latest` / `fail_ack` calls in a row raise."""

    def __init__(self) -> None:
        from serving.replica.control import Latest, Version

        self.state: Any = Latest(Version("e1", 0), None)  # Any: a test feeds it a malformed answer too
        self.acks: list[tuple[str, str, int, str | None]] = []
        self.fail_latest = self.fail_ack = 0
        self.latest = SimpleNamespace(remote=self._latest)
        self.ack = SimpleNamespace(remote=self._ack)

    def publish(self, **engine: Any) -> None:
        from serving.replica.control import Latest, Version

        self.state = Latest(Version("e1", self.state.at.version + 1), EngineConfig(**engine))

    async def _latest(self) -> Any:
        if self.fail_latest:
            self.fail_latest -= 1
            raise ConnectionError("the channel is restarting")
        return self.state

    async def _ack(self, replica: str, ack: Any) -> None:
        if self.fail_ack:
            self.fail_ack -= 1
            raise ConnectionError("ack lost")
        self.acks.append((replica, ack.at.epoch, ack.at.version, ack.error))


class FakeReplica:
    """The follower's `apply`: records configs; raises for any n_parallel in `refuse`."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.applied: list[EngineConfig] = []
        self.refuse = refuse

    async def apply(self, config: EngineConfig) -> None:
        self.applied.append(config)
        if config.n_parallel in self.refuse:
            raise RuntimeError(f"cannot take n_parallel={config.n_parallel}")


@pytest.mark.engine
def test_a_load_that_hangs_makes_the_replica_unhealthy_after_load_timeout_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve restarts a replica only when its health check fails; a load that never returns (none finished in
    120 s once in a full run here, no error logged) must fail it, or the replica stays loading for good."""
    from serving.replica import host as engine_host
    from serving.replica.server import health_report

    release = threading.Event()

    def hanging_load(*args: Any, **kwargs: Any) -> None:
        release.wait(30)
        raise RuntimeError("released by the test")

    monkeypatch.setattr(engine_host, "Engine", hanging_load)
    limits = engine_host.HostLimits(max_queued_requests=4, traffic_record=16, tuning_lease_s=60.0,
                                    config_poll_s=60.0, load_timeout_s=0.3)
    host = engine_host.EngineHost("r1", limits, FakeChannel())

    async def scenario() -> tuple[str | None, str | None, int]:
        await host.take(EngineConfig())
        early = host.failure()
        await asyncio.sleep(0.5)
        return early, host.failure(), health_report(host.state()).status

    try:
        early, late, status = asyncio.run(scenario())
    finally:
        release.set()
    assert early is None  # loading, within the limit: healthy, /health says loading
    assert late is not None and "has not loaded after" in late and "load_timeout_s 0.3" in late
    assert status == 503


@pytest.mark.engine
def test_a_replica_that_starts_after_a_publish_loads_the_published_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica back with its node (or scaled up) loads what the others serve, not the app's build config it
    would serve until its first poll; the next round acknowledges that version without a second switch."""
    from serving.replica import host as engine_host

    loaded: list[EngineConfig] = []

    def recording_engine(config: EngineConfig, **kwargs: Any) -> Any:
        loaded.append(config)
        return SimpleNamespace(requested=config, alive=True, close=lambda: None)

    monkeypatch.setattr(engine_host, "Engine", recording_engine)
    limits = engine_host.HostLimits(max_queued_requests=4, traffic_record=16, tuning_lease_s=60.0,
                                    config_poll_s=60.0, load_timeout_s=60.0)
    channel = FakeChannel()
    channel.publish(n_parallel=2, n_ctx=512)
    host = engine_host.EngineHost("r2", limits, channel)

    async def scenario() -> None:
        await host.take(EngineConfig())  # Serve's user_config: the build config
        await asyncio.to_thread(host._loaded.wait, 30)
        await host._follower.poll_once()

    try:
        asyncio.run(scenario())
    finally:
        host.close()
    assert [(c.n_parallel, c.n_ctx) for c in loaded] == [(2, 512)]
    assert channel.acks == [("r2", "e1", 1, None)]


@pytest.mark.engine
def test_a_starting_replica_loads_the_build_config_when_nothing_was_published_or_the_channel_is_down() -> None:
    from serving.replica.control import ConfigFollower

    channel, replica = FakeChannel(), FakeReplica()
    follower = ConfigFollower(channel, "r1", replica.apply, poll_s=0.01)

    async def starts() -> tuple[Any, Any]:
        nothing = await follower.published(1.0)
        channel.publish(n_parallel=2, n_ctx=512)
        channel.fail_latest = 1
        down = await follower.published(1.0)
        await follower.poll_once()  # the channel back: the publish applied as any later one
        return nothing, down

    assert asyncio.run(starts()) == (None, None)
    assert [c.n_parallel for c in replica.applied] == [2]


@pytest.mark.engine
def test_the_channel_adopts_a_new_user_config_once_and_a_tuner_publish_always_makes_a_version() -> None:
    from serving.replica.control import ConfigChannel

    channel = ConfigChannel.func_or_class()
    first = channel.publish(EngineConfig(n_parallel=2, n_ctx=512))
    assert channel.adopt(EngineConfig(n_parallel=2, n_ctx=512)) == first  # every replica reports the same
    changed = channel.adopt(EngineConfig(n_parallel=1, n_ctx=512))
    assert changed.version == first.version + 1 and channel.latest().engine == EngineConfig(n_parallel=1, n_ctx=512)
    assert channel.publish(EngineConfig(n_parallel=1, n_ctx=512)).version == changed.version + 1  # ends a study


@pytest.mark.engine
def test_follower_survives_a_failed_ack_and_acks_on_the_next_round() -> None:
    from serving.replica.control import ConfigFollower

    channel, replica = FakeChannel(), FakeReplica()
    follower = ConfigFollower(channel, "r1", replica.apply, poll_s=0.01)

    async def rounds() -> None:
        await follower.poll_once()  # nothing published yet
        channel.publish(n_parallel=2, n_ctx=512)
        channel.fail_ack = 1
        await follower.poll_once()  # applied; the ack is lost (this used to end the follower)
        assert [c.n_parallel for c in replica.applied] == [2] and channel.acks == []
        await follower.poll_once()  # the ack again, without applying again
        await follower.poll_once()
        assert [c.n_parallel for c in replica.applied] == [2]
        assert channel.acks == [("r1", "e1", 1, None)]

    asyncio.run(rounds())


@pytest.mark.engine
def test_follower_loop_keeps_following_through_every_kind_of_failure() -> None:
    """The loop itself (as the replica runs it): an unreachable channel, a malformed answer, a lost ack, a
    config the engine refuses; after all of them the next config is still applied and acknowledged."""
    from serving.replica.control import ConfigFollower, Latest, Version

    channel, replica = FakeChannel(), FakeReplica(refuse=(3,))
    follower = ConfigFollower(channel, "r1", replica.apply, poll_s=0.001)

    async def until(condition: Any) -> None:
        for _ in range(5000):
            if condition():
                return
            await asyncio.sleep(0.001)
        raise AssertionError("the follower stopped following")

    async def scenario() -> None:
        loop = asyncio.create_task(follower.run())
        channel.fail_latest = 3
        channel.publish(n_parallel=3, n_ctx=768)  # refused by the engine
        channel.fail_ack = 2
        await until(lambda: len(channel.acks) == 1)
        assert channel.acks[0][2] == 1 and "cannot take n_parallel=3" in channel.acks[0][3]
        channel.state = {"unexpected": "shape"}  # a malformed answer
        await asyncio.sleep(0.02)
        channel.state = Latest(Version("e1", 1), EngineConfig(n_parallel=3, n_ctx=768))
        channel.publish(n_parallel=2, n_ctx=512)
        await until(lambda: len(channel.acks) == 2)
        assert channel.acks[1] == ("r1", "e1", 2, None)
        assert [c.n_parallel for c in replica.applied] == [3, 2]  # the refused one was not retried
        assert not loop.done()
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop

    asyncio.run(scenario())


@pytest.mark.engine
def test_background_tasks_are_held_reported_when_they_stop_and_cancelled_together() -> None:
    from serving.replica import host as engine_host

    async def scenario() -> None:
        tasks = engine_host.BackgroundTasks()
        running = asyncio.Event()

        async def forever() -> None:
            running.set()
            await asyncio.Event().wait()

        async def crash() -> None:
            raise RuntimeError("boom")

        tasks.start("forever", forever())
        tasks.start("crash", crash())
        await running.wait()
        await asyncio.sleep(0)
        assert tasks.ended() == ["crash"]  # check_health then reports the replica unhealthy
        await asyncio.to_thread(tasks.cancel_all)  # Serve may call __del__ from another thread
        await asyncio.sleep(0.01)
        assert tasks.ended() == ["forever", "crash"]

    asyncio.run(scenario())


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
    from serving.replica.control import DEPLOYMENT_NAME
    import ray


    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if APP in a["name"] and DEPLOYMENT_NAME in a["name"]]


@pytest.fixture(scope="module")
def two(serve_url: str) -> Iterator[str]:
    from ray import serve

    from serving import app as serving_app

    t0 = time.monotonic()
    serve.run(serving_app.main({"num_replicas": 2, "n_parallel": 1, "n_ctx": 1024, "cpus_per_replica": 0.5,
                                "config_poll_s": 0.5, "load_timeout_s": 45}),
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
                           json={"prompt": f"Request {i}: a short note about rivers", "max_tokens": 8,
                                 "ignore_eos": True})


@pytest.mark.serve
@pytest.mark.timeout(300)
def test_two_replicas_share_the_load(two: str) -> None:
    # asked in rounds, not one run of 40: once in a full run here all 40 /slots in a row reached one replica,
    # right after the fixture had seen both answer (both served the tests after it; the cause is not known)
    before = wait_for_replicas(two, 30)
    assert len(before) == 2
    assert all(s["config"]["n_parallel"] == 1 and len(s["slots"]) == 1 for s in before.values())

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(complete(http, two, i) for i in range(8)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses if r.status_code != 200]
    assert all(assert_generated(r.json())["usage"]["completion_tokens"] == 8 for r in responses)

    # each replica's counters, read (at random) until both have answered after the burst
    after = wait_for_replicas(two, 30)
    finished = {k: after[k]["counters"]["requests_finished"] - before.get(k, {}).get("counters", {}).get(
        "requests_finished", 0) for k in after}
    print(f"requests finished per replica: {finished}")
    assert sum(finished.values()) >= 8
    assert all(s["weight_loads"] == 1 for s in after.values())


@pytest.mark.serve
@pytest.mark.timeout(300)
def test_traffic_is_merged_over_every_replica(two: str) -> None:
    """/traffic, whichever replica answers it, counts every replica's requests: it asks them all."""
    from serving.replica.control import DEPLOYMENT_NAME
    from ray import serve


    def traffic() -> dict[str, Any]:
        resp = httpx.get(f"{two}/traffic", timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()

    before = traffic()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(complete(http, two, i) for i in range(6)))

    usages = [assert_generated(r.json())["usage"] for r in asyncio.run(burst())]
    after = traffic()
    assert len(after["replicas"]) == 2 and after["replicas_missing"] == 0, after["replicas"]
    assert after["totals"]["requests"] - before["totals"]["requests"] == 6
    assert after["totals"]["output_tokens"] - before["totals"]["output_tokens"] == 6 * 8
    assert after["totals"]["prompt_tokens"] - before["totals"]["prompt_tokens"] == sum(
        u["prompt_tokens"] for u in usages)
    arrivals = [s["arrival"] for s in after["recent"]["requests"]]
    assert arrivals == sorted(arrivals)  # both replicas' arrivals, interleaved in time order
    # the merged answer is the sum of what each replica holds
    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP)
    each = handle.broadcast("traffic_summary").results(timeout_s=30)
    assert sorted(r for s in each for r in s.replicas) == after["replicas"]
    assert sum(s.totals.requests for s in each) == traffic()["totals"]["requests"]


@pytest.mark.serve
@pytest.mark.timeout(300)
def test_a_trial_on_one_replica_sends_the_clients_to_the_other(two: str, tmp_path: Path) -> None:
    """Serve routes around a replica running an in-place trial (serving/replica/routing.py): every client request
    sent during the trial is served by the other replica, none waits for the trial."""
    from serving.replica.control import DEPLOYMENT_NAME
    from ray import serve

    from serving.replica.routing import ROUTING_STATS_PERIOD_S

    started, gate = tmp_path / "trial-started", tmp_path / "end-the-trial"

    def hold(engine: Any) -> dict[str, Any]:  # the trial's "measurement": runs until the test ends it
        started.touch()
        while not gate.exists():
            time.sleep(0.05)
        return {"replica": serve.get_replica_context().replica_id.unique_id}

    before = slots_by_replica(two)
    assert len(before) == 2
    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP)
    served = EngineConfig(**next(iter(before.values()))["config"])
    trial = handle.tune_trial.remote("routing", 1, served, hold)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), "the trial did not start"
        time.sleep(4 * ROUTING_STATS_PERIOD_S)  # the router's view follows the replicas' reports

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(complete(http, two, i) for i in range(6)))

        responses = asyncio.run(burst())  # a request sent to the replica in the trial would wait for the gate
    finally:
        gate.touch()
    assert [r.status_code for r in responses] == [200] * 6
    assert all(assert_generated(r.json()) for r in responses)
    busy = trial.result(timeout_s=120).measured["replica"]
    after = wait_for_replicas(two, 60)  # the router prefers the replica it last saw idle: ask until both answer
    finished = {k: after[k]["counters"]["requests_finished"] - before[k]["counters"]["requests_finished"]
                for k in before}
    (free,) = set(before) - {busy}
    assert finished == {busy: 0, free: 6}, finished


@pytest.mark.serve
@pytest.mark.timeout(300)
def test_a_returning_conversation_goes_back_to_the_replica_that_served_it(two: str) -> None:
    """Prefix affinity (serving/replica/routing.py): four conversations take turns, one request at a time. The
    first turns spread over both replicas (by load: the one holding least); every returning turn goes by
    affinity to the replica that served its first turn, and finds its history cached there (in the slot or
    restored from host RAM), as /metrics and its usage say. By chance alone, all four would land there one
    time in sixteen."""
    before = routed_counts(two)
    texts = {c: f"Conversation {c}. " + " ".join(f"item {c * 100 + i} is a river" for i in range(60))
             for c in range(4)}
    usage: dict[tuple[int, int], dict[str, Any]] = {}
    with httpx.Client(timeout=120) as http:
        for turn in (1, 2):
            for c, text in texts.items():
                texts[c] = text + f"\nQuestion {turn}: which item comes first?\nAnswer:"
                r = http.post(f"{two}/v1/completions", json={"prompt": texts[c], "max_tokens": 8, "ignore_eos": True,
                                                              "temperature": 0})
                assert r.status_code == 200, r.text
                body = assert_generated(r.json())
                texts[c] += body["choices"][0]["text"]
                usage[(c, turn)] = body["usage"]
    after = routed_counts(two)
    grew = {key: n - before.get(key, 0) for key, n in after.items() if n > before.get(key, 0)}
    by = {why: sum(n for (w, _), n in grew.items() if w == why) for why in ("affinity", "load", "imbalance",
                                                                          "overflow")}
    print(f"routed: {grew}")
    assert by == {"affinity": 4, "load": 4, "imbalance": 0, "overflow": 0}, grew
    assert sorted(n for (w, _), n in grew.items() if w == "load") == [2, 2]  # new conversations spread
    for c in texts:
        first, back = usage[(c, 1)], usage[(c, 2)]
        cached = back["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * first["prompt_tokens"], (c, first, back)


@pytest.mark.serve
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
                except TimeoutError:
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
    # only what was in flight on the killed replica may fail (its slot and its engine queue); the survivor
    # takes the rest
    assert len(failed) <= 1 + 4 and codes.count(200) >= len(codes) - 5
    for code, text in failed:
        # a clean error status: ours is OpenAI-style JSON; Serve's proxy answers a dead replica's
        # requests itself, with a plain-text 500 "Internal Server Error" (no app code runs there)
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
            rs = await asyncio.gather(*(complete(http, two, i) for i in range(4)))
            return [r.status_code for r in rs if r.status_code != 200 or assert_generated(r.json())]

    assert asyncio.run(burst()) == [200] * 4


# -- the app's arguments: one validated model at the builder -----------------------------------------
@pytest.mark.engine
def test_the_builder_validates_its_words_into_one_model_and_binds_the_http_rules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve run serving.app:main KEY=VALUE ...`: Serve validates the words into AppArgs (the builder's
    annotation) before it builds; the API key and CORS origins are bound to the ingress then."""
    from pydantic import ValidationError
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from serving import app as serving_app
    from serving.front.http import HttpRules

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 0)
    words = {"n_parallel": "3", "n_ctx": "3072", "api_key": "k", "cors_origins": "https://a.example, https://b.example"}
    application = call_user_app_builder_with_args_if_necessary(serving_app.main, words)
    ingress = deployment_of(application)
    assert ingress.init_args[1] == HttpRules("k", ("https://a.example", "https://b.example"))
    assert engines_of(application).user_config["engine"]["n_parallel"] == 3
    parsed = serving_app.AppArgs.model_validate(words)
    assert parsed.engine.n_ctx == 3072 and parsed.server.api_key == "k" and parsed.config.name.endswith(".yaml")
    with pytest.raises(ValidationError, match="unknown argument.*'n_paralel'.*engine settings are"):
        serving_app.AppArgs.model_validate({"n_paralel": 2})
    with pytest.raises(ValidationError, match="n_parallel"):  # a bad engine value, at build, not in a replica
        call_user_app_builder_with_args_if_necessary(serving_app.main, {"n_parallel": "0"})
    with pytest.raises(ValidationError, match="max_queued_requests"):
        serving_app.AppArgs.model_validate({"max_queued_requests": -1})


@pytest.mark.engine
def test_with_ingress_engine_the_engine_replicas_are_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ingress=engine`: no ingress deployment; the engine replicas take HTTP themselves (behind the same rules,
    which their options carry), one Serve hop less each way; an unknown mode fails at build."""
    from pydantic import ValidationError
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from serving import app as serving_app
    from serving.replica.control import DEPLOYMENT_NAME

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 0)
    application = call_user_app_builder_with_args_if_necessary(serving_app.main, {"ingress": "engine",
                                                                                  "api_key": "k"})
    engines = deployment_of(application)
    assert engines.name == DEPLOYMENT_NAME and engines.init_args[0]["api_key"] == "k"
    assert engines.init_args[0]["ingress"] == "engine"
    with pytest.raises(ValidationError, match="ingress"):
        serving_app.AppArgs.model_validate({"ingress": "proxy"})


@pytest.mark.engine
def test_the_readme_lists_every_server_setting() -> None:
    """README's server-settings table is where users look: a setting added to ServerOptions must appear there."""
    import re

    from serving import app as serving_app

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("Server settings (`serving/app.py`"):]
    listed = set(re.findall(r"^\| `(\w+)` \|", table[:table.index("\n\n", table.index("| key |"))], re.MULTILINE))
    assert listed == set(serving_app.ServerOptions.model_fields)


@pytest.mark.engine
def test_configuration_md_describes_every_server_setting() -> None:
    from serving import app as serving_app

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    section = doc[doc.index("## Server settings in full"):doc.index("### Admission control")]
    missing = [name for name in serving_app.ServerOptions.model_fields if f"- `{name}` (" not in section]
    assert not missing
