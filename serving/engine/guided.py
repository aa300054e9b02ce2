"""Sampling under an llguidance guide with its token mask computed ahead, while the model decodes.

The mask a guide allows for the next token depends only on the tokens it has consumed, so it can be computed
as soon as the last one is chosen: a worker thread computes it while the step thread runs the next decode
(llguidance releases the GIL while it computes, llama_decode holds none). When the logits arrive the mask is
there, and the step thread pays a bit lookup and an advance; a refused token costs a pick from the mask, not a
mask. vLLM v1 overlaps its grammar bitmasks with the forward pass for the same reason.

Why: inline, a guided greedy token cost a check (15-21 us) and an advance (7-11 us) in the engine on the
development CPU, and a refused one 200-400 us (a mask, then the best candidates one by one), against a token of
~1.15 ms for the embedded model on the H100. There, with the mask computed ahead, sampling under a guide cost
4-24 us a token more than plain greedy (docs/log/2026-12-05-h100-second-run.md).
"""

from __future__ import annotations

import queue
import threading

import numpy as np
from llguidance import LLMatcher


class MaskJob:
    """One mask to compute: `done` is held until it is written (a lock, the cheapest handoff there is: a
    thread pool's future cost ~40 us per token on the development CPU, more than the mask)."""

    __slots__ = ("guide", "mask", "done", "error")

    def __init__(self, guide: LLMatcher, mask: np.ndarray) -> None:
        self.guide, self.mask = guide, mask
        self.done = threading.Lock()
        self.done.acquire()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:  # the guide's mask: one bit per token (EOS alone once the guide has stopped)
            self.guide.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        except BaseException as exc:  # handed to the request's step, which fails that request alone
            self.error = exc
        finally:
            self.done.release()

    def wait(self) -> None:
        self.done.acquire()
        self.done.release()
        if self.error is not None:
            raise RuntimeError(f"the constraint's mask failed: {self.error}") from self.error


class MaskWorker:
    """One thread computing the masks of a context's guided requests, in the order asked; started on the first.

    One thread is enough: a mask takes tens of microseconds, a decode step a millisecond or more. Used from the
    step thread only."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[MaskJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, guide: LLMatcher, mask: np.ndarray) -> MaskJob:
        """Compute `guide`'s next mask into `mask`; the job holds both until it is done, so a request that
        ends meanwhile frees nothing under it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="guide-masks", daemon=True)
            self._thread.start()
        job = MaskJob(guide, mask)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def close(self) -> None:
        """Finish the jobs asked for and stop the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


class Guided:
    """One request's guide and the mask of its next token, computed ahead by a MaskWorker.

    The guide is touched by one thread at a time: the worker while a mask is pending, the step thread only after
    waiting for it (llguidance's matcher refuses a second borrower)."""

    def __init__(self, guide: LLMatcher, n_vocab: int, worker: MaskWorker) -> None:
        self._guide, self._n_vocab, self._worker = guide, n_vocab, worker
        self._mask = np.zeros((n_vocab + 31) // 32, dtype=np.uint32)
        self._pending: MaskJob | None = worker.submit(guide, self._mask)

    def _ready(self) -> LLMatcher:
        """The guide, once the pending mask is written (the worker's error, if any, raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
        return self._guide

    def allows(self, token: int) -> bool:
        """Whether the guide allows `token` next: one bit of the mask."""
        self._ready()
        return bool((int(self._mask[token >> 5]) >> (token & 31)) & 1)

    def allowed(self) -> np.ndarray:
        """The mask as one bool per token; an error if it allows none."""
        guide = self._ready()
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self._n_vocab].astype(bool)
        if not allowed.any():
            raise RuntimeError(f"the constraint allows no token: {guide.get_error() or guide.stop_reason()}")
        return allowed

    def best(self, logits: np.ndarray) -> int:
        """The allowed token of highest logit (ties: the lowest id, as an argmax over the masked vocabulary).
        Forced text stays in its canonical tokens: the mask allows "get", not the split "g" that llguidance's
        single-token check would take."""
        ids = np.flatnonzero(self.allowed())
        return int(ids[int(logits[ids].argmax())])

    def advance(self, token: int) -> None:
        """Consume the chosen token and start computing the next mask."""
        guide = self._ready()
        if not guide.consume_token(token):
            raise RuntimeError(f"the constraint refused token {token}: {guide.get_error()}")
        self._pending = self._worker.submit(guide, self._mask)
