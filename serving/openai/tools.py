"""Tool calls: prompting a model with tools, and reading its calls back out of the generated text.

Formats read: Hermes / Qwen2.5 / Qwen3 (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more)
and Llama 3.x JSON (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several joined by
`;`). A model whose chat template does not render `tools` itself is told about them in a system message in
the Hermes format, which is also what a forced call's grammar produces (serving/openai/structured.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# a followed call's body up to its arguments: punctuation, a key among these, or (None) the name
_HEAD: tuple[str | tuple[str, ...] | None, ...] = ("{", ("name",), ":", None, ",", ("arguments", "parameters"), ":")


class CallMode(Enum):
    """How a request's calls come. `auto`: the model may answer in text or call (a call is read back as
    it is recognised); `forced`: a grammar (tool_choice `required` or a named function) makes the answer
    calls only, so nothing of a call's markup is ever content, even when the answer is cut."""

    auto = "auto"
    forced = "forced"


class _Style(Enum):
    hermes = "hermes"  # <tool_call>{...}</tool_call> blocks
    llama3 = "llama3"  # bare {...} calls joined by ";", optionally after <|python_tag|>


class _Phase(Enum):
    text = "text"  # content, until a call starts
    between = "between"  # after a call: waiting for the next one
    head = "head"  # a call's body before its arguments: {"name": "...", "arguments":
    arguments = "arguments"  # the arguments object, streamed as it comes
    tail = "tail"  # after the arguments, up to the call's end
    raw = "raw"  # a call in a shape not followed as it comes: held whole, read at its end
    done = "done"  # anything after the calls (dropped)


class _Head(Enum):
    more = "more"  # could still become a call's head: wait for more text
    no = "no"  # not a head this stream follows
    yes = "yes"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallPiece:
    """A streamed part of the call at `index`, as OpenAI streams calls: the first carries the call's id and
    name (and the start of its arguments, maybe ""), the later ones more of its arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def join_pieces(pieces: list[CallPiece]) -> list[CallPiece]:
    """Consecutive pieces of one call as one (what one stream event carries)."""
    out: list[CallPiece] = []
    for piece in pieces:
        if out and piece.id is None and out[-1].index == piece.index:
            out[-1] = replace(out[-1], arguments=out[-1].arguments + piece.arguments)
        else:
            out.append(piece)
    return out


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(_new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _parse_call(body: str) -> ToolCall | None:
    try:
        return _call(json.loads(body))
    except json.JSONDecodeError:
        return None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _read_head(text: str, tag: bool) -> tuple[_Head, str, int]:
    """Whether `text` opens a call as `{"name": "<name>", "arguments": {` ("parameters" too; after an
    optional <|python_tag|> when `tag`): (verdict, the name, where the arguments object starts)."""
    at = _skip_space(text, 0)
    if tag and text.startswith(PYTHON_TAG, at):
        at += len(PYTHON_TAG)
    name = ""
    for step in _HEAD:
        at = _skip_space(text, at)
        if at == len(text):
            return _Head.more, "", 0
        if isinstance(step, str):
            if text[at] != step:
                return _Head.no, "", 0
            at += 1
            continue
        found = _STRING.match(text, at)
        if found is None:
            return (_Head.more if text[at] == '"' else _Head.no), "", 0
        try:
            value = json.loads(found.group())
        except json.JSONDecodeError:
            return _Head.no, "", 0
        if step is None:
            name = value
        elif value not in step:
            return _Head.no, "", 0
        at = found.end()
    at = _skip_space(text, at)
    if at == len(text):
        return _Head.more, "", 0
    return (_Head.yes, name, at) if text[at] == "{" else (_Head.no, "", 0)


class _ObjectEnd:
    """Where a JSON object that arrives in pieces ends (brackets counted outside strings)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str) -> int | None:
        """The offset just past the object's closing brace in `text`, or None if it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ToolCallStream:
    """Generated text in, as it comes; content and tool calls out, as they are recognised.

    Content is released as it comes, except what may open a call (`<tool_call>`, or a `{` that starts the
    answer). A call whose body opens as `{"name": ..., "arguments": {` is streamed from there: a first
    piece with its id and name, then its arguments text as it is generated (OpenAI's and llama-server's
    streaming). A call is complete when its arguments object closes; `calls` holds the complete ones, which
    is what a whole answer carries. A call cut before that (max_tokens) has had pieces streamed but is not
    among `calls`; the finish reason (`length`) says it was cut. A call in another shape (arguments as a
    string, keys in another order) is held and read whole when its block ends. Text between and after
    calls is dropped. Under `auto`, what turns out to be no call is content as written; under `forced`,
    nothing of a call's markup is ever content.
    """

    def __init__(self, mode: CallMode = CallMode.auto) -> None:
        self.mode = mode
        self.calls: list[ToolCall] = []
        self._phase, self._style = _Phase.text, _Style.hermes
        self._buf, self._content, self._visible = "", "", False
        self._pieces: list[CallPiece] = []
        self._id, self._name, self._args = "", "", ""
        self._end = _ObjectEnd()

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """(content to release, call pieces to stream) for the next piece of generated text."""
        self._buf += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> tuple[str, list[CallPiece]]:
        """At the end of generation: what was still held, released or read."""
        if self._phase is _Phase.text:
            self._release(self._buf)
        elif self._phase in (_Phase.head, _Phase.raw):
            self._read_raw(self._buf)
        self._buf, self._phase = "", _Phase.done
        return self._take()

    def _take(self) -> tuple[str, list[CallPiece]]:
        out = self._content, join_pieces(self._pieces)
        self._content, self._pieces = "", []
        return out

    def _release(self, text: str) -> None:
        self._content += text
        self._visible = self._visible or bool(text.strip())

    def _step(self) -> bool:
        """One move through the held text; False when the next one needs more text."""
        return {_Phase.text: self._text, _Phase.between: self._between, _Phase.head: self._head,
                _Phase.arguments: self._arguments, _Phase.tail: self._tail, _Phase.raw: self._raw,
                _Phase.done: self._done}[self._phase]()

    def _text(self) -> bool:
        buf = self._buf
        body = buf.lstrip()
        if not self._visible:  # a Llama-3 call can only open the answer
            if not body or (PYTHON_TAG.startswith(body) and len(body) < len(PYTHON_TAG)):
                return False
            if body.startswith(("{", PYTHON_TAG)):
                self._phase, self._style = _Phase.head, _Style.llama3
                return True
        at = buf.find(OPEN)
        if at >= 0:
            self._release(buf[:at])
            self._buf, self._phase = buf[at + len(OPEN):], _Phase.head
            return True
        keep = len(buf) - _partial_suffix(buf, OPEN)
        self._release(buf[:keep])
        self._buf = buf[keep:]
        return False

    def _between(self) -> bool:
        if self._style is _Style.hermes:
            return self._skip_to(OPEN, _Phase.head)
        rest = self._buf.lstrip().lstrip(";").lstrip()
        self._buf = rest
        if not rest:
            return False
        self._phase = _Phase.head if rest.startswith("{") else _Phase.done
        return True

    def _head(self) -> bool:
        verdict, name, at = _read_head(self._buf, self._style is _Style.llama3)
        if verdict is _Head.more:
            return False
        if verdict is _Head.no:
            self._phase = _Phase.raw
            return True
        self._id, self._name, self._args, self._end = _new_call_id(), name, "", _ObjectEnd()
        self._pieces.append(CallPiece(len(self.calls), "", self._id, name))
        self._buf, self._phase = self._buf[at:], _Phase.arguments
        return True

    def _arguments(self) -> bool:
        end = self._end.scan(self._buf)
        piece = self._buf if end is None else self._buf[:end]
        self._args += piece
        if piece:
            self._pieces.append(CallPiece(len(self.calls), piece))
        if end is None:
            self._buf = ""
            return False
        self.calls.append(ToolCall(self._id, self._name, self._args))
        self._buf, self._phase = self._buf[end:], _Phase.tail
        return True

    def _tail(self) -> bool:
        if self._style is _Style.hermes:
            return self._skip_to(CLOSE, _Phase.between)
        return self._skip_to("}", _Phase.between)

    def _raw(self) -> bool:
        if self._style is _Style.llama3:
            return False  # read at the end
        at = self._buf.find(CLOSE)
        if at < 0:
            return False
        body = self._buf[:at]
        self._buf, self._phase = self._buf[at + len(CLOSE):], _Phase.between
        self._read_raw(body, CLOSE)
        return True

    def _done(self) -> bool:
        self._buf = ""
        return False

    def _skip_to(self, tag: str, then: _Phase) -> bool:
        """Drop text up to and including `tag` and go on with `then`; without it, keep only what may begin it."""
        at = self._buf.find(tag)
        if at < 0:
            self._buf = self._buf[len(self._buf) - _partial_suffix(self._buf, tag):]
            return False
        self._buf, self._phase = self._buf[at + len(tag):], then
        return True

    def _read_raw(self, body: str, close: str = "") -> None:
        """A held call body (Hermes: one block's; Llama 3: the rest of the answer) read whole: its calls go
        out whole; text that is no call is content under `auto`, dropped under `forced`."""
        if self._style is _Style.hermes:
            found = [_parse_call(body)]
            written = OPEN + body + close
        else:
            text = body.strip()
            parts = text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text
            found = [_parse_call(part) for part in parts.split(";")]
            written = body
        calls = [c for c in found if c is not None]
        if len(calls) < len(found):
            if self.mode is CallMode.auto:
                self._release(written)
            return
        for call in calls:
            self._pieces.append(CallPiece(len(self.calls), call.arguments, call.id, call.name))
            self.calls.append(call)


def parse_tool_calls(text: str, mode: CallMode = CallMode.auto) -> tuple[str, list[ToolCall]]:
    """Split a whole generated text into (content, complete tool calls), as the stream would."""
    stream = ToolCallStream(mode)
    content = stream.feed(text)[0] + stream.finish()[0]
    return (content.strip() if stream.calls else content), stream.calls


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Tell a model whose template knows no tools what it may call, and how (Hermes format)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to answer. The functions:\n<tools>\n" + lines + "\n</tools>\n"
            "To call one, reply with exactly:\n<tool_call>\n{\"name\": <function name>, \"arguments\": "
            "<arguments as a JSON object>}\n</tool_call>")


def messages_for_plain_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                                ) -> list[dict[str, Any]]:
    """Rewrite tool turns for a template without tool support: calls become <tool_call> text, tool results
    user turns in <tool_response>, and the tool list a system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                         "arguments": c["function"]["arguments"]},
                                                        ensure_ascii=False) + "\n" + CLOSE for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
