"""The workload every measurement runs: prompts, warm-up, repeats, medians, and what each figure means.

The tuner's objective (tuning/objective.py) and the benchmark scripts use this module, so a figure in a
report means the same thing wherever it was measured:
- decode tok/s of a stream: (completion tokens - 1) / time from its first token to its last (llama-server's
  timings.predicted_per_second);
- TTFT: from the moment the request reached the engine to its first token (queueing included);
- prefill tok/s: prompt tokens evaluated (not served from a slot's cache) / TTFT;
- aggregate tok/s: all tokens of `concurrency` streams started together / wall time until the last ends;
- capacity tok/s: the best aggregate over 1, 2, 4, ... up to the config's slots streams at once with every
  stream's decode tok/s at least a floor (`min_stream_tok_s`), one run per stream count.
Every prompt starts with a distinct request number, so no run is flattered by a slot's prefix cache.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from typing import Protocol

from serving.request import FinishReason, GenerationChunk, SamplingParams, Usage

PLAIN = (
    "Request {n}. Write a detailed, practical guide to maintaining a small vegetable garden through the "
    "seasons: soil preparation, choosing what to plant, watering, dealing with pests, harvesting and "
    "storing the crop, and preparing the beds for winter. Use clear headings and short paragraphs."
)
COPY_TASKS = (
    "Request {n}. Here is a Python module. Repeat it exactly, changing only the name `IncrementalDetokenizer` "
    "to `Detokenizer` everywhere:\n\n{text}",
    "Request {n}. Summarise this module, quoting each docstring word for word:\n\n{text}",
)


class PromptSet(str, Enum):
    """`plain`: free writing (little to copy). `copy`: edit code or quote a text given in the prompt, the
    work where prompt lookup (speculation) pays."""

    plain = "plain"
    copy = "copy"


class Handle(Protocol):
    def __iter__(self) -> Handle: ...

    def __next__(self) -> GenerationChunk: ...


class Submitter(Protocol):
    """What the workload needs of an engine (serving.engine.Engine fits)."""

    def tokenize_prompt(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str: ...

    def submit(self, prompt_tokens: list[int], params: SamplingParams) -> Handle: ...


def source_text() -> str:
    """The copy set's material: a module of this project, shipped with it (the same bytes everywhere)."""
    return resources.files("serving").joinpath("detok.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Workload:
    """The fixed measurement plan."""

    gen_tokens: int = 64
    concurrency: int = 4
    repeats: int = 3
    prompt_set: PromptSet = PromptSet.plain
    ignore_eos: bool = True  # fixed lengths for speed; the copy set stops at EOS (see params)
    min_stream_tok_s: float | None = None  # set: also measure the capacity curve with this floor per stream
    report_copy: bool = False  # also measure the single stream on the copy set (tuning/objective.py)

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.gen_tokens, temperature=0.0,
                              ignore_eos=self.ignore_eos and self.prompt_set == PromptSet.plain)


@dataclass(frozen=True)
class Stream:
    """One finished stream."""

    text: str
    usage: Usage

    @property
    def decode_tok_s(self) -> float | None:
        return self.usage.decode_tok_s

    @property
    def prefill_tok_s(self) -> float | None:
        if not self.usage.ttft_s:
            return None
        return (self.usage.prompt_tokens - self.usage.cached_tokens) / self.usage.ttft_s


@dataclass(frozen=True)
class Speed:
    """Medians over the repeats."""

    single_tok_s: float
    aggregate_tok_s: float
    ttft_ms: float
    prefill_tok_s: float


@dataclass(frozen=True)
class CapacityPoint:
    """`streams` streams at once: their aggregate tok/s, and the slowest one's decode tok/s."""

    streams: int
    aggregate_tok_s: float
    slowest_tok_s: float


@dataclass(frozen=True)
class Capacity:
    """What a server is bought for: the most aggregate tok/s at any stream count up to the config's slots
    with every stream at least `floor_tok_s` (a reader's pace); 0 when even one stream is slower."""

    floor_tok_s: float
    tok_s: float
    streams: int  # the stream count that gave it (0: none met the floor)
    curve: tuple[CapacityPoint, ...]

    @classmethod
    def of(cls, floor_tok_s: float, curve: list[CapacityPoint]) -> Capacity:
        met = [p for p in curve if p.slowest_tok_s >= floor_tok_s]
        best = max(met, key=lambda p: p.aggregate_tok_s, default=None)
        return cls(floor_tok_s, best.aggregate_tok_s if best else 0.0, best.streams if best else 0, tuple(curve))


def capacity_levels(slots: int) -> list[int]:
    """Stream counts the capacity curve is measured at: 1, 2, 4, ... below `slots`, and `slots`."""
    levels = [1 << i for i in range(slots.bit_length()) if 1 << i < slots]
    return [*levels, slots]


def read(handle: Handle) -> Stream:
    """A stream to its end; an error ends the measurement (a failed run is no figure)."""
    parts, last = [], GenerationChunk()
    for chunk in handle:
        parts.append(chunk.text)
        last = chunk
    if last.finish_reason not in (FinishReason.stop, FinishReason.length) or last.usage is None:
        raise RuntimeError(f"a measured request ended with {last.finish_reason}: {last.error}")
    return Stream("".join(parts), last.usage)


class Runner:
    """Runs the workload on one engine; request numbers keep counting across calls (fresh prefixes)."""

    def __init__(self, workload: Workload, first_request: int = 1) -> None:
        self.workload = workload
        self._n = first_request - 1
        self._source = source_text() if workload.prompt_set == PromptSet.copy else ""

    @property
    def next_request(self) -> int:
        """The number the next prompt will carry (a second runner can continue from it)."""
        return self._n + 1

    def prompt(self, engine: Submitter) -> list[int]:
        self._n += 1
        if self.workload.prompt_set == PromptSet.plain:
            return engine.tokenize_prompt(PLAIN.format(n=self._n))
        task = COPY_TASKS[self._n % len(COPY_TASKS)].format(n=self._n, text=self._source)
        return engine.tokenize_prompt(engine.render_chat([{"role": "user", "content": task}]))

    def single(self, engine: Submitter) -> Stream:
        return read(engine.submit(self.prompt(engine), self.workload.params()))

    def concurrent(self, engine: Submitter, streams: int | None = None) -> tuple[float, list[Stream]]:
        """`streams` (default: the workload's `concurrency`) streams at once: (total generated tokens / wall
        time, the streams)."""
        prompts = [self.prompt(engine) for _ in range(streams or self.workload.concurrency)]
        t0 = time.perf_counter()
        done = [read(h) for h in [engine.submit(p, self.workload.params()) for p in prompts]]
        total = sum(s.usage.completion_tokens for s in done)
        return total / (time.perf_counter() - t0), done

    def capacity(self, engine: Submitter, slots: int, floor_tok_s: float) -> Capacity:
        """The capacity curve up to `slots` streams (one run per stream count, after `measure`'s warm-up)."""
        curve = []
        for n in capacity_levels(slots):
            aggregate, done = self.concurrent(engine, n)
            curve.append(CapacityPoint(n, aggregate, min(s.decode_tok_s or 0.0 for s in done)))
        return Capacity.of(floor_tok_s, curve)

    def measure(self, engine: Submitter) -> Speed:
        """Warm up once (first-use allocations, CPU caches), then the medians of `repeats` runs."""
        self.single(engine)
        self.concurrent(engine)
        singles = [self.single(engine) for _ in range(self.workload.repeats)]
        aggregates = [self.concurrent(engine)[0] for _ in range(self.workload.repeats)]
        return Speed(
            single_tok_s=statistics.median(s.decode_tok_s or 0.0 for s in singles),
            aggregate_tok_s=statistics.median(aggregates),
            ttft_ms=statistics.median(s.usage.ttft_s or 0.0 for s in singles) * 1e3,
            prefill_tok_s=statistics.median(s.prefill_tok_s or 0.0 for s in singles),
        )
