"""Latency targets (`--slo ttft_p95=1.5s,itl_p95=80ms`), the percentiles they are checked on, and goodput.

A target bounds one percentile of one latency: TTFT (arrival to first token, queueing included), ITL (the gap
between consecutive tokens of a stream, over every gap of every request, as vLLM's benchmark counts it) or E2E
(arrival to the last token). A run meets the SLO when every target's percentile is within its bound; by how
much it misses is `observed / bound - 1` of the worst target (the constraint Optuna steers by).

Goodput (DistServe's term, vLLM's `--goodput`) counts only the requests that were good: a request is good when
it ended without error and its own TTFT, its own mean ITL and its own E2E are within every bound set; goodput
is good requests (or their output tokens) per second of the run. A percentile target then says what share of
requests must be good on that latency (p95: 95%).

A percentile of few samples moves a lot between runs: `min_samples` is the count that leaves at least
`TAIL_SAMPLES` samples beyond the percentile, and every percentile is reported with a bootstrap interval, so
a report shows how far it can be trusted. Pure: no I/O, unit-tested on constructed records.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from measure.metrics import percentile

TAIL_SAMPLES = 5  # samples beyond a percentile for it to be worth reporting (p95: 100 samples)
PERCENTILES = (50, 90, 95, 99)
BOOTSTRAP_RESAMPLES = 200
_TARGET = re.compile(r"^(?P<metric>[a-z0-9]+)_p(?P<pct>\d+)=(?P<value>\d+(\.\d*)?|\.\d+)\s*(?P<unit>ms|s)?$")


class Latency(str, Enum):
    """The latencies a target can bound."""

    ttft = "ttft"  # arrival to the first token: queueing and prefill
    itl = "itl"  # between consecutive tokens of a stream
    e2e = "e2e"  # arrival to the last token

    @property
    def per_request(self) -> bool:
        """One sample per request (TTFT, E2E), else one per token gap (ITL)."""
        return self is not Latency.itl


@dataclass(frozen=True)
class Target:
    """`metric`'s `pct`-th percentile must be at most `bound_s`."""

    metric: Latency
    pct: int
    bound_s: float

    def __str__(self) -> str:
        return f"{self.metric.value}_p{self.pct}<={_seconds(self.bound_s)}"


@dataclass(frozen=True)
class Slo:
    """Latency targets; empty: every request counts as good (goodput is then throughput)."""

    targets: tuple[Target, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft_p95=1.5s,itl_p95=80ms,e2e_p99=20s`: a unit of s or ms (a bare number is seconds)."""
        targets: dict[tuple[Latency, int], Target] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            match = _TARGET.match(part.replace(" ", ""))
            if match is None:
                raise ValueError(f"SLO target {part!r}: expected METRIC_pNN=VALUE[s|ms], e.g. ttft_p95=1.5s")
            try:
                metric = Latency(match["metric"])
            except ValueError:
                raise ValueError(f"SLO target {part!r}: the metric is one of "
                                 f"{', '.join(m.value for m in Latency)}") from None
            pct = int(match["pct"])
            if pct not in PERCENTILES:
                raise ValueError(f"SLO target {part!r}: the percentile is one of "
                                 f"{', '.join(f'p{p}' for p in PERCENTILES)}")
            bound = float(match["value"]) / (1000.0 if match["unit"] == "ms" else 1.0)
            if not bound > 0:
                raise ValueError(f"SLO target {part!r}: the bound must be above 0")
            if (metric, pct) in targets:
                raise ValueError(f"SLO target {part!r}: {metric.value}_p{pct} is given twice")
            targets[(metric, pct)] = Target(metric, pct, bound)
        if not targets:
            raise ValueError("an SLO needs at least one target, e.g. ttft_p95=1.5s")
        return cls(tuple(targets.values()))

    def __str__(self) -> str:
        return ",".join(str(t) for t in self.targets) or "none"

    def bound(self, metric: Latency) -> float:
        """The tightest bound on `metric` (a request is good only within it); inf when none is set."""
        return min((t.bound_s for t in self.targets if t.metric is metric), default=math.inf)

    def min_samples(self) -> int:
        """Requests a run needs for its per-request percentiles to leave TAIL_SAMPLES beyond them."""
        return max((tail_count(t.pct) for t in self.targets if t.metric.per_request), default=0)


def tail_count(pct: int) -> int:
    """Samples for TAIL_SAMPLES of them to lie beyond the `pct`-th percentile."""
    return math.ceil(TAIL_SAMPLES * 100 / (100 - pct))


@dataclass(frozen=True)
class RequestLatency:
    """One replayed request as the SLO sees it: whether it succeeded, its latencies, what it produced."""

    ok: bool
    ttft_s: float
    e2e_s: float
    itl_s: tuple[float, ...]
    output_tokens: int

    @property
    def mean_itl_s(self) -> float:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else 0.0

    def good(self, slo: Slo) -> bool:
        return (self.ok and self.ttft_s <= slo.bound(Latency.ttft) and self.mean_itl_s <= slo.bound(Latency.itl)
                and self.e2e_s <= slo.bound(Latency.e2e))


@dataclass(frozen=True)
class Spread:
    """A percentile and the 5th-95th percentile of its bootstrap resamples (how far a rerun might move it)."""

    value: float
    low: float
    high: float
    samples: int
    pct: int

    @property
    def stable(self) -> bool:
        """Enough samples beyond the percentile (TAIL_SAMPLES) for it to mean something."""
        return self.samples >= tail_count(self.pct)

    def __str__(self) -> str:
        return f"{_seconds(self.value)} [{_seconds(self.low)}-{_seconds(self.high)}]"


def spread(values: Sequence[float], pct: int, seed: int = 0) -> Spread:
    """The `pct`-th percentile of `values` with a bootstrap interval (seeded: the same data, the same report)."""
    if not values:
        return Spread(math.nan, math.nan, math.nan, 0, pct)
    rng = random.Random(seed)
    resampled = sorted(percentile(rng.choices(values, k=len(values)), pct) for _ in range(BOOTSTRAP_RESAMPLES))
    return Spread(percentile(values, pct), percentile(resampled, 5), percentile(resampled, 95), len(values), pct)


def samples(requests: Sequence[RequestLatency], metric: Latency) -> list[float]:
    """The samples a percentile of `metric` is taken over: succeeded requests, every token gap for ITL."""
    done = [r for r in requests if r.ok]
    if metric is Latency.itl:
        return [gap for r in done for gap in r.itl_s]
    return [r.ttft_s if metric is Latency.ttft else r.e2e_s for r in done]


@dataclass(frozen=True)
class Miss:
    """A target the run missed: its percentile as observed, and by how much (observed / bound - 1)."""

    target: Target
    observed_s: float

    @property
    def excess(self) -> float:
        return self.observed_s / self.target.bound_s - 1.0

    def __str__(self) -> str:
        name = f"{self.target.metric.value}_p{self.target.pct}"
        if math.isnan(self.observed_s):
            return f"{name}: no sample (no request succeeded)"
        return f"{name} {_seconds(self.observed_s)} > {_seconds(self.target.bound_s)} (+{100 * self.excess:.0f}%)"


@dataclass(frozen=True)
class SloOutcome:
    """A run against an SLO: each target's percentile with its spread, the misses, the share of good requests."""

    observed: tuple[tuple[Target, Spread], ...]
    misses: tuple[Miss, ...]
    failed: int  # requests that ended in an error: never good, and a run with any misses nothing
    good: int
    requests: int

    @property
    def met(self) -> bool:
        return not self.misses and self.failed == 0

    @property
    def violation(self) -> float:
        """Optuna's constraint value, <= 0 when met: the worst target's observed / bound - 1 (negative: the
        headroom left), at least 1.0 when a request failed; 0.0 for an SLO with no targets."""
        worst = max((s.value / t.bound_s - 1.0 if not math.isnan(s.value) else 1.0 for t, s in self.observed),
                    default=0.0)
        return max(worst, 1.0) if self.failed else worst

    @property
    def attainment(self) -> float:
        """The share of requests that were good."""
        return self.good / self.requests if self.requests else 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SloOutcome:
        """Back from `dataclasses.asdict` (a saved report): the tables can be drawn again from what was measured."""
        def target(t: Mapping[str, Any]) -> Target:
            return Target(Latency(t["metric"]), int(t["pct"]), float(t["bound_s"]))

        return cls(observed=tuple((target(t), Spread(**s)) for t, s in data["observed"]),
                   misses=tuple(Miss(target(m["target"]), float(m["observed_s"])) for m in data["misses"]),
                   failed=int(data["failed"]), good=int(data["good"]), requests=int(data["requests"]))

    def describe(self) -> str:
        if self.met:
            return f"met ({self.good}/{self.requests} requests good)"
        parts = [str(m) for m in self.misses] + ([f"{self.failed} failed"] if self.failed else [])
        return "missed: " + "; ".join(parts)


def evaluate(requests: Sequence[RequestLatency], slo: Slo) -> SloOutcome:
    """Each target's percentile over the run's requests, and which it misses."""
    observed = tuple((t, spread(samples(requests, t.metric), t.pct)) for t in slo.targets)
    misses = tuple(Miss(t, s.value) for t, s in observed if not s.value <= t.bound_s)
    return SloOutcome(observed, misses, failed=sum(1 for r in requests if not r.ok),
                      good=sum(1 for r in requests if r.good(slo)), requests=len(requests))


def _seconds(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value * 1000:.0f}ms" if value < 1.0 else f"{value:.2f}s"
