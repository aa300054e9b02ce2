"""The workload every measurement runs: prompts, warm-up, repeats, interleaving, medians.

The tuner's objective (tuning/objective.py) and every benchmark script (scripts/bench_*.py) run this module
on a target (measure/targets.py: our engine in-process, a server over HTTP, llama-server), so a figure in a
report means the same thing wherever it was measured (definitions: measure/metrics.py).

- Prompts: a fixed set per prompt set; stream i of a round always gets base prompt i (every target sees the
  same mix), and every request starts with its own number, so no run is flattered by a slot's prefix cache.
- Greedy; `gen_tokens` per request. The plain set ignores EOS (fixed lengths, for speed); the copy set
  honours it (an EOS-less greedy loop would flatter speculation's prompt lookup).
- Per concurrency level: one warm-up round per target, then `repeats` rounds with the targets interleaved
  (A B, B A, ...) so drift on a shared machine hits every target alike; the median of the rounds is kept.
- Capacity (what a server is bought for): the best aggregate over 1, 2, 4, ... up to the config's slots
  streams at once with every stream's decode tok/s at least a floor (`min_stream_tok_s`), one measured
  round per stream count after a warm-up round of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from importlib import resources
from typing import Any, Protocol

from measure.design import round_order
from measure.metrics import RoundFigures, StreamRecord, stream_figures

PLAIN_PROMPTS: tuple[str, ...] = (
    "Write a detailed, practical guide to maintaining a small vegetable garden through the seasons: soil "
    "preparation, choosing what to plant, watering, dealing with pests, harvesting and storing the crop, and "
    "preparing the beds for winter. Use clear headings and short paragraphs.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old, step by step.",
    "List the main causes of the French Revolution and explain each briefly.",
    "Describe the water cycle, from evaporation over the ocean to a river reaching the sea.",
    "What are the trade-offs between trains and airplanes for a 500 km journey?",
    "Write a polite email asking a neighbour to keep their dog quiet at night.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Give a recipe for a simple vegetable soup and explain why each step matters.",
    "Summarise the plot of a detective novel you invent, in one paragraph.",
    "Why is the sky blue during the day and red at sunset? Explain the physics.",
    "Describe a typical day in the life of a medieval blacksmith.",
    "Compare renting and buying a home for a young family, pros and cons.",
    "Write a poem about autumn leaves falling in a quiet city park.",
    "Explain what a hash table is and why lookups are usually fast.",
    "Describe how bees communicate the location of flowers to the hive.",
)
COPY_TASKS: tuple[str, ...] = (
    "Here is a Python module. Repeat it exactly, changing only the name `IncrementalDetokenizer` to "
    "`Detokenizer` everywhere:\n\n{text}",
    "Summarise this module, quoting each docstring word for word:\n\n{text}",
)
ROUND_TIMEOUT_S = 900.0


class PromptSet(str, Enum):
    """`plain`: free writing (little to copy), as raw completions. `chat`: the same instructions as chat
    messages, through the model's template, as a chat client sends them. `copy`: edit code or quote a text
    given in the prompt, the work where prompt lookup (speculation) pays."""

    plain = "plain"
    chat = "chat"
    copy = "copy"


@dataclass(frozen=True)
class Prompt:
    """One request's input: raw text for a completion, or a user message for a chat completion."""

    text: str
    chat: bool


def source_text() -> str:
    """The copy set's material: a module of this project, shipped with it (the same bytes everywhere)."""
    return resources.files("serving.engine").joinpath("detok.py").read_text(encoding="utf-8")


class Prompts:
    """Numbered prompts of one set; the numbers keep counting, so every request's prefix is new."""

    def __init__(self, prompt_set: PromptSet, first: int = 1) -> None:
        self.prompt_set = prompt_set
        self.next_number = first
        self._source = source_text() if prompt_set == PromptSet.copy else ""

    def round(self, streams: int) -> list[Prompt]:
        """The prompts of one round: stream i gets base prompt i, each with a fresh number."""
        first = self.reserve(streams)
        return [self._prompt(first + i, i) for i in range(streams)]

    def reserve(self, count: int) -> int:
        """The first of `count` numbers no other prompt of this set gets (a replay's salt, say)."""
        first, self.next_number = self.next_number, self.next_number + count
        return first

    def _prompt(self, number: int, stream: int) -> Prompt:
        if self.prompt_set in (PromptSet.plain, PromptSet.chat):
            return Prompt(f"Request {number}. {PLAIN_PROMPTS[stream % len(PLAIN_PROMPTS)]}",
                          chat=self.prompt_set == PromptSet.chat)
        task = COPY_TASKS[stream % len(COPY_TASKS)].format(text=self._source)
        return Prompt(f"Request {number}. {task}", chat=True)


class Target(Protocol):
    """Something that runs one streamed greedy generation and times it on the client's clock."""

    name: str

    async def run_stream(self, prompt: Prompt, max_tokens: int, ignore_eos: bool) -> StreamRecord: ...


@dataclass(frozen=True)
class Workload:
    """The fixed measurement plan."""

    gen_tokens: int = 64
    levels: tuple[int, ...] = (1, 4)  # streams at once: a lone stream, and the N-way aggregate
    repeats: int = 3
    prompt_set: PromptSet = PromptSet.plain
    min_stream_tok_s: float | None = None  # set: also measure the capacity curve with this floor per stream
    report_copy: bool = False  # also measure the single stream on the copy set (tuning/objective.py)
    honour_eos: bool = False  # the plain and chat sets too stop at EOS (speculation's benchmark: no EOS-less loops)

    @property
    def ignore_eos(self) -> bool:
        return self.prompt_set in (PromptSet.plain, PromptSet.chat) and not self.honour_eos

    @property
    def concurrency(self) -> int:
        """The N of the N-way aggregate: the largest level."""
        return max(self.levels)


@dataclass
class Level:
    """One target at one concurrency level: every measured round, and their median."""

    rounds: list[RoundFigures] = field(default_factory=list)

    @property
    def median(self) -> RoundFigures:
        return RoundFigures.median(self.rounds)

    def as_dict(self) -> dict[str, Any]:
        """For a JSON report."""
        return {"median": self.median.as_dict(), "rounds": [r.as_dict() for r in self.rounds]}


@dataclass(frozen=True)
class Speed:
    """The tuner's speed figures: medians of the lone stream and of the N-way rounds."""

    single_tok_s: float
    aggregate_tok_s: float
    ttft_ms: float
    prefill_tok_s: float

    @classmethod
    def of(cls, single: RoundFigures, multi: RoundFigures) -> Speed:
        return cls(single.decode_tok_s or 0.0, multi.aggregate_tok_s, single.ttft_ms, single.prefill_tok_s or 0.0)


@dataclass(frozen=True)
class CapacityPoint:
    """`streams` streams at once: their aggregate tok/s, and the slowest one's decode tok/s."""

    streams: int
    aggregate_tok_s: float
    slowest_tok_s: float


@dataclass(frozen=True)
class Capacity:
    """The most aggregate tok/s at any stream count up to the config's slots with every stream at least
    `floor_tok_s` (a reader's pace); 0 when even one stream is slower."""

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


Progress = Callable[[str, int, int, RoundFigures], None]  # target, level, repeat (1-based), the round


class Runner:
    """Runs a workload on targets; request numbers keep counting across calls (fresh prefixes)."""

    def __init__(self, workload: Workload, first_request: int = 1, round_timeout_s: float = ROUND_TIMEOUT_S,
                 pause_s: float = 0.0) -> None:
        """`pause_s`: idle time before each round, so what a target does while idle (the prompt cache's
        saves) is done before its next round and never during another target's; 0: rounds back to back."""
        self.workload = workload
        self.prompts = Prompts(workload.prompt_set, first_request)
        self.round_timeout_s = round_timeout_s
        self.pause_s = pause_s

    async def round(self, target: Target, streams: int) -> RoundFigures:
        """`streams` requests started together, each with its own prompt."""
        return (await self.run_round(target, streams))[0]

    async def run_round(self, target: Target, streams: int) -> tuple[RoundFigures, list[StreamRecord]]:
        """A round's figures, and its streams' records (their text, for comparing outputs)."""
        w = self.workload
        prompts = self.prompts.round(streams)
        if self.pause_s > 0:
            await asyncio.sleep(self.pause_s)
        t0 = time.perf_counter()
        records = await asyncio.wait_for(
            asyncio.gather(*(target.run_stream(p, w.gen_tokens, w.ignore_eos) for p in prompts)),
            self.round_timeout_s)
        wall = max(r.t_end for r in records) - t0
        return RoundFigures.of([stream_figures(r) for r in records], wall, w.gen_tokens), records

    async def levels(self, targets: Sequence[Target], progress: Progress | None = None) -> dict[str, dict[int, Level]]:
        """Per level: a warm-up round per target, then `repeats` rounds, the targets in `round_order`'s turn
        (two targets: A B, B A, ...)."""
        results: dict[str, dict[int, Level]] = {t.name: {} for t in targets}
        for streams in self.workload.levels:
            for target in targets:
                await self.round(target, streams)
            for repeat in range(self.workload.repeats):
                for target in round_order(targets, repeat):
                    figures = await self.round(target, streams)
                    results[target.name].setdefault(streams, Level()).rounds.append(figures)
                    if progress is not None:
                        progress(target.name, streams, repeat + 1, figures)
        return results

    async def speed(self, target: Target) -> Speed:
        """The levels on one target, as the tuner's figures (the lone stream, the N-way aggregate)."""
        levels = (await self.levels([target]))[target.name]
        return Speed.of(levels[min(levels)].median, levels[max(levels)].median)

    async def capacity(self, target: Target, slots: int, floor_tok_s: float) -> Capacity:
        """The capacity curve up to `slots` streams: per stream count a warm-up round (a batch shape the
        engine has not run yet costs a first time: CUDA graphs, buffers), then one measured round."""
        curve = []
        for n in capacity_levels(slots):
            await self.round(target, n)
            figures = await self.round(target, n)
            curve.append(CapacityPoint(n, figures.aggregate_tok_s, figures.slowest_decode_tok_s or 0.0))
        return Capacity.of(floor_tok_s, curve)
