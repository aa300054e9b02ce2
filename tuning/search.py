"""`python -m tuning.search --trials 40`: tune llama.cpp's settings with Ray Tune + Optuna, then apply the pick.

The seed article's afternoon of hand-tuning as a study: Optuna proposes engine configs (multi-objective:
single-stream and 4-way aggregate decode tok/s), each is checked against the memory budget from the GGUF
header before anything loads, Ray Tune runs the survivors on one GPU each (weights stay loaded, only the
context is rebuilt), and the pick is written to configs/tuned.yaml and pushed to a running Serve app.

This module is the command and the run: the plan is settled once (tuning/plan.py), the app found in
tuning/serving_app.py, the pick confirmed in tuning/confirm.py, written back by tuning/writeback.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the classic progress table with our columns
os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")  # Ctrl-C reaches main(): stop, and restore in place

# Nothing heavy at the top: `--help` and a bad flag answer at once. Ray, Optuna and the engine (whose
# serving/engine/llama.py loads ray before libllama) are imported where they are first needed.
from serving.engine.config import EngineConfig, load_engine_config  # noqa: E402
from tuning.confirm import Confirmation, confirm_pick  # noqa: E402
from tuning.errors import UserError  # noqa: E402
from tuning.gpus import TrialSlots  # noqa: E402
from serving.engine.units import GiB  # noqa: E402
from tuning.options import REPO_ROOT, Prefer, Sampler, SearchOptions, Where, parse_options  # noqa: E402
from tuning.plan import StudyPlan, base_config, study_plan  # noqa: E402
from tuning.report import Objective, TrialRow  # noqa: E402
from tuning.serving_app import ServingApp, serving_app  # noqa: E402
from tuning.space import SearchSpace, SpaceFunction, to_engine_config  # noqa: E402

ARTICLE_CONFIG = REPO_ROOT / "configs" / "article.yaml"
DEFAULT_OUT = SearchOptions().out


@dataclass
class Session:
    """What a run set up and must undo at its end: a Ray it started, and the app it tunes in place with
    whether its replicas were given a config (else main() gives them back what they served)."""

    started_ray: bool = False
    app: ServingApp | None = None
    settled: bool = False


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


def article_point(base: EngineConfig, space: SearchSpace, contexts: Sequence[int]) -> dict[str, Any] | None:
    """The article's final config as a point of this space (the baseline, evaluated first)."""
    article = load_engine_config(ARTICLE_CONFIG)
    ctx = article.n_ctx // article.n_parallel
    point = {"n_parallel": article.n_parallel, "n_batch": article.n_batch, "n_ubatch": article.n_ubatch,
             "ctx_per_slot": ctx, "type_k": article.type_k.value, "type_v": article.type_v.value}
    valid = (ctx in contexts and article.n_parallel in space.n_parallel and article.n_batch in space.n_batch
             and article.n_ubatch in space.n_ubatch and article.type_k in space.type_k
             and article.type_v in space.type_v)
    return point if valid else None


TPE_STARTUP = 8  # TPE's random start; `prior` puts the predicted ranking's first this many there instead


def make_sampler(plan: StudyPlan) -> Any:
    """Optuna's sampler; TPE and NSGA-II read the memory and quality constraints each trial carries
    (tuning/recording.py sets them), so infeasible configs steer the search away; prior: the memory model's and
    the roofline's ranking (tuning/prior.py) for TPE's start, then TPE."""
    import optuna

    name, seed = plan.options.sampler, plan.options.seed
    if name is Sampler.nsga2:
        return optuna.samplers.NSGAIISampler(seed=seed)
    if name is Sampler.random:
        return optuna.samplers.RandomSampler(seed=seed)
    tpe = optuna.samplers.TPESampler(seed=seed, n_startup_trials=TPE_STARTUP)
    if name is Sampler.prior:
        from tuning.prior_sampler import PriorSampler

        return PriorSampler(prior_ranking(plan), TPE_STARTUP, then=tpe)
    return tpe


def prior_ranking(plan: StudyPlan) -> list[dict[str, Any]]:
    """The plan's space ranked by the prediction (tuning/prior.py) at its workload's depth and streams; a model
    placed partly in host memory is refused (the roofline would need the host's bandwidth too)."""
    from tuning import prior

    if plan.placement is not None:
        raise UserError("--sampler prior ranks configs of a model that fits the budget; this one is placed partly "
                        "in host memory: use --sampler tpe")
    opts, traffic = plan.options, plan.traffic
    shapes = [(r.prompt_tokens, r.output_tokens) for r in traffic.workload.requests] if traffic is not None else []
    aggregate = opts.objective is Objective.aggregate  # 4 streams; capacity and goodput: as many as there are slots
    streams = plan.settings.workload.concurrency if aggregate else max(plan.space.n_parallel)
    ranked = prior.rank(plan.space, plan.contexts, plan.settings.shape, plan.base, plan.budget, plan.on_gpu,
                        prior.workload_depth(opts.gen_tokens, shapes), streams,
                        single_first=opts.prefer is Prefer.single, seed=opts.seed)
    if not ranked:
        raise UserError("--sampler prior: no config of the space fits the budget by the memory model")
    return [r.point for r in ranked]


def make_searcher(plan: StudyPlan, storage: Any) -> Any:
    """Optuna behind Ray Tune on the plan's space, the article baseline first when the study is new."""
    from tuning.recording import RecordingOptunaSearch

    opts = plan.options
    baseline = (article_point(plan.base, plan.space, plan.contexts)
                if not _study_has_trials(storage, plan.study_name) else None)
    return RecordingOptunaSearch(
        space=SpaceFunction(plan.space, list(plan.contexts), plan.placement),
        metric=["single_tok_s", opts.objective.key], mode=["max", "max"],
        points_to_evaluate=[baseline] if baseline else None,
        sampler=make_sampler(plan), study_name=plan.study_name, storage=storage, seed=opts.seed,
        first_is_baseline=baseline is not None, canonical=partial(to_engine_config, base=plan.base),
        objective=opts.objective, prune_prefer=opts.prefer.value, prune_below=plan.settings.prune_below,
    )


def open_storage(opts: SearchOptions) -> Any:
    import optuna

    url = opts.storage or f"sqlite:///{(opts.results_dir / 'optuna.db').resolve()}"
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    return optuna.storages.RDBStorage(url)


def run_study(plan: StudyPlan, searcher: Any) -> float:
    """The search: Ray Tune runs the trials the searcher proposes; returns its wall time in seconds."""
    from ray import tune
    from ray.tune import Callback, CLIReporter

    from tuning.inplace import ON_HEAD, FirstTrialNotice, ReplicaTrial
    from tuning.trial import EngineTrial

    opts, settings, app = plan.options, plan.settings, plan.app
    if app is not None:  # each replica is a trial slot; the actor only talks to it
        trainable = tune.with_resources(tune.with_parameters(
            ReplicaTrial, settings=settings, app=app.name, study=plan.study_name, trials=opts.trials), ON_HEAD)
    else:
        trainable = tune.with_resources(tune.with_parameters(EngineTrial, settings=settings), plan.slots.resources)
    reporter = CLIReporter(
        parameter_columns=["n_parallel", "n_batch", "n_ubatch", "ctx_per_slot", "type_k", "type_v", "flash_attn"],
        metric_columns={"single_tok_s": "single", "aggregate_tok_s": "4-way" if not settings.traffic else "out tok/s",
                        **({"capacity_tok_s": "capacity"} if opts.min_stream_tok_s else {}),
                        **({"goodput_rps": "goodput"} if settings.traffic else {}), "feasible": "ok"},
        max_report_frequency=15,
    )
    callbacks: list[Callback] = [FirstTrialNotice(opts.trials, plan.at_once)] if app is not None else []
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=opts.trials, reuse_actors=True,
                                    max_concurrent_trials=plan.at_once),
        run_config=tune.RunConfig(name=plan.study_name, storage_path=str((opts.results_dir / "ray").resolve()),
                                  stop={"training_iteration": 1}, progress_reporter=reporter, verbose=1,
                                  callbacks=callbacks),
    )
    logging.getLogger("ray.tune").setLevel(logging.ERROR)  # the progress table says it all; not INFO lines too
    t0 = time.perf_counter()
    tuner.fit()
    return time.perf_counter() - t0


def finish(plan: StudyPlan, session: Session, storage: Any, context: dict[str, Any]) -> int:
    """After the search: the pick (confirmed), the report and plots, configs written, the pick applied."""
    import optuna

    from tuning import report
    from tuning.writeback import apply_to_serve, write_config

    opts, study_name = plan.options, plan.study_name
    study = optuna.load_study(study_name=study_name, storage=storage)
    rows = report.rows_from_study(study, opts.objective)
    winner = report.pick(rows, opts.prefer)
    out_dir = opts.results_dir / study_name
    out_dir.mkdir(parents=True, exist_ok=True)
    confirmed: Confirmation | None = None
    if winner is not None and opts.confirm_rounds > 0:
        confirmed = confirm_pick(plan, rows, winner)
        winner = confirmed.row if confirmed is not None and confirmed.row is not None else winner
    if confirmed is not None and confirmed.verdict.keeps_served:
        return keep_served(opts, rows, winner, confirmed, context, out_dir)
    report.plot(rows, winner, out_dir / "pareto.png")
    capacity_plot = "capacity.png" if opts.min_stream_tok_s is not None and report.plot_capacity(
        rows, opts.min_stream_tok_s, out_dir / "capacity.png") else None
    loads, load_s = report.weight_loads(rows)
    answered = sum(1 for r in rows if r.answered_from is not None)
    loads_label = ("weight loads (the serving replicas' totals, their own start-up included)"
                   if plan.app is not None else "weight loads (all actors)")
    context = {**context, "trials in study": len(rows),
               "answered from an earlier trial of the same engine config": answered,
               loads_label: loads, "time loading weights": f"{load_s:.1f} s"}
    summary = pick_summary(study_name, winner, rows, confirmed, opts) if winner is not None else None
    search = report.search_section(rows, report.pruned_rows(study, opts.objective), report.finished_s(study),
                                   winner, opts.prefer.value)
    text = report.markdown(rows, winner, opts.prefer.value, context, "pareto.png", capacity_plot, summary,
                           importances=report.importance_section(study, opts.objective, out_dir), search=search)
    write_report(out_dir, text, confirmed)
    if winner is None or summary is None:
        print(f"{report.no_pick(rows)} Nothing written.", file=sys.stderr)
        return 1
    tuned = to_engine_config(winner.params, plan.base)
    write_config(opts.out, tuned, header=summary)
    print(f"pick: {summary}\nwritten: {opts.out}")
    if not opts.apply:
        return 0
    if plan.app is None and opts.where is Where.auto:  # looked for one before the study: none was serving
        print(f"no Serve app was serving: the next `serve run serving.app:main` loads {opts.out}"
              if opts.out == DEFAULT_OUT else "no Serve app was serving: only the file was written")
        return 0
    if session.started_ray and plan.app is None:  # --offline beside an app: it is in another cluster; join it
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


def run(opts: SearchOptions, session: Session) -> int:
    """A study from the command line: Ray joined (or started), the app found, the plan settled once, the search,
    then finish()."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # "A new study created": the plan line says it
    if opts.where is Where.offline:
        base_config(opts)  # a bad --model is reported before any Ray starts
    total, free = start_ray(opts, session)
    session.app = serving_app(opts)
    plan = study_plan(opts, session.app, total, free)
    storage = open_storage(plan.options)
    searcher = make_searcher(plan, storage)
    print(plan_line(plan.options, plan.base, plan.app, plan.on_gpu, plan.slots, plan.budget, plan.min_ctx),
          flush=True)
    wall = run_study(plan, searcher)
    return finish(plan, session, storage, report_context(plan, wall))


def report_context(plan: StudyPlan, wall: float) -> dict[str, Any]:
    """What the report's header says the study ran on, and how long this run's search took."""
    opts, app, traffic = plan.options, plan.app, plan.traffic
    return {"model": plan.base.model_path.name, "device": "GPU" if plan.on_gpu else "CPU",
            "trials ran": (f"in place, on app {app.name!r}" if app else
                           f"offline (engines of the tuner's own; {slots_text(plan.slots, plan.on_gpu)})"),
            "budget": f"{plan.budget / GiB:.2f} GiB", "min context per slot": plan.min_ctx,
            "max quality loss": f"{opts.max_quality_loss} nats/token", "sampler": sampler_text(opts.sampler),
            "pruning": pruning_text(plan),
            **({"workload": traffic.workload.describe(), "SLO": str(opts.slo or "none")} if traffic else
               {"prompt set": opts.prompt_set}),
            "objectives": f"{opts.objective.first_label}, {opts.objective.label}",
            **({"capacity floor": f"{opts.min_stream_tok_s} tok/s per stream"} if opts.min_stream_tok_s else {}),
            "study": plan.study_name, "this run": f"{opts.trials} trials in {wall:.0f} s"}


def sampler_text(sampler: Sampler) -> str:
    """The sampler as the report names it, saying what `prior` is made of."""
    if sampler is Sampler.prior:
        return (f"prior (the memory model's and the roofline's ranking for the first {TPE_STARTUP} proposals, "
                "then TPE)")
    return sampler.value


def pruning_text(plan: StudyPlan) -> str:
    """Whether trials were measured short first, and the bar."""
    below = plan.settings.prune_below
    if below > 0:
        return (f"short first, pruned below {below:g} x the leader's short figure on every objective the pick "
                "reads")
    if plan.options.prune_below > 0:
        return "off (in place and on a traffic workload every trial is measured in full)"
    return "off"


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
