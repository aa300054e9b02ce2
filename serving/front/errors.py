"""OpenAI's error JSON: the one error a client of any route sees, raised anywhere in front of the engine or
in the OpenAI layer and written by `serving.front.http.error_response`. Pure data: no Ray, no libllama.

Validation errors from pydantic/FastAPI become one 400 naming one bad parameter; a server bug becomes a 500
that names only the request id its log line carries.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error JSON, for the OpenAPI schema (what every 4xx/5xx of this server carries)."""

    error: ErrorDetail


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
