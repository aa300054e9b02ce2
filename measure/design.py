"""The experimental design every comparison shares: the order targets run in within a round, and how two
targets are compared round by round (paired ratios, paired gaps and the gaps' confidence intervals).

On a shared machine drift moves every figure; running the targets interleaved and comparing each round with
the reference's round run beside it cancels what moves both. The tuner's objective, its confirmation round
and every benchmark take their orders and comparisons from here, so "paired" means one thing everywhere.

Pure (no I/O): unit-tested on constructed figures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from measure.metrics import RoundFigures, percentile

T = TypeVar("T")

RATIO_KEYS = ("aggregate_tok_s", "decode_tok_s", "ttft_ms", "itl_ms_p50", "itl_ms_p95")
CONFIDENCE = 0.95


# -- the order of targets per round ---------------------------------------------------------------------------

def round_order(targets: Sequence[T], index: int) -> list[T]:
    """The targets' order in round `index`: every ordering in turn (for two, A B then B A), so that over a
    run each target follows each other one as often. Reversing alone keeps a middle target beside the same
    neighbours; on a CPU, where the last target's threads may still hold the cores, the target that always
    follows the in-process engine paid for it (docs/log/2026-12-06-cpu-http-omp-wait.md)."""
    rest, order = list(targets), []
    index %= math.factorial(len(rest))
    for left in range(len(rest), 0, -1):  # the index-th of itertools.permutations' order, without listing them
        pick, index = divmod(index, math.factorial(left - 1))
        order.append(rest.pop(pick))
    return order


def rotated(items: Sequence[T], by: int) -> list[T]:
    """`items` starting at index `by` (mod its length): each goes first in turn (A B C, B C A, C A B, ...), so
    none is always the one measured right after a switch; cheaper than `round_order` where every run reloads
    or reconfigures an engine."""
    if not items:
        return []
    start = by % len(items)
    return [*items[start:], *items[:start]]


# -- paired ratios ----------------------------------------------------------------------------------------------

def ratios(ours: RoundFigures, reference: RoundFigures) -> dict[str, float | None]:
    """ours / reference for the headline figures (throughput: > 1 is better; latency: < 1 is better)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        a, b = getattr(ours, key), getattr(reference, key)
        out[key] = a / b if a is not None and b else None
    return out


def paired_ratios(ours: Sequence[RoundFigures], reference: Sequence[RoundFigures]) -> dict[str, float | None]:
    """The median over rounds of ours[i] / reference[i]: each round against the reference round run beside it
    (the workload interleaves targets), so drift that moves both cancels, where a ratio of medians keeps it
    (on a noisy machine one fast reference round can move that by 5%)."""
    if len(ours) != len(reference):
        raise ValueError(f"{len(ours)} rounds against {len(reference)}: pair rounds of one interleaved run")
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        pairs = [(getattr(a, key), getattr(b, key)) for a, b in zip(ours, reference, strict=True)]
        each = [a / b for a, b in pairs if a is not None and b]
        out[key] = statistics.median(each) if each else None
    return out


def paired_ratio(ours: Mapping[int, float], reference: Mapping[int, float]) -> float | None:
    """One figure by round number: the median over rounds of ours / reference in the same round. Rounds where
    the reference got nothing done are left out; None when no round is left."""
    each = [ours[r] / reference[r] for r in sorted(ours.keys() & reference.keys()) if reference[r] > 0]
    return statistics.median(each) if each else None


# -- paired gaps and their intervals ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PairedGap:
    """ours[i] - reference[i] over the rounds of one interleaved run: the median and quartiles. For a latency
    (TTFT) a bar in milliseconds asks this, not a ratio; the quartiles show how much of it the machine's noise is,
    and `ci_low`..`ci_high` (a 95% confidence interval of the median, `median_interval`) whether a bar is met or
    only missed by the noise (None where the rounds are too few for one, and in reports saved before it)."""

    median: float
    q1: float
    q3: float
    rounds: int
    ci_low: float | None = None
    ci_high: float | None = None

    def text(self) -> str:
        quartiles = f"{self.median:+.1f} [{self.q1:+.1f}, {self.q3:+.1f}]"
        if self.ci_low is None or self.ci_high is None:
            return quartiles
        return f"{quartiles} (95%: {self.ci_low:+.1f} to {self.ci_high:+.1f})"


def median_interval(ordered: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median of sorted `ordered`: the k-th smallest and k-th
    largest values, k the largest for which fewer than k of n values fall below the median with probability at
    most (1 - confidence) / 2 (the binomial(n, 1/2) count; no assumption on the noise's shape, which on these
    machines has long tails). None where n is too small for any such k (n < 6 at 95%)."""
    n = len(ordered)
    tail = (1.0 - confidence) / 2
    below, k = 0.0, 0  # P(count < k+1) = sum of C(n, i) / 2^n for i <= k
    while k < n // 2:
        below += math.comb(n, k) / 2.0**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def paired_gap(ours: Sequence[float], reference: Sequence[float]) -> PairedGap | None:
    """The pair-by-pair difference ours[i] - reference[i] (None without pairs)."""
    if len(ours) != len(reference):
        raise ValueError(f"{len(ours)} rounds against {len(reference)}: pair rounds of one interleaved run")
    each = sorted(a - b for a, b in zip(ours, reference, strict=True))
    if not each:
        return None
    interval = median_interval(each)
    return PairedGap(statistics.median(each), percentile(each, 25), percentile(each, 75), len(each),
                     *(interval or (None, None)))
