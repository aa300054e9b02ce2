"""`python -m tuning.search --trials 40`: tune llama.cpp's settings with Ray Tune + Optuna, then apply the pick.

The seed article's afternoon of hand-tuning as a study: Optuna proposes engine configs (multi-objective:
single-stream and 4-way aggregate decode tok/s), each is checked against the memory budget from the GGUF
header before anything loads, Ray Tune runs the survivors on one GPU each (weights stay loaded, only the
context is rebuilt), and the pick is written to configs/tuned.yaml and pushed to a running Serve app.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the classic progress table with our columns
os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")  # Ctrl-C reaches main(): stop, and restore in place

# Nothing heavy at the top: `--help` and a bad flag answer at once. Ray, Optuna and the engine (whose
# serving/engine/llama.py loads ray before libllama) are imported where they are first needed.
from measure.workload import Workload  # noqa: E402
from serving.engine.config import (CacheType, EngineConfig, FlashAttn, SpecMode, default_threads,  # noqa: E402
                            load_engine_config)
from serving.engine.memory import GiB, ModelShape, parse_bytes, predict  # noqa: E402
from tuning.options import REPO_ROOT, DeviceChoice, Sampler, SearchOptions, Where, parse_options  # noqa: E402
from tuning.confirm import Candidate, Verdict  # noqa: E402
from tuning.gpus import TrialSlots, free_gpu_places  # noqa: E402
from tuning.report import Objective, TrialRow  # noqa: E402
from tuning.space import (PlacementFit, PlacementSearch, SearchSpace, SpaceFunction,  # noqa: E402
                          thread_choices, to_engine_config)
from tuning.workloads import TrafficPlan, UserError, least_context, traffic_plan  # noqa: E402

if TYPE_CHECKING:
    from tuning.inplace import ServingApp

ARTICLE_CONFIG = REPO_ROOT / "configs" / "article.yaml"
DEFAULT_OUT = SearchOptions().out
GPU_MARGIN = 1 * GiB


@dataclass
class Session:
    """What a run set up and must undo at its end: a Ray it started, and the app it tunes in place with
    whether its replicas were given a config (else main() gives them back what they served)."""

    started_ray: bool = False
    app: ServingApp | None = None
    settled: bool = False


def base_config(opts: SearchOptions) -> EngineConfig:
    overrides = {"model": opts.model} if opts.model else {}
    try:
        config = load_engine_config(opts.base_config, overrides)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if not config.model_path.is_file():
        raise UserError(f"model file {config.model_path} does not exist: pass --model PATH to a GGUF file")
    return config


def start_ray(opts: SearchOptions, session: Session) -> tuple[int, int]:
    """Connect to (or start) Ray; return (GPUs in the cluster, GPUs free now). Unless --offline, the cluster a
    Serve app runs in is joined when there is one; else a local Ray is started for the study."""
    import ray

    session.started_ray = not ray.is_initialized()
    if session.started_ray:
        if opts.ray_address is None and opts.where is not Where.offline:
            _join_serving_cluster(opts.serve_address)
        if not ray.is_initialized():
            if opts.where is Where.in_place and opts.ray_address is None:
                raise UserError(f"--in-place: no running Ray cluster at {opts.serve_address!r}; start the app first "
                                "(serve run serving.app:main)")
            with _quiet_ray_logs():
                ray.init(address=opts.ray_address, logging_level=logging.ERROR, log_to_driver=False,
                         include_dashboard=False)
    total = int(ray.cluster_resources().get("GPU", 0))
    free = int(ray.available_resources().get("GPU", 0))
    return total, free


def _join_serving_cluster(address: str) -> None:
    """Join the running Ray cluster at `address` ("auto": the one on this machine), if there is one."""
    import ray

    with _quiet_ray_logs():
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except (ConnectionError, RuntimeError):
            pass


@contextlib.contextmanager
def _quiet_ray_logs() -> Iterator[None]:
    """Ray's driver logs "Connecting to existing Ray cluster" / "Started a local Ray instance" at INFO before
    `logging_level` takes effect: the tuner's own first line should be the first thing a user reads."""
    logger = logging.getLogger("ray")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def serving_app(opts: SearchOptions, find: Callable[[str | None], ServingApp | None] | None = None
                ) -> ServingApp | None:
    """The Serve app an in-place study runs on, or None for offline trials: any app serving engine replicas in
    the connected cluster unless --offline; --in-place or --app-name make finding none an error. `find` looks
    the app up (default: tuning.inplace.find_serving_app, in the connected Ray cluster)."""
    if opts.where is Where.offline:
        return None
    if find is None:
        from tuning.inplace import find_serving_app  # imports ray.serve, which sets its logger to INFO

        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its handles' "Started <router>" is no news
        find = find_serving_app
    try:
        app = find(opts.app_name)
    except LookupError as exc:  # several apps and no --app-name
        raise UserError(str(exc)) from exc
    except Exception as exc:  # no Serve in this cluster, or its controller not answering
        if opts.where is Where.in_place:
            raise UserError(f"--in-place: cannot reach a Serve app ({type(exc).__name__}: {exc})") from exc
        return None
    if app is None:
        if opts.where is Where.in_place or opts.app_name is not None:
            named = f"named {opts.app_name!r} " if opts.app_name else ""
            raise UserError(f"no running Serve app {named}with engine replicas to tune in place; start one "
                            "(serve run serving.app:main), or pass --offline")
        return None
    if app.replicas < 1:
        raise UserError(f"Serve app {app.name!r} has no running engine replica (starting, or failed?); retry "
                        "when its /health answers 200, or pass --offline")
    return app


def trial_slots(opts: SearchOptions, total: int, free: int, app: ServingApp | None) -> TrialSlots:
    """Where offline trials run: every free GPU of the cluster, read on its node (none in place, where the replicas
    are the slots, with --device cpu, or on a cluster without GPUs)."""
    if app is not None or opts.device is DeviceChoice.cpu or total == 0 or free == 0:
        return TrialSlots()
    try:
        return TrialSlots(free_gpu_places(free))
    except RuntimeError as exc:
        raise UserError(f"{exc}: retry, or tune in place (drop --offline)") from exc


def choose_device(opts: SearchOptions, total: int, free: int, app: ServingApp | None = None,
                  slots: TrialSlots | None = None) -> bool:
    """True for GPU trials. A GPU cluster whose GPUs are all taken is an error, not a silent CPU run. Where the
    trials run in place, the replicas say whether their engines have a GPU, each read on its own node; offline,
    the GPUs' own nodes say it (`slots`): declared GPUs whose engines cannot offload (a CPU build of llama.cpp, or
    no GPU NVML can see) give CPU trials, one per declared GPU, as the serving replicas there run on the CPU."""
    if opts.device is DeviceChoice.cpu:
        return False
    if app is not None:
        return app.on_gpu
    if total == 0:
        if opts.device is DeviceChoice.gpu:
            raise UserError("--device gpu, but the Ray cluster has no GPU")
        return False
    if free == 0:
        raise UserError(f"no free GPU: the cluster's {total} GPU(s) are all in use (a Serve app holding them?); "
                        "tune in place (drop --offline), stop the app, or add GPUs")
    lacking = slots.without_offload() if slots is not None else []
    if slots is None or not lacking:
        return True
    where = ", ".join(sorted({f"{p.hostname} ({p.node_ip})" for p in lacking}))
    if opts.device is DeviceChoice.gpu or len(lacking) < len(slots.places):  # one study, one device kind
        raise UserError(f"GPU trials, but the engine cannot put layers on the GPU Ray gives it on {where} (a CPU "
                        "build of llama.cpp there, or no GPU NVML can see): build llama-cpp-python with CUDA there, "
                        "or pass --device cpu")
    return False


def ram_budget_bytes(opts: SearchOptions) -> int:
    """Host memory a config may take (weights left in host memory, their K/V, the CPU's buffers): --ram-budget,
    else three quarters of this machine's memory."""
    if opts.ram_budget:
        try:
            return parse_bytes(opts.ram_budget)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 3 // 4


def budget_bytes(opts: SearchOptions, on_gpu: bool, gpu_total: int | None = None) -> int:
    """--vram-budget, else on a GPU the smallest GPU the trials run on (`gpu_total`, read on its node) less a
    margin, else half of this machine's memory."""
    if opts.vram_budget:
        try:
            return parse_bytes(opts.vram_budget)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
    if on_gpu:
        if gpu_total is None:
            raise UserError("cannot read the GPU's memory size (NVML): pass --vram-budget")
        return gpu_total - GPU_MARGIN
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def placement_search(shape: ModelShape, base: EngineConfig, budget: int, on_gpu: bool,
                     space: SearchSpace, ctx: int, threads: int) -> PlacementSearch | None:
    """None when the whole model fits with the smallest config; else what to move to host memory, derived per
    point (tuning/space.py, PlacementFit): a mixture of experts keeps its attention and shared weights on the
    GPU and moves experts (per token it reads only the experts it is routed to, so this costs far less than
    moving whole layers); a dense model moves layers. With it, the threads for the CPU's share: the space's
    list, else (unless the base config sets them) the choices around `threads`, what the trial engines run by
    default; for a mixture of experts, the space's ends to take the layers from."""
    smallest = cheapest_config(base, space, ctx)
    if not on_gpu or predict(shape, smallest, on_gpu).total <= budget:
        return None
    searched = tuple(space.n_threads) or (() if base.n_threads else thread_choices(threads))
    fit = PlacementFit(shape, base, budget)
    return PlacementSearch(fit, searched, tuple(space.expert_end)) if shape.n_expert else PlacementSearch(fit, searched)


def cheapest_config(base: EngineConfig, space: SearchSpace, ctx: int) -> EngineConfig:
    order = [CacheType.q4_0, CacheType.q8_0, CacheType.f16]
    kv = next((t for t in order if t in space.type_k and t in space.type_v), space.type_v[0])
    params = {"n_parallel": min(space.n_parallel), "n_batch": min(space.n_batch), "n_ubatch": min(space.n_ubatch),
              "ctx_per_slot": ctx, "type_k": kv.value, "type_v": kv.value,
              "flash_attn": FlashAttn.on.value}
    return to_engine_config(params, base)


def check_possible(shape: ModelShape, base: EngineConfig, space: SearchSpace, ctx: int, budget: int,
                   on_gpu: bool) -> None:
    """Refuse a space none of whose configs can fit, before any trial runs."""
    cheapest = cheapest_config(base, space, ctx)
    need = predict(shape, cheapest.model_copy(update={"n_gpu_layers": 0}), on_gpu)
    if need.total > budget:
        raise UserError(
            f"impossible space: even the smallest config ({ctx} tokens per slot, {cheapest.n_parallel} slot(s), "
            f"{cheapest.type_k.value} cache) needs {need.total / GiB:.2f} GiB, over the budget of "
            f"{budget / GiB:.2f} GiB: lower --min-ctx-per-slot, or raise --vram-budget")


def article_point(base: EngineConfig, space: SearchSpace, contexts: list[int]) -> dict[str, Any] | None:
    """The article's final config as a point of this space (the baseline, evaluated first)."""
    article = load_engine_config(ARTICLE_CONFIG)
    ctx = article.n_ctx // article.n_parallel
    point = {"n_parallel": article.n_parallel, "n_batch": article.n_batch, "n_ubatch": article.n_ubatch,
             "ctx_per_slot": ctx, "type_k": article.type_k.value, "type_v": article.type_v.value}
    valid = (ctx in contexts and article.n_parallel in space.n_parallel and article.n_batch in space.n_batch
             and article.n_ubatch in space.n_ubatch and article.type_k in space.type_k
             and article.type_v in space.type_v)
    return point if valid else None


def make_sampler(name: Sampler, seed: int) -> Any:
    """Optuna's sampler; TPE and NSGA-II read the memory and quality constraints each trial carries
    (tuning/recording.py sets them), so infeasible configs steer the search away."""
    import optuna

    if name is Sampler.nsga2:
        return optuna.samplers.NSGAIISampler(seed=seed)
    if name is Sampler.random:
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=8)


def make_searcher(opts: SearchOptions, space: SearchSpace, contexts: list[int], placement: PlacementSearch | None,
                  baseline: dict[str, Any] | None, storage: Any, study_name: str, base: EngineConfig) -> Any:
    from tuning.recording import RecordingOptunaSearch

    return RecordingOptunaSearch(
        space=SpaceFunction(space, contexts, placement),
        metric=["single_tok_s", opts.objective.key], mode=["max", "max"],
        points_to_evaluate=[baseline] if baseline else None,
        sampler=make_sampler(opts.sampler, opts.seed), study_name=study_name, storage=storage, seed=opts.seed,
        first_is_baseline=baseline is not None, canonical=partial(to_engine_config, base=base),
    )


def open_storage(opts: SearchOptions) -> Any:
    import optuna

    url = opts.storage or f"sqlite:///{(opts.results_dir / 'optuna.db').resolve()}"
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    return optuna.storages.RDBStorage(url)


def run_study(*, opts: SearchOptions, settings: Any, searcher: Any, slots: TrialSlots, study_name: str,
              app: ServingApp | None) -> float:
    """The search: Ray Tune runs the trials the searcher proposes; returns its wall time in seconds."""
    from ray import tune
    from ray.tune import Callback, CLIReporter

    from tuning.inplace import FirstTrialNotice, ReplicaTrial
    from tuning.trial import EngineTrial

    if app is not None:  # each replica is a trial slot; the actor only talks to it
        trainable = tune.with_resources(tune.with_parameters(
            ReplicaTrial, settings=settings, app=app.name, study=study_name, trials=opts.trials), {"cpu": 0.01})
        at_once = app.replicas
    else:
        trainable = tune.with_resources(tune.with_parameters(EngineTrial, settings=settings), slots.resources)
        at_once = slots.count
    reporter = CLIReporter(
        parameter_columns=["n_parallel", "n_batch", "n_ubatch", "ctx_per_slot", "type_k", "type_v", "flash_attn"],
        metric_columns={"single_tok_s": "single", "aggregate_tok_s": "4-way" if not settings.traffic else "out tok/s",
                        **({"capacity_tok_s": "capacity"} if opts.min_stream_tok_s else {}),
                        **({"goodput_rps": "goodput"} if settings.traffic else {}), "feasible": "ok"},
        max_report_frequency=15,
    )
    callbacks: list[Callback] = [FirstTrialNotice(opts.trials, at_once)] if app is not None else []
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=opts.trials, reuse_actors=True,
                                    max_concurrent_trials=at_once),
        run_config=tune.RunConfig(name=study_name, storage_path=str((opts.results_dir / "ray").resolve()),
                                  stop={"training_iteration": 1}, progress_reporter=reporter, verbose=1,
                                  callbacks=callbacks),
    )
    logging.getLogger("ray.tune").setLevel(logging.ERROR)  # the progress table says it all; not INFO lines too
    t0 = time.perf_counter()
    tuner.fit()
    return time.perf_counter() - t0


def finish(*, opts: SearchOptions, session: Session, storage: Any, study_name: str, base: EngineConfig,
           context: dict[str, Any], settings: Any) -> int:
    """After the search: the pick (confirmed), the report and plots, configs written, the pick applied."""
    import optuna

    from tuning import report
    from tuning.writeback import apply_to_serve, write_config

    study = optuna.load_study(study_name=study_name, storage=storage)
    rows = report.rows_from_study(study, opts.objective)
    winner = report.pick(rows, opts.prefer)
    out_dir = opts.results_dir / study_name
    out_dir.mkdir(parents=True, exist_ok=True)
    confirmed: Confirmation | None = None
    if winner is not None and opts.confirm_rounds > 0:
        confirmed = confirm_pick(opts, rows, winner, base, settings, study_name, session.app)
        winner = confirmed.row if confirmed is not None and confirmed.row is not None else winner
    if confirmed is not None and confirmed.verdict.keeps_served:
        return keep_served(opts, rows, winner, confirmed, context, out_dir)
    report.plot(rows, winner, out_dir / "pareto.png")
    capacity_plot = "capacity.png" if opts.min_stream_tok_s is not None and report.plot_capacity(
        rows, opts.min_stream_tok_s, out_dir / "capacity.png") else None
    loads, load_s = report.weight_loads(rows)
    answered = sum(1 for r in rows if r.answered_from is not None)
    loads_label = ("weight loads (the serving replicas' totals, their own start-up included)"
                   if session.app is not None else "weight loads (all actors)")
    context = {**context, "trials in study": len(rows),
               "answered from an earlier trial of the same engine config": answered,
               loads_label: loads, "time loading weights": f"{load_s:.1f} s"}
    summary = pick_summary(study_name, winner, rows, confirmed, opts) if winner is not None else None
    text = report.markdown(rows, winner, opts.prefer.value, context, "pareto.png", capacity_plot, summary)
    write_report(out_dir, text, confirmed)
    if winner is None or summary is None:
        print(f"{report.no_pick(rows)} Nothing written.", file=sys.stderr)
        return 1
    tuned = to_engine_config(winner.params, base)
    write_config(opts.out, tuned, header=summary)
    print(f"pick: {summary}\nwritten: {opts.out}")
    if not opts.apply:
        return 0
    if session.app is None and opts.where is Where.auto:  # looked for one before the study: none was serving
        print(f"no Serve app was serving: the next `serve run serving.app:main` loads {opts.out}"
              if opts.out == DEFAULT_OUT else "no Serve app was serving: only the file was written")
        return 0
    if session.started_ray and session.app is None:  # --offline beside an app: it is in another cluster; join it
        import ray

        ray.shutdown()
    result = apply_to_serve(tuned, app_name=opts.app_name, address=opts.serve_address)
    print(f"live apply: {result.message}")
    session.settled = result.applied
    return 0


def write_report(out_dir: Path, text: str, confirmed: Confirmation | None) -> None:
    """report.md, with the confirmation round's section (when it ran) before the Pareto front."""
    if confirmed is not None:
        text = text.replace("\n## Pareto front", f"\n{confirmed.section}\n## Pareto front", 1)
    (out_dir / "report.md").write_text(text)
    print(f"\nreport: {out_dir / 'report.md'}  plot: {out_dir / 'pareto.png'}")


def keep_served(opts: SearchOptions, rows: list[TrialRow], best: TrialRow | None, confirmed: Confirmation,
                context: dict[str, Any], out_dir: Path) -> int:
    """In place, when no candidate beat the config served now: the report says so, and nothing is written
    or applied (the replicas keep serving as they are)."""
    from tuning import report

    summary = confirmed.summary(opts.objective)
    report.plot(rows, best, out_dir / "pareto.png")
    write_report(out_dir, report.markdown(rows, best, opts.prefer.value, context, "pareto.png", kept=summary),
                 confirmed)
    print(f"pick: {summary}. Nothing written or applied.")
    return 0


def pick_summary(study_name: str, winner: TrialRow, rows: list[TrialRow], confirmed: Confirmation | None,
                 opts: SearchOptions) -> str:
    """The one sentence on the pick that the pick line, tuned.yaml's header and the report all carry: the
    confirmation round's medians and paired ratios when it ran, else the search's single measurement."""
    from tuning import report

    if confirmed is not None:
        single, second = confirmed.figures()
        outcome = confirmed.summary(opts.objective)
    else:
        single, second = winner.single, winner.second
        outcome = report.gain(winner, next((r for r in rows if r.is_baseline), None))
    traffic = winner.result.traffic
    if traffic is not None:
        return (f"study {study_name}, trial {winner.number} ({opts.prefer.value} pick) on workload {traffic.workload}: "
                f"{second:.2f} {opts.objective.label} (SLO {traffic.slo_outcome} in the search), {single:.1f} tok/s "
                f"median stream; {outcome}")
    return (f"study {study_name}, trial {winner.number} ({opts.prefer.value} pick): {single:.1f} tok/s single, "
            f"{second:.1f} {opts.objective.label}; {outcome}")


def confirmation_candidates(rows: list[TrialRow], winner: TrialRow, base: EngineConfig, top: int,
                            prefer: str) -> list[TrialRow]:
    """The pick and the next best of the Pareto front, `top` distinct engine configs in all (a re-run study
    can hold one config twice), then the article baseline when it ran and is not among them."""
    from tuning import report

    ranked = sorted(report.pareto_front(rows), key=lambda r: (r.second, r.single), reverse=True)
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


def confirm_pick(opts: SearchOptions, rows: list[TrialRow], winner: TrialRow, base: EngineConfig, settings: Any,
                 study_name: str, app: ServingApp | None) -> Confirmation | None:
    """The search's best few, the baseline and (in place) the served config measured again, interleaved
    (tuning/confirm.py): the pick on paired ratios. None when there is nothing to compare the pick with."""
    from tuning import confirm

    chosen = confirmation_candidates(rows, winner, base, opts.confirm_top, opts.prefer)
    candidates = [confirm.Candidate(r.number, r.label(), to_engine_config(r.params, base), r.is_baseline,
                                    memory=r.result.mem_measured or r.result.mem_predicted) for r in chosen]
    if app is not None:
        candidates = with_served(candidates, app.serving, settings)
    if len(candidates) < 2:
        return None
    reference = next((i for i, c in enumerate(candidates) if c.is_baseline), 0)  # else the search's pick
    print(f"confirmation: {len(candidates)} candidates x {opts.confirm_rounds} rounds, interleaved")
    with confirmation_measure(app=app, workload=settings.workload, on_gpu=settings.on_gpu, study=study_name,
                              total_trials=opts.trials + opts.confirm_rounds * len(candidates),
                              objective=opts.objective, traffic=settings.traffic) as measure:
        confirmed = confirm.confirm(candidates, reference, opts.confirm_rounds, measure, progress=print)
    verdict = confirm.decide(confirmed, opts.prefer)
    noise = " (within noise)" if verdict.within_noise else ""
    print(f"confirmed pick: {verdict.pick.candidate.name}{noise}")
    picked = next((r for r in rows if r.number == verdict.pick.candidate.number), None)
    section = confirm.markdown(confirmed, verdict, candidates[reference], opts.confirm_rounds, opts.objective.label)
    return Confirmation(picked, verdict, candidates[reference], opts.confirm_rounds, section)


def with_served(candidates: list[Candidate], serving: EngineConfig, settings: Any) -> list[Candidate]:
    """In place, the config the replicas serve now joins the candidates (a pick must beat it): marked on the
    candidate that is it, else added (trial number -1, its memory predicted from the GGUF header)."""
    from tuning.report import config_label

    if any(c.config == serving for c in candidates):
        return [replace(c, is_served=c.config == serving) for c in candidates]
    memory = predict(settings.shape, serving, settings.on_gpu).total
    return [*candidates, Candidate(-1, config_label(serving), serving, memory=memory, is_served=True)]


@contextlib.contextmanager
def confirmation_measure(*, app: ServingApp | None, workload: Workload, on_gpu: bool, study: str,
                         total_trials: int, objective: Objective, traffic: TrafficPlan | None = None
                         ) -> Iterator[Callable[[EngineConfig], Any]]:
    """`config -> Figures` for the confirmation round: on a serving replica in place, else on one engine of
    our own in a Ray actor (one more weight load); on a traffic workload each measurement is its replay."""
    import itertools

    from tuning.confirm import Figures
    from tuning.objective import SpeedMeasure
    from tuning.results import SpeedFigures

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


def run(opts: SearchOptions, session: Session) -> int:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # "A new study created": the plan line says it
    if opts.where is Where.offline:
        base_config(opts)  # a bad --model is reported before any Ray starts
    total, free = start_ray(opts, session)
    app = session.app = serving_app(opts)
    opts, traffic = traffic_plan(opts, app)
    # in place, the replicas' own model and settings are the study's base (--model and --base-config unused)
    base = app.serving if app is not None else base_config(opts)
    try:
        shape = ModelShape.from_gguf(base.model_path)
        space = SearchSpace.from_yaml(opts.space)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if SpecMode.draft in space.spec_mode and base.draft_model is None:
        raise UserError("the search space lists spec_mode draft, but the base config has no draft_model: set it "
                        "(a GGUF sharing the model's vocabulary) or drop draft from the space")
    min_ctx = least_context(opts, shape, traffic)
    try:
        contexts = space.contexts(min_ctx)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    slots = trial_slots(opts, total, free, app)
    on_gpu = choose_device(opts, total, free, app, slots)
    budget = budget_bytes(opts, on_gpu, app.gpu_memory_total if app is not None else slots.gpu_memory_total)
    check_possible(shape, base, space, contexts[0], budget, on_gpu)
    threads = (app.threads if app is not None else slots.threads) or default_threads()
    placement = placement_search(shape, base, budget, on_gpu, space, contexts[0], threads)
    # in place measures other conditions (live replicas, the whole device's memory): a study of its own
    where = "-inplace" if app is not None else ""
    on = f"-{traffic.workload.name}" if traffic is not None else ""
    study_name = opts.study_name or (f"{base.model_path.stem}-{'gpu' if on_gpu else 'cpu'}-{budget // 2**20}MiB"
                                     f"{on}{where}")
    storage = open_storage(opts)
    baseline = article_point(base, space, contexts) if not _study_has_trials(storage, study_name) else None

    from tuning.trial import TrialSettings

    workload = Workload(gen_tokens=opts.gen_tokens, repeats=opts.repeats, prompt_set=opts.workload_prompt_set,
                        report_copy=opts.prompt_set == "both", min_stream_tok_s=opts.min_stream_tok_s)
    settings = TrialSettings(base=base, shape=shape, budget_bytes=budget, on_gpu=on_gpu, workload=workload,
                             max_quality_loss=opts.max_quality_loss, traffic=traffic,
                             ram_budget_bytes=ram_budget_bytes(opts))
    searcher = make_searcher(opts, space, contexts, placement, baseline, storage, study_name, base)
    print(plan_line(opts, base, app, on_gpu, slots, budget, min_ctx), flush=True)
    wall = run_study(opts=opts, settings=settings, searcher=searcher, slots=slots, study_name=study_name, app=app)
    context = {"model": base.model_path.name, "device": "GPU" if on_gpu else "CPU",
               "trials ran": (f"in place, on app {app.name!r}" if app else
                              f"offline (engines of the tuner's own; {slots_text(slots, on_gpu)})"),
               "budget": f"{budget / GiB:.2f} GiB", "min context per slot": min_ctx,
               "max quality loss": f"{opts.max_quality_loss} nats/token", "sampler": opts.sampler.value,
               **({"workload": traffic.workload.describe(), "SLO": str(opts.slo or "none")} if traffic else
                  {"prompt set": opts.prompt_set}),
               "objectives": f"{opts.objective.first_label}, {opts.objective.label}",
               **({"capacity floor": f"{opts.min_stream_tok_s} tok/s per stream"} if opts.min_stream_tok_s else {}),
               "study": study_name, "this run": f"{opts.trials} trials in {wall:.0f} s"}
    return finish(opts=opts, session=session, storage=storage, study_name=study_name, base=base, context=context,
                  settings=settings)


def plan_line(opts: SearchOptions, base: EngineConfig, app: ServingApp | None, on_gpu: bool, slots: TrialSlots,
              budget: int, min_ctx: int) -> str:
    """The one line printed before the first trial: what will be tuned, where, and what it does to clients."""
    what = (f"tuning {base.model_path.name} on {'GPU' if on_gpu else 'CPU'}, budget {budget / GiB:.2f} GiB, "
            f">= {min_ctx} tokens per slot, {opts.trials} trials")
    if app is not None:
        return (f"{what}, in place on Serve app {app.name!r} ({app.replicas} replica(s), one trial each at a "
                "time): a trial takes its replica's engine between client requests, which wait meanwhile (how "
                "long is printed after the first trial); Ctrl-C puts back the config served now; --offline "
                "tunes on engines of the tuner's own instead")
    apply = ("then applied to the running app" if opts.apply and opts.where is Where.offline else
             "which the next `serve run serving.app:main` loads" if opts.out == DEFAULT_OUT else "")
    return (f"{what}, offline ({slots_text(slots, on_gpu)}, engines of the tuner's own); "
            f"the pick goes to {opts.out}{', ' + apply if apply else ''}")


def slots_text(slots: TrialSlots, on_gpu: bool) -> str:
    """How many trials run at a time, and where."""
    if not slots.places:
        return "1 trial at a time"
    nodes = f" on {slots.nodes} nodes" if slots.nodes > 1 else ""
    engines = "" if on_gpu else " (their engines on the CPU: none can put layers on its GPU)"
    return f"{slots.count} trial(s) at a time, one per GPU{nodes}{engines}"


def _study_has_trials(storage: Any, study_name: str) -> bool:
    import optuna

    try:
        return len(optuna.load_study(study_name=study_name, storage=storage).trials) > 0
    except KeyError:
        return False


def restore_serving(opts: SearchOptions, app: ServingApp) -> Any:
    """An in-place study that ends without applying a pick: the replicas get back what they served."""
    from tuning.writeback import apply_to_serve

    return apply_to_serve(app.serving, app_name=app.name, address=opts.serve_address)


def main(argv: list[str] | None = None) -> int:
    opts = parse_options(argv)
    session = Session()
    try:
        return run(opts, session)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the study is saved and resumes with the same --study-name", file=sys.stderr)
        return 130
    finally:
        if session.app is not None and not session.settled:  # no pick applied: what they served
            print(f"restore: {restore_serving(opts, session.app).message}", file=sys.stderr)
        if session.started_ray:  # leave no Ray of ours behind (a caller's own Ray stays up)
            import ray

            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
