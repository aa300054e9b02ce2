"""Tool calls: prompting a model with tools, and reading its calls back out of the generated text.

Formats read: Hermes / Qwen2.5 / Qwen3 (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more)
and Llama 3.x JSON (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several joined by
`;`). A model whose chat template does not render `tools` itself is told about them in a system message in
the Hermes format, which is also what a forced call's grammar produces (serving/structured.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


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
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split generated text into (content, tool calls). Text that is not a well-formed call stays content."""
    if OPEN in text:
        calls = []
        for body in _BLOCK.findall(text):
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[: text.index(OPEN)].strip(), calls
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if body.startswith("{"):
        calls = []
        for part in body.split(";"):
            try:
                call = _call(json.loads(part))
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return "", calls
    return text, []


class ToolCallStream:
    """Streaming side of parse_tool_calls: releases content as it comes, holds back anything that may be a
    call (from `<tool_call>` or a leading `{`), and parses the held text at the end."""

    def __init__(self) -> None:
        self._held = ""
        self._seen = ""  # everything so far: a leading "{" means a Llama-3 style call may follow
        self._holding = False

    def feed(self, text: str) -> str:
        self._seen += text
        if self._holding:
            self._held += text
            return ""
        pending = self._held + text
        if not self._seen.strip():
            self._held = pending
            return ""
        if self._seen.lstrip().startswith(("{", PYTHON_TAG)) or OPEN in pending:
            cut = pending.find(OPEN)
            self._holding = True
            self._held = pending[cut:] if cut > 0 else pending
            return pending[:cut] if cut > 0 else ""
        keep = _partial_suffix(pending, OPEN)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to release, the calls found)."""
        if not self._holding:
            out, self._held = self._held, ""
            return out, []
        content, calls = parse_tool_calls(self._held)
        return (content, calls) if calls else (self._held, [])


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
