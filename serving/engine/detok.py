"""Incremental detokenisation: tokens in, safe UTF-8 text out, stop strings honoured across tokens.

A token's bytes can end in the middle of a UTF-8 character (Chinese text often does with byte-level BPE),
and a stop string can span several tokens. Text is released only once it is whole and cannot be the start
of a stop string, so a stream never shows a broken character or a stop string's head.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class StopMatcher:
    """Holds back text that might begin a stop string; reports the first full match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to release now, whether a stop string was hit)."""
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out, False
        hit = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if hit >= 0:
            out, self._pending = self._pending[:hit], ""
            return out, True
        keep = self._partial_suffix_len()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """At the end of generation, the held-back text was not a stop string after all: release it."""
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix_len(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text chunks, UTF-8-safe and stop-string-aware."""

    def __init__(self, token_bytes: Callable[[int], bytes], stops: tuple[str, ...] = ()) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(stops)

    def add(self, token: int) -> tuple[str, bool]:
        """Decode one token; return (text to release, whether a stop string ended generation)."""
        text = self._utf8.decode(self._token_bytes(token))
        return self._stops.feed(text)

    def finish(self) -> str:
        """Release everything still held: an incomplete UTF-8 tail becomes U+FFFD, as llama-server does."""
        return self._stops.feed(self._utf8.decode(b"", final=True))[0] + self._stops.flush()
