"""The fuzz's rules for a response (scripts/fuzz_api.py): a generating request capped, a body that must be JSON
or a complete SSE stream, an error that must be OpenAI's error JSON, and the findings of a recorded run (HAR)
grouped. Apart from the run itself, so the rules are unit-tested on constructed responses
(tests/test_soak_script.py) without a server or schemathesis.
"""

from __future__ import annotations

import base64
import json
from collections import Counter, defaultdict
from typing import Any

import httpx


def drop_fields(body: Any, fields: list[str]) -> Any:
    """Remove top-level `fields` from a dict body (to look past a known failure with --drop-fields)."""
    if isinstance(body, dict):
        for key in fields:
            body.pop(key, None)
    return body


# Generating routes and their length fields; the first is set when none is given (chat: the newer name, so
# that path is exercised too). Other routes' bodies are sent as generated: an unknown field is a 400 there.
GENERATION_FIELDS: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}


def cap_generation(body: Any, cap: int, path: str) -> Any:
    """Clamp the generation length of a request body to a generating route (dicts only).

    Integer length fields above `cap` (integral floats such as 215.0 too: the server accepts them as
    integers) become `cap`; when none is given, the route's first field gets `cap`. Other values (negative
    tests) are left alone: the server must reject them with a 400. Bodies for other routes are unchanged.
    """
    fields = GENERATION_FIELDS.get(path)
    if not fields or not isinstance(body, dict):
        return body
    present = False
    for key in fields:
        value = body.get(key)
        if key in body and value is not None:
            present = True
        if isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer() \
                and value > cap:
            body[key] = cap
    if not present:
        body[fields[0]] = cap
    return body


RESPONSES_DONE = ("response.completed", "response.incomplete")  # the Responses API's last events


def sse_events(text: str) -> list[Any]:
    """The decoded `data:` payloads of an SSE body ("[DONE]" stays a string; undecodable ones are None)."""
    events: list[Any] = []
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            events.append("[DONE]")
            continue
        try:
            events.append(json.loads(payload))
        except ValueError:
            events.append(None)
    return events


def sse_error_events(text: str) -> list[str]:
    """The error events of an SSE body: chat/completions' `{"error": ...}`, the Responses API's `error` and
    `response.failed` events, and undecodable ones."""
    errors = []
    for obj in sse_events(text):
        if obj is None:
            errors.append("undecodable event")
        elif isinstance(obj, dict) and "error" in obj and obj.get("type") is None:
            err = obj["error"]
            errors.append(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        elif isinstance(obj, dict) and obj.get("type") in ("error", "response.failed"):
            err = obj.get("message") or (obj.get("response") or {}).get("error") or obj
            errors.append(f"{obj['type']}: {str(err)[:200]}")
    return errors


def sse_complete(text: str) -> bool:
    """The stream ended as its API ends one: `data: [DONE]`, or a Responses API completed/incomplete event."""
    for obj in reversed(sse_events(text)):
        return obj == "[DONE]" or (isinstance(obj, dict) and obj.get("type") in RESPONSES_DONE)
    return False


INCOMPLETE_STREAM = "a 200 stream that did not end (no data: [DONE], no response.completed)"


def documented_types(paths: dict[str, Any], method: str, path: str, status: int) -> set[str]:
    """Media types the OpenAPI document declares for this operation's `status` (or its default) response."""
    responses = (paths.get(path, {}).get(method.lower(), {}) or {}).get("responses", {})
    declared = responses.get(str(status)) or responses.get("default") or {}
    return {media.split(";")[0].strip() for media in declared.get("content", {})}


def response_problem(status: int, content_type: str, text: str, declared: set[str] | frozenset[str] = frozenset()
                     ) -> str | None:
    """What is wrong with one response by this project's rules, or None. A body of a non-JSON type that the
    schema declares for the operation (`declared`: e.g. /metrics' text/plain) is not required to be JSON.

    A stream without [DONE] is reported as INCOMPLETE_STREAM, which the summary lists but does not fail on:
    the client may have closed it (Serve's proxy logs "Client ... disconnected" then).
    """
    if status >= 500:
        return f"server error {status}: {text[:300]}"
    if content_type.startswith("text/event-stream"):
        if status != 200:
            return f"an SSE body with status {status}"
        errors = sse_error_events(text)
        if errors:
            return f"error event in a 200 stream: {errors[0][:300]}"
        if not sse_complete(text):
            return INCOMPLETE_STREAM
        return None
    media = content_type.split(";")[0].strip()
    if media and media != "application/json" and media in declared:
        return None
    try:
        body = json.loads(text)
    except ValueError:
        return f"status {status} with a non-JSON body ({content_type or 'no content-type'}): {text[:200]!r}"
    if status >= 400 and not (isinstance(body, dict) and isinstance(body.get("error"), dict)
                              and isinstance(body["error"].get("message"), str)):
        return f"status {status} without OpenAI error JSON: {text[:200]}"
    return None


# -- the HAR record -> findings -----------------------------------------------------------------------------
def _har_text(content: dict[str, Any]) -> str:
    text = content.get("text") or ""
    if content.get("encoding") == "base64":
        try:
            text = base64.b64decode(text).decode(errors="replace")
        except ValueError:
            pass
    return text


def analyse_har(har: dict[str, Any], schema_paths: dict[str, Any]) -> dict[str, Any]:
    """Per operation status counts, and every response that breaks the rules (with its request)."""
    api_paths = set(schema_paths)
    by_op: dict[str, Counter[str]] = defaultdict(Counter)
    problems: list[dict[str, Any]] = []
    for entry in har.get("log", {}).get("entries", []):
        req, resp = entry.get("request", {}), entry.get("response", {})
        method = req.get("method", "?")
        path = httpx.URL(req.get("url", "")).path
        op = f"{method} {path}" if path in api_paths else f"{method} (other) {path}"
        status = int(resp.get("status", 0))
        by_op[op][str(status)] += 1
        content = resp.get("content", {})
        text = _har_text(content)
        ctype = content.get("mimeType", "") or next(
            (h.get("value", "") for h in resp.get("headers", []) if h.get("name", "").lower() == "content-type"), "")
        declared = documented_types(schema_paths, method, path, status)
        problem = (response_problem(status, ctype, text, declared) if status
                   else "no response (transport error/timeout)")
        if problem:
            problems.append({"operation": op, "status": status, "problem": problem,
                             "request_body": (req.get("postData") or {}).get("text", "")[:2000],
                             "query": req.get("queryString") or None,
                             "response": text[:600]})
    server_errors = [p for p in problems if p["status"] >= 500]
    incomplete = [p for p in problems if p["problem"] == INCOMPLETE_STREAM]
    methods = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
    documented = [f"{m.upper()} {path}" for path, ops in schema_paths.items() for m in (ops or {}) if m in methods]
    never_2xx = sorted(op for op in documented if not any(k.startswith("2") for k in by_op.get(op, {})))
    return {"requests": sum(sum(c.values()) for c in by_op.values()),
            "by_operation": {op: dict(c) for op, c in sorted(by_op.items())},
            "never_2xx": never_2xx,
            "server_errors": len(server_errors),
            "other_problems": len(problems) - len(server_errors) - len(incomplete),
            "incomplete_streams": len(incomplete),
            "problems": problems}


def group_problems(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (operation, status, first line of the problem), with a count and the first example."""
    groups: dict[tuple[str, int, str], dict[str, Any]] = {}
    for p in problems:
        key = (p["operation"], p["status"], p["problem"][:160])
        if key in groups:
            groups[key]["count"] += 1
        else:
            groups[key] = {**p, "count": 1}
    return sorted(groups.values(), key=lambda g: (-g["status"], -g["count"]))
