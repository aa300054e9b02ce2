"""Each workload's pick measured on every workload: tuned configs crossed with traffic workloads, in one run.

A config tuned for one workload (chat: many concurrent decodes; rag: long prefills) is a guess on another. This
script loads one engine with the first config, then per round and per workload replays the workload on every
config in turn (the order rotates each round; `Engine.reconfigure` between, the weights kept), so every config
of a round meets the same machine state, and reports goodput under an SLO (measure/slo.py) as ratios paired by
round: per workload each config against that workload's best, and a cross table of every config on every
workload against the workload's own-named config (config `chat` is the reference on workload `chat`).

Every replay gets a salt of its own (measure/replay.py), so no run finds another's prefixes cached; one short
warm-up replay per (config, workload) comes before the rounds and is reported apart. A config whose context
per slot cannot hold a workload's largest request still runs: the engine refuses those requests, they count
as failed, and the table says how many could not fit.

    python scripts/bench_workloads.py --config chat=configs/tuned-chat.yaml --config rag=configs/tuned-rag.yaml \\
        --workload chat --workload rag --slo ttft_p95=2s,itl_p95=150ms --requests 24 --rounds 3

The markdown tables go to stdout and next to the JSON report (same stem, .md); progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parents[1]

# Only modules that load neither libllama nor Ray up here: the tables are unit-tested without them.
# serving.engine.llama (the library load order) is imported first inside `measure_all`, where the engine is built.
from measure.design import paired_ratio, rotated  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from measure.replay import (  # noqa: E402
    DEFAULT_CONCURRENCY,
    DEFAULT_REQUESTS,
    Arrivals,
    Builtin,
    Replayer,
    ReplayFigures,
    TrafficWorkload,
    builtin,
    load_file,
)
from measure.slo import Slo  # noqa: E402
from measure.workload import source_text  # noqa: E402
from serving.engine.config import EngineConfig, load_engine_config  # noqa: E402

if TYPE_CHECKING:
    from measure.targets import EngineTarget

DEFAULT_ROUNDS = 3
DEFAULT_WARMUP_REQUESTS = 4
DEFAULT_OUT = REPO_ROOT / "results" / "bench_workloads.json"


# -- the command line ---------------------------------------------------------------------------------------

def named_path(text: str) -> tuple[str, Path]:
    """`NAME=PATH` of --config: the name is what the tables call the config (and what ties it to a workload)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (e.g. chat=configs/tuned-chat.yaml), got {text!r}")
    return name.strip(), Path(path.strip())


def key_value(text: str) -> tuple[str, str]:
    """`KEY=VALUE` of --engine: an engine setting every config gets (the config files' own values lose)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. n_ctx=8192), got {text!r}")
    return key.strip(), value.strip()


def slo_arg(text: str) -> Slo:
    try:
        return Slo.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {least} or more, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return whole_number(text, 0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", type=named_path, default=[], metavar="NAME=PATH",
                   help="an engine config YAML under a name (repeat: at least 2, names unique). The engine is loaded "
                        "with the first; the others are switched to by Engine.reconfigure (the context rebuilt, the "
                        "weights kept while model and n_gpu_layers agree). A config named like a workload is that "
                        "workload's reference in the cross table")
    p.add_argument("--engine", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="an engine setting applied to every config, over the files' values (repeat; e.g. "
                        "model=/models/x.gguf, n_threads=8)")
    p.add_argument("--workload", action="append", default=[], metavar="NAME|PATH",
                   help=f"a workload to replay (repeat): a built-in ({', '.join(b.value for b in Builtin)}) drawn "
                        "with --seed, or a JSONL file of request shapes (measure/replay.py load_file; GET /traffic's "
                        "recent.requests lines), named by its file stem. Names must be unique")
    p.add_argument("--slo", type=slo_arg, metavar="TARGETS",
                   help="the latency targets goodput counts against, e.g. ttft_p95=2s,itl_p95=150ms (metrics ttft, "
                        "itl, e2e; percentiles p50, p90, p95, p99; units s or ms). A request is good when its own "
                        "TTFT, mean ITL and E2E are within every bound; a run meets the SLO when every percentile does "
                        "and no request failed")
    p.add_argument("--requests", type=positive_int, default=DEFAULT_REQUESTS, metavar="N",
                   help="requests per replay: a built-in draws N; a file gives its first N (all of them when it holds "
                        f"fewer) (default {DEFAULT_REQUESTS})")
    p.add_argument("--rounds", type=positive_int, default=DEFAULT_ROUNDS, metavar="N",
                   help="measured rounds; each replays every workload on every config once, configs in an order that "
                        "rotates by one each round. Medians and paired ratios are over rounds "
                        f"(default {DEFAULT_ROUNDS})")
    p.add_argument("--warmup-requests", type=non_negative_int, default=DEFAULT_WARMUP_REQUESTS, metavar="N",
                   help="the first N requests of each workload replayed once per config before the rounds, not "
                        f"counted (0: no warm-up) (default {DEFAULT_WARMUP_REQUESTS})")
    pacing = p.add_mutually_exclusive_group()
    pacing.add_argument("--concurrency", type=positive_int, metavar="N",
                        help="closed loop (the default): N clients, each sending its next request when its last one "
                             f"ended; a file's recorded arrival times are ignored (default {DEFAULT_CONCURRENCY})")
    pacing.add_argument("--rate", type=positive_float, metavar="R",
                        help="open loop: requests arrive as a Poisson process at R requests/s (drawn with --seed, the "
                             "same arrival times for every config and round), whatever the server's pace")
    pacing.add_argument("--rate-scale", type=positive_float, metavar="X",
                        help="open loop at a file's recorded arrival times divided by X (2: twice as fast; 1: as "
                             "recorded); only for workloads with recorded arrivals")
    p.add_argument("--length-scale", type=positive_float, default=1.0, metavar="X",
                   help="every prompt, shared prefix and output X times as long (the tuner's --length-scale: a "
                        "small machine's quick run keeps each workload's mix) (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the built-in workloads' draws and of --rate's arrival times (default 0)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="PATH",
                   help="the JSON report (provenance, command, configs, workloads, SLO, every run's figures); the "
                        "markdown tables are saved beside it with the suffix .md "
                        f"(default {DEFAULT_OUT.relative_to(REPO_ROOT)})")
    p.add_argument("--tables-from", type=Path, metavar="REPORT",
                   help="measure nothing: draw the tables again from a saved JSON report (its runs, under this "
                        "version's rules) and print them")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, with what argparse cannot check alone: two configs at least, no name given twice."""
    p = parser()
    args = p.parse_args(argv)
    if args.tables_from is not None:
        return args
    missing = [flag for flag, value in (("--config", args.config), ("--workload", args.workload), ("--slo", args.slo))
               if not value]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    names = [name for name, _ in args.config]
    if len(names) < 2:
        p.error("--config: give at least 2 configs (NAME=PATH) to compare")
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        p.error(f"--config: the name(s) {', '.join(duplicated)} are given twice")
    keys = [key for key, _ in args.engine]
    if duplicated := sorted({k for k in keys if keys.count(k) > 1}):
        p.error(f"--engine: {', '.join(duplicated)} set twice")
    return args


# -- configs and workloads ----------------------------------------------------------------------------------

def load_configs(named: Sequence[tuple[str, Path]], overrides: Mapping[str, Any]) -> dict[str, EngineConfig]:
    """Every config with the common overrides, validated before any engine loads (a typo fails in a second)."""
    configs = {}
    for name, path in named:
        try:
            configs[name] = load_engine_config(path, dict(overrides))
        except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise SystemExit(f"error: --config {name}={path}: {exc}") from None
    return configs


def resolve_workload(text: str, requests: int, seed: int) -> TrafficWorkload:
    """A built-in name, else a JSONL file: `requests` of it either way."""
    if text in {b.value for b in Builtin}:
        return builtin(Builtin(text), requests, seed)
    path = Path(text)
    if not path.is_file():
        raise SystemExit(f"error: --workload {text!r} is neither a built-in "
                         f"({', '.join(b.value for b in Builtin)}) nor a file")
    try:
        return load_file(path).taking(requests)
    except ValueError as exc:
        raise SystemExit(f"error: --workload {text!r}: {exc}") from None


def pace(workload: TrafficWorkload, concurrency: int | None, rate: float | None, rate_scale: float | None,
         seed: int) -> TrafficWorkload:
    """How the replay sends it: every workload the same way, so a column compares like with like."""
    if rate is not None:
        return workload.paced(Arrivals.open, rate_per_s=rate, seed=seed)
    if rate_scale is not None:
        if workload.rate_per_s is None:
            raise SystemExit(f"error: --rate-scale: workload {workload.name!r} has no recorded arrival times "
                             "(use --rate for an open loop on it)")
        return workload.paced(Arrivals.open, rate_scale=rate_scale)
    return workload.paced(Arrivals.closed, concurrency=concurrency or DEFAULT_CONCURRENCY)


def load_workloads(args: argparse.Namespace) -> list[TrafficWorkload]:
    workloads = [pace(resolve_workload(w, args.requests, args.seed).lengths_scaled(args.length_scale),
                      args.concurrency, args.rate, args.rate_scale, args.seed) for w in args.workload]
    names = [w.name for w in workloads]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        raise SystemExit(f"error: --workload: the name(s) {', '.join(duplicated)} are given twice (a file is named "
                         "by its stem)")
    return workloads


def unfit_requests(workload: TrafficWorkload, config: EngineConfig) -> int:
    """Requests the engine refuses outright on `config`: prompt plus one choice's output beyond a slot's context
    (serving/engine/core.py's check), or more choices than slots. They still run, and count as failed."""
    return sum(1 for r in workload.requests
               if r.n > config.n_parallel
               or r.prompt_tokens + max(r.output_tokens // r.n, 1) > config.n_ctx_per_slot)


@dataclass(frozen=True)
class WorkloadInfo:
    """What the tables say of a workload: its name, its description, requests per replay, and per config the
    requests that cannot fit its context per slot. Saved in the report, so tables can be drawn again."""

    name: str
    describe: str
    requests: int
    unfit: dict[str, int]

    @classmethod
    def of(cls, workload: TrafficWorkload, configs: Mapping[str, EngineConfig]) -> WorkloadInfo:
        return cls(workload.name, workload.describe(), len(workload.requests), unfit_by_config(workload, configs))


def unfit_by_config(workload: TrafficWorkload, configs: Mapping[str, EngineConfig]) -> dict[str, int]:
    return {name: unfit_requests(workload, config) for name, config in configs.items()}


# -- measuring ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """One replay: in which round (-1: the warm-up), of which workload, on which config, and what it measured."""

    round: int
    workload: str
    config: str
    salt: int
    figures: ReplayFigures


def schedule(configs: Sequence[str], workloads: Sequence[str], rounds: int) -> Iterator[tuple[int, str, str]]:
    """(round, workload, config) in the order they run: per round, per workload, every config, rotating."""
    for r in range(rounds):
        for workload in workloads:
            for config in rotated(configs, r):
                yield r, workload, config


class Bench:
    """One engine and the replays on it: switches config only when the next run needs another, and gives each
    replay a salt never used before in this process."""

    def __init__(self, target: EngineTarget, configs: Mapping[str, EngineConfig], slo: Slo, loaded: str) -> None:
        self.target, self.configs, self.slo, self.loaded = target, configs, slo, loaded
        self.filler = source_text()
        self.salts = 0

    def replay(self, config: str, workload: TrafficWorkload, round_: int, label: str) -> Run:
        """One replay on `config`, its progress line on stderr (a long cross run shows it is alive)."""
        if config != self.loaded:
            self.target.engine.reconfigure(self.configs[config])
            self.loaded = config
        self.salts += 1
        t0 = time.perf_counter()
        figures = asyncio.run(Replayer(workload, self.slo, self.filler, salt=self.salts).run(self.target))
        print(f"[{label}] {workload.name} on {config}: goodput {figures.goodput_rps:.2f} req/s "
              f"({figures.goodput_tok_s:.0f} tok/s), {figures.failed}/{figures.requests} failed, "
              f"SLO {figures.slo.describe()} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        return Run(round_, workload.name, config, self.salts, figures)


def measure_all(configs: Mapping[str, EngineConfig], workloads: Sequence[TrafficWorkload], slo: Slo, rounds: int,
                warmup_requests: int) -> tuple[list[Run], list[Run]]:
    """The warm-up replays, then the measured ones, on one engine loaded with the first config."""
    from serving.engine import llama as _llama  # noqa: F401  (first: the library load order, see serving/engine/llama.py)
    from measure.targets import EngineTarget
    from serving.engine.core import Engine

    names = list(configs)
    by_name = {w.name: w for w in workloads}
    engine = Engine(configs[names[0]])
    try:
        bench = Bench(EngineTarget(engine), configs, slo, names[0])
        pairs = [(c, w) for c in names for w in workloads] if warmup_requests else []
        warmups = [bench.replay(c, w.taking(warmup_requests), -1, f"warm-up {i + 1}/{len(pairs)}")
                   for i, (c, w) in enumerate(pairs)]
        plan = list(schedule(names, list(by_name), rounds))
        runs = [bench.replay(c, by_name[w], r, f"round {r + 1}/{rounds}, run {i + 1}/{len(plan)}")
                for i, (r, w, c) in enumerate(plan)]
    finally:
        engine.close()
    return warmups, runs


# -- the tables (pure: unit-tested on constructed figures) ----------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One config on one workload, over the rounds."""

    config: str
    goodput_rps: float  # median over rounds
    ratio_to_best: float | None  # median of per-round goodput / the best config's in the same round
    met: int  # rounds that met the SLO
    rounds: int
    ttft_p95_s: float  # median over rounds
    itl_p95_s: float
    failed: int  # over every round
    requests: int
    unfit: int  # requests per replay the config cannot hold (they fail)


@dataclass(frozen=True)
class Cell:
    """One config on one workload in the cross table: its median goodput, its paired ratio to `reference`, and
    in how many rounds it met the SLO (goodput of a run that missed is shown, but wins nothing)."""

    goodput_rps: float
    ratio: float | None
    reference: str
    met: int
    rounds: int


def median(values: Sequence[float]) -> float:
    """The median of the values that are numbers (a round with no succeeded request has NaN percentiles)."""
    present = [v for v in values if not math.isnan(v)]
    return statistics.median(present) if present else math.nan


def by_round(runs: Sequence[Run], workload: str, config: str) -> dict[int, ReplayFigures]:
    """The measured rounds of one config on one workload (warm-ups, round -1, left out)."""
    return {r.round: r.figures for r in runs if r.workload == workload and r.config == config and r.round >= 0}


def goodputs(runs: Sequence[Run], workload: str, config: str) -> dict[int, float]:
    return {r: f.goodput_rps for r, f in by_round(runs, workload, config).items()}


def best_config(runs: Sequence[Run], workload: str, configs: Sequence[str]) -> str:
    """The config that met the SLO in the most rounds (as the tuner, which calls a miss infeasible: a config
    that fails long requests quickly can show more goodput from the short ones), then the highest median
    goodput; on a tie (all 0 where nothing meets the SLO) the one that got the most done (median throughput),
    then the first named."""
    def rank(config: str) -> tuple[int, float, float, int]:
        rounds = by_round(runs, workload, config).values()
        return (sum(1 for f in rounds if f.slo.met), median([f.goodput_rps for f in rounds]),
                median([f.throughput_rps for f in rounds]), -configs.index(config))

    return max(configs, key=rank)


def own_config(workload: str, configs: Sequence[str]) -> str | None:
    """The config named like the workload, its length scale aside (config `rag` belongs to workload `rag@0.5`)."""
    base = workload.partition("@")[0]
    return base if base in configs else None


def reference_config(runs: Sequence[Run], workload: str, configs: Sequence[str]) -> str:
    """The cross table's reference on a workload: the config named like it, else the workload's best."""
    return own_config(workload, configs) or best_config(runs, workload, configs)


def workload_rows(runs: Sequence[Run], workload: str, configs: Sequence[str],
                  unfit: Mapping[str, int]) -> list[Row]:
    best = goodputs(runs, workload, best_config(runs, workload, configs))
    rows = []
    for config in configs:
        rounds = by_round(runs, workload, config)
        figures = list(rounds.values())
        rows.append(Row(
            config=config, goodput_rps=median([f.goodput_rps for f in figures]),
            ratio_to_best=paired_ratio(goodputs(runs, workload, config), best),
            met=sum(1 for f in figures if f.slo.met), rounds=len(figures),
            ttft_p95_s=median([_p95(f, "ttft") for f in figures]), itl_p95_s=median([_p95(f, "itl") for f in figures]),
            failed=sum(f.failed for f in figures), requests=sum(f.requests for f in figures),
            unfit=unfit.get(config, 0)))
    return rows


def _p95(figures: ReplayFigures, metric: str) -> float:
    spread = figures.percentiles.get(f"{metric}_p95")
    return spread.value if spread is not None else math.nan


def cross_cells(runs: Sequence[Run], workloads: Sequence[str], configs: Sequence[str]) -> dict[str, dict[str, Cell]]:
    """cells[config][workload]: every config on every workload against that workload's reference config."""
    cells: dict[str, dict[str, Cell]] = {c: {} for c in configs}
    for workload in workloads:
        reference = reference_config(runs, workload, configs)
        ref = goodputs(runs, workload, reference)
        for config in configs:
            ours = goodputs(runs, workload, config)
            rounds = by_round(runs, workload, config).values()
            cells[config][workload] = Cell(median(list(ours.values())), paired_ratio(ours, ref), reference,
                                           met=sum(1 for f in rounds if f.slo.met), rounds=len(rounds))
    return cells


def seconds(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value * 1000:.0f}ms" if value < 1.0 else f"{value:.2f}s"


def ratio_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def goodput_text(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def failed_text(row: Row, requests_per_replay: int) -> str:
    text = f"{row.failed}/{row.requests}"
    if row.unfit:
        text += f" ({row.unfit} of {requests_per_replay} requests do not fit its context per slot)"
    return text


def workload_table(workload: WorkloadInfo, rows: Sequence[Row], best: str, slo: str) -> str:
    lines = [f"### Workload `{workload.name}`", "", f"{workload.describe}. SLO {slo}; best config: `{best}`.",
             "", "| config | goodput req/s (median) | goodput / best (paired) | SLO met | TTFT p95 | ITL p95 "
             "| failed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r.config} | {goodput_text(r.goodput_rps)} | {ratio_text(r.ratio_to_best)} "
                     f"| {r.met}/{r.rounds} "
                     f"| {seconds(r.ttft_p95_s)} | {seconds(r.itl_p95_s)} | {failed_text(r, workload.requests)} |")
    return "\n".join(lines) + "\n"


def cross_table(cells: Mapping[str, Mapping[str, Cell]], workloads: Sequence[str], rounds: int) -> str:
    first = next(iter(cells.values()), {})
    header = [f"{w} (vs `{first[w].reference}`{'' if own_config(w, list(cells)) else ', its best'})"
              for w in workloads]
    lines = ["### Each workload's pick measured on every workload", "",
             f"Goodput req/s, median over {rounds} round(s); in brackets the median per-round paired ratio to the "
             "workload's own config (the config named like it; else its best config, as the header says), and the "
             "rounds that met the SLO where some did not: a config that misses wins nothing.", "",
             f"| config \\ workload | {' | '.join(header)} |", f"| --- |{' ---: |' * len(workloads)}"]
    for config, row in cells.items():
        texts = [cell_text(row[w]) for w in workloads]
        lines.append(f"| {config} | " + " | ".join(f"**{t}**" if row[w].reference == config else t
                                                    for w, t in zip(workloads, texts, strict=True)) + " |")
    return "\n".join(lines) + "\n"


def cell_text(cell: Cell) -> str:
    missed = f", SLO met {cell.met}/{cell.rounds}" if cell.met < cell.rounds else ""
    return f"{goodput_text(cell.goodput_rps)} ({ratio_text(cell.ratio)}{missed})"


def markdown(runs: Sequence[Run], workloads: Sequence[WorkloadInfo], names: Sequence[str], slo: str,
             rounds: int) -> str:
    parts = [workload_table(w, workload_rows(runs, w.name, names, w.unfit), best_config(runs, w.name, names), slo)
             for w in workloads]
    parts.append(cross_table(cross_cells(runs, [w.name for w in workloads], names), [w.name for w in workloads],
                             rounds))
    return "\n".join(parts)


# -- the report ---------------------------------------------------------------------------------------------

def run_dict(run: Run) -> dict[str, Any]:
    """A run's figures as plain JSON, with the SLO outcome's derived values (met, violation, attainment)."""
    outcome = run.figures.slo
    return {"round": run.round, "workload": run.workload, "config": run.config, "salt": run.salt,
            "figures": asdict(run.figures), "slo_met": outcome.met, "slo_violation": outcome.violation,
            "slo_attainment": outcome.attainment, "slo_describe": outcome.describe()}


def run_from_dict(data: Mapping[str, Any]) -> Run:
    """A run back from its saved form (`run_dict`)."""
    return Run(int(data["round"]), data["workload"], data["config"], int(data["salt"]),
               ReplayFigures.from_dict(data["figures"]))


def saved_tables(path: Path) -> str:
    """The markdown tables of a saved report, drawn again from its runs under this version's rules."""
    import json

    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        runs = [run_from_dict(r) for r in saved["runs"]]
        workloads = [WorkloadInfo(name, w["describe"], w["requests"], w.get("unfit_requests", {}))
                     for name, w in saved["workloads"].items()]
        return markdown(runs, workloads, list(saved["configs"]), saved["slo"], saved["rounds"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--tables-from {path}: not a report of this script ({type(exc).__name__}: {exc})") from None


def report(args: argparse.Namespace, argv: Sequence[str], configs: Mapping[str, EngineConfig],
           workloads: Sequence[TrafficWorkload], warmups: Sequence[Run], runs: Sequence[Run]) -> dict[str, Any]:
    names = list(configs)
    cells = cross_cells(runs, [w.name for w in workloads], names)
    return {
        **provenance(), "command": shlex.join(["python", "scripts/bench_workloads.py", *argv]),
        "configs": {name: {"path": str(path), "engine": configs[name].to_yaml_dict(),
                           "n_ctx_per_slot": configs[name].n_ctx_per_slot} for name, path in args.config},
        "engine_overrides": dict(args.engine),
        "workloads": {w.name: {"describe": w.describe(), "requests": len(w.requests), "max_context": w.max_context,
                               "unfit_requests": unfit_by_config(w, configs)} for w in workloads},
        "slo": str(args.slo), "rounds": args.rounds, "warmup_requests": args.warmup_requests,
        "summary": {w.name: {"best": best_config(runs, w.name, names),
                             "rows": [asdict(r)
                                      for r in workload_rows(runs, w.name, names, unfit_by_config(w, configs))]}
                    for w in workloads},
        "cross": {c: {w: asdict(cell) for w, cell in row.items()} for c, row in cells.items()},
        "warmup": [run_dict(r) for r in warmups], "runs": [run_dict(r) for r in runs],
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.tables_from is not None:
        print(saved_tables(args.tables_from), end="")
        return 0
    configs = load_configs(args.config, dict(args.engine))
    workloads = load_workloads(args)
    for w in workloads:
        print(f"workload {w.describe()}", file=sys.stderr)
        for name, config in configs.items():
            if unfit := unfit_requests(w, config):
                print(f"  config {name}: {unfit} of its {len(w.requests)} requests exceed the {config.n_ctx_per_slot}"
                      f"-token context per slot (largest {w.max_context}): they will fail", file=sys.stderr)
    warmups, runs = measure_all(configs, workloads, args.slo, args.rounds, args.warmup_requests)
    text = markdown(runs, [WorkloadInfo.of(w, configs) for w in workloads], list(configs), str(args.slo), args.rounds)
    print(text, flush=True)
    write_report(args.out, report(args, argv, configs, workloads, warmups, runs))
    args.out.with_suffix(".md").write_text(text, encoding="utf-8")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}", file=sys.stderr)
    return 0

