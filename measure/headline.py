"""The headline benchmark: goodput on traces, our server with a tuned config against llama-server as a user
starts it and llama-server with the article's hand-tuned flags.

Targets (each an OpenAI-compatible server over HTTP, fed the same token-id prompts, measure/targets.py):
- `defaults`: `llama-server -m MODEL --host 127.0.0.1 --port P` and nothing else, so its own defaults decide
  (`--fit on`, `-c 0`, `-np auto`, the default `--cache-ram`); with `--vram-budget` on a GPU, `--fit-target`
  so that it sees only that much free memory (as measure/device_bench.py does). What it chose (context, slots)
  is read back from /props and /slots into the report;
- `article`: llama-server with the article's flags (ARTICLE_ARGS, or `--article-args`), `--fit-target` too under
  a budget;
- `ours` (`--ours [NAME=]CONFIG`, repeat: one per trace's pick): our Serve app as `serve run serving.app:main
  config=CONFIG model=MODEL` builds it (measure/serve_app.py), or `--ours-url [NAME=]URL` of one already running;
  one named like a trace (`--ours chat=tuned_chat.yaml`) is that trace's pick and replays that trace alone.

Each trace (`--trace NAME=FILE`, Mooncake JSONL: measure/traces.py writes synthetic ones) is replayed open loop at
its timestamps divided by `--rate-scale`, every replay with a salt of its own (measure/replay.py), on every
target, in `--rounds` rounds with the target order rotated each round (measure/design.py). Without a GPU every
target is started once and they all live through the rounds; on a GPU they cannot share it, so each is started,
replayed on and stopped in turn, every round (`--start`). A target that fails to start is reported; the rest
still runs. Per trace the report gives goodput (requests and output tokens a second of those whose TTFT and ITL
met the SLO, measure/slo.py), throughput, TTFT/ITL p50/p95, failed requests and their first errors, and every
target's goodput against `defaults` (the median over rounds of the ratio within a round).

Several rates (`--rate-scale 0.25,0.5,1`) replay each trace at each, as traces of their own (`chat@0.5x`), and
add the question users ask: how many requests a second each target holds within the SLO, the highest rate at
which it met the SLO in every round. One rate answers it badly either way: where every target meets the SLO,
goodput is the offered rate for all; where none does (the first H100 run: 2.6 chat requests a second, every
target's TTFT p95 over 10 s), the ratio compares queues.

    python scripts/bench_headline.py --model MODEL.gguf --llama-server .llama-build/bin/llama-server \\
        --trace chat=traces/chat.jsonl --trace agent=traces/agent.jsonl --slo ttft_p95=2s,itl_p95=150ms \\
        --ours chat=tuned_chat.yaml --ours agent=tuned_agent.yaml --out results/headline.json

The JSON report (with provenance), a markdown table beside it (.md) and a plot (.png, where matplotlib is
installed) of goodput per target per trace; progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import math
import shlex
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from measure.design import paired_ratio, rotated
from measure.provenance import provenance, write_report
from measure.replay import Arrivals, Replayer, ReplayFigures, TrafficWorkload, load_file
from measure.slo import Slo
from measure.targets import HttpTarget, Tokenizer, check_loopback_url, check_server_args, llama_server_version
from measure.workload import source_text
from measure.workload_cross import (
    goodput_text,
    median,
    named_path,
    non_negative_int,
    positive_float,
    positive_int,
    ratio_text,
    seconds,
    slo_arg,
)
from serving.engine.units import parse_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]
ARTICLE_ARGS = ("-ngl", "99", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "-c", "4096", "-np", "2", "-b", "512")
REFERENCE = "defaults"
DEFAULT_OUT = REPO_ROOT / "results" / "headline.json"
DEFAULT_WARMUP_REQUESTS = 2
MiB = 1 << 20


class Kind(str, Enum):
    """What a target is."""

    defaults = "defaults"  # llama-server with nothing but the model and the address
    article = "article"  # llama-server with the article's hand-tuned flags
    ours = "ours"  # our Serve app with a config, or one already running


class Start(str, Enum):
    """When targets are started."""

    auto = "auto"  # once without a GPU, per round with one
    once = "once"  # every target once, all living through the rounds
    per_round = "per-round"  # one at a time: started, replayed on, stopped, in every round


@dataclass(frozen=True)
class TargetSpec:
    """One target: llama-server with `server_args`, our app with `config`, or the server at `url`; it replays
    `only` those traces where that is set (a trace's own pick), else every trace."""

    name: str
    kind: Kind
    server_args: tuple[str, ...] = ()
    config: Path | None = None
    url: str | None = None
    only: tuple[str, ...] = ()

    def replays(self, trace: str) -> bool:
        return not self.only or base_trace(trace) in self.only

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "server_args": list(self.server_args),
                "config": None if self.config is None else str(self.config), "url": self.url,
                "traces": list(self.only) or "all"}


@dataclass(frozen=True)
class Run:
    """One replay: in which round (-1: the warm-up), of which trace, on which target, and what it measured."""

    round: int
    trace: str
    target: str
    salt: int
    figures: ReplayFigures


@dataclass(frozen=True)
class Failure:
    """A target that did not start, or a replay that did not finish (its requests' own errors are figures)."""

    round: int
    target: str
    stage: str  # "start" or "replay NAME"
    error: str


# -- the command line ---------------------------------------------------------------------------------------

def named_or_plain(text: str, flag: str) -> tuple[str, str]:
    """`NAME=VALUE` or a bare VALUE (the name is then empty)."""
    name, sep, value = text.partition("=")
    if not sep:
        return "", text.strip()
    if not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"{flag}: expected [NAME=]VALUE, got {text!r}")
    return name.strip(), value.strip()


def ours_config(text: str) -> tuple[str, str]:
    return named_or_plain(text, "--ours")


def ours_url(text: str) -> tuple[str, str]:
    name, url = named_or_plain(text, "--ours-url")
    try:
        return name, check_loopback_url(url)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--ours-url: {exc}") from None


def server_args(text: str) -> tuple[str, ...]:
    try:
        args = tuple(shlex.split(text))
        check_server_args(args)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--article-args: {exc}") from None
    return args


def byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="the GGUF every target serves (ours: over its config's)")
    p.add_argument("--llama-server", metavar="BINARY", help="llama-server (scripts/build_llama_server.sh builds it); "
                   "needed for the defaults and article targets")
    p.add_argument("--trace", action="append", type=named_path, default=[], metavar="NAME=FILE",
                   help="a Mooncake JSONL trace under a name (repeat; measure/traces.py writes synthetic ones)")
    p.add_argument("--slo", type=slo_arg, required=True, metavar="TARGETS",
                   help="what a good request meets, e.g. ttft_p95=2s,itl_p95=150ms (measure/slo.py)")
    p.add_argument("--targets", default="defaults,article,ours", metavar="LIST",
                   help="which targets, comma-separated: defaults, article, ours (every --ours and --ours-url) "
                        "(default: all three)")
    p.add_argument("--ours", action="append", type=ours_config, default=[], metavar="[NAME=]CONFIG",
                   help="our server with this engine config YAML (the tuner's --out), named ours[-NAME] (repeat)")
    p.add_argument("--ours-url", action="append", type=ours_url, default=[], metavar="[NAME=]URL",
                   help="our server already running at this loopback API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--article-args", type=server_args, default=ARTICLE_ARGS, metavar="FLAGS",
                   help=f"the article target's llama-server flags (default: {shlex.join(ARTICLE_ARGS)})")
    p.add_argument("--vram-budget", type=byte_size, metavar="SIZE",
                   help="GPU memory every target may use, e.g. 32GiB: llama-server gets --fit-target so that it "
                        "sees that much free, ours vram_budget (needs a GPU)")
    p.add_argument("--rate-scale", type=rate_scales, default=(1.0,), metavar="X[,X...]",
                   help="arrivals X times as fast as the trace's timestamps (default 1); several: each trace at "
                        "each, and the highest rate each target holds within the SLO")
    p.add_argument("--requests", type=positive_int, metavar="N", help="each trace's first N requests (default: all)")
    p.add_argument("--rounds", type=positive_int, default=1, metavar="R",
                   help="rounds, the target order rotated each round; ratios are paired by round (default 1)")
    p.add_argument("--warmup-requests", type=non_negative_int, default=DEFAULT_WARMUP_REQUESTS, metavar="N",
                   help="each trace's first N requests replayed on each target once it starts, not counted "
                        f"(default {DEFAULT_WARMUP_REQUESTS})")
    p.add_argument("--start", choices=[s.value for s in Start], default=Start.auto.value,
                   help="once: every target started once, all living through the rounds; per-round: one at a time, "
                        "each round; auto (default): once without a GPU, per-round with one")
    p.add_argument("--start-timeout", type=positive_float, default=600.0, metavar="S",
                   help="seconds a target may take to answer /health (default 600)")
    p.add_argument("--request-timeout", type=positive_float, default=600.0, metavar="S",
                   help="seconds one request may take (default 600)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="PATH",
                   help="the JSON report; the markdown table (.md) and the plot (.png) go beside it "
                        f"(default {DEFAULT_OUT.relative_to(REPO_ROOT)})")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, with what argparse cannot check alone."""
    p = parser()
    args = p.parse_args(argv)
    if not args.trace:
        p.error("give at least one --trace NAME=FILE")
    for flag, names in (("--trace", [n for n, _ in args.trace]),
                        ("--ours/--ours-url", [ours_name(n) for n, _ in [*args.ours, *args.ours_url]])):
        if duplicated := sorted({n for n in names if names.count(n) > 1}):
            p.error(f"{flag}: the name(s) {', '.join(duplicated)} are given twice")
    try:
        args.specs = target_specs(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def target_specs(args: argparse.Namespace) -> list[TargetSpec]:
    """The targets asked for, `defaults` first (the reference): ValueError when one cannot be built."""
    wanted = [w.strip() for w in args.targets.split(",") if w.strip()]
    if unknown := [w for w in wanted if w not in {k.value for k in Kind}]:
        raise ValueError(f"--targets: unknown {', '.join(unknown)} (defaults, article, ours)")
    specs = []
    if Kind.defaults.value in wanted:
        specs.append(TargetSpec(REFERENCE, Kind.defaults))
    if Kind.article.value in wanted:
        specs.append(TargetSpec(Kind.article.value, Kind.article, tuple(args.article_args)))
    if (Kind.defaults.value in wanted or Kind.article.value in wanted) and not args.llama_server:
        raise ValueError("--llama-server BINARY is needed for the defaults and article targets")
    if Kind.ours.value in wanted:
        if not args.ours and not args.ours_url:
            raise ValueError("--targets has ours: give --ours CONFIG or --ours-url URL, or leave ours out of "
                             "--targets")
        traces = {name for name, _ in args.trace}
        specs += [TargetSpec(ours_name(name), Kind.ours, config=Path(path), only=_own(name, traces))
                  for name, path in args.ours]
        specs += [TargetSpec(ours_name(name), Kind.ours, url=url, only=_own(name, traces))
                  for name, url in args.ours_url]
    if not specs:
        raise ValueError("--targets: no target left to run")
    return specs


def ours_name(name: str) -> str:
    """What the tables call an `--ours [NAME=]...` target: ours, or ours-NAME."""
    return f"{Kind.ours.value}-{name}" if name else Kind.ours.value


def _own(name: str, traces: set[str]) -> tuple[str, ...]:
    """The traces a named pick replays: its own trace where it is named like one (the tuner's pick for it), else
    every trace."""
    return (name,) if name in traces else ()


RATE_MARK = "@"  # a trace replayed at one of several rates: NAME@0.5x


def rate_scales(text: str) -> tuple[float, ...]:
    """`--rate-scale`: one scale or several, comma-separated, each above 0, none twice; in ascending order."""
    scales = [positive_float(part.strip()) for part in text.split(",") if part.strip()]
    if not scales:
        raise argparse.ArgumentTypeError("expected a number above 0, or several comma-separated")
    if len(set(scales)) != len(scales):
        raise argparse.ArgumentTypeError(f"a scale is given twice in {text!r}")
    return tuple(sorted(scales))


def base_trace(name: str) -> str:
    """The trace a replay name is of: `chat` for `chat@0.5x` and for `chat`."""
    return name.split(RATE_MARK, 1)[0]


def load_traces(named: Sequence[tuple[str, Path]], requests: int | None, rate_scale: float | Sequence[float]
                ) -> dict[str, TrafficWorkload]:
    """Each trace read (measure/replay.py's load_file), its first `requests`, open loop at its timestamps times
    each rate scale: named as given for one scale, `NAME@Xx` for each of several."""
    scales = (rate_scale,) if isinstance(rate_scale, float | int) else tuple(rate_scale)
    traces = {}
    for name, path in named:
        try:
            workload = load_file(path)
        except ValueError as exc:
            raise SystemExit(f"error: --trace {name}={path}: {exc}") from None
        if workload.arrivals is not Arrivals.open:
            raise SystemExit(f"error: --trace {name}={path}: not every line has a timestamp (an open-loop replay "
                             "needs them)")
        taken = workload.taking(requests) if requests else workload
        for scale in scales:
            key = name if len(scales) == 1 else f"{name}{RATE_MARK}{scale:g}x"
            traces[key] = taken.paced(Arrivals.open, rate_scale=scale)
    return traces


# -- the targets --------------------------------------------------------------------------------------------

def fit_target_mib(total_bytes: int, used_bytes: int, budget_bytes: int) -> int:
    """llama-server's --fit-target (the free memory it must leave, MiB) for it to see `budget_bytes` free."""
    return max(0, (total_bytes - used_bytes - budget_bytes) // MiB)


def server_choice(props: Mapping[str, Any] | None, slots: Any) -> dict[str, Any]:
    """What a server chose for itself, from GET /props (llama-server's and ours say the same) and, where it says
    nothing, GET /slots (llama-server's is a list of slots): context per slot and slots, None where neither says."""
    props = props or {}
    listed = slots if isinstance(slots, list) else []
    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx") \
        or next((s.get("n_ctx") for s in listed if isinstance(s, dict)), None)
    return {"n_ctx_per_slot": n_ctx, "slots": props.get("total_slots") or len(listed) or None}


async def read_choice(target: HttpTarget) -> dict[str, Any]:
    """GET /props and /slots at the server's root (what it chose), never failing the run."""
    import httpx

    root = target.base_url.removesuffix("/v1")
    answers: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        for path in ("props", "slots"):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = await client.get(f"{root}/{path}")
                answers[path] = resp.json() if resp.status_code == 200 else None
    props = answers.get("props") if isinstance(answers.get("props"), dict) else None
    kept = {k: v for k, v in (props or {}).items() if k != "chat_template"}
    return {**server_choice(props, answers.get("slots")), "props": kept or None}


@dataclass
class Launcher:
    """Starts targets: llama-server from its binary, our app in one Ray and Serve started at its first use."""

    model: Path
    binary: str | None
    tokenizer: Tokenizer
    fit_target_mib: int | None
    vram_budget: int | None
    start_timeout_s: float
    request_timeout_s: float
    serve_port: int | None = None
    num_gpus: int = 0
    stopped: list[str] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def open(self, spec: TargetSpec) -> AsyncIterator[HttpTarget]:
        """The target started (or reached), its choice read back into `extra`; stopped afterwards."""
        async with self._started(spec) as target:
            target.name = spec.name
            target.extra["choice"] = await read_choice(target)
            yield target

    def _started(self, spec: TargetSpec) -> contextlib.AbstractAsyncContextManager[HttpTarget]:
        from measure.targets import llama_server

        if spec.kind is not Kind.ours:
            assert self.binary is not None
            fit = () if self.fit_target_mib is None else ("--fit-target", str(self.fit_target_mib))
            return llama_server(self.binary, self.model, [*spec.server_args, *fit], self.start_timeout_s,
                                self.request_timeout_s, self.tokenizer)
        if spec.url is not None:
            return self._reached(spec)
        return self._deployed(spec)

    @contextlib.asynccontextmanager
    async def _reached(self, spec: TargetSpec) -> AsyncIterator[HttpTarget]:
        assert spec.url is not None
        target = HttpTarget(spec.name, spec.url, self.request_timeout_s, self.tokenizer)
        try:
            await target.preflight()
            yield target
        finally:
            await target.aclose()

    @contextlib.asynccontextmanager
    async def _deployed(self, spec: TargetSpec) -> AsyncIterator[HttpTarget]:
        from measure import serve_app

        if self.serve_port is None:
            self.serve_port = await asyncio.to_thread(serve_app.start_serve, self.num_gpus, None)
        words: dict[str, Any] = {"config": str(spec.config), "model": str(self.model)}
        if self.vram_budget is not None:
            words["vram_budget"] = self.vram_budget
        name = serve_app.APP_NAME if spec.name == Kind.ours.value else spec.name
        async with serve_app.deployed(self.serve_port, words, self.start_timeout_s, self.request_timeout_s, name,
                                      tokenizer=self.tokenizer) as target:
            yield target

    def close(self) -> None:
        if self.serve_port is not None:
            from measure import serve_app

            serve_app.stop_serve()
            self.serve_port = None


# -- measuring ----------------------------------------------------------------------------------------------

@dataclass
class Bench:
    """The replays: every one with a salt never used before in this run, each a progress line on stderr."""

    traces: Mapping[str, TrafficWorkload]
    slo: Slo
    warmup_requests: int
    filler: str = field(default_factory=source_text)
    salts: int = 0
    runs: list[Run] = field(default_factory=list)
    warmups: list[Run] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    started: dict[str, dict[str, Any]] = field(default_factory=dict)  # target -> what it ran, as it said

    async def replay(self, target: HttpTarget, round_: int, trace: str, workload: TrafficWorkload) -> Run | None:
        self.salts += 1
        t0 = time.perf_counter()
        try:
            figures = await Replayer(workload, self.slo, self.filler, salt=self.salts).run(target)
        except Exception as exc:  # noqa: BLE001 (a replay that did not finish: reported, the others go on)
            self.failures.append(Failure(round_, target.name, f"replay {trace}", f"{type(exc).__name__}: {exc}"))
            say(f"{target.name}: replay of {trace} failed: {exc}")
            return None
        label = "warm-up" if round_ < 0 else f"round {round_ + 1}"
        say(f"[{label}] {trace} on {target.name}: goodput {figures.goodput_rps:.3f} req/s "
            f"({figures.goodput_tok_s:.1f} tok/s), {figures.failed}/{figures.requests} failed, SLO "
            f"{figures.slo.describe()} ({time.perf_counter() - t0:.1f} s)")
        return Run(round_, trace, target.name, self.salts, figures)

    async def warm(self, spec: TargetSpec, target: HttpTarget) -> None:
        """The first requests of each of its traces once, not counted: a fresh server's first requests pay its
        warm-up (allocations, graphs), which is no part of serving."""
        self.started.setdefault(spec.name, target.describe())
        if not self.warmup_requests:
            return
        for name, workload in self.traces.items():
            if spec.replays(name) and (run := await self.replay(target, -1, name,
                                                                workload.taking(self.warmup_requests))):
                self.warmups.append(run)

    async def measure(self, spec: TargetSpec, target: HttpTarget, round_: int) -> None:
        for name, workload in self.traces.items():
            if spec.replays(name) and (run := await self.replay(target, round_, name, workload)):
                self.runs.append(run)

    def start_failed(self, round_: int, spec: TargetSpec, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"
        self.failures.append(Failure(round_, spec.name, "start", error))
        say(f"{spec.name}: failed to start: {error}")


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def run_per_round(bench: Bench, launcher: Launcher, specs: Sequence[TargetSpec], rounds: int) -> None:
    """One target at a time, every round, in an order rotated by the round."""
    for r in range(rounds):
        for spec in rotated(specs, r):
            say(f"round {r + 1}/{rounds}: starting {spec.name}")
            try:
                async with launcher.open(spec) as target:
                    await bench.warm(spec, target)
                    await bench.measure(spec, target, r)
            except Exception as exc:  # noqa: BLE001 (a target that failed: reported, the rest still runs)
                bench.start_failed(r, spec, exc)


async def run_once(bench: Bench, launcher: Launcher, specs: Sequence[TargetSpec], rounds: int) -> None:
    """Every target started once and living through the rounds, replayed on in an order rotated by the round."""
    async with contextlib.AsyncExitStack() as stack:
        live: list[tuple[TargetSpec, HttpTarget]] = []
        for spec in specs:
            say(f"starting {spec.name}")
            try:
                target = await stack.enter_async_context(launcher.open(spec))
                await bench.warm(spec, target)
                live.append((spec, target))
            except Exception as exc:  # noqa: BLE001 (a target that failed: reported, the rest still runs)
                bench.start_failed(0, spec, exc)
        for r in range(rounds):
            for spec, target in rotated(live, r):
                await bench.measure(spec, target, r)


def gpu_memory() -> tuple[int, int, int] | None:
    """(GPUs, total bytes, used bytes) of the first visible GPU, or None without one."""
    from measure.device import Gpu

    gpu = Gpu.open()
    if gpu is None:
        return None
    return len(gpu.indices), int(gpu.info()["memory_total_bytes"]), gpu.used()


async def measure_all(args: argparse.Namespace, traces: Mapping[str, TrafficWorkload]) -> Bench:
    from measure.targets import vocabulary

    gpu = gpu_memory()
    if args.vram_budget is not None and gpu is None:
        raise SystemExit("error: --vram-budget needs a GPU (none is visible)")
    fit = None if gpu is None or args.vram_budget is None else fit_target_mib(gpu[1], gpu[2], args.vram_budget)
    start = Start(args.start)
    if start is Start.auto:
        start = Start.once if gpu is None else Start.per_round
    bench = Bench(traces, args.slo, args.warmup_requests)
    with vocabulary(args.model) as tokenize:
        launcher = Launcher(args.model, args.llama_server, tokenize, fit, args.vram_budget, args.start_timeout,
                            args.request_timeout, num_gpus=gpu[0] if gpu else 0)
        try:
            runner = run_once if start is Start.once else run_per_round
            await runner(bench, launcher, args.specs, args.rounds)
        finally:
            launcher.close()
    return bench


# -- the table (pure: unit-tested on constructed figures) -----------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One target on one trace over the rounds: medians, failures summed, goodput paired against defaults."""

    target: str
    rounds: int
    met: int
    goodput_rps: float
    goodput_tok_s: float
    throughput_rps: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    itl_p50_s: float
    itl_p95_s: float
    failed: int
    requests: int
    errors: tuple[str, ...]
    goodput_ratio: float | None  # goodput req/s / defaults', median of per-round ratios
    goodput_tok_ratio: float | None
    not_started: str = ""


def by_round(runs: Sequence[Run], trace: str, target: str) -> dict[int, ReplayFigures]:
    return {r.round: r.figures for r in runs if r.trace == trace and r.target == target and r.round >= 0}


def _median_of(figures: Sequence[ReplayFigures], pick: Callable[[ReplayFigures], float]) -> float:
    return median([pick(f) for f in figures])


def _pct(figures: ReplayFigures, key: str) -> float:
    spread = figures.percentiles.get(key)
    return spread.value if spread is not None else math.nan


def trace_rows(runs: Sequence[Run], failures: Sequence[Failure], trace: str, targets: Sequence[str]) -> list[Row]:
    """Every target's row on `trace`, ratios to `defaults` where it ran."""
    reference = by_round(runs, trace, REFERENCE)
    rows = []
    for target in targets:
        rounds = by_round(runs, trace, target)
        figures = list(rounds.values())
        med = functools.partial(_median_of, figures)
        starts = [f.error for f in failures if f.target == target and f.stage == "start"]
        errors = tuple(dict.fromkeys(e for f in figures for e in f.errors))[:3]
        rows.append(Row(
            target=target, rounds=len(figures), met=sum(1 for f in figures if f.slo.met),
            goodput_rps=med(lambda f: f.goodput_rps), goodput_tok_s=med(lambda f: f.goodput_tok_s),
            throughput_rps=med(lambda f: f.throughput_rps), output_tok_s=med(lambda f: f.output_tok_s),
            ttft_p50_s=med(lambda f: _pct(f, "ttft_p50")), ttft_p95_s=med(lambda f: _pct(f, "ttft_p95")),
            itl_p50_s=med(lambda f: _pct(f, "itl_p50")), itl_p95_s=med(lambda f: _pct(f, "itl_p95")),
            failed=sum(f.failed for f in figures), requests=sum(f.requests for f in figures), errors=errors,
            goodput_ratio=paired_ratio({r: f.goodput_rps for r, f in rounds.items()},
                                       {r: f.goodput_rps for r, f in reference.items()}),
            goodput_tok_ratio=paired_ratio({r: f.goodput_tok_s for r, f in rounds.items()},
                                           {r: f.goodput_tok_s for r, f in reference.items()}),
            not_started=starts[0] if starts and not figures else ""))
    return rows


def _number(value: float, spec: str) -> str:
    return "n/a" if math.isnan(value) else format(value, spec)


def trace_table(trace: str, describe: str, rows: Sequence[Row], slo: str) -> str:
    lines = [f"### Trace `{trace}`", "", f"{describe}. SLO {slo}; ratios to `{REFERENCE}`, paired by round.", "",
             "| target | goodput req/s | goodput tok/s | goodput vs defaults | throughput req/s | output tok/s "
             "| TTFT p50 | TTFT p95 | ITL p50 | ITL p95 | SLO met | failed | first errors |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        if r.not_started:
            lines.append(f"| {r.target} | did not start: {_cell(r.not_started)} |" + " |" * 11)
            continue
        lines.append(
            f"| {r.target} | {goodput_text(r.goodput_rps)} | {_number(r.goodput_tok_s, '.1f')} "
            f"| {ratio_text(r.goodput_ratio)} | {_number(r.throughput_rps, '.3f')} | {_number(r.output_tok_s, '.1f')} "
            f"| {seconds(r.ttft_p50_s)} | {seconds(r.ttft_p95_s)} | {seconds(r.itl_p50_s)} | {seconds(r.itl_p95_s)} "
            f"| {r.met}/{r.rounds} | {r.failed}/{r.requests} | {_cell('; '.join(r.errors))} |")
    return "\n".join(lines) + "\n"


def _cell(text: str, limit: int = 160) -> str:
    """Text that stays inside one markdown cell."""
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def servers_table(started: Mapping[str, Mapping[str, Any]], specs: Sequence[TargetSpec]) -> str:
    """What each target ran: its command or config, and the context and slots it chose or was given."""
    lines = ["### Targets", "", "| target | ran | context per slot | slots |", "| --- | --- | ---: | ---: |"]
    for spec in specs:
        seen = started.get(spec.name, {})
        choice = seen.get("choice") or {}
        ran = seen.get("command") or (f"config {spec.config}" if spec.config else spec.url) or "(did not start)"
        lines.append(f"| {spec.name} | `{_cell(str(ran), 300)}` | {choice.get('n_ctx_per_slot', 'n/a')} "
                     f"| {choice.get('slots', 'n/a')} |")
    return "\n".join(lines) + "\n"


def summary(bench: Bench, specs: Sequence[TargetSpec], traces: Sequence[str]) -> dict[str, list[Row]]:
    """Per trace, the rows of the targets that replay it."""
    return {t: trace_rows(bench.runs, bench.failures, t, [s.name for s in specs if s.replays(t)]) for t in traces}


@dataclass(frozen=True)
class Held:
    """One target on one trace replayed at several rates: the offered rate of each replay (requests/s) and
    whether the target met the SLO there in every round; `holds_rps` is the highest rate it met it at, 0.0
    where it met it at none (None: it ran at no rate)."""

    trace: str
    target: str
    rates: tuple[tuple[float, bool, float], ...]  # (offered req/s, SLO met in every round, goodput req/s)
    holds_rps: float | None


def capacity(rows: Mapping[str, Sequence[Row]], traces: Mapping[str, TrafficWorkload]) -> list[Held]:
    """Per trace replayed at several rates and per target: the rates it was offered and the highest it held."""
    out = []
    for base in dict.fromkeys(base_trace(t) for t in traces):
        names = [t for t in traces if base_trace(t) == base and t != base]
        if len(names) < 2:
            continue
        for target in dict.fromkeys(r.target for t in names for r in rows.get(t, ())):
            rates = []
            for t in sorted(names, key=lambda n: traces[n].rate_scale):
                row = next((r for r in rows.get(t, ()) if r.target == target and r.rounds), None)
                if row is not None:
                    offered = (traces[t].rate_per_s or 0.0) * traces[t].rate_scale
                    rates.append((offered, row.met == row.rounds, row.goodput_rps))
            held = [rate for rate, met, _ in rates if met]
            out.append(Held(base, target, tuple(rates), max(held) if held else (0.0 if rates else None)))
    return out


def capacity_table(helds: Sequence[Held]) -> str:
    """The table of what each target holds within the SLO; empty without a trace replayed at several rates."""
    if not helds:
        return ""
    lines = ["### Requests a second each target holds within the SLO", "",
             f"The highest offered rate at which a target met the SLO in every round, and that rate against "
             f"`{REFERENCE}`'s; then each rate's goodput (requests/s), marked where the SLO was met.", "",
             "| trace | target | holds, req/s | vs defaults | goodput at each offered rate |",
             "| --- | --- | ---: | ---: | --- |"]
    reference = {h.trace: h.holds_rps for h in helds if h.target == REFERENCE}
    for h in helds:
        ref = reference.get(h.trace)
        versus = (f"{h.holds_rps / ref:.2f}" if h.holds_rps is not None and ref else
                  "above" if h.holds_rps and ref == 0.0 else "n/a")
        each = ", ".join(f"{good:.3f} at {rate:.2f}{' (met)' if met else ''}" for rate, met, good in h.rates)
        held = "n/a" if h.holds_rps is None else ("none" if h.holds_rps == 0 else f"{h.holds_rps:.2f}")
        lines.append(f"| {h.trace} | {h.target} | {held} | {versus} | {each} |")
    return "\n".join(lines) + "\n"


def markdown(bench: Bench, specs: Sequence[TargetSpec], traces: Mapping[str, TrafficWorkload], slo: str) -> str:
    rows = summary(bench, specs, list(traces))
    parts = [trace_table(t, traces[t].describe(), rows[t], slo) for t in traces]
    held = capacity_table(capacity(rows, traces))
    return "\n".join([*([held] if held else []), *parts, servers_table(bench.started, specs)])


def plot(rows: Mapping[str, Sequence[Row]], path: Path) -> bool:
    """Goodput per target per trace (req/s and tok/s), grouped bars; False where matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(rows)
    targets = list(dict.fromkeys(r.target for per_trace in rows.values() for r in per_trace))
    width = 0.8 / max(len(targets), 1)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in ((axes[0], "goodput_rps", "goodput, requests/s"),
                           (axes[1], "goodput_tok_s", "goodput, output tokens/s")):
        for i, target in enumerate(targets):
            values = [next((getattr(r, key) for r in rows[t] if r.target == target), math.nan) for t in traces]
            ax.bar([x + i * width for x in range(len(traces))], [0.0 if math.isnan(v) else v for v in values],
                   width, label=target)
        ax.set_xticks([x + width * (len(targets) - 1) / 2 for x in range(len(traces))], traces)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("goodput under the SLO, per trace (median over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- the report ---------------------------------------------------------------------------------------------

def run_dict(run: Run) -> dict[str, Any]:
    return {"round": run.round, "trace": run.trace, "target": run.target, "salt": run.salt,
            "figures": asdict(run.figures), "slo_met": run.figures.slo.met}


def report(args: argparse.Namespace, argv: Sequence[str], traces: Mapping[str, TrafficWorkload], bench: Bench
           ) -> dict[str, Any]:
    rows = summary(bench, args.specs, list(traces))
    paths = dict(args.trace)
    return {
        **provenance(), "command": shlex.join(["python", "scripts/bench_headline.py", *argv]),
        "model": str(args.model),
        "llama_server": {"binary": args.llama_server,
                         "version": llama_server_version(args.llama_server) if args.llama_server else None},
        "slo": str(args.slo), "rounds": args.rounds, "rate_scale": args.rate_scale, "vram_budget": args.vram_budget,
        "traces": {name: {"path": str(paths[base_trace(name)]), "describe": workload.describe(),
                          "requests": len(workload.requests)} for name, workload in traces.items()},
        "targets": {s.name: {**s.describe(), "started": bench.started.get(s.name)} for s in args.specs},
        "failures": [asdict(f) for f in bench.failures],
        "summary": {t: [asdict(r) for r in per_trace] for t, per_trace in rows.items()},
        "holds": [asdict(h) for h in capacity(rows, traces)],
        "warmup": [run_dict(r) for r in bench.warmups], "runs": [run_dict(r) for r in bench.runs],
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    traces = load_traces(args.trace, args.requests, args.rate_scale)
    for name, workload in traces.items():
        say(f"trace {name}: {workload.describe()}")
    bench = asyncio.run(measure_all(args, traces))
    text = markdown(bench, args.specs, traces, str(args.slo))
    print(text, flush=True)
    write_report(args.out, report(args, argv, traces, bench))
    args.out.with_suffix(".md").write_text(text, encoding="utf-8")
    drawn = plot(summary(bench, args.specs, list(traces)), args.out.with_suffix(".png"))
    say(f"wrote {args.out}, {args.out.with_suffix('.md')}" + (f" and {args.out.with_suffix('.png')}" if drawn else
                                                                " (no plot: matplotlib is not installed)"))
    return 1 if bench.failures and not bench.runs else 0
