"""From the Optuna study to a decision: the trial table, the Pareto front, the pick, which settings mattered
(tuning/importance.py), a markdown report, plots.

Everything is read back from the study's storage, so a resumed study reports all of its trials, and the
report can be regenerated at any time from the SQLite file alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from serving.engine.config import EngineConfig
from tuning import importance
from tuning.results import Objective, TrialResult

__all__ = ["Objective", "TrialRow", "importance_section", "markdown", "pareto_front", "pick", "rows_from_study",
           "trial_table"]

PICK_WITHIN = 0.05  # the balanced pick: best aggregate among trials within 5% of the best single stream
NEAR_BEST = 0.95  # "a good pick": within 5% of the best's figure (time to it: search_section)
GOODPUT_TIE = 0.02  # goodputs this close tie: at a fixed arrival rate every config that keeps up serves the same
HEADROOM_TIE = 0.1  # SLO headrooms this close tie (a tenth of a bound): a p95 of a few dozen requests is no finer
IMPORTANCE_PLOT = "importance.png"


@dataclass
class TrialRow:
    """One finished trial of the study as the report shows it."""

    number: int
    result: TrialResult
    objective: Objective = Objective.aggregate

    @property
    def params(self) -> dict[str, Any]:
        return self.result.params

    @property
    def is_baseline(self) -> bool:
        return self.result.is_baseline

    @property
    def single(self) -> float:
        return self.result.single_tok_s

    @property
    def second(self) -> float:
        """The second objective's figure (4-way aggregate, or capacity)."""
        return self.result.second(self.objective)

    @property
    def feasible(self) -> bool:
        return self.result.feasible

    @property
    def answered_from(self) -> int | None:
        """The trial whose measurement answered this proposal (the same engine config), if any."""
        return self.result.answered_from

    def label(self) -> str:
        """The trial's config in short, as config_label writes an engine config."""
        p = self.params
        ubatch = min(p.get("n_ubatch") or 0, p.get("n_batch") or 0)  # as the engine ran it (clamped)
        label = (f"np{p.get('n_parallel')} b{p.get('n_batch')}/{ubatch} c{p.get('ctx_per_slot')}/slot "
                 f"{p.get('type_k')}/{p.get('type_v')} fa-{p.get('flash_attn')}")
        label += " kvu" if p.get("kv_unified") else ""
        label += f" ngl{p['n_gpu_layers']}" if "n_gpu_layers" in p else ""
        label += f" cpu-moe{p['n_cpu_moe']}" if "n_cpu_moe" in p else ""
        label += f"@{p['cpu_moe_start']}" if p.get("cpu_moe_start") else ""
        label += f" t{p['n_threads']}" if "n_threads" in p else ""
        return label + (f" spec-{p['spec_mode']}" if p.get("spec_mode", "off") != "off" else "")


def config_label(config: EngineConfig) -> str:
    """An engine config in short, as a trial's label writes it: `np4 b2048/512 c2048/slot f16/f16 fa-auto`
    (` kvu`: one K/V buffer for all slots)."""
    label = (f"np{config.n_parallel} b{config.n_batch}/{min(config.n_ubatch, config.n_batch)} "
             f"c{config.n_ctx // config.n_parallel}/slot {config.type_k.value}/{config.type_v.value} "
             f"fa-{config.flash_attn.value}")
    label += " kvu" if config.kv_unified else ""
    return label + (f" spec-{config.spec_mode.value}" if config.spec_mode.value != "off" else "")


def rows_from_study(study: Any, objective: Objective = Objective.aggregate) -> list[TrialRow]:
    """Finished trials of an optuna.Study, with the records the trials stored as user attributes."""
    rows = []
    for trial in study.trials:
        if trial.state.name != "COMPLETE":
            continue
        result = TrialResult.from_attrs(dict(trial.user_attrs))
        if not result.params:
            result = replace(result, params=dict(trial.params))
        rows.append(TrialRow(trial.number, result, objective))
    return rows


def pruned_rows(study: Any, objective: Objective = Objective.aggregate) -> list[TrialRow]:
    """The study's pruned trials (tuning/prune.py): measured short only, never on the front nor the pick."""
    return [TrialRow(t.number, TrialResult.from_attrs(dict(t.user_attrs)), objective)
            for t in study.trials if t.state.name == "PRUNED"]


def finished_s(study: Any) -> dict[int, float]:
    """Seconds from the study's first trial start to each finished trial's end (Optuna's datetime_start and
    datetime_complete), by trial number."""
    started = [t.datetime_start for t in study.trials if t.datetime_start is not None]
    if not started:
        return {}
    t0 = min(started)
    return {t.number: (t.datetime_complete - t0).total_seconds() for t in study.trials
            if t.datetime_complete is not None}


def score(row: TrialRow, prefer: str) -> float:
    """The figure a pick by `prefer` ranks on: the single stream for single, else the second objective (the
    balanced pick's best aggregate among the near-best single streams)."""
    return row.single if prefer == "single" else row.second


def time_to(rows: Sequence[TrialRow], finished: dict[int, float], target: float, prefer: str,
            within: float = NEAR_BEST) -> float | None:
    """Seconds from the study's start until the first feasible measured trial within `within` of `target` (on
    the figure `prefer` ranks on) had finished; None when none came that close."""
    times = [finished[r.number] for r in rows if r.feasible and r.answered_from is None and r.number in finished
             and score(r, prefer) >= within * target]
    return min(times, default=None)


@dataclass(frozen=True)
class PruneSaving:
    """What measuring short first cost and saved: every short run is paid, each pruned trial skips a full
    measurement (estimated at the median full measurement of the study)."""

    pruned: int
    shorts: int
    short_s: float
    full_median_s: float | None

    @property
    def saved_s(self) -> float | None:
        """Full measurements skipped less every short run paid; None without a full measurement to size one."""
        if self.full_median_s is None:
            return None
        return self.pruned * self.full_median_s - self.short_s


def prune_saving(rows: Sequence[TrialRow], pruned: Sequence[TrialRow]) -> PruneSaving:
    both = [*rows, *pruned]
    shorts = [r.result.short_s for r in both if r.result.short_s is not None and r.answered_from is None]
    fulls = sorted(r.result.measure_s for r in rows if r.result.measure_s is not None and r.answered_from is None)
    median = fulls[len(fulls) // 2] if fulls else None
    return PruneSaving(len([r for r in pruned if r.answered_from is None]), len(shorts), sum(shorts), median)


def search_section(rows: list[TrialRow], pruned: list[TrialRow], finished: dict[int, float],
                   winner: TrialRow | None, prefer: str) -> list[str]:
    """How fast the search reached its pick: the time to a trial within NEAR_BEST of the pick's figure, and what
    measuring short first saved (when it was on)."""
    out = ["## How fast the search got there", ""]
    if winner is not None:
        found = time_to(rows, finished, score(winner, prefer), prefer)
        figure = "single-stream tok/s" if prefer == "single" else winner.objective.label
        out.append(f"- time to {NEAR_BEST:.0%} of the pick's {figure} ({score(winner, prefer):.1f}): "
                   + (f"{found:.0f} s from the first trial's start" if found is not None else "not reached"))
    saving = prune_saving(rows, pruned)
    if saving.shorts:
        saved = saving.saved_s
        full = f"{saving.full_median_s:.1f} s" if saving.full_median_s is not None else "none measured"
        out.append(f"- measured short first: {saving.pruned} of {saving.shorts} trials pruned "
                   f"({', '.join(f'#{r.number}' for r in pruned) or 'none'}); short runs {saving.short_s:.0f} s in "
                   f"all, a full measurement {full} (median): net saving "
                   + (f"{saved:.0f} s" if saved is not None else "unknown"))
    return [*out, ""]


def weight_loads(rows: list[TrialRow]) -> tuple[int, float]:
    """Weight loads and seconds spent loading, over all trial actors (each actor's running totals; a trial
    rejected before loading reports none, so the largest figure per actor counts)."""
    per_actor: dict[str, tuple[int, float]] = {}
    for r in rows:
        actor = r.result.actor
        if actor:
            loads, secs = per_actor.get(actor, (0, 0.0))
            per_actor[actor] = (max(loads, r.result.weight_loads or 0), max(secs, r.result.weight_load_s or 0.0))
    return sum(v[0] for v in per_actor.values()), sum(v[1] for v in per_actor.values())


def pareto_front(rows: list[TrialRow]) -> list[TrialRow]:
    """Feasible trials no other feasible trial beats on both objectives (single stream, and the second);
    a proposal answered from another trial's measurement is that trial, not a second point."""
    feasible = [r for r in rows if r.feasible and r.answered_from is None]
    front = [r for r in feasible
             if not any(o.single >= r.single and o.second >= r.second
                        and (o.single > r.single or o.second > r.second) for o in feasible)]
    return sorted(front, key=lambda r: r.single, reverse=True)


def pick(rows: list[TrialRow], prefer: str) -> TrialRow | None:
    """The winner among feasible trials. balanced (default): best second objective (4-way aggregate, or
    capacity) within 5% of the best single stream; single: best single stream; aggregate: best second
    objective. Ties go to the other objective. On goodput, every trial within GOODPUT_TIE of the best ties (at
    one arrival rate every config that keeps up serves the same requests/s); of those, the one furthest under the
    SLO's bounds wins, since it holds the most traffic beyond the rate measured (the H100 headline: np2 picked
    over np4 by 50 MB, at TTFT p95 1.43 s against 0.58 s), and within HEADROOM_TIE of that, the one using the
    least memory, then the faster median stream."""
    front = pareto_front(rows)
    if not front:
        return None
    if prefer == "single":
        return max(front, key=lambda r: (r.single, r.second))
    if prefer == "aggregate" and front[0].objective is Objective.goodput:  # a tie is no domination: all feasible
        feasible = [r for r in rows if r.feasible and r.answered_from is None]
        best = max(r.second for r in feasible)
        ties = [r for r in feasible if r.second >= (1 - GOODPUT_TIE) * best]
        roomiest = min(r.result.constraint_slo for r in ties)  # <= 0 when met: the headroom
        ties = [r for r in ties if r.result.constraint_slo <= roomiest + HEADROOM_TIE]
        return min(ties, key=lambda r: (r.result.mem_measured or r.result.mem_predicted, -r.single))
    if prefer == "aggregate":
        return max(front, key=lambda r: (r.second, r.single))
    best_single = max(r.single for r in front)
    near = [r for r in front if r.single >= (1 - PICK_WITHIN) * best_single]
    return max(near, key=lambda r: (r.second, r.single))


def _gib(value: Any) -> str:
    return f"{value / 2**30:.2f}" if isinstance(value, (int, float)) and value < 1e17 else "-"


def _num(value: Any, fmt: str = ".1f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def _flags(row: TrialRow) -> str:
    r = row.result
    flags = [text for text in (r.rejected, r.error) if text]
    if row.answered_from is not None:
        flags.append(f"answered from #{row.answered_from}")
    if r.throttled:
        flags.append(f"throttled ({r.throttle_reasons})")
    if r.shared:
        flags.append("GPU shared")
    if row.is_baseline:
        flags.append("baseline")
    if r.pruned:
        flags.append("pruned")
    return "; ".join(flags)


def traffic_table(rows: list[TrialRow]) -> str:
    """The trials of a traffic workload: goodput, the SLO's outcome, the tail latencies with their spread."""
    head = ("| # | config | goodput req/s | goodput tok/s | out tok/s | SLO | TTFT p95 | ITL p95 | E2E p95 | failed "
            "| NLL delta | mem meas GiB | feasible | notes |\n" + "|---" * 14 + "|")
    lines = [head]
    for r in rows:
        t = r.result.traffic
        if t is None:
            lines.append(f"| {r.number} | {r.label()} |" + " - |" * 9 + f" {_gib(r.result.mem_measured)} "
                         f"| {'yes' if r.feasible else 'no'} | {_flags(r)} |")
            continue
        lines.append(
            f"| {r.number} | {r.label()} | {t.goodput_rps:.2f} | {t.goodput_tok_s:.1f} | {t.output_tok_s:.1f} "
            f"| {t.slo_outcome} | {t.percentile_text('ttft_p95')} | {t.percentile_text('itl_p95')} "
            f"| {t.percentile_text('e2e_p95')} | {t.failed}/{t.requests} | {_num(r.result.nll_delta, '+.4f')} "
            f"| {_gib(r.result.mem_measured)} | {'yes' if r.feasible else 'no'} | {_flags(r)} |")
    return "\n".join(lines)


def trial_table(rows: list[TrialRow], traffic: bool | None = None) -> str:
    """The table of `rows`; a traffic study's (`traffic`, else whether a row replayed a workload) has goodput,
    the SLO and latency columns."""
    if traffic if traffic is not None else any(r.result.workload for r in rows):
        return traffic_table(rows)
    capacity = any(r.result.capacity_tok_s is not None for r in rows)
    copy = any(r.result.single_copy_tok_s is not None for r in rows)
    host = any("n_cpu_moe" in r.params or "n_gpu_layers" in r.params for r in rows)  # part of the model on the CPU
    extra_head = (" capacity tok/s (streams) |" if capacity else "") + (" copy-set single tok/s |" if copy else "")
    extra_rule = "---|" * (capacity + copy + host)
    head = (f"| # | config | single tok/s | 4-way tok/s |{extra_head} TTFT ms | prefill tok/s | NLL delta "
            f"| mem pred GiB | mem meas GiB |{' host pred GiB |' if host else ''} feasible | notes |\n"
            f"|---|---|---|---|{extra_rule}---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        a = r.result
        streams = a.capacity_streams if a.capacity_streams is not None else "-"
        cap = f" {_num(a.capacity_tok_s)} ({streams}) |" if capacity else ""
        cap += f" {_num(a.single_copy_tok_s)} |" if copy else ""
        lines.append(
            f"| {r.number} | {r.label()} | {_num(r.single)} | {_num(a.aggregate_tok_s)} |{cap} "
            f"{_num(a.ttft_ms)} | {_num(a.prefill_tok_s, '.0f')} | {_num(a.nll_delta, '+.4f')} "
            f"| {_gib(a.mem_predicted)} | {_gib(a.mem_measured)} |"
            f"{f' {_gib(a.mem_host_predicted)} |' if host else ''} {'yes' if r.feasible else 'no'} "
            f"| {_flags(r)} |")
    return "\n".join(lines)


def plot(rows: list[TrialRow], winner: TrialRow | None, path: Path) -> None:
    """Single stream vs the second objective: feasible, infeasible, Pareto front, baseline, winner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    ran = [r for r in rows if r.single > 0]
    styles = ((False, "lightgray", "infeasible"), (True, "tab:blue", "feasible"))
    for feasible, colour, label in styles:
        pts = [r for r in ran if r.feasible == feasible]
        ax.scatter([r.single for r in pts], [r.second for r in pts], s=25, c=colour, label=label)
    front = pareto_front(rows)
    ax.plot([r.single for r in front], [r.second for r in front], "-o", c="tab:orange", label="Pareto front")
    for r in rows:
        if r.is_baseline and r.single > 0:
            ax.scatter([r.single], [r.second], marker="s", s=90, c="tab:red", label="article baseline")
    if winner is not None:
        ax.scatter([winner.single], [winner.second], marker="*", s=250, c="gold", edgecolors="k", label="pick")
    ax.set_xlabel(f"{(rows[0].objective if rows else Objective.aggregate).first_label}: decode tok/s")
    ax.set_ylabel(rows[0].objective.label if rows else Objective.aggregate.label)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def best_curves(rows: list[TrialRow]) -> list[TrialRow]:
    """Per slot count, the feasible measured trial with the highest capacity: the curves worth drawing."""
    best: dict[int, TrialRow] = {}
    for r in rows:
        if r.feasible and r.answered_from is None and r.result.capacity_curve:
            slots = int(r.params.get("n_parallel", 0))
            if slots not in best or (r.result.capacity_tok_s or 0) > (best[slots].result.capacity_tok_s or 0):
                best[slots] = r
    return [best[k] for k in sorted(best)]


def plot_capacity(rows: list[TrialRow], floor_tok_s: float, path: Path) -> bool:
    """The capacity curves (aggregate and slowest stream's tok/s against streams at once) of the best trial
    per slot count; False when the study measured none."""
    curves = best_curves(rows)
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (agg, slow) = plt.subplots(1, 2, figsize=(11, 4.5))
    for r in curves:
        points = r.result.capacity_curve or ()
        streams = [p.streams for p in points]
        label = f"#{r.number} {r.label()}"
        agg.plot(streams, [p.aggregate_tok_s for p in points], "-o", label=label)
        slow.plot(streams, [p.slowest_tok_s for p in points], "-o", label=label)
    slow.axhline(floor_tok_s, color="tab:red", linestyle="--", label=f"floor {floor_tok_s:g} tok/s")
    for ax, title in ((agg, "aggregate tok/s"), (slow, "slowest stream's decode tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("streams at once")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    slow.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def gain(winner: TrialRow, baseline: TrialRow | None) -> str:
    if baseline is None or baseline.single <= 0 or baseline.second <= 0:
        return "the baseline did not run (rejected, failed or infeasible), so there is no ratio to report"
    return (f"single stream {winner.single / baseline.single:.2f}x, {winner.objective.label.removesuffix(' tok/s')} "
            f"{winner.second / baseline.second:.2f}x the article baseline")


def capacity_section(rows: list[TrialRow], plot_name: str) -> list[str]:
    """The capacity curves of the best trial per slot count: a plot and a table."""
    curves = best_curves(rows)
    if not curves:
        return []
    levels = sorted({p.streams for r in curves for p in r.result.capacity_curve or ()})
    heads = " | ".join(f"{n} stream{'s' if n > 1 else ''}" for n in levels)
    out = ["## Capacity", "", f"![Capacity curves]({plot_name})", "",
           "Aggregate tok/s (slowest stream's decode tok/s) with that many streams at once, the best trial per "
           "slot count; the capacity figure is the best aggregate whose slowest stream keeps the floor.", "",
           f"| # | config | capacity tok/s (streams) | {heads} |",
           "|---|---|---|" + "---|" * len(levels)]
    for r in curves:
        at = {p.streams: p for p in r.result.capacity_curve or ()}
        cells = [f"{at[n].aggregate_tok_s:.1f} ({at[n].slowest_tok_s:.1f})" if n in at else "" for n in levels]
        streams = r.result.capacity_streams if r.result.capacity_streams is not None else "-"
        out.append(f"| {r.number} | {r.label()} | {_num(r.result.capacity_tok_s)} ({streams}) | "
                   + " | ".join(cells) + " |")
    return [*out, ""]


def importance_section(study: Any, objective: Objective, out_dir: Path) -> list[str]:
    """Which settings mattered, per objective: a table and out_dir/importance.png; where there are too few
    trials to say, one line saying so (and no plot)."""
    try:
        found = importance.importances(study, (objective.first_label, objective.label))
    except ValueError as exc:
        return ["## Which settings mattered", "", f"Not computed: {exc}.", ""]
    importance.plot(found, out_dir / IMPORTANCE_PLOT)
    return ["## Which settings mattered", "", f"![Setting importance]({IMPORTANCE_PLOT})", "",
            f"Each setting's share of importance per objective ({importance.EVALUATOR}, Optuna's default evaluator: "
            f"how far its values in the best quarter of trials differ from those of all {found.trials} distinct "
            "configs measured, infeasible ones included at the figures they reported). Over a few dozen trials "
            "these are indications, not measurements: a setting drawn in few trials can rank high by chance.",
            "", importance.table(found), ""]


def no_pick(rows: list[TrialRow]) -> str:
    """Why there is no pick, in one sentence; on a traffic workload, the trial that came closest to its SLO."""
    measured = [r for r in rows if r.result.traffic is not None and r.result.constraint_mem <= 0
                and r.result.constraint_quality <= 0]
    if not measured:
        return "No feasible trial: widen the space or the budget."
    closest = min(measured, key=lambda r: r.result.constraint_slo)
    traffic = closest.result.traffic
    outcome = traffic.slo_outcome if traffic is not None else ""
    return (f"No trial met the SLO: widen the space or relax the targets. Closest: trial {closest.number} "
            f"(`{closest.label()}`), {outcome}.")


def latency_section(winner: TrialRow | None) -> list[str]:
    """On a traffic workload: the pick's latency percentiles, each with its bootstrap 5-95% range and sample
    count, so a reader sees how far a rerun could move it."""
    traffic = winner.result.traffic if winner is not None else None
    if traffic is None:
        return []
    out = ["", f"Latency of the pick on `{traffic.workload}` ({traffic.requests} requests, {traffic.failed} failed; "
           f"{traffic.throughput_rps:.2f} req/s served, {traffic.goodput_rps:.2f} req/s good): value [bootstrap "
           "5-95% range] (samples)", "", "| | p50 | p95 | p99 |", "|---|---|---|---|"]
    for metric in ("ttft", "itl", "e2e"):
        names = [f"{metric}_p{p}" for p in (50, 95, 99)]
        cells = [f"{traffic.percentile_text(n)} ({traffic.percentiles.get(n, (0, 0, 0, 0))[3]})" for n in names]
        out.append(f"| {metric.upper()} | " + " | ".join(cells) + " |")
    if traffic.errors:
        out += ["", "Errors: " + "; ".join(traffic.errors)]
    return out


def markdown(rows: list[TrialRow], winner: TrialRow | None, prefer: str, context: dict[str, Any],
             plot_name: str, capacity_plot: str | None = None, summary: str | None = None,
             kept: str | None = None, importances: Sequence[str] = (), search: Sequence[str] = ()) -> str:
    """The report; `summary` (the tuner's pick line, with the confirmed figures) replaces the winner's line
    drawn from the study's single measurements; `kept` (in place: why the served config stays) replaces the
    winner section, and the latency table is then the search's best trial's; `importances`
    (importance_section's lines) follow the Pareto front and the capacity curves, `search` (search_section's)
    them."""
    baseline = next((r for r in rows if r.is_baseline), None)
    front = pareto_front(rows)
    out = ["# Tuning report", ""]
    out += [f"- {k}: {v}" for k, v in context.items()]
    out += ["", f"![Pareto front]({plot_name})", "", "## Winner", ""]
    traffic = any(r.result.workload for r in rows)
    if kept is not None:
        out.append(f"None: {kept}." + (f" The search's best trial, {winner.number}, is below." if winner else ""))
    elif winner is None:
        out.append(no_pick(rows))
    elif summary:
        out.append(f"`{winner.label()}`: {summary}.")
    else:
        out += [f"Trial {winner.number} ({prefer} pick): `{winner.label()}`: {_num(winner.single)} tok/s single, "
                f"{_num(winner.second)} {winner.objective.label}; {gain(winner, baseline)}."]
    out += latency_section(winner)
    out += ["", "## Pareto front", "", trial_table(front, traffic), ""]
    out += capacity_section(rows, capacity_plot) if capacity_plot else []
    out += importances
    out += search
    out += ["## All trials", "", trial_table(rows, traffic), "", *nodes_section(rows),
            "Quality: NLL delta is the mean negative log-likelihood (nats/token) of tuning/data/quality.txt "
            "under the trial's config minus the same with an f16 K/V cache; trials above "
            "--max-quality-loss are infeasible. Memory: predicted from the GGUF header before loading; "
            "measured with NVML (the process's GPU memory) or as resident-memory growth on CPU."]
    return "\n".join(out) + "\n"


def nodes_section(rows: list[TrialRow]) -> list[str]:
    """Where the trials were measured, when that was more than one node of the cluster (each trial on its own)."""
    by_node: dict[str, list[int]] = {}
    for r in rows:
        if r.result.node and not r.result.reused:
            by_node.setdefault(r.result.node, []).append(r.number)
    if len(by_node) < 2:
        return []
    where = "; ".join(f"{node}: {', '.join(f'#{n}' for n in numbers)}" for node, numbers in sorted(by_node.items()))
    return [f"Trials measured on {len(by_node)} nodes (host/Ray node): {where}.", ""]


def main(argv: list[str] | None = None) -> int:
    """`python -m tuning.report STORAGE STUDY OUT_DIR`: the report and plots again, from the study alone (the
    confirmation round's re-measurements are not stored: they are in the report the tuner wrote)."""
    import argparse

    import optuna

    parser = argparse.ArgumentParser(prog="python -m tuning.report", description=main.__doc__)
    parser.add_argument("storage", help="Optuna storage URL, e.g. sqlite:///results/optuna.db")
    parser.add_argument("study")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--objective", choices=[o.value for o in Objective], default=Objective.aggregate.value)
    parser.add_argument("--prefer", choices=["balanced", "single", "aggregate"], default="balanced")
    parser.add_argument("--min-stream-tok-s", type=float, help="the capacity floor the study measured with")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=args.study, storage=args.storage)
    rows = rows_from_study(study, Objective(args.objective))
    winner = pick(rows, args.prefer)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(rows, winner, args.out_dir / "pareto.png")
    capacity = args.min_stream_tok_s is not None and plot_capacity(rows, args.min_stream_tok_s,
                                                                   args.out_dir / "capacity.png")
    context = {"study": args.study, "storage": args.storage, "trials in study": len(rows)}
    search = search_section(rows, pruned_rows(study, Objective(args.objective)), finished_s(study), winner,
                            args.prefer)
    text = markdown(rows, winner, args.prefer, context, "pareto.png", "capacity.png" if capacity else None,
                    importances=importance_section(study, Objective(args.objective), args.out_dir), search=search)
    (args.out_dir / "report.md").write_text(text)
    print(f"report: {args.out_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
