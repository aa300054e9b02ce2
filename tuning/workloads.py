"""The traffic a study replays: `--workload` (the serving app's recorded traffic, a built-in, a file) and `--slo`
resolved into a TrafficPlan, which a trial runs on its engine (tuning/objective.py) instead of the fixed benchmark.

In place with no --workload, the app's own recorded traffic is the workload once it holds LIVE_MIN_REQUESTS
requests (fewer: the fixed benchmark, and the tuner says why). Every slot must hold the workload's largest
request, so the least context per slot is raised to it. Light: no Ray, no libllama (the tuner's `--help`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from measure.replay import Arrivals, Builtin, Replayer, TrafficWorkload, builtin, from_shapes, load_file
from measure.slo import Slo
from measure.targets import EngineTarget
from measure.workload import source_text
from tuning.errors import UserError
from serving.engine.memory import ModelShape
from tuning.options import BENCHMARK, LIVE, LIVE_MIN_REQUESTS, SearchOptions
from tuning.results import TrafficFigures
from tuning.serving_app import ServingApp, recorded_traffic

if TYPE_CHECKING:
    from serving.engine.core import Engine
    from serving.engine.traffic import TrafficSummary


@dataclass(frozen=True)
class TrafficPlan:
    """A study on a traffic workload: what each trial replays, and the latency targets it is judged by."""

    workload: TrafficWorkload
    slo: Slo

    def replay(self, engine: Engine, salt: int) -> TrafficFigures:
        """The workload replayed once on `engine` (its own event loop: call from a thread without one)."""
        replayer = Replayer(self.workload, self.slo, source_text(), salt)
        return TrafficFigures.of(asyncio.run(replayer.run(EngineTarget(engine))))


def traffic_plan(opts: SearchOptions, app: ServingApp | None,
                 recorded: Callable[[str], tuple[TrafficSummary, int | None]] = recorded_traffic
                 ) -> tuple[SearchOptions, TrafficPlan | None]:
    """The options settled (in place without --workload, the recorded traffic once it holds enough requests)
    and the TrafficPlan trials replay, or None for the fixed benchmark; a line saying which is printed.
    `recorded` reads an app's merged traffic (default: tuning.serving_app.recorded_traffic)."""
    name = opts.workload
    if name == BENCHMARK:
        return opts, None
    summary = None
    if app is not None and name in (None, LIVE):
        summary, missing = recorded(app.name)
        count = len(summary.recent)
        if missing:
            print(f"workload: {missing} replica(s) did not report their traffic", file=sys.stderr)
        if name is None and count < LIVE_MIN_REQUESTS:
            if opts.slo is not None:
                raise UserError(f"--slo without --workload replays the recorded traffic, but app {app.name!r} "
                                f"has recorded {count} requests (< {LIVE_MIN_REQUESTS}): pass --workload "
                                "chat|rag|agent|FILE")
            print(f"workload: the fixed benchmark (app {app.name!r} has recorded {count} client requests; its own "
                  f"traffic is replayed from {LIVE_MIN_REQUESTS} on, or pass --workload)", flush=True)
            return opts, None
        if count == 0:
            raise UserError(f"--workload live: app {app.name!r} has recorded no client request yet")
        name = LIVE
    if name is None:
        return opts, None
    try:
        if summary is not None:
            recent = summary.recent[-opts.replay_requests:]
            workload = from_shapes(recent, LIVE, f"live: the last {len(recent)} of {len(summary.recent)} requests "
                                   f"recorded by {len(summary.replicas)} replica(s)")
        elif name in {b.value for b in Builtin}:
            workload = builtin(Builtin(name), opts.replay_requests, opts.seed)
        else:
            workload = load_file(Path(name)).taking(opts.replay_requests)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    workload = workload.lengths_scaled(opts.length_scale)
    if opts.rate is not None:
        workload = workload.paced(Arrivals.open, rate_per_s=opts.rate, seed=opts.seed)
    elif workload.arrivals is Arrivals.open:
        workload = workload.paced(Arrivals.open, rate_scale=opts.rate_scale)
    else:
        workload = workload.paced(Arrivals.closed, concurrency=opts.concurrency)
    opts = replace(opts, workload=name)
    print(f"workload: {workload.describe()}; SLO: {opts.slo or 'none (goodput = throughput)'}", flush=True)
    return opts, TrafficPlan(workload, opts.slo or Slo())


def least_context(opts: SearchOptions, shape: ModelShape, traffic: TrafficPlan | None) -> int:
    """Tokens every slot must hold: --min-ctx-per-slot, else min(2048, the model's training context) raised to
    the workload's largest request (a config with less would fail it). An explicit value below that is kept,
    with a warning: those configs fail some requests, and the SLO counts them. So is a request longer than the
    model was trained for: the least is then the trained length, and the study runs. An explicit value over the
    trained length is the user's error (UserError): it is asked for, not recorded."""
    default = min(2048, shape.n_ctx_train or 2048)
    need = traffic.workload.max_context if traffic is not None else 0
    if opts.min_ctx_per_slot is not None:
        if shape.n_ctx_train and opts.min_ctx_per_slot > shape.n_ctx_train:  # asked for, not recorded: the user's
            raise UserError(f"--min-ctx-per-slot {opts.min_ctx_per_slot} is over the model's trained context of "
                            f"{shape.n_ctx_train} tokens: no config can hold it well; ask for at most "
                            f"{shape.n_ctx_train}")
        if opts.min_ctx_per_slot < need:
            print(f"warning: --min-ctx-per-slot {opts.min_ctx_per_slot} is below the {need} tokens the workload's "
                  "largest request needs: configs with less context per slot fail it", file=sys.stderr)
        return opts.min_ctx_per_slot
    if shape.n_ctx_train and need > shape.n_ctx_train:
        print(f"warning: the workload's largest request needs {need} tokens of context, over the model's training "
              f"context of {shape.n_ctx_train}: slots hold {shape.n_ctx_train}, and the requests longer fail in "
              "every config (the SLO counts them)", file=sys.stderr)
        return shape.n_ctx_train
    return max(default, need)
