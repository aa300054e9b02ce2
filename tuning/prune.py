"""Short first: a trial is measured short (fewer tokens, one round), and the full measurement is skipped when
that short figure is clearly behind the best short figure of the study so far.

A trial is pruned when it is behind the bar on every objective the pick reads (`--prefer`: single reads the single
stream, aggregate the second objective, balanced both): a config clearly behind on all of them cannot become the
pick, while one behind on a single objective still can (the balanced pick of a study whose slots rarely pay can be
its best single stream). The bar is `--prune-below` (0.8) times the best short figure per objective, each over the
short figures of the trials measured so far (possibly two different trials): short is compared with short, as a
short run of few tokens reads lower than a full one. The baseline (the article's config) and the confirmation
round are never pruned, and a pruned trial, having no full figures, is never the pick (the report reads only
complete trials).

Pure: the rule and the bar's transport to the trial (a plain dict in the trial's config, under BAR_KEY).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

BAR_KEY = "short_bar"  # the trial config's key the searcher passes the bar under (not an engine setting)
DEFAULT_PRUNE_BELOW = 0.8
SHORT_GEN_FRACTION = 0.25  # a short measurement generates this share of --gen-tokens, in one round
SHORT_MIN_TOKENS = 8


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


def bar(shorts: Sequence[Short], prefer: str, fraction: float) -> Bar | None:
    """The bar from the short figures measured so far; None when pruning is off or nothing was measured."""
    if fraction <= 0 or not shorts:
        return None
    single, second = reads(prefer)
    return Bar(single_tok_s=fraction * max(s.single_tok_s for s in shorts) if single else None,
               second=fraction * max(s.second for s in shorts) if second else None)


def behind(short: Short, line: Bar) -> bool:
    """Below the bar on every objective it holds (and it holds at least one)."""
    checks = [(short.single_tok_s, line.single_tok_s), (short.second, line.second)]
    judged = [value < limit for value, limit in checks if limit is not None]
    return bool(judged) and all(judged)


def short_tokens(gen_tokens: int) -> int:
    """Tokens a short measurement generates per request."""
    return min(gen_tokens, max(SHORT_MIN_TOKENS, round(gen_tokens * SHORT_GEN_FRACTION)))
