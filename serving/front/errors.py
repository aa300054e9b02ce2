"""OpenAI's error JSON: the one error a client of any route sees, raised anywhere in front of the engine or
in the OpenAI layer and written by `serving.front.http.error_response`. Pure data: no Ray, no libllama.

Anthropic's Messages API (/v1/messages...) writes the same errors in its own shape (`anthropic_body`): its
clients (the anthropic SDK, Claude Code) read `{"type": "error", "error": {"type", "message"}}`, and the
front door's refusals (401, 413) reach them before any route, so the writer picks the shape by path.

Validation errors from pydantic/FastAPI become one 400 naming one bad parameter; a server bug becomes a 500
that names only the request id its log line carries.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel

ANTHROPIC_PATH = "/v1/messages"  # Anthropic's Messages API, and every path under it (count_tokens)


class ErrorDialect(str, Enum):
    """Which API's error JSON a path's clients read."""

    openai = "openai"
    anthropic = "anthropic"

    @classmethod
    def of(cls, path: str) -> ErrorDialect:
        """Anthropic's shape on /v1/messages and below; OpenAI's everywhere else."""
        anthropic = path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
        return cls.anthropic if anthropic else cls.openai


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (its clients pick their exception by the status)."""
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


class APIError(Exception):
    """An error to send back as OpenAI's error JSON with this HTTP status (and these headers)."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers
        self.details = details or {}  # more fields for the error object (llama-server's, e.g. n_ctx)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.details}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error JSON: its type follows the status; the message says the rest (the parameter)."""
        return {"type": "error", "error": {"type": anthropic_error_type(self.status), "message": self.message}}

    def body_in(self, dialect: ErrorDialect) -> dict[str, Any]:
        return self.anthropic_body() if dialect is ErrorDialect.anthropic else self.body()


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error JSON, for the OpenAPI schema (what every 4xx/5xx of this server carries)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error JSON, for the OpenAPI schema of the /v1/messages routes."""

    type: str = "error"
    error: AnthropicErrorDetail


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one OpenAI-style 400 naming one bad parameter.

    For a union (`prompt` is text, token ids or a list of text) pydantic reports every member; the one
    that got deepest into the value is the one that matched the client's intent.
    """
    if not errors:
        return APIError(400, "invalid request")
    if errors[0].get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    located = [(_param_path(err.get("loc", ())), err) for err in errors]
    loc, first = max(located, key=lambda pair: (len(pair[0]), not str(pair[1].get("type", "")).endswith("_type")))
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request"))
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type", "missing"):
        msg = "the request body must be a JSON object"
    return APIError(400, f"invalid value for '{param}': {msg}" if param else msg, param=param)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


_LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})  # where FastAPI found the value


def _param_path(loc: tuple[Any, ...] | list[Any]) -> list[str]:
    """`('body', 'prompt', 'list[str]', 0, 'function-after[...]')` -> `['prompt', '0']`; `('query', 'recent')`
    -> `['recent']`."""
    if loc and loc[0] in _LOCATIONS:
        loc = loc[1:]
    return [str(part) for part in loc
            if isinstance(part, int) or (part != "body" and str(part).isidentifier() and part not in _UNION_TAGS)]


def internal_error(request_id: str) -> APIError:
    """What a client sees of a server bug: no exception text, only the id the log line carries."""
    return APIError(500, f"internal server error (request id {request_id}); the details are in the server log",
                    type_="server_error", code="internal_error")
