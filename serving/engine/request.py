"""A request as the engine sees it, and the handle its caller reads the output from. Pure data and queues:
no libllama, no Ray, so the API layer and the tests import it freely.

The engine's step thread pushes chunks; the caller reads them either from asyncio (the HTTP routes) or
from a plain thread (benchmarks, the tuner). Cancelling marks the request; the scheduler frees its slot at
the next step, so a dropped client never holds a slot longer than one decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    """Why a request ended. `stop` and `length` are OpenAI's; the other two never reach a client as such."""

    stop = "stop"  # end-of-generation token or a stop string
    length = "length"  # max_tokens, or the slot's context is full
    cancelled = "cancelled"  # the caller cancelled (a client went away)
    error = "error"  # this request failed; `GenerationChunk.error` says why


class ConstraintKind(str, Enum):
    """Which machinery enforces a constraint, token by token (serving/engine/llama.py's SamplerChain)."""

    gbnf = "gbnf"  # a client's raw GBNF grammar (llama-server's `grammar`): llama.cpp's grammar sampler
    guide = "guide"  # an llguidance grammar (response_format, json_schema, forced tool calls): a token mask


@dataclass(frozen=True)
class Constraint:
    """What a request's answer must match: grammar text of its kind (serving/openai/structured.py compiles it)."""

    kind: ConstraintKind
    text: str


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of generation.

    `max_tokens=None` means "until the slot's context is full". Values are validated by the API layer
    (serving/openai/requests.py); the engine trusts them.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # generate to max_tokens, never sampling an end-of-generation token (as llama-server)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit; -inf bans)
    constraint: Constraint | None = None  # only continuations it accepts are sampled
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the k most likely

    @property
    def has_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that needs llama.cpp's sampler state: argmax of the logits is the answer."""
        return self.temperature <= 0.0 and not self.has_penalties and not self.logit_bias and self.constraint is None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives at that position.

    From the model's raw logits (log-softmax), before penalties, logit_bias, grammar and temperature, as
    vLLM reports by default: the model's own belief, comparable across sampling settings.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class Usage:
    """Token counts and timings of one finished request (OpenAI usage plus what llama-server reports)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    decode_s: float = 0.0
    queue_s: float | None = None  # from arrival until a slot took it (the rest of the TTFT is the prefill)

    @property
    def decode_tok_s(self) -> float | None:
        """Decode speed after the first token, the way llama-server's timings.predicted_per_second counts."""
        if self.completion_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.completion_tokens - 1) / self.decode_s


@dataclass
class GenerationChunk:
    """New output of one request. `finish_reason` is set on the last chunk, and `usage` with it.

    `error` (with `finish_reason=error`) is a message safe to show a client; details go to the log.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token in token_ids, when asked

    def merge(self, later: GenerationChunk) -> GenerationChunk:
        """Join a later chunk onto this one (used to send everything available in one SSE event)."""
        return GenerationChunk(
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            finish_reason=later.finish_reason,
            usage=later.usage or self.usage,
            error=later.error or self.error,
            logprobs=self.logprobs + later.logprobs,
        )


@dataclass
class Request:
    """One generation request: prompt tokens, sampling parameters, and its cancellation flag.

    `cancelled` is the one field another thread writes (a plain bool store); the step thread reads it.
    """

    id: int
    prompt_tokens: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False


class RequestHandle:
    """The caller's side of a request: iterate it (sync or async) for GenerationChunks; cancel() to drop it.

    Async iteration yields every chunk available at the moment as one merged chunk, so a reader slower than
    the decoder (a busy HTTP stack) sends fewer, fuller SSE events instead of falling behind; `next_chunk`
    lets a reader pace itself (take what came over an interval as one chunk).
    """

    def __init__(self, request: Request, wake_engine: threading.Event) -> None:
        self.request = request
        self._chunks: queue.SimpleQueue[GenerationChunk] = queue.SimpleQueue()
        self._wake_engine = wake_engine
        self._done = False
        self._waiting = False  # the reader waits for the next chunk, not just for the last (see push)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._ready: asyncio.Event | None = asyncio.Event()
            self._ended: asyncio.Event | None = asyncio.Event()  # the last chunk is queued
        except RuntimeError:
            self._loop, self._ready, self._ended = None, None, None

    # -- engine side ---------------------------------------------------------------------------------
    def push(self, chunk: GenerationChunk) -> bool:
        """Called from the engine thread. False when the reader's event loop is gone: nobody will read on.

        The reader's loop is woken only when the reader waits for this chunk: always for the last, and for
        any other only while the reader waits for the next chunk. A paced reader sleeping out its interval
        is not woken once per token: each wake is a cross-thread call and a turn of the replica's event loop
        that, where every core decodes, preempts a decode thread
        (docs/log/2026-12-04-cpu-http-paced-reader.md). No wake is lost:
        the reader raises `_waiting` before it looks at the queue, and this reads it after queueing.

        The loop can close between any check and the call, so the call itself is what is guarded.
        """
        self._chunks.put(chunk)
        if self._loop is None or self._ready is None:
            return True
        last = chunk.finish_reason is not None
        if not last and not self._waiting:
            return not self._loop.is_closed()
        try:
            self._loop.call_soon_threadsafe(self._wake_reader, last)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    def _wake_reader(self, last: bool) -> None:
        """On the reader's loop: a chunk is queued (and whether it is the request's last)."""
        assert self._ready is not None and self._ended is not None
        self._ready.set()
        if last:
            self._ended.set()

    # -- caller side ---------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the engine to stop this request; its slot is freed at the next step."""
        self.request.cancelled = True
        self._wake_engine.set()

    @property
    def finished(self) -> bool:
        return self._done

    def __iter__(self) -> RequestHandle:
        return self

    def __next__(self) -> GenerationChunk:
        if self._done:
            raise StopIteration
        return self.get()

    def get(self, timeout: float | None = None) -> GenerationChunk:
        """The next chunk, blocking (raises queue.Empty after `timeout` seconds): for threads, not loops."""
        chunk = self._chunks.get(timeout=timeout)
        self._done = chunk.finish_reason is not None
        return chunk

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> GenerationChunk:
        return await self._next(merge=True)

    async def next_chunk(self, not_before: float | None = 0.0) -> GenerationChunk:
        """The next chunk, merged with all that follows until the event loop's clock reads `not_before`, or
        until the request's last chunk comes if sooner (at least one chunk: past `not_before`, the next).
        `None`: the next chunk alone, as the engine pushed it (one token), however many wait behind it.

        A paced reader (the HTTP routes, `paced` below) thus wakes once per interval, not once per token,
        and never holds a request's end back."""
        if self._ended is None:
            raise RuntimeError("this handle was created outside an event loop; iterate it synchronously")
        if not_before is None:
            return await self._next(merge=False)
        wait = not_before - asyncio.get_running_loop().time()
        if wait > 0 and not self._ended.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), wait)
        return await self._next(merge=True)

    async def _next(self, merge: bool) -> GenerationChunk:
        if self._done:
            raise StopAsyncIteration
        if self._ready is None:
            raise RuntimeError("this handle was created outside an event loop; iterate it synchronously")
        while True:
            self._waiting = True  # before looking: a chunk queued from here on wakes this reader
            chunk = self._drain(merge)
            if chunk is not None:
                self._waiting = False
                self._done = chunk.finish_reason is not None
                return chunk
            await self._ready.wait()
            self._ready.clear()

    def _drain(self, merge: bool) -> GenerationChunk | None:
        merged = None
        while True:
            try:
                chunk = self._chunks.get_nowait()
            except queue.Empty:
                return merged
            merged = chunk if merged is None else merged.merge(chunk)
            if chunk.finish_reason is not None or not merge:
                return merged


def unpaced() -> float:
    """A stream's spacing when it is not paced: each read takes whatever is there."""
    return 0.0


async def paced(handle: RequestHandle, spacing: Callable[[], float] | None) -> AsyncIterator[GenerationChunk]:
    """A handle's chunks: at once until one carries text (the first visible token never waits), then each
    `spacing()` seconds (asked each time) after the reader came back for it, holding everything generated in
    between (the last never waits); with `spacing=None`, one chunk per token however far the reader lags.

    Why: every chunk a stream sends costs Python work in the replica, in Serve's hops and in the client,
    and on a machine whose cores all decode that work stalls the decode threads; a chunk per interval
    rather than per token keeps it off them (vLLM's `stream_interval` does the same by token count)."""
    loop = asyncio.get_running_loop()
    not_before, shown = 0.0, False
    while not handle.finished:
        chunk = await handle.next_chunk(None if spacing is None else not_before)
        yield chunk
        shown = shown or bool(chunk.text)
        not_before = loop.time() + spacing() if spacing is not None and shown else 0.0
