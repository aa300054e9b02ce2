"""Mooncake's trace format: the JSONL that vLLM's `bench serve` trace mode, GuideLLM and AIPerf replay.

One request a line: `timestamp` (ms from the trace's start), `input_length` and `output_length` (tokens), and
`hash_ids`: one id per 512-token block of the prompt, the last block possibly partial. Two lines whose
`hash_ids` begin alike share that many blocks of prompt, so a replay builds their prompts with the same tokens
there and a prefix cache finds them, as it found the service's. An id names a block *and everything before it*
(a chained hash), so equal leading ids are all that sharing means.

Reading a trace (measure/replay.py) needs only `TraceLine.parse`. Writing one from the traffic record
(`GET /traffic?format=mooncake`) has to say what the record can: it keeps counts, never text, so which prompts
shared what is unknown; what it keeps is how many of each prompt's tokens a slot already held (`cached_tokens`).
`trace_of` turns that into block ids honestly bounded by it:

- a request shares `cached_tokens // 512` whole blocks (a hit shorter than a block is not expressible);
- it shares them with the latest earlier request whose prompt has that many whole blocks (the record does not
  say which earlier prompt the slot held: the latest long enough is a guess that at least existed and was
  recent), else with the earlier request with the most whole blocks, as many as it has (fewer than were hit);
- every other block gets an id of its own.

So a replay of the export finds at most the prefix hits the service found, in whole blocks, with one earlier
request each; the tokens a hit took from an earlier answer (a slot holds its prompt and its output) are
shared only as far as that earlier prompt reaches. Pure data: no libllama, no Ray.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serving.engine.traffic import RequestShape

BLOCK_TOKENS = 512  # Mooncake's block: what one hash id covers
MEDIA_TYPE = "application/x-ndjson"  # JSON Lines; application/jsonl is the newer name for the same


@dataclass(frozen=True)
class TraceLine:
    """One request of a Mooncake trace. `timestamp_ms` None: the line had none (a trace without times is
    replayed as a closed loop)."""

    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()
    timestamp_ms: float | None = None

    @classmethod
    def parse(cls, line: Mapping[str, Any]) -> TraceLine:
        """A parsed JSON object as a line; ValueError naming what is wrong (the caller adds the line number)."""
        missing = [k for k in ("input_length", "output_length") if k not in line]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (a Mooncake line has input_length and output_length)")
        ids = line.get("hash_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError("hash_ids is a list of integers (one per 512-token block of the prompt)")
        timestamp = line.get("timestamp")
        parsed = cls(int(line["input_length"]), int(line["output_length"]), tuple(ids),
                     None if timestamp is None else float(timestamp))
        if parsed.input_length < 1 or parsed.output_length < 0:
            raise ValueError(f"input_length {parsed.input_length} < 1 or output_length {parsed.output_length} < 0")
        return parsed

    def as_dict(self) -> dict[str, Any]:
        """The line as Mooncake writes it (its field order; no `timestamp` where it had none)."""
        timed = {} if self.timestamp_ms is None else {"timestamp": round(self.timestamp_ms)}
        return {**timed, "input_length": self.input_length, "output_length": self.output_length,
                "hash_ids": list(self.hash_ids)}


def is_trace_line(line: Mapping[str, Any]) -> bool:
    """Whether a parsed JSON line is Mooncake's (ours, GET /traffic's shapes, has `prompt_tokens`)."""
    return "input_length" in line


def whole_blocks(tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    return tokens // block_tokens


def blocks_of(tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Ids a prompt of `tokens` has: one per block, the last partial one included."""
    return max(1, math.ceil(tokens / block_tokens))


class _Sources:
    """Earlier lines by their whole-block count: the latest with at least k whole blocks, O(distinct counts)."""

    def __init__(self) -> None:
        self._latest: dict[int, int] = {}  # whole blocks -> index of the latest line with exactly that many

    def add(self, index: int, blocks: int) -> None:
        self._latest[blocks] = index

    def pick(self, want: int) -> tuple[int, int] | None:
        """(line index, blocks to share): the latest line with >= `want` whole blocks, else the one with the
        most (sharing all of its); None when `want` is 0 or no earlier line has a whole block."""
        if want < 1:
            return None
        long_enough = [i for k, i in self._latest.items() if k >= want]
        if long_enough:
            return max(long_enough), want
        most = max((k for k in self._latest if k > 0), default=0)
        return (self._latest[most], most) if most else None


def trace_of(shapes: Sequence[RequestShape], block_tokens: int = BLOCK_TOKENS) -> list[TraceLine]:
    """The recorded shapes (any order) as Mooncake lines in arrival order, timestamps from the first arrival;
    block ids shared as the module docstring says. A request that produced nothing asks for one token, as its
    replay would (a zero-token request is no request to most replay tools)."""
    ordered = sorted(shapes, key=lambda s: s.arrival)
    if not ordered:
        return []
    lines: list[TraceLine] = []
    first, sources, next_id = ordered[0].arrival, _Sources(), 0
    for index, shape in enumerate(ordered):
        prompt = max(shape.prompt_tokens, 1)
        source = sources.pick(whole_blocks(min(shape.cached_tokens, prompt), block_tokens))
        shared = lines[source[0]].hash_ids[:source[1]] if source else ()
        own = blocks_of(prompt, block_tokens) - len(shared)
        ids = (*shared, *range(next_id, next_id + own))
        next_id += own
        lines.append(TraceLine(prompt, max(shape.output_tokens, 1), ids, (shape.arrival - first) * 1000.0))
        sources.add(index, whole_blocks(prompt, block_tokens))
    return lines


def jsonl(lines: Iterable[TraceLine]) -> str:
    """The lines as the file: one JSON object a line, each ending with a newline."""
    return "".join(json.dumps(line.as_dict()) + "\n" for line in lines)
