"""Drafting tokens for speculative decoding: guesses the scheduler verifies in one decode.

Decode is bound by reading the weights once per step; verifying k guessed tokens of one sequence in the
same step costs little more than one token (measured on the H200: 16 rows ~ 2.2x one row, for up to 17
tokens), so every accepted guess is a token for nearly free. The scheduler verifies guesses with the
request's own sampler, row by row, and keeps a guess only when the sampler drew exactly that token: what a
request gets is drawn from the same distribution as without speculation (identical when greedy).

Prompt lookup (llama.cpp's "lookup" / vLLM's n-gram): the continuation that followed the most recent
earlier occurrence of the last n tokens, longest n first. No second model; it shines when the output copies
the input (editing code, quoting a document) and proposes nothing otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecSettings:
    """The engine's speculation settings (from EngineConfig)."""

    draft_max: int = 16  # most tokens guessed per step
    ngram_min: int = 2  # shortest n-gram looked up
    ngram_max: int = 4  # longest n-gram looked up (tried first)
    max_busy: int = 1  # speculate only while at most this many slots generate: guesses cost batch rows


class PromptLookup:
    """One request's n-gram index over its tokens (prompt + generated), extended as tokens arrive.

    `_last[n][gram]` is the position right after the latest occurrence of `gram` that ends before the
    newest token, so the current suffix never matches itself.
    """

    def __init__(self, settings: SpecSettings) -> None:
        self._s = settings
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(settings.ngram_min,
                                                                                  settings.ngram_max + 1)}
        self._indexed = 0  # positions < this have been indexed as continuation starts

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest recent n-gram matching the end of `tokens`."""
        end = len(tokens)
        self._index(tokens, end - 1)
        for n in range(self._s.ngram_max, self._s.ngram_min - 1, -1):
            if end < n:
                continue
            start = self._last[n].get(tuple(tokens[end - n:]))
            if start is not None:
                return tokens[start:start + k]
        return []

    def _index(self, tokens: list[int], upto: int) -> None:
        for i in range(self._indexed + 1, upto + 1):  # continuation starting at i follows tokens[i-n:i]
            for n, table in self._last.items():
                if i >= n:
                    table[tuple(tokens[i - n:i])] = i
        self._indexed = max(self._indexed, upto)
