"""`python -m tuning.search --trials 40`: tune llama.cpp's settings with Ray Tune + Optuna, then apply the pick.

The seed article's afternoon of hand-tuning as a study: Optuna proposes engine configs (multi-objective:
single-stream and 4-way aggregate decode tok/s), each is checked against the memory budget from the GGUF
header before anything loads, Ray Tune runs the survivors on one GPU each (weights stay loaded, only the
context is rebuilt), and the pick is written to configs/tuned.yaml and pushed to a running Serve app.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Callable, Iterator
from functools import partial
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the classic progress table with our columns
os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")  # Ctrl-C reaches main(): stop, and restore in place

from serving import llama as _llama  # noqa: E402,F401  (load order: ray before libllama, see serving/llama.py)
from serving.config import CacheType, EngineConfig, FlashAttn, SpecMode, load_engine_config  # noqa: E402
from measure.device import gpu_memory_total  # noqa: E402
from tuning.memory import GiB, ModelShape, parse_bytes, predict  # noqa: E402
from measure.workload import PromptSet  # noqa: E402
from tuning.report import Objective  # noqa: E402
from tuning.objective import Workload  # noqa: E402
from tuning.space import SearchSpace, SpaceFunction, to_engine_config  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
ARTICLE_CONFIG = REPO_ROOT / "configs" / "article.yaml"
GPU_MARGIN = 1 * GiB


class UserError(Exception):
    """Bad input the user can fix; printed without a traceback, exit code 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tuning.search", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=40, help="trials to run (default 40)")
    p.add_argument("--model", help="GGUF file (default: `model:` of --base-config, else the embedded model)")
    p.add_argument("--base-config", type=Path, default=REPO_ROOT / "configs" / "default.yaml",
                   help="engine config the trials start from (model, threads)")
    p.add_argument("--space", type=Path, help="search-space YAML (default configs/search_space.yaml)")
    p.add_argument("--vram-budget", help="memory budget, e.g. 32GiB (default: the GPU's memory minus 1 GiB; "
                   "on CPU: half of this machine's RAM, counted as resident memory)")
    p.add_argument("--min-ctx-per-slot", type=int, help="least context per slot (default: min(2048, the "
                   "model's training context))")
    p.add_argument("--max-quality-loss", type=float, default=0.01,
                   help="allowed rise of mean NLL over the f16-cache baseline, nats/token (default 0.01, ~1%% ppl)")
    p.add_argument("--prefer", choices=["balanced", "single", "aggregate"], default="balanced",
                   help="how to pick from the Pareto front (default balanced: best 4-way aggregate within 5%% "
                        "of the best single stream)")
    p.add_argument("--confirm-rounds", type=int, default=3, help="after the search, measure the best "
                   "--confirm-top configs and the baseline this many more times, interleaved, and pick on paired "
                   "ratios (default 3; 0 = pick on the search's single measurements)")
    p.add_argument("--confirm-top", type=int, default=3, help="configs of the Pareto front to confirm (default 3)")
    p.add_argument("--objective", choices=[o.value for o in Objective], default="aggregate",
                   help="the second objective beside single-stream tok/s: aggregate (4 streams at once, default) or "
                        "capacity (the best aggregate at 1, 2, 4, ... up to the config's slots streams with every "
                        "stream at least --min-stream-tok-s)")
    p.add_argument("--min-stream-tok-s", type=float, help="per-stream floor of the capacity figure, e.g. 10 "
                   "(a reader's pace); given, every trial also measures the capacity curve (one run per stream count)")
    p.add_argument("--sampler", choices=["tpe", "nsga2", "random"], default="tpe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per measured request")
    p.add_argument("--repeats", type=int, default=3, help="measured repeats per workload (median kept)")
    p.add_argument("--prompt-set", choices=[*(s.value for s in PromptSet), "both"], default="plain",
                   help="the workload's prompts: plain (free writing, EOS ignored), copy (edit code, quote a text: "
                        "where speculation's prompt lookup pays; stops at EOS), or both (the objectives on plain, "
                        "the single stream on copy reported beside them)")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    p.add_argument("--storage", help="Optuna storage URL (default sqlite:///results/optuna.db)")
    p.add_argument("--study-name", help="default: <model>-<device>-<budget>; an existing study is resumed")
    p.add_argument("--results-dir", type=Path, default=REPO_ROOT / "results")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "configs" / "tuned.yaml", help="where the pick goes")
    p.add_argument("--no-apply", action="store_true", help="only write --out; do not touch a running Serve app")
    p.add_argument("--app-name", help="Serve app to apply to (default: the one running LlamaServer)")
    p.add_argument("--in-place", action="store_true", help="run the trials on the running Serve app's engine "
                   "replicas (needed when it has one replica: its clients then wait their turn during trials, "
                   "or get 503 with Retry-After when too many wait); with several replicas this is the default. The "
                   "replicas' own model and settings are the base: --model and --base-config are not used")
    p.add_argument("--offline", action="store_true", help="run the trials on engines of the tuner's own, even "
                   "when a Serve app is serving")
    p.add_argument("--ray-address", help="Ray cluster to run trials on (default: the Serve app's, else start a "
                   "local one)")
    p.add_argument("--serve-address", default="auto", help="Ray cluster where the Serve app runs")
    args = p.parse_args(argv)
    if args.trials < 1:
        p.error("--trials must be at least 1")
    if args.repeats < 1 or args.gen_tokens < 2:
        p.error("--repeats must be >= 1 and --gen-tokens >= 2")
    if args.objective == Objective.capacity.value and args.min_stream_tok_s is None:
        p.error("--objective capacity needs --min-stream-tok-s (the floor every stream must keep)")
    if args.min_stream_tok_s is not None and args.min_stream_tok_s <= 0:
        p.error("--min-stream-tok-s must be > 0")
    if args.confirm_rounds < 0 or args.confirm_top < 1:
        p.error("--confirm-rounds must be >= 0 and --confirm-top >= 1")
    if args.in_place and args.offline:
        p.error("--in-place and --offline exclude each other")
    return args


def base_config(args: argparse.Namespace) -> EngineConfig:
    overrides = {"model": args.model} if args.model else {}
    try:
        config = load_engine_config(args.base_config, overrides)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if not config.model_path.is_file():
        raise UserError(f"model file {config.model_path} does not exist: pass --model PATH to a GGUF file")
    return config


def start_ray(args: argparse.Namespace) -> tuple[int, int]:
    """Connect to (or start) Ray; return (GPUs in the cluster, GPUs free now)."""
    import ray

    args.started_ray = not ray.is_initialized()
    if args.started_ray:
        address = args.ray_address
        if address is None and not args.offline:  # join the cluster a Serve app runs in, if there is one
            try:
                ray.init(address=args.serve_address, logging_level=logging.ERROR, log_to_driver=False)
            except (ConnectionError, RuntimeError):
                if args.in_place:
                    raise UserError(f"--in-place: no running Ray cluster at {args.serve_address!r}; start the "
                                    "app first (serve run serving.app:main)") from None
        if not ray.is_initialized():
            ray.init(address=address, logging_level=logging.ERROR, include_dashboard=False)
    total = int(ray.cluster_resources().get("GPU", 0))
    free = int(ray.available_resources().get("GPU", 0))
    return total, free


def serving_app(args: argparse.Namespace) -> Any:
    """The Serve app an in-place study runs on (tuning/inplace.py's ServingApp), or None for offline trials.

    Found: in place when it has several replicas or --in-place says so; with one replica and neither flag,
    an error that names both (its clients would wait during trials: the operator decides)."""
    from tuning.inplace import find_serving_app

    if args.offline:
        return None
    try:
        app = find_serving_app(args.app_name)
    except Exception as exc:  # no Serve in this cluster, or its controller not answering
        if args.in_place:
            raise UserError(f"--in-place: cannot reach a Serve app ({type(exc).__name__}: {exc})") from exc
        return None
    if app is None:
        if args.in_place:
            raise UserError("--in-place: no running Serve app with engine replicas; start one "
                            "(serve run serving.app:main) or drop --in-place")
        return None
    if app.replicas < 1:
        raise UserError(f"Serve app {app.name!r} has no running engine replica")
    if app.replicas == 1 and not args.in_place:
        raise UserError(f"Serve app {app.name!r} is serving on one replica: pass --in-place to run the trials "
                        "on it (client requests wait their turn during each trial), or --offline to run them "
                        "on engines of the tuner's own beside it")
    return app


def choose_device(args: argparse.Namespace, total: int, free: int, in_place: bool = False) -> bool:
    """True for GPU trials. A GPU cluster whose GPUs are all taken is an error, not a silent CPU run
    (unless the trials run in place, on the replicas that hold them)."""
    if args.device == "cpu":
        return False
    if in_place:
        return total > 0
    if total == 0:
        if args.device == "gpu":
            raise UserError("--device gpu, but the Ray cluster has no GPU")
        return False
    if free == 0:
        raise UserError(f"no free GPU: the cluster's {total} GPU(s) are all in use (a Serve app holding them?); "
                        "stop it, or add GPUs, then retry")
    return True


def budget_bytes(args: argparse.Namespace, on_gpu: bool) -> int:
    if args.vram_budget:
        try:
            return parse_bytes(args.vram_budget)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
    if on_gpu:
        total = gpu_memory_total()
        if total is None:
            raise UserError("cannot read the GPU's memory size (NVML): pass --vram-budget")
        return total - GPU_MARGIN
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def layer_search(shape: ModelShape, base: EngineConfig, budget: int, on_gpu: bool,
                 space: SearchSpace, ctx: int) -> int | None:
    """None when all layers fit with the smallest config; else the layer count to search up to."""
    smallest = cheapest_config(base, space, ctx)
    if not on_gpu or predict(shape, smallest, on_gpu).total <= budget:
        return None
    return shape.n_layer


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


def trial_constraints(trial: Any) -> list[float]:
    """Optuna constraints (feasible when all <= 0), read from what the trial recorded."""
    return [trial.user_attrs.get("constraint_mem", 1e18), trial.user_attrs.get("constraint_quality", 1e9)]


def make_sampler(name: str, seed: int) -> Any:
    import optuna

    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, constraints_func=trial_constraints)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, constraints_func=trial_constraints, n_startup_trials=8)


def make_searcher(args: argparse.Namespace, space: SearchSpace, contexts: list[int], n_layers: int | None,
                  baseline: dict[str, Any] | None, storage: Any, study_name: str, base: EngineConfig) -> Any:
    from tuning.recording import RecordingOptunaSearch

    return RecordingOptunaSearch(
        space=SpaceFunction(space, contexts, n_layers),
        metric=["single_tok_s", Objective(args.objective).key], mode=["max", "max"],
        points_to_evaluate=[baseline] if baseline else None,
        sampler=make_sampler(args.sampler, args.seed), study_name=study_name, storage=storage, seed=args.seed,
        recorded=RECORDED, first_is_baseline=baseline is not None, canonical=partial(to_engine_config, base=base),
    )


RECORDED = ("single_tok_s", "aggregate_tok_s", "capacity_tok_s", "capacity_streams", "capacity_curve",
            "single_copy_tok_s", "ttft_ms",
            "prefill_tok_s", "nll", "nll_baseline", "nll_delta",
            "mem_predicted", "mem_measured", "mem_budget", "constraint_mem", "constraint_quality", "feasible",
            "rejected", "error", "setup_s", "weight_loads", "weight_load_s", "actor", "sm_clock_mhz",
            "mem_clock_mhz", "sm_clock_max_mhz", "temperature_c", "throttle_reasons", "throttled", "shared",
            "time_total_s", "n_ctx")


def open_storage(args: argparse.Namespace) -> Any:
    import optuna

    url = args.storage or f"sqlite:///{(args.results_dir / 'optuna.db').resolve()}"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    return optuna.storages.RDBStorage(url)


def run_study(args: argparse.Namespace, settings: Any, searcher: Any, on_gpu: bool, gpus: int,
              study_name: str, app: Any = None) -> float:
    from ray import tune
    from ray.tune import CLIReporter

    from tuning.inplace import ReplicaTrial
    from tuning.trial import EngineTrial

    if app is not None:  # each replica is a trial slot; the actor only talks to it
        trainable = tune.with_resources(tune.with_parameters(
            ReplicaTrial, settings=settings, app=app.name, study=study_name, trials=args.trials), {"cpu": 0.01})
        slots = app.replicas
    else:
        resources: dict[str, float] = {"gpu": 1, "cpu": 1} if on_gpu else {"cpu": 1}
        trainable = tune.with_resources(tune.with_parameters(EngineTrial, settings=settings), resources)
        slots = max(gpus, 1) if on_gpu else 1
    reporter = CLIReporter(
        parameter_columns=["n_parallel", "n_batch", "n_ubatch", "ctx_per_slot", "type_k", "type_v", "flash_attn"],
        metric_columns={"single_tok_s": "single", "aggregate_tok_s": "4-way",
                        **({"capacity_tok_s": "capacity"} if args.min_stream_tok_s else {}), "feasible": "ok"},
        max_report_frequency=15,
    )
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=args.trials, reuse_actors=True,
                                    max_concurrent_trials=slots),
        run_config=tune.RunConfig(name=study_name, storage_path=str((args.results_dir / "ray").resolve()),
                                  stop={"training_iteration": 1}, progress_reporter=reporter, verbose=1),
    )
    t0 = time.perf_counter()
    tuner.fit()
    return time.perf_counter() - t0


def finish(args: argparse.Namespace, storage: Any, study_name: str, base: EngineConfig, context: dict[str, Any],
           settings: Any) -> int:
    import optuna

    from tuning import report
    from tuning.writeback import apply_to_serve, write_config

    study = optuna.load_study(study_name=study_name, storage=storage)
    rows = report.rows_from_study(study, Objective(args.objective))
    winner = report.pick(rows, args.prefer)
    out_dir = args.results_dir / study_name
    out_dir.mkdir(parents=True, exist_ok=True)
    confirmation = ""
    if winner is not None and args.confirm_rounds > 0:
        winner, confirmation = confirm_pick(args, rows, winner, base, settings, study_name)
    report.plot(rows, winner, out_dir / "pareto.png")
    capacity_plot = "capacity.png" if args.min_stream_tok_s is not None and report.plot_capacity(
        rows, args.min_stream_tok_s, out_dir / "capacity.png") else None
    loads, load_s = report.weight_loads(rows)
    answered = sum(1 for r in rows if "answered_from" in r.attrs)
    loads_label = ("weight loads (the serving replicas' totals, their own start-up included)"
                   if args.in_place_app is not None else "weight loads (all actors)")
    context = {**context, "trials in study": len(rows),
               "answered from an earlier trial of the same engine config": answered,
               loads_label: loads, "time loading weights": f"{load_s:.1f} s"}
    text = report.markdown(rows, winner, args.prefer, context, "pareto.png", capacity_plot)
    (out_dir / "report.md").write_text(text.replace("\n## Pareto front", f"\n{confirmation}\n## Pareto front", 1)
                                       if confirmation else text)
    print(f"\nreport: {out_dir / 'report.md'}  plot: {out_dir / 'pareto.png'}")
    if winner is None:
        print("no feasible trial: nothing written; widen the space or the budget", file=sys.stderr)
        return 1
    tuned = to_engine_config(winner.params, base)
    baseline = next((r for r in rows if r.is_baseline), None)
    summary = (f"study {study_name}, trial {winner.number} ({args.prefer} pick): {winner.single:.1f} tok/s single, "
               f"{winner.second:.1f} {winner.objective.label}; {report.gain(winner, baseline)}")
    write_config(args.out, tuned, header=summary)
    print(f"pick: {summary}\nwritten: {args.out}")
    if not args.no_apply:
        if args.started_ray and args.in_place_app is None:  # offline: the app is in another cluster; join it
            import ray

            ray.shutdown()
        result = apply_to_serve(tuned, app_name=args.app_name, address=args.serve_address)
        print(f"live apply: {result.message}")
        args.in_place_settled = result.applied  # else main() gives the replicas back what they served
    return 0


def confirmation_candidates(rows: list[Any], winner: Any, base: EngineConfig, top: int, prefer: str) -> list[Any]:
    """The pick and the next best of the Pareto front, `top` distinct engine configs in all (a re-run study
    can hold one config twice), then the article baseline when it ran and is not among them."""
    from tuning import report

    ranked = sorted(report.pareto_front(rows), key=lambda r: (r.second, r.single), reverse=True)
    if prefer == "single":
        ranked.sort(key=lambda r: (r.single, r.second), reverse=True)
    chosen: list[Any] = []
    for row in [winner, *ranked]:
        if len(chosen) < top and all(to_engine_config(row.params, base) != to_engine_config(c.params, base)
                                     for c in chosen):
            chosen.append(row)
    baseline = next((r for r in rows if r.is_baseline and r.single > 0), None)
    if baseline is not None and all(to_engine_config(baseline.params, base) != to_engine_config(c.params, base)
                                    for c in chosen):
        chosen.append(baseline)
    return chosen


def confirm_pick(args: argparse.Namespace, rows: list[Any], winner: Any, base: EngineConfig, settings: Any,
                 study_name: str) -> tuple[Any, str]:
    """The search's best few and the baseline measured again, interleaved (tuning/confirm.py): the pick on
    paired ratios, and the report's section on it."""
    from tuning import confirm

    chosen = confirmation_candidates(rows, winner, base, args.confirm_top, args.prefer)
    if len(chosen) < 2:
        return winner, ""
    candidates = [confirm.Candidate(r.number, r.label(), to_engine_config(r.params, base), r.is_baseline)
                  for r in chosen]
    reference = next((i for i, c in enumerate(candidates) if c.is_baseline), 0)  # else the search's pick
    print(f"confirmation: {len(candidates)} candidates x {args.confirm_rounds} rounds, interleaved")
    with confirmation_measure(args, settings, study_name, candidates) as measure:
        confirmed = confirm.confirm(candidates, reference, args.confirm_rounds, measure, progress=print)
    verdict = confirm.decide(confirmed, args.prefer)
    noise = " (within noise)" if verdict.within_noise else ""
    print(f"confirmed pick: trial {verdict.pick.candidate.number}{noise}")
    picked = next(r for r in rows if r.number == verdict.pick.candidate.number)
    return picked, confirm.markdown(confirmed, verdict, candidates[reference], args.confirm_rounds,
                                    Objective(args.objective).label)


@contextlib.contextmanager
def confirmation_measure(args: argparse.Namespace, settings: Any, study_name: str,
                         candidates: list[Any]) -> Iterator[Callable[[EngineConfig], Any]]:
    """`config -> Figures` for the confirmation round: on a serving replica in place, else on one engine of
    our own in a Ray actor (one more weight load)."""
    import itertools

    from tuning.confirm import Figures
    from tuning.objective import SpeedMeasure

    requests = itertools.count(10**6, 1000)  # request numbers apart from the trials'
    second = Objective(args.objective).key

    def figures(result: dict[str, Any]) -> Figures:
        return Figures(float(result["single_tok_s"]), float(result[second]))

    app = args.in_place_app
    if app is not None:
        from tuning.inplace import replica_speed

        total = args.trials + args.confirm_rounds * len(candidates)
        yield lambda config: figures(replica_speed(
            app.name, study_name, total, config, SpeedMeasure(settings.workload, next(requests))))
        return
    import ray

    from tuning.trial import ConfirmEngine

    resources = {"num_gpus": 1, "num_cpus": 1} if settings.on_gpu else {"num_cpus": 1}
    actor: Any = ray.remote(ConfirmEngine).options(**resources).remote(candidates[0].config)
    try:
        yield lambda config: figures(ray.get(actor.measure.remote(
            config, SpeedMeasure(settings.workload, next(requests)))))
    finally:
        ray.get(actor.close.remote())
        ray.kill(actor)

def run(args: argparse.Namespace) -> int:
    if args.offline:
        base = base_config(args)  # a bad --model is reported before any Ray starts
    total, free = start_ray(args)
    app = args.in_place_app = serving_app(args)
    # in place, the replicas' own model and settings are the study's base (--model and --base-config unused)
    base = app.serving if app is not None else base_config(args)
    try:
        shape = ModelShape.from_gguf(base.model_path)
        space = SearchSpace.from_yaml(args.space)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if SpecMode.draft in space.spec_mode and base.draft_model is None:
        raise UserError("the search space lists spec_mode draft, but the base config has no draft_model: set it "
                        "(a GGUF sharing the model's vocabulary) or drop draft from the space")
    min_ctx = args.min_ctx_per_slot or min(2048, shape.n_ctx_train or 2048)
    try:
        contexts = space.contexts(min_ctx)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    on_gpu = choose_device(args, total, free, in_place=app is not None)
    budget = budget_bytes(args, on_gpu)
    check_possible(shape, base, space, contexts[0], budget, on_gpu)
    n_layers = layer_search(shape, base, budget, on_gpu, space, contexts[0])
    study_name = args.study_name or f"{base.model_path.stem}-{'gpu' if on_gpu else 'cpu'}-{budget // 2**20}MiB"
    storage = open_storage(args)
    baseline = article_point(base, space, contexts) if not _study_has_trials(storage, study_name) else None

    from tuning.trial import TrialSettings

    settings = TrialSettings(base=base, shape=shape, budget_bytes=budget, on_gpu=on_gpu,
                             workload=Workload(gen_tokens=args.gen_tokens, repeats=args.repeats,
                                               prompt_set=PromptSet(args.prompt_set.replace("both", "plain")),
                                               report_copy=args.prompt_set == "both",
                                               min_stream_tok_s=args.min_stream_tok_s),
                             max_quality_loss=args.max_quality_loss)
    searcher = make_searcher(args, space, contexts, n_layers, baseline, storage, study_name, base)
    where = (f"in place on app {app.name!r} ({app.replicas} replica(s), one trial each at a time)" if app else
             f"({max(total, 1) if on_gpu else 1} trial(s) at a time)")
    print(f"tuning {base.model_path.name} on {'GPU' if on_gpu else 'CPU'} {where}, budget {budget / GiB:.2f} GiB, "
          f">= {min_ctx} tokens per slot, {args.trials} trials")
    wall = run_study(args, settings, searcher, on_gpu, total, study_name, app)
    context = {"model": base.model_path.name, "device": "GPU" if on_gpu else "CPU",
               "trials ran": f"in place, on app {app.name!r}" if app else "offline (engines of the tuner's own)",
               "budget": f"{budget / GiB:.2f} GiB", "min context per slot": min_ctx,
               "max quality loss": f"{args.max_quality_loss} nats/token", "sampler": args.sampler,
               "prompt set": args.prompt_set, "objectives": f"single stream, {Objective(args.objective).label}",
               **({"capacity floor": f"{args.min_stream_tok_s} tok/s per stream"} if args.min_stream_tok_s else {}),
               "study": study_name, "this run": f"{args.trials} trials in {wall:.0f} s"}
    return finish(args, storage, study_name, base, context, settings)


def _study_has_trials(storage: Any, study_name: str) -> bool:
    import optuna

    try:
        return len(optuna.load_study(study_name=study_name, storage=storage).trials) > 0
    except KeyError:
        return False


def restore_serving(args: argparse.Namespace) -> Any:
    """An in-place study that ends without applying a pick: the replicas get back what they served."""
    from tuning.writeback import apply_to_serve

    app = args.in_place_app
    return apply_to_serve(app.serving, app_name=app.name, address=args.serve_address)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.started_ray = False
    args.in_place_app = None
    args.in_place_settled = False
    try:
        return run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the study is saved and resumes with the same --study-name", file=sys.stderr)
        return 130
    finally:
        if args.in_place_app is not None and not args.in_place_settled:  # no pick applied: what they served
            print(f"restore: {restore_serving(args).message}", file=sys.stderr)
        if args.started_ray:  # leave no Ray of ours behind (a caller's own Ray stays up)
            import ray

            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
