"""Synthetic traces in Mooncake's format (serving/engine/mooncake.py), of the shapes of the public traces.

No public trace can be fetched where the benchmarks are built, so these write two of their shapes, seeded.
They are synthetic shapes, not recorded traffic: any Mooncake JSONL can be given wherever they are (the tuner's
`--workload FILE`, scripts/bench_headline.py's `--trace`), e.g. Mooncake's own conversation and toolagent traces.

- `chat` imitates a conversation trace: multi-turn conversations, each turn's prompt the conversation so far
  (so it begins with the previous turn's whole blocks), prompts of about 1-3k tokens, answers of 100-400,
  a few conversations interleaved, Poisson arrivals;
- `agent` imitates a tool-agent trace: coding-agent sessions over one long prefix (system prompt and tool
  definitions, 8-16k tokens) that every session shares, each turn extending its session's context by the last
  answer and a tool result, short answers of 50-200 tokens, Poisson arrivals.

The lengths above are this generator's settings for those shapes, not statistics measured from the public
traces (they could not be read here).

`length_scale` multiplies every length before the blocks are cut, so one trace shape runs on a CPU with a 135M
model and on a GPU with a 27B-class one.

    python scripts/make_traces.py --out-dir results/traces --length-scale 0.5   # chat.jsonl and agent.jsonl
 Blocks stay Mooncake's 512 tokens, so at a small scale less of each
prompt lies in whole shared blocks (a partial last block is a prompt's own, as in a real trace: its chained
hash covers tokens the next turn changes); the tuner's `--length-scale` instead scales a full-size trace's
blocks with it. Pure: no I/O but the caller's.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from serving.engine.mooncake import BLOCK_TOKENS, TraceLine, blocks_of, jsonl, whole_blocks


class Shape(str, Enum):
    """The trace shapes written here."""

    chat = "chat"  # multi-turn conversations: each turn extends its conversation
    agent = "agent"  # agent sessions over one long prefix every session shares


DEFAULT_REQUESTS = {Shape.chat: 32, Shape.agent: 20}
DEFAULT_DURATION_S = 45.0
INTERLEAVED = {Shape.chat: 6, Shape.agent: 4}  # conversations or sessions taking turns at once


@dataclass(frozen=True)
class TraceSpec:
    """What to write: `requests` lines of `shape`, Poisson arrivals spanning `duration_s`,
    every length times `length_scale`, drawn with `seed`."""

    shape: Shape
    requests: int
    duration_s: float = DEFAULT_DURATION_S
    length_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or not self.duration_s > 0 or not self.length_scale > 0:
            raise ValueError(f"a trace needs requests >= 1, duration_s > 0 and length_scale > 0: {self}")


@dataclass(frozen=True)
class Turn:
    """One request of a session: its whole prompt (the session so far) and the answer it asks for."""

    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Session:
    """A conversation or an agent session: its turns, and the whole blocks every turn starts with (the
    shared prefix's; none for a conversation)."""

    turns: tuple[Turn, ...]
    prefix_ids: tuple[int, ...] = ()


def make_trace(spec: TraceSpec) -> list[TraceLine]:
    """The trace's lines in arrival order, timestamps in ms from 0."""
    rng = random.Random(f"{spec.shape.value}-{spec.seed}")
    scale = spec.length_scale
    if spec.shape is Shape.chat:
        prefix_ids: tuple[int, ...] = ()
        draw: Callable[[], Session] = functools.partial(_chat_session, rng, scale)
    else:
        prefix = _scaled(rng.randint(8000, 16000), scale)
        prefix_ids = tuple(range(whole_blocks(prefix)))
        draw = functools.partial(_agent_session, rng, scale, prefix, prefix_ids)
    order = _interleaved(draw, spec.requests, INTERLEAVED[spec.shape], rng)
    return _lines(order, _arrivals_ms(rng, spec.requests, spec.duration_s), first_id=len(prefix_ids))


def _scaled(tokens: float, scale: float) -> int:
    return max(1, round(tokens * scale))


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _chat_session(rng: random.Random, scale: float) -> Session:
    """2-6 turns: a first prompt of ~1k tokens (system prompt, context, question), then each turn adds the
    last answer and a new message, up to ~3k tokens; answers of 100-400 tokens."""
    turns, context = [], _lognormal(rng, 1000, 0.3, 500, 2000)
    for _ in range(rng.randint(2, 6)):
        if context > 3200:
            break
        output = _lognormal(rng, 220, 0.35, 100, 400)
        turns.append(Turn(_scaled(context, scale), _scaled(output, scale)))
        context += output + _lognormal(rng, 150, 0.5, 30, 600)
    return Session(tuple(turns))


def _agent_session(rng: random.Random, scale: float, prefix: int, prefix_ids: tuple[int, ...]) -> Session:
    """3-8 turns over the shared prefix: a task of ~400 tokens, then each turn adds the last answer and a tool
    result (~600 tokens: a file read, a test run); answers of 50-200 tokens. `prefix` is already scaled, its
    whole blocks `prefix_ids`."""
    turns, context = [], prefix + _scaled(_lognormal(rng, 400, 0.4, 100, 1500), scale)
    for _ in range(rng.randint(3, 8)):
        output = _lognormal(rng, 100, 0.4, 50, 200)
        turns.append(Turn(context, _scaled(output, scale)))
        context += _scaled(output + _lognormal(rng, 600, 0.6, 100, 2000), scale)
    return Session(tuple(turns), prefix_ids)


def _interleaved(draw: Callable[[], Session], count: int, active: int, rng: random.Random
                 ) -> list[tuple[int, Session, int]]:
    """(session number, session, turn index) for `count` requests: `active` sessions take turns at random, a
    finished one replaced by a new one, so a session's turns come in order with others' between them."""
    sessions = [draw() for _ in range(active)]
    numbers, taken = list(range(active)), [0] * active
    order: list[tuple[int, Session, int]] = []
    started = active
    while len(order) < count:
        slot = rng.randrange(active)
        order.append((numbers[slot], sessions[slot], taken[slot]))
        taken[slot] += 1
        if taken[slot] == len(sessions[slot].turns):
            sessions[slot], numbers[slot], taken[slot], started = draw(), started, 0, started + 1
    return order


def _arrivals_ms(rng: random.Random, count: int, duration_s: float) -> list[float]:
    """Poisson arrivals from 0, stretched so the last one comes at `duration_s` (a few dozen draws of a Poisson
    process span anywhere from half to twice their mean: the replay's length is what a caller plans by)."""
    gaps = [rng.expovariate(1.0) for _ in range(count - 1)]
    stretch = duration_s * 1000.0 / sum(gaps) if gaps else 0.0
    return [stretch * t for t in itertools.accumulate(gaps, initial=0.0)]


def _lines(order: Sequence[tuple[int, Session, int]], arrivals: Sequence[float], first_id: int) -> list[TraceLine]:
    """Lines with block ids: a turn's prompt starts with every whole block its session's text already had (the
    last turn's prompt, or for a first turn the shared prefix); its other blocks get ids of their own."""
    known: dict[int, tuple[int, ...]] = {}  # session number -> the whole blocks of its text so far
    lines, next_id = [], first_id
    for (number, session, index), at in zip(order, arrivals, strict=True):
        turn = session.turns[index]
        shared = known.get(number, session.prefix_ids)[:whole_blocks(turn.prompt_tokens)]
        own = blocks_of(turn.prompt_tokens) - len(shared)
        ids = (*shared, *range(next_id, next_id + own))
        next_id += own
        known[number] = ids[:whole_blocks(turn.prompt_tokens)]
        lines.append(TraceLine(turn.prompt_tokens, turn.output_tokens, ids, at))
    return lines


def describe(spec: TraceSpec) -> str:
    """What the trace is, for a report or a file's neighbour: shape, size, scale, seed, and that it is synthetic."""
    return (f"synthetic {spec.shape.value} shape (measure/traces.py): {spec.requests} requests over ~"
            f"{spec.duration_s:g} s, lengths x{spec.length_scale:g}, seed {spec.seed}, {BLOCK_TOKENS}-token blocks")


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True, help="where SHAPE.jsonl goes (made if need be)")
    p.add_argument("--shape", action="append", choices=[s.value for s in Shape], default=[],
                   help="a shape to write (repeat; default: every shape)")
    p.add_argument("--requests", type=_positive(int), metavar="N",
                   help="requests per trace (default: " + ", ".join(f"{k.value} {v}" for k, v in
                                                                    DEFAULT_REQUESTS.items()) + ")")
    p.add_argument("--duration", type=_positive(float), default=DEFAULT_DURATION_S, metavar="S",
                   help=f"seconds from the first arrival to the last (default {DEFAULT_DURATION_S:g})")
    p.add_argument("--length-scale", type=_positive(float), default=1.0, metavar="X",
                   help="every length times X, blocks kept at 512 tokens (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed (default 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for shape in [Shape(s) for s in dict.fromkeys(args.shape)] or list(Shape):
        spec = TraceSpec(shape, int(args.requests or DEFAULT_REQUESTS[shape]), args.duration, args.length_scale,
                         args.seed)
        path = args.out_dir / f"{shape.value}.jsonl"
        path.write_text(jsonl(make_trace(spec)), encoding="utf-8")
        print(f"wrote {path}: {describe(spec)}", file=sys.stderr)
    return 0
