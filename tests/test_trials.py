"""In-place trials and client turns on one engine (serving/replica/trials.py), with a fake engine: no model, no Ray."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from serving.engine.errors import EngineUnavailableError
from serving.front.errors import APIError
from serving.openai.errors import unavailable
from serving.engine.config import EngineConfig
from serving.replica.trials import TrialHost

pytestmark = pytest.mark.unit

SERVING = EngineConfig(n_parallel=4, n_ctx=4096)
TRIAL = EngineConfig(n_parallel=2, n_ctx=1024)


class FakeEngine:
    """What TrialHost uses of an Engine; `busy` admitted requests that end when `release()` is called."""

    def __init__(self) -> None:
        self.config = SERVING
        self.configs: list[EngineConfig] = []
        self.busy = 0
        self.weight_loads = 1

    def reconfigure(self, config: EngineConfig) -> None:
        self.config = config
        self.configs.append(config)

    @property
    def queue_depth(self) -> int:
        return 0

    def snapshot(self) -> Any:
        return SimpleNamespace(slots_busy=self.busy)


def _host(engine: FakeEngine, max_waiting: int = 4, lease_s: float = 60.0,
          clock: Any = None) -> TrialHost:
    return TrialHost(lambda: engine, asyncio.Lock(), max_waiting, lease_s, **({"clock": clock} if clock else {}))


def test_a_trial_measures_its_config_and_the_next_client_gets_the_serving_one_back() -> None:
    async def scenario() -> tuple[FakeEngine, Any, list[EngineConfig]]:
        engine, seen = FakeEngine(), []
        host = _host(engine)
        result = await host.run_trial("s", 3, TRIAL, lambda e: {"measured_on": e.config.n_parallel})
        assert host.state() is not None and host.state()["status"] == "tuning: 1/3 trials done (study s)"
        async with host.client_turn():
            seen.append(engine.config)
        return engine, result, seen

    engine, result, seen = asyncio.run(scenario())
    assert result.measured["measured_on"] == 2 and result.weight_loads == 1
    assert result.held_s >= result.setup_s >= 0
    assert seen == [SERVING], "a client is never answered by a trial's config"
    assert engine.configs == [TRIAL, SERVING]


def test_a_client_arriving_during_a_trial_waits_for_it() -> None:
    async def scenario() -> list[str]:
        engine, order = FakeEngine(), []
        host = _host(engine)
        started, finish = asyncio.Event(), asyncio.Event()

        def measure(_: Any) -> dict:
            order.append("trial runs")
            asyncio.run_coroutine_threadsafe(_set(started), loop).result()
            asyncio.run_coroutine_threadsafe(finish.wait(), loop).result()
            order.append("trial ends")
            return {}

        async def client() -> None:
            await started.wait()
            async with host.client_turn():
                order.append(f"client on n_parallel={engine.config.n_parallel}")

        loop = asyncio.get_running_loop()
        trial = asyncio.create_task(host.run_trial("s", 2, TRIAL, measure))
        waiting = asyncio.create_task(client())
        await started.wait()
        await asyncio.sleep(0.05)
        assert host.state()["status"] == "tuning: trial 1/2 (study s)" and host.state()["clients_waiting"] == 1
        finish.set()
        await asyncio.gather(trial, waiting)
        return order

    assert asyncio.run(scenario()) == ["trial runs", "trial ends", "client on n_parallel=4"]


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_a_trial_waits_for_admitted_requests_and_for_clients_on_their_way() -> None:
    async def scenario() -> list[str]:
        engine, order = FakeEngine(), []
        host = _host(engine)
        engine.busy = 1
        in_turn = asyncio.Event()
        leave = asyncio.Event()

        async def client() -> None:
            async with host.client_turn():  # no study yet: passes at once, but counts
                in_turn.set()
                await leave.wait()
                order.append("client submitted")

        c = asyncio.create_task(client())
        await in_turn.wait()
        assert not host.busy_with_trials
        trial = asyncio.create_task(host.run_trial("s", 1, TRIAL, lambda e: order.append("measured") or {}))
        await asyncio.sleep(0.15)
        assert order == [], "the trial waits for the client that is on its way"
        assert host.busy_with_trials, "a waiting trial already steers new clients elsewhere (replica/routing.py)"
        leave.set()
        await c
        await asyncio.sleep(0.15)
        assert order == ["client submitted"], "and for the request the engine is running"
        engine.busy = 0
        await trial
        assert not host.busy_with_trials
        return order

    assert asyncio.run(scenario()) == ["client submitted", "measured"]


def test_clients_beyond_the_waiting_bound_get_a_503_with_retry_after() -> None:
    async def scenario() -> APIError:
        engine = FakeEngine()
        host = _host(engine, max_waiting=1)
        await host.run_trial("s", 2, TRIAL, lambda e: {})
        lock_holder = asyncio.Event()

        async def hold() -> None:  # a second trial holds the engine
            def measure(_: Any) -> dict:
                asyncio.run_coroutine_threadsafe(lock_holder.wait(), loop).result()
                return {}

            await host.run_trial("s", 2, TRIAL, measure)

        async def first_client() -> None:
            async with host.client_turn():
                pass

        loop = asyncio.get_running_loop()
        trial = asyncio.create_task(hold())
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(first_client())
        await asyncio.sleep(0.05)
        with pytest.raises(EngineUnavailableError) as refused:
            async with host.client_turn():
                pass
        lock_holder.set()
        await asyncio.gather(trial, waiting)
        return unavailable(refused.value)

    err = asyncio.run(scenario())
    assert err.status == 503 and err.headers == {"Retry-After": "5"} and err.code == "tuning_in_progress"


def test_a_published_config_ends_the_study_and_a_silent_tuner_s_lease_expires() -> None:
    async def scenario() -> FakeEngine:
        now = [0.0]
        engine = FakeEngine()
        host = _host(engine, lease_s=60, clock=lambda: now[0])
        await host.run_trial("s", 5, TRIAL, lambda e: {})
        engine.reconfigure(SERVING)  # what the replica's apply of a published config does, then:
        host.finish()
        assert host.state() is None
        await host.run_trial("t", 5, TRIAL, lambda e: {})
        now[0] = 30.0
        await host.expire()
        assert host.state() is not None and engine.config == TRIAL, "inside the lease: still the study's"
        now[0] = 61.0
        await host.expire()
        assert host.state() is None
        return engine

    assert asyncio.run(scenario()).config == SERVING, "the serving config is back"


def test_a_failed_measurement_reaches_the_tuner_and_frees_the_turn() -> None:
    async def scenario() -> list[EngineConfig]:
        engine = FakeEngine()
        host = _host(engine)

        def broken(_: Any) -> dict:
            raise RuntimeError("config failed to build")

        with pytest.raises(RuntimeError, match="failed to build"):
            await host.run_trial("s", 2, TRIAL, broken)
        async with host.client_turn():
            return [engine.config]

    assert asyncio.run(scenario()) == [SERVING]


class FakeHandle:
    def __init__(self) -> None:
        self.cancelled = False
        self.finished = False

    def cancel(self) -> None:
        self.cancelled = True


def test_a_published_config_stops_the_measuring_trial_within_a_round() -> None:
    """Ctrl-C publishes the old config while a trial measures: the measurement's requests are cancelled and its
    next submit refused, so the config is applied at once rather than after the whole (slow) measurement."""
    import threading
    import time

    from serving.replica.trials import TrialAbandoned

    engine, handles, submitted = FakeEngine(), [], threading.Event()

    def submit_choices(prompt: list[int], params: Any, n: int) -> list[FakeHandle]:
        handles.extend(FakeHandle() for _ in range(n))
        return handles[-n:]

    engine.submit_choices = submit_choices  # type: ignore[attr-defined]

    def measure(lent: Any) -> dict:  # rounds of requests until it is told to stop
        assert lent.config == TRIAL, "the other calls reach the engine"
        for _ in range(1000):
            handle = lent.submit([1, 2], None)
            submitted.set()
            while not handle.cancelled and not handle.finished:
                time.sleep(0.005)
            handle.finished = True
        return {"measured": "all"}

    async def scenario() -> BaseException | None:
        host = _host(engine)
        trial = asyncio.create_task(host.run_trial("s", 2, TRIAL, measure))
        await asyncio.to_thread(submitted.wait, 10)
        host.abandon()
        try:
            await asyncio.wait_for(trial, 10)
        except TrialAbandoned as exc:
            return exc
        return None

    raised = asyncio.run(scenario())
    assert isinstance(raised, TrialAbandoned), "the measurement was stopped, not run to its end"
    assert handles and handles[0].cancelled and len(handles) == 1, "its request cancelled, no next one sent"
    idle = _host(FakeEngine())
    idle.abandon()  # no trial measuring: nothing to stop
