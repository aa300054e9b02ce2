"""Anthropic's Messages API answers: one generation's chunks in, Anthropic's stream events out, and the whole
message built from those same events, so stream and whole answer agree by construction. Pure data (no FastAPI,
no engine): the route feeds it chunks.

A stream is: `message_start` (the message with no content, input tokens counted), `ping`, then per content
block `content_block_start`, its deltas (`text_delta`; `thinking_delta`, then an empty `signature_delta`;
a tool_use block's input as `input_json_delta` pieces of `partial_json`, as the model generates them) and
`content_block_stop`; then `message_delta` (stop_reason, stop_sequence, usage) and `message_stop`. The text,
reasoning and tool calls come from the OpenAI layer's ChoiceState (serving/openai/responses.py), which reads
`<think>` and tool calls out of the generated text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from serving.engine.request import GenerationChunk, Usage
from serving.openai.responses import ChoiceState, Delta, new_id
from serving.openai.tools import CallPiece


class StopReason(str, Enum):
    end_turn = "end_turn"
    max_tokens = "max_tokens"
    stop_sequence = "stop_sequence"
    tool_use = "tool_use"
    model_context_window_exceeded = "model_context_window_exceeded"  # the slot's context ended it first


class BlockKind(str, Enum):
    text = "text"
    thinking = "thinking"
    tool_use = "tool_use"


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic spells it (`toolu_...`), from the OpenAI layer's `call_...`."""
    return "toolu_" + call_id.removeprefix("call_")


def sse(event: dict[str, Any]) -> str:
    """One server-sent event, named by its type as Anthropic's stream names them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def usage_body(usage: Usage | None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache, which are
    cache_read_input_tokens (their sum is the prompt); nothing is written to a cache on request."""
    usage = usage or Usage()
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def matched_stop(stops: tuple[str, ...], released: str, generated: str) -> str | None:
    """Which stop sequence ended a generation: the engine releases the text before it (`released`) and
    stops; the whole generated text (`generated`, its tokens detokenised) shows which one followed."""
    return next((s for s in stops if generated.startswith(released + s)), None)


@dataclass
class _Open:
    """The content block being streamed."""

    kind: BlockKind
    index: int
    body: dict[str, Any]
    json: str = ""  # a tool_use block's input so far, as generated


class MessageAnswer:
    """One /v1/messages answer: its events as chunks come, and its whole message at the end.

    Whitespace that would open a text block is held until text follows it (a model often writes a newline
    before a tool call: no text block for it); an answer with no block at all gets one empty text block."""

    def __init__(self, model: str, input_tokens: int, max_tokens: int, state: ChoiceState) -> None:
        self.id = new_id("msg", "_")
        self.model, self.input_tokens, self.max_tokens, self.state = model, input_tokens, max_tokens, state
        self.blocks: list[dict[str, Any]] = []
        self.text = ""  # as the engine released it, and its tokens: for the stop sequence
        self.token_ids: list[int] = []
        self._open: _Open | None = None
        self._space = ""

    # -- events --------------------------------------------------------------------------------------
    def opening(self) -> list[dict[str, Any]]:
        start = {**self._envelope([], None, None), "usage": {"input_tokens": self.input_tokens, "output_tokens": 0,
                                                             "cache_read_input_tokens": 0,
                                                             "cache_creation_input_tokens": 0}}
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def feed(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        """The events for one chunk's text (the closing ones come from `closing`)."""
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        return self._delta_events(self.state.feed(chunk))

    def closing(self, stop_sequence: str | None) -> list[dict[str, Any]]:
        """The last block's end, message_delta and message_stop, once the final chunk was fed."""
        events = self._close()
        if not self.blocks:
            events += self._start(BlockKind.text, {"type": "text", "text": ""})
            if self._space:
                events.append(self._text_delta(self._space))
            events += self._close()
        delta = {"stop_reason": self.stop_reason(stop_sequence).value, "stop_sequence": stop_sequence}
        return events + [{"type": "message_delta", "delta": delta, "usage": usage_body(self.state.usage)},
                         {"type": "message_stop"}]

    def message(self, stop_sequence: str | None) -> dict[str, Any]:
        """The whole message (after `closing`): the blocks the events built; a tool_use block whose input was
        cut before it closed (max_tokens) is left out, as the OpenAI routes leave out a cut call."""
        content = [b for b in self.blocks if b["type"] != BlockKind.tool_use.value or b["input"] is not None]
        body = self._envelope(content, self.stop_reason(stop_sequence).value, stop_sequence)
        return {**body, "usage": usage_body(self.state.usage)}

    def stop_reason(self, stop_sequence: str | None) -> StopReason:
        finish = self.state.finish
        if finish == "tool_calls":
            return StopReason.tool_use
        if finish == "length":
            done = self.state.usage.completion_tokens if self.state.usage is not None else 0
            return StopReason.max_tokens if done >= self.max_tokens else StopReason.model_context_window_exceeded
        return StopReason.stop_sequence if stop_sequence is not None else StopReason.end_turn

    # -- blocks --------------------------------------------------------------------------------------
    def _envelope(self, content: list[dict[str, Any]], stop: str | None, sequence: str | None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop, "stop_sequence": sequence}

    def _delta_events(self, delta: Delta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            if self._open is None or self._open.kind is not BlockKind.thinking:
                events += self._close() + self._start(BlockKind.thinking, {"type": "thinking", "thinking": "",
                                                                           "signature": ""})
            events.append(self._thinking_delta(delta.reasoning))
        if delta.content:
            events += self._text(delta.content)
        for piece in delta.tool_calls:
            events += self._call(piece)
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        if self._open is not None and self._open.kind is BlockKind.text:
            return [self._text_delta(text)]
        if not (self._space + text).strip():
            self._space += text
            return []
        text, self._space = self._space + text, ""
        return self._close() + self._start(BlockKind.text, {"type": "text", "text": ""}) + [self._text_delta(text)]

    def _call(self, piece: CallPiece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.id is not None:
            self._space = ""
            events += self._close() + self._start(BlockKind.tool_use, {
                "type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name, "input": {}})
        if piece.arguments and self._open is not None and self._open.kind is BlockKind.tool_use:
            self._open.json += piece.arguments
            events.append(self._block_delta({"type": "input_json_delta", "partial_json": piece.arguments}))
        return events

    def _start(self, kind: BlockKind, body: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = _Open(kind, len(self.blocks), dict(body))
        self.blocks.append(self._open.body)
        return [{"type": "content_block_start", "index": self._open.index, "content_block": body}]

    def _text_delta(self, text: str) -> dict[str, Any]:
        assert self._open is not None
        self._open.body["text"] += text
        return self._block_delta({"type": "text_delta", "text": text})

    def _thinking_delta(self, text: str) -> dict[str, Any]:
        assert self._open is not None
        self._open.body["thinking"] += text
        return self._block_delta({"type": "thinking_delta", "thinking": text})

    def _block_delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        assert self._open is not None
        return {"type": "content_block_delta", "index": self._open.index, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        block, self._open = self._open, None
        if block is None:
            return []
        events: list[dict[str, Any]] = []
        if block.kind is BlockKind.thinking:  # Anthropic's clients expect a signature; this server signs nothing
            events.append({"type": "content_block_delta", "index": block.index,
                           "delta": {"type": "signature_delta", "signature": ""}})
        if block.kind is BlockKind.tool_use:
            block.body["input"] = _object(block.json)
        return events + [{"type": "content_block_stop", "index": block.index}]


def _object(text: str) -> dict[str, Any] | None:
    """A tool call's input as generated: a JSON object, or None when it was cut before it closed."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
