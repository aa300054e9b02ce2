"""Short first: a trial is measured short (fewer tokens, one round), and the full measurement is skipped when
that short figure is clearly behind the leader's short figure.

A trial is pruned when it is behind the bar on every objective the pick reads (`--prefer`: single reads the single
stream, aggregate the second objective, balanced both): a config clearly behind on all of them cannot become the
pick, while one behind on a single objective still can (the balanced pick of a study whose slots rarely pay can be
its best single stream). The bar is `--prune-below` (0.8) times the leader's short figure per objective: the
leader is the feasible trial with the best FULL figure on that objective (possibly two different trials), and
short is compared with short, as a short run of few tokens reads lower than a full one. The best short figure
alone made a bad bar: one short run reading high on a noisy machine set it above what later trials' short runs
reach, and two CPU studies pruned every trial from their seventh on (docs/log/2026-12-07-cpu-sampler-compare.md);
a leader is chosen by a full measurement, so one lucky short run no longer sets the bar. For the same reason,
after MAX_PRUNED_IN_A_ROW prunes in a row the next trial is measured in full. The baseline (the article's config)
and the confirmation round are never pruned, and a pruned trial, having no full figures, is never the pick (the
report reads only complete trials).

Pure: the rule and the bar's transport to the trial (a plain dict in the trial's config, under BAR_KEY).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

BAR_KEY = "short_bar"  # the trial config's key the searcher passes the bar under (not an engine setting)
# Off unless asked (--prune-below 0.8): on the 2-core CPU it has not paid. With the best short figure as the bar,
# the studies that pruned most made the worst picks; with the leader's, the studies took 1.14x as long (the short
# runs cost more than the few prunes saved) for picks 0.98x as good, paired by seed
# (docs/log/2026-12-07-cpu-prune-ab.md). Whether it pays on a GPU is not measured yet.
DEFAULT_PRUNE_BELOW = 0.0
SHORT_GEN_FRACTION = 0.25  # a short measurement generates this share of --gen-tokens, in one round
SHORT_MIN_TOKENS = 8
MAX_PRUNED_IN_A_ROW = 3  # then one trial in full: the bar may be what is wrong, not the trials


@dataclass(frozen=True)
class Short:
    """A trial's short measurement: the single stream and the second objective."""

    single_tok_s: float
    second: float


@dataclass(frozen=True)
class Bar:
    """What a trial's short figures must reach: None where the pick does not read that objective."""

    single_tok_s: float | None
    second: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Bar:
        return cls(single_tok_s=data.get("single_tok_s"), second=data.get("second"))


def reads(prefer: str) -> tuple[bool, bool]:
    """Which objectives the pick reads, (single stream, second objective), for a --prefer value."""
    return {"single": (True, False), "aggregate": (False, True)}.get(prefer, (True, True))


@dataclass(frozen=True)
class Measured:
    """A trial of the study as the bar reads it: its short figures, and its full ones unless it was pruned."""

    short: Short
    full: Short | None
    feasible: bool


def bar(trials: Sequence[Measured], prefer: str, fraction: float) -> Bar | None:
    """The bar from the trials measured so far, in study order; None (measure in full) when pruning is off, no
    feasible trial was measured in full yet, or the last MAX_PRUNED_IN_A_ROW trials were all pruned."""
    if fraction <= 0 or pruned_in_a_row(trials) >= MAX_PRUNED_IN_A_ROW:
        return None
    leaders = [t for t in trials if t.full is not None and t.feasible]
    if not leaders:
        return None
    single, second = reads(prefer)
    by_single = max(leaders, key=lambda t: t.full.single_tok_s if t.full else 0.0)
    by_second = max(leaders, key=lambda t: t.full.second if t.full else 0.0)
    return Bar(single_tok_s=fraction * by_single.short.single_tok_s if single else None,
               second=fraction * by_second.short.second if second else None)


def pruned_in_a_row(trials: Sequence[Measured]) -> int:
    """How many of the last trials were pruned, counting back to the last one measured in full."""
    count = 0
    for trial in reversed(trials):
        if trial.full is not None:
            break
        count += 1
    return count


def behind(short: Short, line: Bar) -> bool:
    """Below the bar on every objective it holds (and it holds at least one)."""
    checks = [(short.single_tok_s, line.single_tok_s), (short.second, line.second)]
    judged = [value < limit for value, limit in checks if limit is not None]
    return bool(judged) and all(judged)


def short_tokens(gen_tokens: int) -> int:
    """Tokens a short measurement generates per request."""
    return min(gen_tokens, max(SHORT_MIN_TOKENS, round(gen_tokens * SHORT_GEN_FRACTION)))
