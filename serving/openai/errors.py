"""The engine's and the replica's errors as OpenAI's error JSON: the one place where an error raised below
HTTP (the engine's queue is full, it stopped, a prompt is too long, the replica has no engine yet) gets its
status, code and Retry-After. Pure data: no libllama, no Ray."""

from __future__ import annotations

from serving.engine.errors import EngineUnavailableError, PromptTooLongError, QueueFullError
from serving.front.errors import APIError


def unavailable(exc: EngineUnavailableError) -> APIError:
    """503: the replica has no engine for this request now (loading, failed to load, tuning with a full queue)."""
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return APIError(503, str(exc), type_="server_error", code=exc.why.value, headers=headers)


def engine_unavailable() -> APIError:
    """503: the engine stopped under the request (a restart, a model reload); a retry finds it again."""
    return APIError(503, "the engine is restarting or reloading its model; retry shortly", type_="server_error",
                    code="engine_unavailable", headers={"Retry-After": "1"})


def queue_full(exc: QueueFullError) -> APIError:
    """503 with the engine's own estimate of when a retry finds room."""
    return APIError(503, f"the server is at capacity ({exc.queued} requests waiting); retry in "
                         f"{exc.retry_after_s} s", type_="server_error", code="server_overloaded",
                    headers={"Retry-After": str(exc.retry_after_s)})


def prompt_too_long(exc: PromptTooLongError, param: str) -> APIError:
    """400 with llama-server's numbers (n_prompt_tokens, n_ctx), which clients read to trim the prompt."""
    return APIError(400, str(exc), param=param, code="context_length_exceeded",
                    details={"n_prompt_tokens": exc.n_prompt, "n_ctx": exc.n_ctx_slot})
