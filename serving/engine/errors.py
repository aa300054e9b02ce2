"""Errors the engine raises to its callers; each message says what the caller can change.

Pure data (no libllama, no Ray), so the HTTP layer and the tuner can catch them without loading anything.
"""

from __future__ import annotations

from enum import Enum


class EngineError(RuntimeError):
    """The engine could not do what its config asks (load, context creation); the message says what to change."""


class PromptTooLongError(ValueError):
    """A prompt (plus what it asks to generate) does not fit one slot's context."""

    def __init__(self, n_prompt: int, n_requested: int, n_ctx_slot: int) -> None:
        self.n_prompt, self.n_requested, self.n_ctx_slot = n_prompt, n_requested, n_ctx_slot
        super().__init__(
            f"The request exceeds the available context size: this model's maximum context length per slot is "
            f"{n_ctx_slot} tokens. However, you requested "
            f"{n_prompt + n_requested} tokens ({n_prompt} in the prompt, {n_requested} for the completion). "
            "Shorten the prompt or max_tokens, or serve with a larger n_ctx (or fewer n_parallel slots)."
        )


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its bound: the caller should answer 503 and ask to retry later.

    `retry_after_s` is an estimate from the queue's length and the engine's recent request rate, rounded up
    to whole seconds (HTTP's Retry-After), never below 1.
    """

    def __init__(self, queued: int, limit: int, retry_after_s: int) -> None:
        self.queued, self.limit, self.retry_after_s = queued, limit, retry_after_s
        super().__init__(
            f"the server is at capacity ({queued} requests waiting, limit {limit}); retry in {retry_after_s} s"
        )


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or its step thread has stopped; no new request can be taken."""


class Unavailable(str, Enum):
    """Why a replica has no engine for a request now; the values are the error codes clients see."""

    loading = "model_loading"
    load_failed = "model_load_failed"
    tuning = "tuning_in_progress"


class EngineUnavailableError(RuntimeError):
    """No engine can take the request now (still loading, failed to load, or an in-place study holds it and its
    queue is full). Raised by the replica's host, which knows nothing of HTTP; the routes answer it as a 503
    with `retry_after_s` as Retry-After (None: retrying will not help until an operator acts)."""

    def __init__(self, why: Unavailable, message: str, retry_after_s: int | None = None) -> None:
        self.why, self.retry_after_s = why, retry_after_s
        super().__init__(message)
