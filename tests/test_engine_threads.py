"""The engine's step thread and its callers: hand-overs that once went wrong, one test per hazard.

Each test builds its own small engine when it breaks or patches one (the model loads in well under a
second); the shared `engine` fixture is only read.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from serving.engine.config import EngineConfig
from serving.engine.errors import EngineError, EngineStoppedError, QueueFullError
from serving.engine.request import FinishReason, SamplingParams
from tests.helpers import collect

if TYPE_CHECKING:
    from serving.engine.core import Engine
    from serving.engine.llama import LlamaModel

pytestmark = pytest.mark.engine

SMALL = EngineConfig(n_parallel=2, n_ctx=1024, seed=7)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture
def small() -> Iterator[Engine]:
    from serving.engine.core import Engine

    eng = Engine(SMALL)
    yield eng
    eng.close()


def wait_for(predicate, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_admission_stays_on_after_many_drain_commands(small: Engine) -> None:
    """A drain command must never leave admission paused (the pause once raced the step thread)."""
    tokens = small.tokenize_prompt("The river begins as a thin line of water.")
    for _ in range(30):
        small.score(tokens)
        assert collect(small.submit(tokens, SHORT)).tokens


def test_a_command_that_times_out_before_it_starts_is_withdrawn(small: Engine) -> None:
    busy = small.submit(small.tokenize_prompt("Count to a thousand:"), LONG)
    busy.get(timeout=60)
    other = SMALL.model_copy(update={"n_batch": 256, "n_ubatch": 256})
    with pytest.raises(TimeoutError):
        small.reconfigure(other, timeout=0.05)
    busy.cancel()
    collect(busy, allow=(FinishReason.cancelled,))
    assert collect(small.submit(small.tokenize_prompt("Hello"), SHORT)).tokens  # admission is back on
    time.sleep(0.2)
    assert small.requested == SMALL  # the withdrawn reconfigure never ran (config is SMALL as sized at load)


def test_the_last_chunk_arrives_after_the_slot_is_free(small: Engine) -> None:
    tokens = small.tokenize_prompt("Name a colour.")
    for _ in range(10):
        collect(small.submit(tokens, SHORT))
        assert small.stats()["slots_busy"] == 0


def test_a_penalised_request_among_greedy_ones_succeeds(engine: Engine) -> None:
    prompt = engine.tokenize_prompt("la la la la la la")
    plain = collect(engine.submit(prompt, SamplingParams(max_tokens=16, temperature=0.0)))
    penalised_params = SamplingParams(max_tokens=16, temperature=0.0, repeat_penalty=1.5, frequency_penalty=1.0,
                                      presence_penalty=0.5)
    handles = [engine.submit(prompt, SamplingParams(max_tokens=16, temperature=0.0)) for _ in range(2)]
    penalised = engine.submit(prompt, penalised_params)
    results = [collect(h) for h in handles]
    assert all(r.text == plain.text for r in results)
    assert collect(penalised).text != plain.text


def test_a_failing_sampler_fails_only_its_request(small: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.engine.llama import LlamaContext

    real = LlamaContext.new_sampler

    def new_sampler(self, params, default_seed):  # noqa: ANN001, ANN202
        chain = real(self, params, default_seed)
        if params.seed == 13:
            def boom(row: int) -> int:
                raise RuntimeError("sampler exploded")
            chain.sample = boom  # type: ignore[method-assign]
        return chain

    monkeypatch.setattr(LlamaContext, "new_sampler", new_sampler)
    tokens = small.tokenize_prompt("Once upon a time")
    alone = collect(small.submit(tokens, SamplingParams(max_tokens=8, temperature=0.0))).text
    good = small.submit(tokens, SamplingParams(max_tokens=8, temperature=0.0))
    bad = small.submit(tokens, SamplingParams(max_tokens=8, temperature=0.7, seed=13))
    assert collect(good).text == alone
    failed = collect(bad, allow=(FinishReason.error,))
    assert failed.finish_reason == FinishReason.error
    assert small.stats()["counters"]["requests_failed"] == 1
    assert collect(small.submit(tokens, SamplingParams(max_tokens=8, temperature=0.0))).text == alone


def test_a_reader_whose_event_loop_closed_frees_its_slot(small: Engine) -> None:
    tokens = small.tokenize_prompt("Tell me a long story:")

    async def submit_and_leave() -> None:
        small.submit(tokens, LONG)  # never read; the loop closes when this returns

    asyncio.run(submit_and_leave())
    wait_for(lambda: small.stats()["counters"]["requests_cancelled"] == 1)
    wait_for(lambda: small.stats()["slots_busy"] == 0)
    assert collect(small.submit(tokens, SHORT)).tokens


def test_token_ids_outside_the_vocabulary_are_refused(small: Engine) -> None:
    for bad in ([small.n_vocab], [-1], [1, 2, 10**12]):
        with pytest.raises(ValueError, match="token ids"):
            small.submit(bad, SHORT)


def test_a_full_queue_is_refused_with_a_retry_hint() -> None:
    from serving.engine.core import Engine

    eng = Engine(SMALL, max_queued=1)
    try:
        tokens = eng.tokenize_prompt("Count to a thousand:")
        running = [eng.submit(tokens, LONG) for _ in range(2)]  # both slots
        wait_for(lambda: eng.stats()["slots_busy"] == 2)
        queued = eng.submit(tokens, SHORT)
        with pytest.raises(QueueFullError) as info:
            eng.submit(tokens, SHORT)
        assert info.value.retry_after_s >= 1 and info.value.limit == 1
        for h in running:
            h.cancel()
        assert collect(queued).tokens
    finally:
        eng.close()


# -- close and rebuild -------------------------------------------------------------------------------
def test_close_never_frees_a_context_that_is_still_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    import serving.engine.core as engine_module
    from serving.engine.core import Engine

    eng = Engine(SMALL)
    ctx = eng._ctx  # noqa: SLF001 (the object whose lifetime is under test)
    entered, release = threading.Event(), threading.Event()
    real_decode = ctx.decode

    def slow_decode() -> int:
        entered.set()
        release.wait(30)
        return real_decode()

    ctx.decode = slow_decode  # type: ignore[method-assign]
    monkeypatch.setattr(engine_module, "JOIN_TIMEOUT_S", 0.1)
    handle = eng.submit(eng.tokenize_prompt("Hello"), SHORT)
    assert entered.wait(30)
    eng.close()  # gives up waiting after 0.1 s
    assert ctx.ptr is not None, "the context was freed while llama_decode was running"
    with pytest.raises(EngineStoppedError):
        eng.submit(eng.tokenize_prompt("Hi") if False else [1, 2], SHORT)
    release.set()
    wait_for(lambda: not eng._thread.is_alive())  # noqa: SLF001
    assert ctx.ptr is None  # freed by the step thread as it left
    assert collect(handle, allow=(FinishReason.error, FinishReason.length)).finish_reason in (
        FinishReason.error, FinishReason.length)


class _FailingContexts:
    """Makes LlamaContext creation fail for chosen configs (as an out-of-memory would)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import serving.engine.core as engine_module
        from serving.engine.llama import LlamaContext

        self.fail: set[int] = set()  # n_ctx values that fail
        real = LlamaContext

        def make(model, config, n_threads):  # noqa: ANN001, ANN202
            if config.n_ctx in self.fail:
                raise EngineError(f"cannot create a context with n_ctx={config.n_ctx} (test)")
            return real(model, config, n_threads)

        monkeypatch.setattr(engine_module, "LlamaContext", make)


def test_a_failed_reconfigure_restores_the_old_config(small: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    contexts = _FailingContexts(monkeypatch)
    contexts.fail.add(2048)
    with pytest.raises(EngineError):
        small.reconfigure(SMALL.model_copy(update={"n_ctx": 2048}))
    assert small.requested == SMALL and small.alive
    assert collect(small.submit(small.tokenize_prompt("Hello"), SHORT)).tokens


def test_a_failed_reload_frees_the_new_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.engine.core import Engine
    from serving.engine.llama import LlamaModel

    copy = tmp_path / "copy.gguf"
    shutil.copy(SMALL.model_path, copy)
    freed: list[Path] = []
    real_free = LlamaModel.free

    def free(self: LlamaModel) -> None:
        if self.ptr:
            freed.append(self.path)
        real_free(self)

    monkeypatch.setattr(LlamaModel, "free", free)
    eng = Engine(SMALL)
    try:
        contexts = _FailingContexts(monkeypatch)
        contexts.fail.add(2048)
        with pytest.raises(EngineError):
            eng.reconfigure(SMALL.model_copy(update={"model": copy, "n_ctx": 2048}))
        assert freed == [SMALL.model_path, copy]  # old weights out first, then the new ones after the failure
        assert eng.requested == SMALL and eng.weight_loads == 3
        assert collect(eng.submit(eng.tokenize_prompt("Hello"), SHORT)).tokens
    finally:
        eng.close()


def test_when_even_the_old_config_cannot_be_restored_the_engine_stops_cleanly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.engine.core import Engine

    eng = Engine(SMALL)
    tokens = eng.tokenize_prompt("Count to a thousand:")
    contexts = _FailingContexts(monkeypatch)
    contexts.fail.update({2048, SMALL.n_ctx})
    running = eng.submit(tokens, LONG)  # long enough to outlast the reconfigure's sizing (a GGUF header read)
    wait_for(lambda: eng.stats()["slots_busy"] == 1)  # running before the reconfigure asks for a drain
    errors: list[BaseException] = []

    def switch() -> None:
        try:
            eng.reconfigure(SMALL.model_copy(update={"n_ctx": 2048}))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    worker = threading.Thread(target=switch)
    worker.start()
    wait_for(lambda: not eng._scheduler.admitting)  # noqa: SLF001 (the reconfigure is waiting)
    waiting = eng.submit(tokens, SHORT)  # waits through the switch, then gets the engine's end
    assert collect(running).finish_reason == FinishReason.length
    worker.join(60)
    assert errors and isinstance(errors[0], EngineError)
    wait_for(lambda: not eng.alive)
    assert collect(waiting, allow=(FinishReason.error,)).finish_reason == FinishReason.error
    with pytest.raises(EngineStoppedError):
        eng.submit(tokens, SHORT)
    eng.close()
