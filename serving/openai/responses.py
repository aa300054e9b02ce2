"""OpenAI response bodies: one choice's chunks -> content, reasoning, tool calls, logprobs; streamed as
OpenAI frames them, or whole. Pure data (no FastAPI, no engine): the routes feed it chunks.

Stream and whole answer are built by the same `ChoiceState`, so they agree by construction: a whole
answer is the concatenation of what the stream would have sent. Chat streams are framed as OpenAI frames
them: per choice a first chunk with the role and empty content, then content (and reasoning_content)
deltas, tool call deltas (a call's id and name first, then its arguments as they are generated), a last
chunk with the finish reason and an empty delta; then, when asked, a usage chunk with no choices; then
`[DONE]` (the routes add that). The one place they differ: a call cut by max_tokens before its arguments
closed has had its start streamed, while the whole answer carries only the calls that completed
(serving/openai/tools.py); `finish_reason: "length"` says so in both.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.openai.reasoning import ThinkSplitter
from serving.engine.request import FinishReason, GenerationChunk, TokenLogprob, Usage
from serving.openai.tools import CallMode, CallPiece, ToolCall, ToolCallStream, join_pieces

Piece = Callable[[int], bytes]  # a token id's bytes (the engine's token_piece)


def new_id(prefix: str, sep: str = "-") -> str:
    """An answer's id as OpenAI spells it: `chatcmpl-...`, `cmpl-...`; the Responses API's `resp_...`, `msg_...`."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def usage_dict(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage()
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(chunk: GenerationChunk) -> str | None:
    """OpenAI knows 'stop' and 'length'; a cancelled or failed request never reaches a client as such."""
    reason = chunk.finish_reason
    if reason in (FinishReason.stop, FinishReason.length):
        return FinishReason(reason).value
    return None


def _token_entry(token: int, logprob: float, piece: Piece) -> dict[str, Any]:
    raw = piece(token)
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(lps: list[TokenLogprob], piece: Piece) -> list[dict[str, Any]]:
    """OpenAI chat shape: per token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
    return [{**_token_entry(lp.token, lp.logprob, piece),
             "top_logprobs": [_token_entry(t, v, piece) for t, v in lp.top]} for lp in lps]


def completion_logprobs(lps: list[TokenLogprob], piece: Piece, offset: int) -> dict[str, Any]:
    """OpenAI completions shape: parallel lists, top_logprobs as {token text: logprob}."""
    tokens = [piece(lp.token).decode("utf-8", "replace") for lp in lps]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{piece(t).decode("utf-8", "replace"): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets}


@dataclass
class Delta:
    """What one chunk adds to a choice."""

    content: str = ""
    reasoning: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[CallPiece] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.logprobs or self.tool_calls)


class ChoiceState:
    """One choice: splits reasoning off (when asked), reads tool calls out as they come (when tools are on,
    in their `CallMode`), and keeps the totals for the whole answer."""

    def __init__(self, index: int, *, reasoning: bool = False, thinking_open: bool = False,
                 tools: CallMode | None = None) -> None:
        self.index = index
        self._think = ThinkSplitter(thinking_open) if reasoning else None
        self._calls = ToolCallStream(tools) if tools is not None else None
        self.content, self.reasoning = "", ""
        self.logprobs: list[TokenLogprob] = []
        self.finish: str | None = None
        self.usage: Usage | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls that completed (a call cut by max_tokens is not one)."""
        return self._calls.calls if self._calls is not None else []

    def feed(self, chunk: GenerationChunk) -> Delta:
        """A chunk in; what to send for it out. On the last chunk, everything still held is released."""
        reasoning, content, calls = self._split(chunk.text)
        delta = Delta(content, reasoning, list(chunk.logprobs), calls)
        if chunk.finish_reason is not None:
            delta = self._merge(delta, self._release())
            self.finish = finish_reason(chunk)
            if self.tool_calls and self.finish == FinishReason.stop.value:
                self.finish = "tool_calls"
            self.usage = chunk.usage
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.logprobs += delta.logprobs
        return delta

    def _split(self, text: str) -> tuple[str, str, list[CallPiece]]:
        reasoning, content = self._think.feed(text) if self._think is not None else ("", text)
        if self._calls is None:
            return reasoning, content, []
        content, calls = self._calls.feed(content)
        return reasoning, content, calls

    def _release(self) -> Delta:
        reasoning, content = self._think.finish() if self._think is not None else ("", "")
        if self._calls is None:
            return Delta(content, reasoning)
        content, calls = self._calls.feed(content)
        rest, more = self._calls.finish()
        return Delta(content + rest, reasoning, tool_calls=calls + more)

    @staticmethod
    def _merge(a: Delta, b: Delta) -> Delta:
        return Delta(a.content + b.content, a.reasoning + b.reasoning, a.logprobs + b.logprobs,
                     join_pieces(a.tool_calls + b.tool_calls))


def total_usage(choices: list[ChoiceState], prompts: int) -> Usage:
    """Prompt tokens once per prompt (the choices of one prompt share it), completion tokens of all."""
    per_prompt = len(choices) // max(prompts, 1)
    firsts = [c.usage or Usage() for c in choices[::per_prompt or 1]]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in firsts),
                 completion_tokens=sum((c.usage or Usage()).completion_tokens for c in choices),
                 cached_tokens=sum(u.cached_tokens for u in firsts),
                 ttft_s=min((c.usage.ttft_s for c in choices if c.usage and c.usage.ttft_s), default=None),
                 decode_s=max(((c.usage.decode_s if c.usage else 0.0) for c in choices), default=0.0),
                 queue_s=min((c.usage.queue_s for c in choices if c.usage and c.usage.queue_s is not None),
                             default=None))


class ChatResponse:
    """Bodies of one /v1/chat/completions answer."""

    object = "chat.completion"

    def __init__(self, model: str, piece: Piece, logprobs: bool, fingerprint: str | None = None) -> None:
        self.model, self.piece, self.want_logprobs, self.fingerprint = model, piece, logprobs, fingerprint
        self.id = new_id("chatcmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: Any = None,
               reason: str | None = None) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                         "finish_reason": reason}])

    def opening(self, index: int) -> dict[str, Any]:
        return self._chunk(index, {"role": "assistant", "content": ""})

    def stream(self, state: ChoiceState, delta: Delta) -> list[dict[str, Any]]:
        """Frames for one delta of one choice (and its closing frame once the choice has finished)."""
        out = []
        body: dict[str, Any] = {}
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.content:
            body["content"] = delta.content
        logprobs = {"content": chat_logprobs(delta.logprobs, self.piece)} if self.want_logprobs and delta.logprobs \
            else None
        if body or logprobs:
            out.append(self._chunk(state.index, body, logprobs))
        if delta.tool_calls:
            out.append(self._chunk(state.index, {"tool_calls": [p.as_openai() for p in delta.tool_calls]}))
        if state.finish is not None or (state.usage is not None):
            out.append(self._chunk(state.index, {}, None, state.finish))
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage_dict(usage), "timings": _timings(usage)}

    def whole(self, choices: list[ChoiceState], usage: Usage) -> dict[str, Any]:
        bodies = []
        for c in choices:
            message: dict[str, Any] = {"role": "assistant", "content": c.content if c.content or not c.tool_calls
                                       else None}
            if c.reasoning:
                message["reasoning_content"] = c.reasoning
            if c.tool_calls:
                message["tool_calls"] = [call.as_openai() for call in c.tool_calls]
            logprobs = {"content": chat_logprobs(c.logprobs, self.piece)} if self.want_logprobs else None
            bodies.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish})
        body = self._envelope(self.object, bodies)
        body["usage"] = usage_dict(usage)
        body["timings"] = _timings(usage)
        return body


class CompletionResponse:
    """Bodies of one /v1/completions answer."""

    object = "text_completion"

    def __init__(self, model: str, piece: Piece, logprobs: bool, fingerprint: str | None = None) -> None:
        self.model, self.piece, self.want_logprobs, self.fingerprint = model, piece, logprobs, fingerprint
        self.id = new_id("cmpl")
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def opening(self, index: int, echo: str = "") -> dict[str, Any] | None:
        self._offsets[index] = len(echo)
        if not echo:
            return None
        return self._envelope([{"index": index, "text": echo, "logprobs": None, "finish_reason": None}])

    def stream(self, state: ChoiceState, delta: Delta) -> list[dict[str, Any]]:
        out = []
        if delta.content or delta.logprobs:
            at = self._offsets.get(state.index, 0)
            logprobs = completion_logprobs(delta.logprobs, self.piece, at) if self.want_logprobs else None
            self._offsets[state.index] = at + len(delta.content)
            out.append(self._envelope([{"index": state.index, "text": delta.content, "logprobs": logprobs,
                                        "finish_reason": None}]))
        if state.finish is not None or state.usage is not None:
            out.append(self._envelope([{"index": state.index, "text": "", "logprobs": None,
                                        "finish_reason": state.finish}]))
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope([]), "usage": usage_dict(usage), "timings": _timings(usage)}

    def whole(self, choices: list[ChoiceState], usage: Usage, echoes: list[str]) -> dict[str, Any]:
        bodies = []
        for c, echo in zip(choices, echoes, strict=True):
            logprobs = completion_logprobs(c.logprobs, self.piece, len(echo)) if self.want_logprobs else None
            bodies.append({"index": c.index, "text": echo + c.content, "logprobs": logprobs,
                           "finish_reason": c.finish})
        body = self._envelope(bodies)
        body["usage"] = usage_dict(usage)
        body["timings"] = _timings(usage)
        return body


def _timings(usage: Usage) -> dict[str, Any]:
    """llama-server's `timings` object, plus the time to first token (queueing included).

    Prompt figures count the tokens evaluated (not served from a slot's cache) over the time from a slot
    taking the request to its first token; predicted figures, the tokens after the first over the time they
    took (as `timings.predicted_per_second` does in llama-server). A figure with nothing to divide is null.
    """
    ttft, queue = usage.ttft_s, usage.queue_s or 0.0
    prompt_n = usage.prompt_tokens - usage.cached_tokens
    prompt_s = max(ttft - queue, 0.0) if ttft is not None else None
    decoded = usage.completion_tokens - 1
    return {
        "ttft_ms": None if ttft is None else ttft * 1e3,
        "cache_n": usage.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": None if prompt_s is None else prompt_s * 1e3,
        "prompt_per_token_ms": prompt_s * 1e3 / prompt_n if prompt_s is not None and prompt_n > 0 else None,
        "prompt_per_second": prompt_n / prompt_s if prompt_s else None,
        "predicted_n": usage.completion_tokens,
        "predicted_ms": usage.decode_s * 1e3,
        "predicted_per_token_ms": usage.decode_s * 1e3 / decoded if decoded > 0 and usage.decode_s > 0 else None,
        "predicted_per_second": usage.decode_tok_s,
    }


class ResponsesAnswer:
    """OpenAI's /v1/responses object for one text answer, and its stream events."""

    def __init__(self, model: str, request: dict[str, Any]) -> None:
        self.model, self.request = model, request
        self.id, self.item_id = new_id("resp", "_"), new_id("msg", "_")
        self.created = int(time.time())
        self._seq = 0

    def body(self, status: str, text: str, usage: Usage | None, finish: str | None) -> dict[str, Any]:
        usage = usage or Usage()
        done = status != "in_progress"
        output = [] if not done else [self._message(text, "completed")]
        tokens = {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                  "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        request = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
            "temperature": request.get("temperature"), "top_p": request.get("top_p"),
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "metadata": {},
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": tokens if done else None,
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        done = status == "completed"
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq, **fields}

    def opening(self) -> list[dict[str, Any]]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.created", response=self.body("in_progress", "", None, None)),
                self.event("response.in_progress", response=self.body("in_progress", "", None, None)),
                self.event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
                self.event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                           part=part)]

    def delta(self, text: str) -> dict[str, Any]:
        return self.event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, text: str, usage: Usage | None, finish: str | None) -> list[dict[str, Any]]:
        status = "incomplete" if finish == "length" else "completed"
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return [self.event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=0, item=self._message(text, "completed")),
                # `response.completed` even when cut at max_output_tokens (status "incomplete" says so):
                # openai's stream helper waits for that event to return the final response
                self.event("response.completed", response=self.body(status, text, usage, finish))]
