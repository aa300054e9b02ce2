"""Output processing: per request, tokens -> text (UTF-8-safe, stop strings), usage, delivery to its handle.

vLLM v1 keeps this apart from the scheduler; so do we. The scheduler says which token each request got
and how requests ended; this module detokenises, finds stop strings (which end a request the scheduler
cannot see ending), and pushes chunks. The engine releases the slots of requests that end here BEFORE the
last chunk is pushed, so a caller that sees its last chunk finds its slot already free.

One request's trouble stays its own: a detokeniser that raises fails that request only, and a reader
whose event loop has gone (a client that disconnected) gets its request cancelled, nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from serving.detok import IncrementalDetokenizer
from serving.request import FinishReason, GenerationChunk, Request, RequestHandle
from serving.scheduler import RequestOutput

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


class OutputProcessor:
    """Owned by the engine's step thread, like the scheduler."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._live: dict[int, _Live] = {}

    def rebind(self, token_bytes: Callable[[int], bytes]) -> None:
        """New weights (a reconfigure that reloaded the model); only called with no request running."""
        self._token_bytes = token_bytes

    def add(self, request: Request, handle: RequestHandle) -> None:
        self._live[request.id] = _Live(handle, IncrementalDetokenizer(self._token_bytes, request.params.stop))

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
                if out.finish is None:  # the scheduler still runs it: end it there first
                    ends.append((out.request.id, chunk.finish_reason))
            deliveries.append(Delivery(live.handle, chunk))
        return deliveries, ends

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
