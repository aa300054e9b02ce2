"""Reasoning text: `<think>...</think>` (DeepSeek-R1, Qwen3) split off into `reasoning_content`.

llama-server's `reasoning_format`: `none` leaves the tags in the content; `deepseek` (and `auto`, the
default) moves the thinking out. A template can open the think block in the prompt itself (Qwen3 does with
`enable_thinking`), so the splitter can start inside it.
"""

from __future__ import annotations

from enum import Enum

START, END = "<think>", "</think>"


class ReasoningFormat(str, Enum):
    none = "none"
    auto = "auto"
    deepseek = "deepseek"


class ThinkSplitter:
    """Feed generated text; get (reasoning, content) deltas, never splitting a tag across the two."""

    def __init__(self, inside: bool = False) -> None:
        self._inside = inside
        self._started = inside  # a think block may only open at the very start
        self._held = ""
        self._any_content = False
        self._after_think = False  # newlines right after </think> are not content

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = [], []
        while self._held:
            if self._inside:
                i = self._held.find(END)
                if i < 0:
                    keep = _partial(self._held, END)
                    reasoning.append(self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    break
                reasoning.append(self._held[:i])
                self._held = self._held[i + len(END):]
                self._inside, self._after_think = False, True
                continue
            if self._after_think:
                self._held = self._held.lstrip("\n")
                if not self._held:
                    break
                self._after_think = False
            if not self._started and not self._any_content:
                stripped = self._held.lstrip()
                if stripped.startswith(START):
                    self._held = stripped[len(START):].lstrip("\n")
                    self._inside = self._started = True
                    continue
                if START.startswith(stripped):  # could still become "<think>"
                    break
                self._started = True
            content.append(self._held)
            self._any_content = True
            self._held = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self._inside else ("", held)


def _partial(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, inside: bool = False) -> tuple[str, str]:
    """Whole-text form of ThinkSplitter: (reasoning, content)."""
    splitter = ThinkSplitter(inside)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.feed("")
    r3, c3 = splitter.finish()
    return r1 + r2 + r3, c1 + c2 + c3
