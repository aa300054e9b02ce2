"""Sampling under an llguidance guide, its token mask computed once a token, right after the decode is launched.

The mask a guide allows for the next token depends only on the tokens it has consumed, so it can be computed
before the logits it filters exist. The context computes every due mask on the step thread as soon as
`llama_decode` returns and before any logits are read (serving/engine/llama.py, LlamaContext.decode): on a GPU
that call only launches the work (the logits read waits for it), so the masks are computed while the model
decodes; on a CPU the call returns when the decode is done, and the masks follow it. The step thread then pays a
bit lookup and an advance; a refused token costs a pick from the mask, not a mask. vLLM v1 overlaps its grammar
bitmasks with the forward pass for the same reason.

Why not a worker thread (the design before, `MaskWorker`): each token then cost two hand-offs between threads
(wake the worker, wait for its mask) and the GIL both ways. On the shared 2-core CPU under load 8-34 the step
thread spent 0.95-1.86 ms a token handing off to a worker that could be descheduled, against ~0.2 ms for the mask
itself; with a llama.cpp thread on every core (the default) the worker's mask takes one of the decode's cores
anyway. Where a core is spare and the machine idle, the worker hid its mask and the step thread paid ~0.18 ms a
guided token against ~0.30 ms now; end to end, old and new were level within the noise
(docs/log/2026-12-07-cpu-forced-call-nested.md). A guided token earlier cost a check (15-21 us) and an advance
(7-11 us) inline, and a refused one 200-400 us (a mask, then the best candidates one by one), against a token of
~1.15 ms for the embedded model on the H100 (docs/log/2026-12-05-h100-second-run.md).
"""

from __future__ import annotations

import numpy as np
from llguidance import LLMatcher


class DueMasks:
    """The guides of one context whose next mask is not computed yet, in the order they asked. Used from the
    step thread only."""

    def __init__(self) -> None:
        self._due: list[Guided] = []

    def add(self, guided: Guided) -> None:
        self._due.append(guided)

    def compute(self) -> None:
        """Compute every due mask (the context calls this right after launching a decode)."""
        due, self._due = self._due, []
        for guided in due:
            guided.compute()


class Guided:
    """One request's guide and the mask of its next token: computed when its context's decode is launched
    (`DueMasks`), else when first asked for (a guess's later rows, verified in the same step)."""

    def __init__(self, guide: LLMatcher, n_vocab: int, due: DueMasks) -> None:
        self._guide, self._n_vocab, self._due = guide, n_vocab, due
        self._mask = np.zeros((n_vocab + 31) // 32, dtype=np.uint32)
        self._fresh = False  # the mask is the one for the guide's next token
        self._error: Exception | None = None
        due.add(self)

    def compute(self) -> None:
        """The guide's mask for its next token, once (one bit per token; EOS alone once the guide has stopped).
        A failure is kept for the step that reads the mask, which fails that request alone."""
        if self._fresh:
            return
        try:
            self._guide.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        except Exception as exc:
            self._error = exc
        self._fresh = True

    def _ready(self) -> LLMatcher:
        """The guide, its mask computed (the mask's error, if any, raised here)."""
        self.compute()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the constraint's mask failed: {error}") from error
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
        """Consume the chosen token; the next mask is due."""
        guide = self._ready()
        if not guide.consume_token(token):
            raise RuntimeError(f"the constraint refused token {token}: {guide.get_error()}")
        self._fresh = False
        self._due.add(self)
