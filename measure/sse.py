"""Reading an OpenAI-style event stream as a benchmark client: SSE framing and what each chunk carries.

Pure (no I/O), so the parsing every HTTP figure depends on is unit-tested on recorded streams of both
servers we measure (ours and llama-server), quirks included.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


class StreamError(RuntimeError):
    """The server reported an error inside the stream, or answered with a non-200 status: a failed run is
    no figure."""


class SSEDecoder:
    """Incremental Server-Sent-Events decoder: feed lines, get each event's data when the event completes.

    A class rather than a generator so the async reader can timestamp the exact line that completes an event.
    Handles multi-line ``data:``, comments (llama-server sends ``:`` pings), and other fields (ignored).
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Consume one line (without its newline); return the event's data when this line ends an event."""
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        return None

    def flush(self) -> str | None:
        """The pending event's data, if any (also at the end of a stream without a final blank line)."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The data payload of every SSE event in `lines` (blocking convenience wrapper)."""
    decoder = SSEDecoder()
    for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield data
    tail = decoder.flush()
    if tail is not None:
        yield tail


@dataclass(frozen=True)
class Usage:
    """The stream's usage record, when the server sent one (stream_options.include_usage)."""

    completion_tokens: int | None
    prompt_tokens: int | None
    cached_tokens: int | None


@dataclass(frozen=True)
class ChunkInfo:
    """What one streamed JSON chunk tells the benchmark."""

    text: str
    n_tokens: int | None  # tokens this chunk carries when the chunk says so; None when unknown
    finish_reason: str | None
    usage: Usage | None
    fingerprint: str | None
    token_chunk: bool = False  # a /completions chunk before the final one: it carries a token, text or not
    engine_ttft_ms: float | None = None  # the server's own time to first token (`timings`, see _engine_ttft_ms)

    @property
    def has_output(self) -> bool:
        """True when the chunk carries generated text or tokens (role-only and final chunks do not)."""
        return bool(self.text) or bool(self.n_tokens) or self.token_chunk


def _explicit_token_count(payload: dict[str, Any], choice: dict[str, Any]) -> int | None:
    """Tokens in this chunk if the server says so (``token_ids`` / ``tokens`` lists); None otherwise."""
    for source in (choice, payload):
        for key in ("token_ids", "tokens"):
            value = source.get(key)
            if isinstance(value, list):
                return len(value)
    return None


def _as_int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _usage(payload: dict[str, Any]) -> Usage | None:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = _as_int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(_as_int(usage.get("completion_tokens")), _as_int(usage.get("prompt_tokens")), cached)


def _engine_ttft_ms(payload: dict[str, Any]) -> float | None:
    """The server's own account of the time to first token, from the `timings` object of a final chunk: ours
    sends `ttft_ms` (from the engine's intake, its queue included); llama-server sends `prompt_ms` alone (from
    its slot taking the prompt, its queue not included). The client's TTFT minus this is what the path around
    the engine costs."""
    timings = payload.get("timings")
    if not isinstance(timings, dict):
        return None
    value = timings.get("ttft_ms", timings.get("prompt_ms"))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def interpret_chunk(data: str, chat: bool) -> ChunkInfo:
    """Text, finish reason and usage of one OpenAI-style streaming chunk (`data`: its JSON text).

    llama-server quirks handled: a chat stream opens with a role-only delta (``content: null``) that must not
    count as the first token; /v1/completions puts ``usage`` in the same final chunk as ``finish_reason``
    with empty text, while chat sends usage in an extra chunk with ``choices: []``; ``usage`` may be present
    as null in ordinary chunks (OpenAI does that); /v1/completions sends a chunk for every token even when its
    text is empty (a token that prints nothing: a random-weight model can generate only those), so such a
    chunk counts as output, where chat sends no delta for it. An ``error`` object is a StreamError.
    """
    payload = json.loads(data)
    if not isinstance(payload, dict):
        raise StreamError(f"a stream chunk is not a JSON object: {data[:200]}")
    if "error" in payload:
        raise StreamError(f"server error in stream: {json.dumps(payload['error'])[:500]}")
    choices = payload.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    text = ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""
    finish_reason = choice.get("finish_reason")
    return ChunkInfo(
        text=text,
        n_tokens=_explicit_token_count(payload, choice) if choices else None,
        finish_reason=finish_reason,
        usage=_usage(payload),
        fingerprint=payload.get("system_fingerprint"),
        token_chunk=not chat and "text" in choice and finish_reason is None,
        engine_ttft_ms=_engine_ttft_ms(payload),
    )
