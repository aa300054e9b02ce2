"""The study plan: everything a study runs on, settled once from the options and the place it runs (the Serve app
in place, else the cluster's free GPUs) before the first trial, and read, never changed, by the search, the
confirmation round and the write-back.

The plan says what is tuned (the base config, the model's shape, the search space and its contexts), on what
(the device, its memory budget, the trial slots, what moves to host memory when the model does not fit) and under
which name the study is kept. Light: no Ray, no Optuna, no libllama (the tuner's `--help`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from measure.workload import Workload
from serving.engine.config import (AutoSetting, CacheType, EngineConfig, FlashAttn, SpecMode, default_threads,
                                   load_engine_config)
from serving.engine.fit import DeviceKind, FitBudget, fit
from tuning.errors import UserError
from tuning.gpus import TrialSlots, free_gpu_places
from serving.engine.memory import ModelShape, predict
from serving.engine.units import GiB, parse_bytes
from serving.engine.model_store import HubModel, fetch, resolve
from tuning.options import DeviceChoice, SearchOptions
from tuning.results import Objective
from tuning.serving_app import ServingApp
from tuning.space import PlacementFit, PlacementSearch, SearchSpace, thread_choices, to_engine_config
from tuning.workloads import TrafficPlan, least_context, traffic_plan

GPU_MARGIN = 1 * GiB


@dataclass(frozen=True)
class TrialSettings:
    """What every trial shares: the base config (model, threads), budget, workload, quality margin."""

    base: EngineConfig
    shape: ModelShape
    budget_bytes: int
    on_gpu: bool
    workload: Workload
    max_quality_loss: float
    traffic: TrafficPlan | None = None  # a traffic workload to replay instead of the fixed benchmark
    ram_budget_bytes: int | None = None  # host memory a config may take (with part of the model on the CPU)
    prune_below: float = 0.0  # > 0: each trial measured short first, pruned below this share of the leader's (prune.py)
    objective: Objective = Objective.aggregate  # the second objective, which a short measurement reports too


@dataclass(frozen=True)
class StudyPlan:
    """A study's settled plan. The trials' shared settings (base config, model shape, budget, device, workload)
    are held once, in `settings`, which every trial gets; the rest is what the searcher draws from and where."""

    options: SearchOptions  # settled: in place without --workload, the workload the recorded traffic gave
    app: ServingApp | None  # the Serve app whose replicas run the trials; None: offline, engines of our own
    settings: TrialSettings
    space: SearchSpace
    contexts: tuple[int, ...]  # the tokens per slot the space may draw, each >= min_ctx
    min_ctx: int
    slots: TrialSlots  # offline, the free GPUs the trials run on (none in place: the replicas are the slots)
    placement: PlacementSearch | None  # what moves to host memory when the model does not fit the budget
    study_name: str

    @property
    def base(self) -> EngineConfig:
        return self.settings.base

    @property
    def on_gpu(self) -> bool:
        return self.settings.on_gpu

    @property
    def budget(self) -> int:
        return self.settings.budget_bytes

    @property
    def traffic(self) -> TrafficPlan | None:
        return self.settings.traffic

    @property
    def at_once(self) -> int:
        """How many trials run at a time: one per replica in place, else one per trial slot."""
        return self.app.replicas if self.app is not None else self.slots.count


def study_plan(opts: SearchOptions, app: ServingApp | None, total: int, free: int) -> StudyPlan:
    """The plan of a study on `app` (None: offline) in a cluster of `total` GPUs, `free` of them free now. Prints
    the workload line (tuning/workloads.py); UserError for anything that makes the study impossible."""
    opts, traffic = traffic_plan(opts, app)
    # in place, the replicas' own model and settings are the study's base (--model and --base-config unused)
    base = app.serving if app is not None else base_config(opts)
    shape, space = model_and_space(opts, base)
    min_ctx = least_context(opts, shape, traffic)
    slots = trial_slots(opts, total, free, app)
    space = space.for_gpus((app or slots).gpus_per_engine, base)
    on_gpu = choose_device(opts, total, free, app, slots)
    budget = budget_bytes(opts, on_gpu, app.gpu_memory_total if app is not None else slots.gpu_memory_total)
    contexts = affordable_contexts(shape, base, space, space.contexts(min_ctx, shape.n_ctx_train), budget, on_gpu)
    check_possible(shape, base, space, contexts[0], budget, on_gpu)
    threads = (app.threads if app is not None else slots.threads) or default_threads()
    placement = placement_search(shape, base, budget, on_gpu, space, contexts[0], threads)
    settings = TrialSettings(base=base, shape=shape, budget_bytes=budget, on_gpu=on_gpu, workload=workload(opts),
                             max_quality_loss=opts.max_quality_loss, traffic=traffic,
                             ram_budget_bytes=ram_budget_bytes(opts), prune_below=prune_below(opts, app, traffic),
                             objective=opts.objective)
    return StudyPlan(options=opts, app=app, settings=settings, space=space, contexts=tuple(contexts),
                     min_ctx=min_ctx, slots=slots, placement=placement, study_name=study_name(opts, settings, app))


def prune_below(opts: SearchOptions, app: ServingApp | None, traffic: TrafficPlan | None) -> float:
    """--prune-below where a short measurement exists: offline on the fixed benchmark. In place a short run would
    hold a serving replica twice, and a traffic workload's replay has no short form yet: there trials are
    measured in full (the plan line says so)."""
    return opts.prune_below if app is None and traffic is None else 0.0


def base_config(opts: SearchOptions) -> EngineConfig:
    """The config an offline study starts from: --base-config with --model over it; the model file must exist (a
    model named on the hub is resolved and fetched into this machine's cache first, where the trials load it)."""
    overrides = {"model": opts.model} if opts.model else {}
    try:
        config = load_engine_config(opts.base_config, overrides)
        if isinstance(config.model, HubModel):
            model = resolve(config.model)
            fetch(model)
            config = config.model_copy(update={"model": model})
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if not config.model_path.is_file():
        raise UserError(f"model file {config.model_path} does not exist: pass --model PATH to a GGUF file")
    return config


def model_and_space(opts: SearchOptions, base: EngineConfig) -> tuple[ModelShape, SearchSpace]:
    """The model's shape from its GGUF header and the search space; a space drafting without a draft model is
    refused here, before any trial."""
    try:
        shape = ModelShape.from_gguf(base.model_path)
        space = SearchSpace.from_yaml(opts.space)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if SpecMode.draft in space.spec_mode and base.draft_model is None:
        raise UserError("the search space lists spec_mode draft, but the base config has no draft_model: set it "
                        "(a GGUF sharing the model's vocabulary) or drop draft from the space")
    return shape, space


def workload(opts: SearchOptions) -> Workload:
    """The fixed benchmark each trial runs (unless it replays a traffic workload)."""
    return Workload(gen_tokens=opts.gen_tokens, repeats=opts.repeats, prompt_set=opts.workload_prompt_set,
                    report_copy=opts.prompt_set == "both", min_stream_tok_s=opts.min_stream_tok_s)


def study_name(opts: SearchOptions, settings: TrialSettings, app: ServingApp | None) -> str:
    """--study-name, else the model, device, budget, workload and place: a study resumes only on its own
    conditions (in place measures other conditions, live replicas and the whole device's memory: a study of its
    own)."""
    if opts.study_name:
        return opts.study_name
    where = "-inplace" if app is not None else ""
    on = f"-{settings.traffic.workload.name}" if settings.traffic is not None else ""
    device = "gpu" if settings.on_gpu else "cpu"
    return f"{settings.base.model_path.stem}-{device}-{settings.budget_bytes // 2**20}MiB{on}{where}"


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
    """The space's config needing the least memory at `ctx` tokens per slot: what the budget is checked against."""
    order = [CacheType.q4_0, CacheType.q8_0, CacheType.f16]
    kv = next((t for t in order if t in space.type_k and t in space.type_v), space.type_v[0])
    params = {"n_parallel": min(space.n_parallel), "n_batch": min(space.n_batch), "n_ubatch": min(space.n_ubatch),
              "ctx_per_slot": ctx, "type_k": kv.value, "type_v": kv.value,
              "flash_attn": FlashAttn.on.value}
    return to_engine_config(params, base)


def affordable_contexts(shape: ModelShape, base: EngineConfig, space: SearchSpace, contexts: list[int], budget: int,
                        on_gpu: bool) -> list[int]:
    """The space's contexts a slot can have within the budget: the least always (check_possible judges it), a
    longer one where the space's cheapest config holds it in one slot beside the weights placed as the engine's
    fit at start places them (serving/engine/fit.py: the weights first, then the context in what they leave).
    A longer one would be refused trial by trial, or would push weights off the GPU for a context no config
    holds fast; the agent-sized values of the space (64k, 128k) stay where the model and memory allow them."""
    cheapest = cheapest_config(base, space, contexts[0]).model_copy(update={"n_parallel": 1})
    asked = cheapest.model_copy(update={"auto": frozenset({AutoSetting.n_gpu_layers, AutoSetting.n_ctx})})
    kind = DeviceKind.gpu if on_gpu else DeviceKind.cpu
    longest = fit(shape, asked, FitBudget(kind, budget, "the study's budget")).config.n_ctx_per_slot
    kept = [c for c in contexts if c == contexts[0] or c <= longest]
    if len(kept) < len(contexts):
        print(f"contexts per slot: {kept} (the budget holds at most {longest} tokens a slot beside the weights)",
              flush=True)
    return kept


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
