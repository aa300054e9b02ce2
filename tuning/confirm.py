"""The confirmation round: the search's best few configs, the baseline and (in place) the config served now,
measured again, interleaved, and picked on paired ratios.

Repeats of one config spread ~3% on the H200, and a search's winner can lead its runner-up by less than
that: a pick made on one measurement each may be noise. So after the search the candidates are measured
`rounds` more times in rotating order (A B C, B C A, C A B, ...: drift on the machine hits every candidate
alike; the order is measure/design.py's `rotated`, as in the benchmarks), each round's figure is divided by the
reference's figure of the same round (the article baseline when it ran, else the search's own pick), and the
pick is made on the medians of those paired ratios. When the pick's range of ratios overlaps the runner-up's,
the report says the pick is within noise. In place, the config the replicas serve is a candidate too (trial
number -1 when no trial ran it): a pick must beat what is served, and a tie within noise keeps it (a switch
would buy nothing measurable).

The whole round is here: which of the study's trials are candidates, where they are measured (on a serving
replica in place, else on one engine of the tuner's own in a Ray actor), each round's ratios (kept per round:
the report shows their range, and the noise test reads it), the verdict, and the outcome the command reports
(`Confirmation`).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from measure.design import rotated
from measure.workload import Workload
from serving.engine.config import EngineConfig
from serving.engine.memory import predict
from tuning.plan import StudyPlan, TrialSettings
from tuning.report import TrialRow, config_label, pareto_front
from tuning.results import Objective, SpeedFigures
from tuning.serving_app import ServingApp
from tuning.space import to_engine_config
from tuning.workloads import TrafficPlan

PICK_WITHIN = 0.05  # balanced: best aggregate among candidates within 5% of the best single stream


@dataclass(frozen=True)
class Candidate:
    """A config to confirm: the study trial it came from (-1: none, the served config), whether it is the
    article baseline, and whether the replicas serve it now."""

    number: int
    label: str
    config: EngineConfig
    is_baseline: bool = False
    memory: int = 0  # bytes the trial measured (else predicted): what a tie within noise is decided on
    is_served: bool = False

    @property
    def name(self) -> str:
        """How tables and lines name it: its trial, else "the served config"."""
        return "the served config" if self.number < 0 else f"trial {self.number}"


@dataclass(frozen=True)
class Figures:
    """One measurement of a candidate: single-stream tok/s and the second objective's tok/s."""

    single: float
    second: float


@dataclass
class Confirmed:
    """A candidate's figures per round, and their ratios to the reference's figures of the same round."""

    candidate: Candidate
    single: list[float] = field(default_factory=list)
    second: list[float] = field(default_factory=list)
    single_ratio: list[float] = field(default_factory=list)
    second_ratio: list[float] = field(default_factory=list)

    def median(self, metric: str) -> float:
        return statistics.median(getattr(self, f"{metric}_ratio"))

    def spread(self, metric: str) -> tuple[float, float]:
        values = getattr(self, f"{metric}_ratio")
        return min(values), max(values)


def rotation(round_: int, n: int) -> list[int]:
    """The order candidates are measured in, in round `round_`: each round starts one later (the shared design's
    rotation: every candidate goes first in turn, and none always right after a switch)."""
    return rotated(range(n), round_)


def confirm(candidates: list[Candidate], reference: int, rounds: int,
            measure: Callable[[EngineConfig], Figures], progress: Callable[[str], None] = lambda _: None
            ) -> list[Confirmed]:
    """Measure every candidate `rounds` times, interleaved; ratios against `candidates[reference]`."""
    results = [Confirmed(c) for c in candidates]
    for r in range(rounds):
        figures: dict[int, Figures] = {}
        for i in rotation(r, len(candidates)):
            figures[i] = measure(candidates[i].config)
            progress(f"confirmation round {r + 1}/{rounds}: {candidates[i].name}: "
                     f"{figures[i].single:.1f} tok/s single, {figures[i].second:.3g} second objective")
        ref = figures[reference]
        for i, result in enumerate(results):
            result.single.append(figures[i].single)
            result.second.append(figures[i].second)
            result.single_ratio.append(figures[i].single / ref.single if ref.single else 0.0)
            result.second_ratio.append(figures[i].second / ref.second if ref.second else 0.0)
    return results


@dataclass(frozen=True)
class Verdict:
    """The confirmed pick, the candidate it beat closest, and whether that lead is inside the noise."""

    pick: Confirmed
    runner_up: Confirmed | None
    metric: str  # the ratio the pick was decided on: "single" or "second"
    within_noise: bool
    by_memory: bool = False  # the best on the metric was within noise of a cheaper config, which was picked
    kept_served: bool = False  # the served config was within noise of the best: it stays

    @property
    def keeps_served(self) -> bool:
        """Nothing to switch to: the served config is the pick."""
        return self.pick.candidate.is_served


def decide(confirmed: list[Confirmed], prefer: str) -> Verdict:
    """The pick on median paired ratios (same rule as the search's pick), the baseline among the candidates:
    where it beats every config the search found, it is the pick (a pick worse than what ran before is no
    pick). Candidates whose range of ratios reaches the best one's are a tie within noise: of
    those, the one using the least memory is picked, then the faster single stream (np4 and np8 reaching the
    same aggregate should not cost 6 GiB more because one run drew the higher figure); the served config, in
    such a tie, is picked before them all (it costs no switch)."""
    pool = confirmed
    if prefer == "single":
        metric, eligible = "single", pool
    else:
        metric, eligible = "second", pool
        if prefer != "aggregate":  # balanced: among those within 5% of the best single stream
            best_single = max(c.median("single") for c in pool)
            eligible = [c for c in pool if c.median("single") >= (1 - PICK_WITHIN) * best_single]
    other = "second" if metric == "single" else "single"
    ranked = sorted(eligible, key=lambda c: (c.median(metric), c.median(other)))
    best = ranked[-1]
    ties = [c for c in ranked if c.spread(metric)[1] >= best.spread(metric)[0]]
    pick = min(ties, key=lambda c: (not c.candidate.is_served, c.candidate.memory, -c.median("single"),
                                    -ranked.index(c)))
    order = [c for c in pool if c not in eligible] + ranked
    runner_up = next((c for c in reversed(order) if c is not pick), None)
    overlap = runner_up is not None and _overlap(pick, runner_up, metric)
    kept = pick is not best and pick.candidate.is_served
    return Verdict(pick, runner_up, metric, overlap, by_memory=pick is not best and not kept, kept_served=kept)


def _overlap(a: Confirmed, b: Confirmed, metric: str) -> bool:
    (a_low, a_high), (b_low, b_high) = a.spread(metric), b.spread(metric)
    return a_high >= b_low and b_high >= a_low


def markdown(confirmed: list[Confirmed], verdict: Verdict, reference: Candidate, rounds: int,
             second_label: str = "4-way tok/s") -> str:
    """The report's confirmation section."""
    lines = ["## Confirmation round", "",
             f"{len(confirmed)} candidates measured {rounds} more time(s) each, interleaved in rotating order; "
             f"ratios are paired with trial {reference.number}"
             f"{' (the article baseline)' if reference.is_baseline else ' (the search pick)'} of the same round: "
             "median [min-max].", "",
             f"| trial | config | single tok/s (rounds) | single ratio | {second_label} (rounds) | its ratio |",
             "|---|---|---|---|---|---|"]
    for c in confirmed:
        mark = " (baseline)" if c.candidate.is_baseline else ""
        mark += " (served)" if c.candidate.is_served else ""
        mark += " **(pick)**" if c is verdict.pick else ""
        number = "-" if c.candidate.number < 0 else c.candidate.number
        lines.append(
            f"| {number}{mark} | {c.candidate.label} | {', '.join(f'{v:.1f}' for v in c.single)} "
            f"| {_ratio(c, 'single')} | {', '.join(f'{v:.3g}' for v in c.second)} | {_ratio(c, 'second')} |")
    lines.append("")
    if verdict.runner_up is None:
        lines.append(f"Pick: {verdict.pick.candidate.name} (the only candidate).")
    else:
        noise = ("**within noise**: its range of ratios overlaps the runner-up's, so the two are not told apart "
                 "by these rounds" if verdict.within_noise else "ahead of the runner-up in every round's range")
        if verdict.kept_served:
            noise += "; within noise of the best, the served config stays (a switch would buy nothing measurable)"
        if verdict.by_memory:
            noise += (f"; picked for its memory ({verdict.pick.candidate.memory / 2**30:.2f} GiB against "
                      f"{verdict.runner_up.candidate.memory / 2**30:.2f} GiB): within noise, the cheaper config")
        metric = "single-stream" if verdict.metric == "single" else second_label
        lines.append(f"Pick: {verdict.pick.candidate.name} on the {metric} ratio "
                     f"({verdict.pick.median(verdict.metric):.3f} vs {verdict.runner_up.median(verdict.metric):.3f} "
                     f"for {verdict.runner_up.candidate.name}): {noise}.")
    return "\n".join(lines) + "\n"


def _ratio(c: Confirmed, metric: str) -> str:
    low, high = c.spread(metric)
    return f"{c.median(metric):.3f} [{low:.3f}-{high:.3f}]"


def confirmation_candidates(rows: list[TrialRow], winner: TrialRow, base: EngineConfig, top: int,
                            prefer: str) -> list[TrialRow]:
    """The pick and the next best of the Pareto front, `top` distinct engine configs in all (a re-run study
    can hold one config twice), then the article baseline when it ran and is not among them."""
    ranked = sorted(pareto_front(rows), key=lambda r: (r.second, r.single), reverse=True)
    if prefer == "single":
        ranked.sort(key=lambda r: (r.single, r.second), reverse=True)
    chosen: list[TrialRow] = []
    for row in [winner, *ranked]:
        if len(chosen) < top and all(to_engine_config(row.params, base) != to_engine_config(c.params, base)
                                     for c in chosen):
            chosen.append(row)
    baseline = next((r for r in rows if r.is_baseline and r.single > 0), None)
    if baseline is not None and all(to_engine_config(baseline.params, base) != to_engine_config(c.params, base)
                                    for c in chosen):
        chosen.append(baseline)
    return chosen


@dataclass(frozen=True)
class Confirmation:
    """The confirmation round's outcome: the pick's study row (None: the served config stays, and no trial ran
    it), its confirmed figures, and the report section."""

    row: TrialRow | None
    verdict: Verdict
    reference: Candidate  # what the ratios are paired against
    rounds: int
    section: str

    def figures(self) -> tuple[float, float]:
        """The pick's median single-stream and second-objective tok/s over the confirmation rounds."""
        pick = self.verdict.pick
        return statistics.median(pick.single), statistics.median(pick.second)

    def summary(self, objective: Objective) -> str:
        """The confirmed, paired ratios, as the pick line, tuned.yaml's header and the report's winner say."""
        pick = self.verdict.pick
        against = ("the article baseline" if self.reference.is_baseline else
                   f"trial {self.reference.number}, the search's pick (the baseline did not run)")
        if self.verdict.keeps_served:
            best = self.verdict.runner_up  # the best of the others
            found = (f"; the best other, {best.candidate.name}, measured {best.median(self.verdict.metric):.3f}x "
                     f"against {pick.median(self.verdict.metric):.3f}x for the served config"
                     if best is not None else "")
            return (f"the served config stays: no candidate beat it over {self.rounds} interleaved confirmation "
                    f"rounds ({'single stream' if self.verdict.metric == 'single' else objective.label} ratios to "
                    f"{against}{found})")
        if pick.candidate == self.reference:
            return f"confirmed over {self.rounds} interleaved rounds (no other candidate beat it)"
        noise = " (within noise of the runner-up)" if self.verdict.within_noise else ""
        return (f"single stream {pick.median('single'):.3f}x, {objective.label.removesuffix(' tok/s')} "
                f"{pick.median('second'):.3f}x {against}: medians of ratios paired in {self.rounds} interleaved "
                f"confirmation rounds{noise}")


def confirm_pick(plan: StudyPlan, rows: list[TrialRow], winner: TrialRow) -> Confirmation | None:
    """The search's best few, the baseline and (in place) the served config measured again, interleaved: the
    pick on paired ratios. None when there is nothing to compare the pick with."""
    opts, base = plan.options, plan.base
    chosen = confirmation_candidates(rows, winner, base, opts.confirm_top, opts.prefer)
    candidates = [Candidate(r.number, r.label(), to_engine_config(r.params, base), r.is_baseline,
                            memory=r.result.mem_measured or r.result.mem_predicted) for r in chosen]
    if plan.app is not None:
        candidates = with_served(candidates, plan.app.serving, plan.settings)
    if len(candidates) < 2:
        return None
    reference = next((i for i, c in enumerate(candidates) if c.is_baseline), 0)  # else the search's pick
    print(f"confirmation: {len(candidates)} candidates x {opts.confirm_rounds} rounds, interleaved")
    with confirmation_measure(app=plan.app, workload=plan.settings.workload, on_gpu=plan.on_gpu,
                              study=plan.study_name, total_trials=opts.trials + opts.confirm_rounds * len(candidates),
                              objective=opts.objective, traffic=plan.traffic) as measure:
        confirmed = confirm(candidates, reference, opts.confirm_rounds, measure, progress=print)
    verdict = decide(confirmed, opts.prefer)
    noise = " (within noise)" if verdict.within_noise else ""
    print(f"confirmed pick: {verdict.pick.candidate.name}{noise}")
    picked = next((r for r in rows if r.number == verdict.pick.candidate.number), None)
    section = markdown(confirmed, verdict, candidates[reference], opts.confirm_rounds, opts.objective.label)
    return Confirmation(picked, verdict, candidates[reference], opts.confirm_rounds, section)


def with_served(candidates: list[Candidate], serving: EngineConfig, settings: TrialSettings) -> list[Candidate]:
    """In place, the config the replicas serve now joins the candidates (a pick must beat it): marked on the
    candidate that is it, else added (trial number -1, its memory predicted from the GGUF header)."""
    if any(c.config == serving for c in candidates):
        return [replace(c, is_served=c.config == serving) for c in candidates]
    memory = predict(settings.shape, serving, settings.on_gpu).total
    return [*candidates, Candidate(-1, config_label(serving), serving, memory=memory, is_served=True)]


@contextlib.contextmanager
def confirmation_measure(*, app: ServingApp | None, workload: Workload, on_gpu: bool, study: str,
                         total_trials: int, objective: Objective, traffic: TrafficPlan | None = None
                         ) -> Iterator[Callable[[EngineConfig], Figures]]:
    """`config -> Figures` for the confirmation round: on a serving replica in place, else on one engine of
    our own in a Ray actor (one more weight load); on a traffic workload each measurement is its replay.
    The engine's modules (and Ray) are imported here, where a round runs: the tuner's `--help` loads none."""
    from tuning.objective import SpeedMeasure

    requests = itertools.count(10**6, 1000)  # request numbers apart from the trials'

    def figures(result: SpeedFigures) -> Figures:
        return Figures(result.single_tok_s, result.second(objective))

    if app is not None:
        from tuning.inplace import replica_speed

        yield lambda config: figures(replica_speed(
            app.name, study, total_trials, config, SpeedMeasure(workload, next(requests), traffic)))
        return
    import ray

    from tuning.trial import ConfirmEngine

    resources = {"num_gpus": 1, "num_cpus": 1} if on_gpu else {"num_cpus": 1}
    actor: Any = ray.remote(ConfirmEngine).options(**resources).remote()
    try:
        yield lambda config: figures(ray.get(actor.measure.remote(config, SpeedMeasure(workload, next(requests),
                                                                                     traffic))))
    finally:
        ray.get(actor.close.remote())
        ray.kill(actor)
