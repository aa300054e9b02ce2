"""Output processing: per request, tokens -> text (UTF-8-safe, stop strings), usage, delivery to its handle.

vLLM v1 keeps this apart from the scheduler; so do we. The scheduler says which token each request got
and how requests ended; this module detokenises, finds stop strings (which end a request the scheduler
cannot see ending), and pushes chunks. The engine releases the slots of requests that end here BEFORE the
last chunk is pushed, so a caller that sees its last chunk finds its slot already free.

One request's trouble stays its own: a detokeniser that raises fails that request only, and a reader
whose event loop has gone (a client that disconnected) gets its request cancelled, nothing more.

Every request's end passes here, whatever ended it (the scheduler, a stop string, an abort), which is why a
client request's shape (serving/engine/traffic.py) is completed here: once per choice's end, never per token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from serving.engine.detok import IncrementalDetokenizer
from serving.engine.request import FinishReason, GenerationChunk, Request, RequestHandle
from serving.engine.scheduler import RequestOutput
from serving.engine.traffic import RequestShape, ShapeInProgress

log = logging.getLogger(__name__)

DETOK_FAILED = "turning this request's tokens into text failed"


@dataclass(frozen=True)
class Delivery:
    """A chunk for one handle, pushed once the scheduler has been told about every end."""

    handle: RequestHandle
    chunk: GenerationChunk


@dataclass
class _Live:
    handle: RequestHandle
    detok: IncrementalDetokenizer
    shape: ShapeInProgress | None = None  # a client request's shape, shared by its choices


class OutputProcessor:
    """Owned by the engine's step thread, like the scheduler."""

    def __init__(self, token_bytes: Callable[[int], bytes],
                 on_shape: Callable[[RequestShape], None] | None = None) -> None:
        """`on_shape` takes each recorded request's shape once its last choice has ended."""
        self._token_bytes = token_bytes
        self._on_shape = on_shape
        self._live: dict[int, _Live] = {}

    def rebind(self, token_bytes: Callable[[int], bytes]) -> None:
        """New weights (a reconfigure that reloaded the model); only called with no request running."""
        self._token_bytes = token_bytes

    def add(self, request: Request, handle: RequestHandle, shape: ShapeInProgress | None = None) -> None:
        self._live[request.id] = _Live(handle, IncrementalDetokenizer(self._token_bytes, request.params.stop),
                                       shape)

    def process(self, outputs: list[RequestOutput]) -> tuple[list[Delivery], list[tuple[int, FinishReason]]]:
        """Turn one step's outputs into chunks; also return the requests that must end now (stop strings,
        failed detokenisation), which the caller ends in the scheduler before delivering."""
        deliveries: list[Delivery] = []
        ends: list[tuple[int, FinishReason]] = []
        for out in outputs:
            live = self._live.get(out.request.id)
            if live is None:
                continue
            try:
                chunk = self._chunk(live.detok, out)
            except Exception:
                log.exception("detokenising request %d failed", out.request.id)
                chunk = GenerationChunk(finish_reason=FinishReason.error, usage=out.usage, error=DETOK_FAILED)
            if chunk.finish_reason is not None:
                del self._live[out.request.id]
                self._end_shape(live, chunk, out.request.id)
                if out.finish is None:  # the scheduler still runs it: end it there first
                    ends.append((out.request.id, chunk.finish_reason))
            deliveries.append(Delivery(live.handle, chunk))
        return deliveries, ends

    def _end_shape(self, live: _Live, chunk: GenerationChunk, request_id: int) -> None:
        """One choice of a recorded request ended; the last one hands the request's shape on. Recording is
        bookkeeping: whatever goes wrong in it is logged, and the request and the step go on."""
        if live.shape is None or self._on_shape is None or chunk.finish_reason is None:
            return
        try:
            shape = live.shape.end_choice(chunk.usage, chunk.finish_reason)
            if shape is not None:
                self._on_shape(shape)
        except Exception:
            log.exception("recording the shape of request %d failed", request_id)

    @staticmethod
    def _chunk(detok: IncrementalDetokenizer, out: RequestOutput) -> GenerationChunk:
        tokens = [out.token] if out.token is not None else []
        logprobs = [out.logprob] if out.logprob is not None else []
        if out.finish in (FinishReason.cancelled, FinishReason.error):
            return GenerationChunk(finish_reason=out.finish, usage=out.usage, error=out.error)
        text, hit_stop = detok.add(out.token) if out.token is not None else ("", False)
        if hit_stop:
            return GenerationChunk(text, tokens, FinishReason.stop, out.usage, logprobs=logprobs)
        if out.finish is not None:  # stop (end of generation) or length: release what was held back
            return GenerationChunk(text + detok.finish(), tokens, out.finish, out.usage, logprobs=logprobs)
        return GenerationChunk(text, tokens, logprobs=logprobs)

    @staticmethod
    def deliver(deliveries: list[Delivery]) -> None:
        """Push chunks; a reader that is gone gets its request cancelled (freed at the next step)."""
        for d in deliveries:
            try:
                alive = d.handle.push(d.chunk)
            except Exception:
                log.exception("delivering to request %d failed", d.handle.request.id)
                alive = False
            if not alive:
                d.handle.request.cancelled = True
