"""The shape of the traffic a replica serves, never its text.

The tuner is to tune for the traffic the service actually receives, by replaying it: for that it needs each
request's shape (prompt tokens, prefix tokens a slot had cached, output tokens, choices, kind, arrival time),
not what was said. So a RequestShape has counts, an enum and a timestamp, and no field that could hold text
or token ids: nothing a client sent can leak through /traffic or a replay file.

Each engine keeps one TrafficRecord: the last `limit` finished requests' shapes (a deque, so memory is bounded
however long the replica runs), running totals since it started, and histograms with fixed bucket edges. Fixed
edges and plain counts are what make replicas mergeable: a TrafficSummary of one replica merges with
another's (counts add, histograms add bucket by bucket, recent arrivals interleave in time order, bounded), so
/traffic can answer for the whole service. Arrival times are wall-clock (`time.time()`) for the same reason:
two replicas' arrivals line up on one time axis, and a replay can keep the gaps between them.

Pure data: no libllama, no Ray, no locks. The engine (serving/engine/core.py) writes its record from the step
thread and reads it from other threads under a lock of its own; JSON appears only in `as_dict`, at the route.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, astuple, dataclass, field
from enum import Enum
from typing import Any

from serving.engine.request import FinishReason, SamplingParams, Usage

DEFAULT_LIMIT = 4096  # shapes a record keeps: about 0.5 MB of JSON, minutes to hours of a busy replica
# vLLM's 1-2-5 buckets for its request_prompt_tokens / request_generation_tokens histograms
TOKEN_EDGES: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000,
                                  50_000, 100_000)
CACHED_FRACTION_EDGES: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)  # 0.0: nothing found cached
N_EDGES: tuple[float, ...] = (1, 2, 5, 10, 20)  # vLLM's request_params_n buckets


class RequestKind(str, Enum):
    """How a request samples: what decides its per-token cost beyond the forward pass (a replay must keep it)."""

    greedy = "greedy"  # temperature 0: argmax
    sampled = "sampled"  # temperature > 0: llama.cpp's sampler chain
    constrained = "constrained"  # a grammar (response_format, a forced tool call): checked every token

    @classmethod
    def of(cls, params: SamplingParams) -> RequestKind:
        if params.constraint is not None:
            return cls.constrained
        return cls.greedy if params.temperature <= 0.0 else cls.sampled


@dataclass(frozen=True)
class TrafficTag:
    """Marks a submission as client traffic to record (the HTTP routes set it). Untagged work (a tuning
    trial's measurement on this same engine, a benchmark) is not recorded: the tuner must never replay
    its own probes as if clients had sent them."""

    streamed: bool = False


@dataclass(frozen=True)
class RequestShape:
    """One finished request, as counts: everything a replay needs, nothing a client wrote."""

    arrival: float  # wall clock (time.time()) when the engine took the request
    kind: RequestKind
    prompt_tokens: int
    cached_tokens: int  # prompt tokens a slot already held (prefix cache hit); not re-evaluated
    output_tokens: int  # over all choices, as OpenAI's usage counts them
    n: int = 1  # choices
    max_tokens: int | None = None  # asked for; None: until the slot is full
    finish: FinishReason = FinishReason.stop  # the worst of its choices' (error > cancelled > length > stop)
    streamed: bool = False

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Built field by field: dataclasses.asdict deep-copies, a cost times thousands of shapes."""
        return {"arrival": self.arrival, "kind": self.kind.value, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_tokens": self.output_tokens, "n": self.n,
                "max_tokens": self.max_tokens, "finish": self.finish.value, "streamed": self.streamed}


_FINISH_RANK = {FinishReason.stop: 0, FinishReason.length: 1, FinishReason.cancelled: 2, FinishReason.error: 3}


@dataclass
class ShapeInProgress:
    """A request's shape while its choices run; the step thread's alone. Each choice ends once (the output
    processor sees every end); the last to end completes the shape."""

    arrival: float
    kind: RequestKind
    prompt_tokens: int
    n: int
    max_tokens: int | None
    streamed: bool
    open: int = field(init=False)
    output_tokens: int = 0
    cached_tokens: int = 0
    finish: FinishReason = FinishReason.stop

    def __post_init__(self) -> None:
        self.open = self.n

    @classmethod
    def start(cls, prompt_tokens: int, params: SamplingParams, n: int, tag: TrafficTag,
              arrival: float) -> ShapeInProgress:
        return cls(arrival, RequestKind.of(params), prompt_tokens, n, params.max_tokens, tag.streamed)

    def end_choice(self, usage: Usage | None, reason: FinishReason) -> RequestShape | None:
        """One choice ended; the whole request's shape once it was the last, else None."""
        if usage is not None:
            self.output_tokens += usage.completion_tokens
            self.cached_tokens = max(self.cached_tokens, usage.cached_tokens)  # the first choice's prefill
        if _FINISH_RANK[reason] > _FINISH_RANK[self.finish]:
            self.finish = reason
        self.open -= 1
        if self.open > 0:
            return None
        return RequestShape(self.arrival, self.kind, self.prompt_tokens, self.cached_tokens, self.output_tokens,
                            self.n, self.max_tokens, self.finish, self.streamed)


@dataclass(frozen=True)
class Histogram:
    """Counts in fixed buckets, Prometheus' way: `counts[i]` holds values v with edges[i-1] < v <= edges[i],
    the last one every v above edges[-1]. Two histograms with the same edges add bucket by bucket."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]

    @classmethod
    def empty(cls, edges: tuple[float, ...]) -> Histogram:
        return cls(edges, (0,) * (len(edges) + 1))

    def merged(self, other: Histogram) -> Histogram:
        if self.edges != other.edges:
            raise ValueError(f"histograms with different bucket edges do not add: {self.edges} vs {other.edges}")
        return Histogram(self.edges, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)))

    def as_dict(self) -> dict[str, Any]:
        return {"le": [*self.edges, "+Inf"], "counts": list(self.counts)}


class _Buckets:
    """A histogram being filled: O(log buckets) per value."""

    def __init__(self, edges: tuple[float, ...]) -> None:
        self.edges = edges
        self.counts = [0] * (len(edges) + 1)

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1

    def frozen(self) -> Histogram:
        return Histogram(self.edges, tuple(self.counts))


@dataclass(frozen=True)
class TrafficTotals:
    """Everything counted since the record started, not only what the recent window still holds."""

    requests: int = 0
    choices: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    streamed: int = 0

    def merged(self, other: TrafficTotals) -> TrafficTotals:
        return TrafficTotals(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def _arrival(shape: RequestShape) -> float:
    return shape.arrival


def _added(a: Mapping[Any, int], b: Mapping[Any, int]) -> dict[Any, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in {*a, *b}}


@dataclass(frozen=True)
class TrafficSummary:
    """One replica's traffic record as a value, or several replicas' merged: what /traffic shows and what a
    replay reads. `recent` is in arrival order, oldest first, at most `limit` long."""

    replicas: tuple[str, ...]
    since: float  # wall clock when the oldest of the merged records started
    limit: int
    totals: TrafficTotals
    by_kind: dict[RequestKind, int]
    by_finish: dict[FinishReason, int]
    prompt_tokens: Histogram
    output_tokens: Histogram
    cached_fraction: Histogram
    recent: tuple[RequestShape, ...]

    @classmethod
    def empty(cls, replica: str, limit: int = DEFAULT_LIMIT, since: float | None = None) -> TrafficSummary:
        """A replica that has served nothing yet (still loading its model, say)."""
        return cls((replica,), time.time() if since is None else since, limit, TrafficTotals(), {}, {},
                   Histogram.empty(TOKEN_EDGES), Histogram.empty(TOKEN_EDGES), Histogram.empty(CACHED_FRACTION_EDGES),
                   ())

    @property
    def window_s(self) -> float:
        """From the first to the last arrival the recent window holds."""
        return self.recent[-1].arrival - self.recent[0].arrival if len(self.recent) > 1 else 0.0

    @property
    def arrival_rate_per_s(self) -> float | None:
        """Arrivals per second over the recent window; None until it holds two arrivals apart in time."""
        window = self.window_s
        return (len(self.recent) - 1) / window if window > 0 else None

    def merged(self, other: TrafficSummary) -> TrafficSummary:
        """Both replicas' traffic as one. The recent window keeps the latest min(limits) arrivals: each
        side's window is complete back to its oldest shape, and so is the merged one only if it reaches
        back no further than either side's oldest, which a window no longer than the shorter one ensures."""
        limit = min(self.limit, other.limit)
        recent = tuple(heapq.merge(self.recent, other.recent, key=_arrival))[-limit:] if limit else ()
        return TrafficSummary(
            replicas=tuple(sorted({*self.replicas, *other.replicas})), since=min(self.since, other.since),
            limit=limit, totals=self.totals.merged(other.totals), by_kind=_added(self.by_kind, other.by_kind),
            by_finish=_added(self.by_finish, other.by_finish),
            prompt_tokens=self.prompt_tokens.merged(other.prompt_tokens),
            output_tokens=self.output_tokens.merged(other.output_tokens),
            cached_fraction=self.cached_fraction.merged(other.cached_fraction), recent=recent)

    def as_dict(self, recent: int | None = None) -> dict[str, Any]:
        """The JSON of /traffic; `recent` caps the shapes listed (the latest ones), None lists the window."""
        shown = self.recent if recent is None else self.recent[len(self.recent) - recent:] if recent else ()
        return {
            "replicas": list(self.replicas), "since": self.since, "totals": asdict(self.totals),
            "by_kind": {k.value: self.by_kind.get(k, 0) for k in RequestKind},
            "by_finish": {r.value: self.by_finish.get(r, 0) for r in FinishReason},
            "histograms": {"prompt_tokens": self.prompt_tokens.as_dict(),
                           "output_tokens": self.output_tokens.as_dict(),
                           "cached_fraction": self.cached_fraction.as_dict()},
            "recent": {"limit": self.limit, "count": len(self.recent), "window_s": self.window_s,
                       "arrival_rate_per_s": self.arrival_rate_per_s,
                       "requests": [shape.as_dict() for shape in shown]},
        }


def merge_summaries(summaries: Iterable[TrafficSummary]) -> TrafficSummary:
    """Several replicas' summaries as one (at least one is needed: there is no replica-less summary)."""
    first, *rest = summaries
    for summary in rest:
        first = first.merged(summary)
    return first


class TrafficRecord:
    """One engine's record: the last `limit` shapes plus totals and histograms since it started. O(1) per
    request (a deque append, a few counters, three bisects); nothing per token. Not thread-safe by itself:
    its one writer and its readers share the engine's lock."""

    def __init__(self, limit: int = DEFAULT_LIMIT, clock: Callable[[], float] = time.time) -> None:
        if limit < 1:
            raise ValueError(f"a traffic record keeps at least one request's shape, not {limit}")
        self.limit = limit
        self.started = clock()
        self.count = 0  # shapes added since the start (the deque keeps the last `limit` of them)
        self._recent: collections.deque[RequestShape] = collections.deque(maxlen=limit)
        self._totals = TrafficTotals()
        self._by_kind: collections.Counter[RequestKind] = collections.Counter()
        self._by_finish: collections.Counter[FinishReason] = collections.Counter()
        self._prompt = _Buckets(TOKEN_EDGES)
        self._output = _Buckets(TOKEN_EDGES)
        self._cached = _Buckets(CACHED_FRACTION_EDGES)

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, shape: RequestShape) -> None:
        self.count += 1
        self._recent.append(shape)
        t = self._totals
        self._totals = TrafficTotals(t.requests + 1, t.choices + shape.n, t.prompt_tokens + shape.prompt_tokens,
                                     t.cached_tokens + shape.cached_tokens, t.output_tokens + shape.output_tokens,
                                     t.streamed + int(shape.streamed))
        self._by_kind[shape.kind] += 1
        self._by_finish[shape.finish] += 1
        self._prompt.add(shape.prompt_tokens)
        self._output.add(shape.output_tokens)
        self._cached.add(shape.cached_fraction)

    def since(self, seen: int) -> tuple[list[RequestShape], int]:
        """The shapes added after the first `seen` (as far as the window still holds them), and the count to
        pass next time. A `seen` beyond the count is from an earlier record (an engine replaced): all of
        this one's are new."""
        new = self.count - seen if 0 <= seen <= self.count else self.count
        new = min(new, len(self._recent))
        return list(itertools.islice(self._recent, len(self._recent) - new, None)), self.count

    def summary(self, replica: str = "") -> TrafficSummary:
        return TrafficSummary(
            replicas=(replica,), since=self.started, limit=self.limit, totals=self._totals,
            by_kind=dict(self._by_kind), by_finish=dict(self._by_finish), prompt_tokens=self._prompt.frozen(),
            output_tokens=self._output.frozen(), cached_fraction=self._cached.frozen(),
            recent=tuple(sorted(self._recent, key=_arrival)))  # finished in end order; shown by arrival
