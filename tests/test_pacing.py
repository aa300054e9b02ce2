"""A stream read at a pace (serving/engine/request.py's `next_chunk` and `paced`), without a model: a thread pushes
chunks as the engine's step thread does, and the reader takes what came over each interval as one chunk."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from serving.engine.request import FinishReason, GenerationChunk, Request, RequestHandle, SamplingParams, Usage, paced


def _handle() -> RequestHandle:
    return RequestHandle(Request(1, [1], SamplingParams()), threading.Event())


def _push_tokens(handle: RequestHandle, n: int, every_s: float, finish: FinishReason = FinishReason.length,
                 first_gap_s: float = 0.0) -> threading.Thread:
    """Push `n` one-token chunks `every_s` apart from another thread (the second `first_gap_s` after the first,
    when that is longer), the last one finishing the request."""
    def run() -> None:
        for i in range(n):
            time.sleep(max(every_s, first_gap_s) if i == 1 else every_s)
            last = i == n - 1
            handle.push(GenerationChunk(text=f"<{i}>", token_ids=[i], finish_reason=finish if last else None,
                                        usage=Usage(1, n) if last else None))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _pushed_and_read(n: int, every_s: float, spacing_s: float | None, finish: FinishReason = FinishReason.length,
                     first_gap_s: float = 0.0) -> tuple[list[GenerationChunk], float]:
    """`n` tokens pushed `every_s` apart, read through `paced`; the chunks read and the seconds it took."""
    async def main() -> list[GenerationChunk]:
        handle = _handle()
        thread = _push_tokens(handle, n, every_s, finish, first_gap_s)
        chunks = [chunk async for chunk in paced(handle, None if spacing_s is None else lambda: spacing_s)]
        thread.join()
        return chunks

    start = time.monotonic()
    chunks = asyncio.run(main())
    return chunks, time.monotonic() - start


@pytest.mark.unit
def test_paced_reader_gets_every_token_in_order_in_fewer_chunks_and_the_first_alone() -> None:
    chunks, _ = _pushed_and_read(40, 0.0005, 0.2, first_gap_s=0.5)  # the first alone for 0.5 s: read alone
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == list(range(40))
    assert "".join(c.text for c in chunks) == "".join(f"<{i}>" for i in range(40))
    assert chunks[0].token_ids == [0]  # the first token never waits for company
    # then ~0.02 s of tokens at one chunk per 0.2 s: a few chunks; fewer than 20 even where a busy machine
    # stretches each 0.5 ms sleep twenty-fold
    assert len(chunks) < 20
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [FinishReason.length]
    assert chunks[-1].usage == Usage(1, 40)


@pytest.mark.unit
def test_unpaced_reader_keeping_up_gets_a_chunk_per_token() -> None:
    chunks, _ = _pushed_and_read(10, 0.01, 0.0)
    assert [c.token_ids for c in chunks] == [[i] for i in range(10)]


@pytest.mark.unit
def test_the_last_chunk_is_not_held_for_the_interval() -> None:
    """A request that ends while its reader waits out a long interval is read at once, not at its end."""
    chunks, took = _pushed_and_read(3, 0.01, 5.0, FinishReason.stop)
    assert [t for c in chunks for t in c.token_ids] == [0, 1, 2]
    assert chunks[-1].finish_reason == FinishReason.stop
    assert took < 2.5  # far below the 5 s interval (what it takes is not measured here)


@pytest.mark.unit
def test_a_chunk_is_read_even_when_nothing_came_during_the_interval() -> None:
    """Past the interval with nothing queued, the reader waits for the next chunk (it never returns empty)."""
    chunks, _ = _pushed_and_read(3, 0.1, 0.01)
    assert [c.token_ids for c in chunks] == [[0], [1], [2]]


@pytest.mark.unit
def test_a_per_token_reader_gets_one_chunk_per_token_even_when_it_lags() -> None:
    """`spacing=None` (a stream whose client asked for logprobs): chunks as pushed, never merged."""
    async def main() -> list[GenerationChunk]:
        handle = _handle()
        _push_tokens(handle, 10, 0.0).join()  # all ten queued before the reader looks
        return [chunk async for chunk in paced(handle, None)]

    assert [c.token_ids for c in asyncio.run(main())] == [[i] for i in range(10)]


@pytest.mark.unit
def test_default_threads_are_every_cpu_unless_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.engine.config import THREADS_ENV, available_cpus, default_threads

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert default_threads() == available_cpus()
    monkeypatch.setenv(THREADS_ENV, "1")
    assert default_threads() == 1
    monkeypatch.setenv(THREADS_ENV, "100000")
    assert default_threads() == available_cpus()  # a cap, never more threads than CPUs
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=THREADS_ENV):
            default_threads()


@pytest.mark.engine
def test_auto_interval_paces_harder_only_where_decoding_takes_every_core() -> None:
    from serving.replica.options import CPU_BOUND_INTERVAL_MS, INTERVAL_MS, stream_interval_ms
    from serving.engine.config import EngineConfig

    cpu = EngineConfig(n_gpu_layers=0)
    assert stream_interval_ms("auto", cpu, gpu_offload=True, cpus=2) == CPU_BOUND_INTERVAL_MS
    assert stream_interval_ms("auto", EngineConfig(), gpu_offload=False, cpus=2) == CPU_BOUND_INTERVAL_MS
    assert stream_interval_ms("auto", EngineConfig(), gpu_offload=True, cpus=16) == INTERVAL_MS  # on the GPU
    assert stream_interval_ms("auto", EngineConfig(n_gpu_layers=0, n_threads=1), True, cpus=2) == INTERVAL_MS
    assert stream_interval_ms("auto", cpu, True, cpus=2, threads=1) == INTERVAL_MS  # capped default threads
    assert stream_interval_ms(0.0, cpu, gpu_offload=False, cpus=2) == 0.0  # a number is taken as given
    assert stream_interval_ms(75.0, EngineConfig(), gpu_offload=True, cpus=16) == 75.0


@pytest.mark.unit
def test_the_interval_starts_at_the_first_chunk_with_text() -> None:
    """Tokens whose text is held back (a partial character, a possible stop string) leave the first visible
    token unpaced: it goes as soon as it comes, not an interval later."""
    async def main() -> list[GenerationChunk]:
        handle = _handle()

        def run() -> None:
            for i in range(3):
                time.sleep(0.01)
                handle.push(GenerationChunk(text="" if i < 2 else "<2>", token_ids=[i]))
            time.sleep(1.0)  # the request goes on well past the first visible token
            handle.push(GenerationChunk(text="<3>", token_ids=[3], finish_reason=FinishReason.length))

        thread = threading.Thread(target=run)
        thread.start()
        start = time.monotonic()
        chunks, shown_after = [], []
        async for chunk in paced(handle, lambda: 5.0):
            chunks.append(chunk)
            if chunk.text:
                shown_after.append(time.monotonic() - start)
        thread.join()
        assert shown_after[0] < 0.5  # the first text went when it came, not with the request's end at 1 s
        return chunks

    chunks = asyncio.run(main())
    assert "".join(c.text for c in chunks) == "<2><3>" and [t for c in chunks for t in c.token_ids] == [0, 1, 2, 3]


@pytest.mark.unit
def test_a_reader_sleeping_out_its_interval_is_not_woken_per_token() -> None:
    """Tokens queued while a paced reader sleeps out its interval do not each wake its event loop (a
    cross-thread call and a loop turn per token, on the replica's busy cores); the last one does."""
    async def main() -> tuple[list[GenerationChunk], list[tuple[object, ...]]]:
        loop = asyncio.get_running_loop()
        wakes: list[tuple[object, ...]] = []
        real = loop.call_soon_threadsafe

        def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
            wakes.append(args)
            return real(callback, *args, **kwargs)

        setattr(loop, "call_soon_threadsafe", counting)  # noqa: B010  (an instance attribute over the method)
        handle = _handle()
        thread = _push_tokens(handle, 20, 0.005)
        chunks = [chunk async for chunk in paced(handle, lambda: 5.0)]
        thread.join()
        return chunks, wakes

    chunks, wakes = asyncio.run(main())
    assert [t for c in chunks for t in c.token_ids] == list(range(20))
    assert len(wakes) <= 2  # the first token (the reader waits for it) and the last, not one per token
    assert wakes[-1] == (True,)  # the last chunk wakes the reader: the end is never held
