"""Is a sampler worth it: studies of the same space by several samplers and seeds, read back and set side by side
(issue 45). scripts/compare_search.py runs the studies; this reads them and makes the table and the plot.

Per sampler (an "arm": a sampler, and with the pruning A/B whether trials were measured short first) and per
checkpoint N: the pick the study would have made from its first N trials (trials Ray Tune ran, in order; a
proposal answered from an earlier trial of the same engine is no trial of its own), its figure (the one the pick
ranks on: tuning/report.py's `score`) as a ratio to the best pick of any study, as the median and the range over
seeds; the time from a study's start to its first trial within 95% of that overall best; pruned trials; the
study's wall time. Single measurements: a ratio near 1 is within the noise of one trial's figure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuning.report import NEAR_BEST, TrialRow, pick, pruned_rows, rows_from_study, score, time_to, finished_s
from tuning.results import Objective

NO_PRUNE = "no-prune"  # the arm suffix of a study measured without pruning (the A/B)


@dataclass(frozen=True)
class StudyRun:
    """One study as the comparison reads it."""

    arm: str
    seed: int
    wall_s: float
    rows: tuple[TrialRow, ...]  # its complete trials
    pruned: tuple[TrialRow, ...] = ()
    finished: dict[int, float] = field(default_factory=dict)  # trial number -> seconds from the study's start

    @property
    def run_order(self) -> list[int]:
        """Trial numbers Ray Tune ran (complete or pruned, not answered from another), in order."""
        return sorted(r.number for r in (*self.rows, *self.pruned) if r.answered_from is None)

    def best_within(self, trials: int, prefer: str) -> float | None:
        """The figure of the pick the study would have made from its first `trials` trials; None: no pick."""
        order = self.run_order
        if not order:
            return None
        last = order[min(trials, len(order)) - 1]
        winner = pick([r for r in self.rows if r.number <= last], prefer)
        return score(winner, prefer) if winner is not None else None


def from_study(study: Any, arm: str, seed: int, wall_s: float, objective: Objective) -> StudyRun:
    """A stored optuna.Study as a StudyRun."""
    return StudyRun(arm, seed, wall_s, tuple(rows_from_study(study, objective)),
                    tuple(pruned_rows(study, objective)), finished_s(study))


@dataclass(frozen=True)
class Spread:
    """Median and range over seeds; `of` counts the seeds that had a value."""

    median: float
    low: float
    high: float
    of: int

    @classmethod
    def over(cls, values: Sequence[float | None]) -> Spread | None:
        got = [v for v in values if v is not None]
        return cls(statistics.median(got), min(got), max(got), len(got)) if got else None

    def text(self, fmt: str = ".2f") -> str:
        return f"{self.median:{fmt}} ({self.low:{fmt}}-{self.high:{fmt}})"


@dataclass(frozen=True)
class ArmRow:
    """One arm at one checkpoint."""

    arm: str
    trials: int
    seeds: int
    best_ratio: Spread | None  # the pick's figure over the overall best
    time_to_near_best_s: Spread | None  # over the seeds that reached it (`of` of `seeds`)
    pruned: Spread | None  # pruned trials within the checkpoint
    wall_s: Spread | None  # the whole study's wall time (same at every checkpoint)


@dataclass(frozen=True)
class Comparison:
    prefer: str
    best: float  # the best pick's figure of any study
    best_study: str
    rows: tuple[ArmRow, ...]


def compare(studies: Sequence[StudyRun], checkpoints: Sequence[int], prefer: str) -> Comparison:
    """The table's rows: each arm (in the order first seen) at each checkpoint."""
    finals = [(s.best_within(len(s.run_order), prefer), s) for s in studies]
    best, where = max(((v, s) for v, s in finals if v is not None), key=lambda x: x[0], default=(0.0, None))
    arms = list(dict.fromkeys(s.arm for s in studies))
    rows = []
    for arm in arms:
        runs = [s for s in studies if s.arm == arm]
        for n in checkpoints:
            ratios = [(v / best if v is not None and best else None) for v in (s.best_within(n, prefer) for s in runs)]
            times = [_time_within(s, n, best, prefer) for s in runs]
            pruned = [float(sum(1 for r in s.pruned if r.number <= _last(s, n))) for s in runs]
            rows.append(ArmRow(arm, n, len(runs), Spread.over(ratios), Spread.over(times), Spread.over(pruned),
                               Spread.over([s.wall_s for s in runs])))
    label = f"{where.arm} seed {where.seed}" if where is not None else "-"
    return Comparison(prefer, best, label, tuple(rows))


def _last(study: StudyRun, trials: int) -> int:
    order = study.run_order
    return order[min(trials, len(order)) - 1] if order else -1


def _time_within(study: StudyRun, trials: int, best: float, prefer: str) -> float | None:
    """Seconds to the study's first trial within NEAR_BEST of the overall best, if among its first `trials`."""
    last = _last(study, trials)
    return time_to([r for r in study.rows if r.number <= last], study.finished, best, prefer)


def table(comparison: Comparison) -> str:
    """Markdown: one row per arm and checkpoint."""
    head = ("| sampler | trials | seeds | best pick / best of all: median (min-max) "
            f"| time to {NEAR_BEST:.0%} of best, s: median (min-max) [seeds reaching it] | pruned | study wall s |\n"
            "|---|---:|---:|---|---|---|---|")
    lines = [head]
    for r in comparison.rows:
        time = (f"{r.time_to_near_best_s.text('.0f')} [{r.time_to_near_best_s.of}/{r.seeds}]"
                if r.time_to_near_best_s else f"not reached [0/{r.seeds}]")
        lines.append(f"| {r.arm} | {r.trials} | {r.seeds} | {r.best_ratio.text() if r.best_ratio else '-'} | {time} "
                     f"| {r.pruned.text('.0f') if r.pruned else '-'} | {r.wall_s.text('.0f') if r.wall_s else '-'} |")
    return "\n".join(lines)


def prune_ab(comparison: Comparison) -> list[str]:
    """Per sampler run both ways: the wall time with pruning over without, and the picks at the last checkpoint."""
    last = max((r.trials for r in comparison.rows), default=0)
    at = {r.arm: r for r in comparison.rows if r.trials == last}
    out = []
    for arm, off in ((a, at.get(f"{a}/{NO_PRUNE}")) for a in at if not a.endswith(NO_PRUNE)):
        on = at[arm]
        if off is None or on.wall_s is None or off.wall_s is None:
            continue
        picks = (f"best pick / best of all {on.best_ratio.median:.2f} vs {off.best_ratio.median:.2f}"
                 if on.best_ratio and off.best_ratio else "no pick in one arm")
        out.append(f"- {arm}: study wall time with pruning {on.wall_s.median:.0f} s vs {off.wall_s.median:.0f} s "
                   f"without (median over seeds, {on.wall_s.median / off.wall_s.median:.2f}x); {picks} at {last} "
                   "trials")
    return out


def plot(comparison: Comparison, path: Path) -> None:
    """Best pick / best of all against the trial count, one line per arm (median), its seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(r.arm for r in comparison.rows):
        rows = [r for r in comparison.rows if r.arm == arm and r.best_ratio is not None]
        xs = [r.trials for r in rows]
        ax.plot(xs, [r.best_ratio.median for r in rows if r.best_ratio], "-o", label=arm)
        ax.fill_between(xs, [r.best_ratio.low for r in rows if r.best_ratio],
                        [r.best_ratio.high for r in rows if r.best_ratio], alpha=0.15)
    ax.axhline(NEAR_BEST, color="gray", linestyle="--", linewidth=1, label=f"{NEAR_BEST:.0%} of the best")
    ax.set_xlabel("trials")
    ax.set_ylabel(f"pick's figure / best of all studies ({comparison.prefer} pick)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
