"""Fit at start: the settings a config leaves `auto` (AutoSetting), sized from the GGUF header and the memory the
engine finds, by the memory model (serving/engine/memory.py), before anything is loaded.

What llama-server's --fit does for the arguments a user leaves unset, in its order: the weights first, then the
context in what they leave.

- Where the weights go (n_gpu_layers auto, on a GPU, with no n_cpu_moe or override_tensor of the user's): every
  layer on the GPU if the model fits beside the least context (one slot of MIN_CTX, or the config's own); else a
  mixture of experts keeps its attention and shared weights there and moves the experts of the fewest layers to
  host memory, the last layers first (where --fit puts them; 4 streams 1.19x faster than the first layers on an
  H100: docs/log/2026-12-06-h100-sixth-run.md), and only if even all experts out do not fit, whole layers too; a
  dense model moves whole layers. With its context auto, a mixture of experts first tries the same beside one
  slot of an agent's context (AGENT_CTX): experts cost a token little in host memory (it reads only those it is
  routed to), so an agent's context is worth a few more of them there; whole layers never move for context.
- The context (n_ctx auto): the largest a slot can have in the memory left, up to the model's trained length.
- The slots (n_parallel auto): 4, as llama-server's -np -1, unless 4 would leave a slot under an agent's context
  (AGENT_CTX, or the trained length if shorter) and 2 or 1 would not: coding agents send 30-60k tokens.

The budget: on a GPU its free memory less FIT_MARGIN (llama-server's --fit-target default), or `vram_budget` where
that is less; on the CPU the K/V cache alone (the weights are mapped from the file, the page cache's to keep),
within a quarter of the memory available and CPU_KV_CAP: a CPU decodes long contexts slowly, and more would only
hold memory a CPU user wants for other things.

The tuner searches placement per trial from the same functions (most_layers, fewest_expert_layers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from serving.engine.config import AutoSetting, EngineConfig, SplitMode
from serving.engine.devices import DeviceMemory
from serving.engine.memory import ModelShape, kv_cache_bytes, predict
from serving.engine.units import GiB
from serving.engine.split import equivalent_total, per_gpu, shares

FIT_MARGIN = 1 * GiB  # left free on each GPU: llama-server's --fit-target default (1024 MiB)
AGENT_CTX = 65536  # a slot's context for coding agents (30-60k tokens a request; Ollama's docs ask for 64k)
MIN_CTX = 4096  # the least context a slot is planned with while the weights are placed: llama-server's --fit-ctx
AUTO_SLOTS = (4, 2, 1)  # n_parallel auto: llama-server's -np -1 is 4; fewer where 4 leave a slot short
CPU_KV_SHARE = 4  # on the CPU the K/V cache may take 1/CPU_KV_SHARE of the memory available ...
CPU_KV_CAP = 8 * GiB  # ... and at most this: 64k tokens of an 8B-class GQA model at f16
CELL_STEP = 256  # llama.cpp pads a slot's cells to multiples of 256


class DeviceKind(str, Enum):
    """What holds the engine's memory: a GPU (the whole prediction counts) or the CPU (the K/V cache counts)."""

    gpu = "gpu"
    cpu = "cpu"


@dataclass(frozen=True)
class FitBudget:
    """The memory a fit may plan for, and where that figure came from (for the log line). A model split over
    several GPUs also has each GPU's own (`gpus`, free less the margin) and its share of the split (`split`,
    serving/engine/split.py): each GPU must hold its part."""

    kind: DeviceKind
    bytes: int
    source: str
    gpus: tuple[int, ...] = ()
    split: tuple[float, ...] = ()

    def fits(self, shape: ModelShape, config: EngineConfig) -> bool:
        """Whether `config` is predicted within the budget: on a GPU all it holds there (on several, each GPU its
        part too), on the CPU its K/V."""
        if self.kind is DeviceKind.gpu:
            estimate = predict(shape, config, on_gpu=True)
            return estimate.total <= self.bytes and all(
                part <= free for part, free in zip(per_gpu(estimate, config, self.split), self.gpus, strict=True))
        return kv_cache_bytes(shape, config) <= self.bytes


def gpu_budget(gpus: Sequence[DeviceMemory], config: EngineConfig) -> FitBudget:
    """The GPUs' free memory less FIT_MARGIN each (split_mode none: main_gpu's alone), or `vram_budget` where
    that is less: the operator's cap, and how a comparison at a fixed budget is set up. Over several GPUs the
    whole is what the split lets them hold (the tightest GPU's free memory over its share), and each GPU is
    checked against its own."""
    used = [gpus[config.main_gpu]] if config.split_mode is SplitMode.none and config.main_gpu < len(gpus) else gpus
    each = tuple(max(g.free_bytes - FIT_MARGIN, 0) for g in used)
    names = ", ".join(f"{g.name} #{g.index}" for g in used)
    split = shares(config, each) if len(each) > 1 else ()
    free = equivalent_total(each, split) if split else sum(each)
    if split:
        names += f" split by {config.split_mode.value} " + ":".join(f"{s:.2f}" for s in split)
    if config.vram_budget is not None and config.vram_budget < free:
        return FitBudget(DeviceKind.gpu, config.vram_budget, f"vram_budget; {free / GiB:.1f} GiB free on {names}",
                         each if split else (), split)
    return FitBudget(DeviceKind.gpu, free, f"free on {names} less {FIT_MARGIN // GiB} GiB each",
                     each if split else (), split)


def cpu_budget(available: int) -> FitBudget:
    """The K/V cache's share of host memory on the CPU."""
    share = available // CPU_KV_SHARE
    if share > CPU_KV_CAP:
        return FitBudget(DeviceKind.cpu, CPU_KV_CAP, f"K/V cache on the CPU, capped ({available / GiB:.1f} GiB "
                         "available)")
    return FitBudget(DeviceKind.cpu, share, f"K/V cache on the CPU: 1/{CPU_KV_SHARE} of {available / GiB:.1f} GiB "
                     "available")


def budget_for(config: EngineConfig, gpus: Sequence[DeviceMemory], available: int) -> FitBudget:
    """The budget where the engine runs: its GPUs' (none: the CPU's, from `available` host memory)."""
    return gpu_budget(gpus, config) if gpus else cpu_budget(available)


@dataclass(frozen=True)
class Fitted:
    """A config with every setting sized, and why (one log line)."""

    config: EngineConfig
    sized: frozenset[AutoSetting]  # what the fit decided (the rest was the config's)
    budget: FitBudget
    predicted: int  # on a GPU all it holds there, on the CPU the K/V cache

    def describe(self, shape: ModelShape) -> str:
        """What was placed and why: model, budget, weights, context."""
        config = self.config
        model = (f"{config.model_path.name} ({shape.weight_bytes / GiB:.2f} GiB, {shape.n_layer} layers"
                 + (f", {shape.n_expert} experts" if shape.n_expert else "") + ")")
        sized = ", ".join(sorted(s.value for s in self.sized)) or "nothing"
        return (f"fit ({sized}): {model}; budget {self.budget.bytes / GiB:.2f} GiB ({self.budget.source}); "
                f"{_placement_words(shape, config, self.budget.kind)}; {config.n_parallel} slot(s) x "
                f"{config.n_ctx_per_slot} tokens (trained {shape.n_ctx_train or 'unknown'}); predicted "
                f"{self.predicted / GiB:.2f} GiB{' of K/V' if self.budget.kind is DeviceKind.cpu else ''}"
                + ("" if self.predicted <= self.budget.bytes else ": over the budget, the least there is"))


def _placement_words(shape: ModelShape, config: EngineConfig, kind: DeviceKind) -> str:
    if kind is DeviceKind.cpu:
        return "weights on the CPU"
    layers = shape.n_layer + 1 if config.n_gpu_layers < 0 else min(config.n_gpu_layers, shape.n_layer + 1)
    words = f"{layers} of {shape.n_layer + 1} layers on the GPU"
    if config.n_cpu_moe:
        last = min(config.cpu_moe_start + config.n_cpu_moe, shape.n_layer) - 1
        words += f", experts of layers {config.cpu_moe_start}-{last} in host memory"
    return words + (f", override_tensor {list(config.override_tensor)}" if config.override_tensor else "")


def fit(shape: ModelShape, config: EngineConfig, budget: FitBudget) -> Fitted:
    """`config` with its auto settings sized for `budget` (a sized config comes back as it is)."""
    placed = _place(shape, config, budget)
    sized = _size_context(shape, placed, budget)
    done = sized.model_copy(update={"auto": frozenset()})
    measure = predict(shape, done, on_gpu=True).total if budget.kind is DeviceKind.gpu else kv_cache_bytes(shape, done)
    return Fitted(done, config.auto, budget, measure)


# -- the weights -----------------------------------------------------------------------------------------------
def _first(values: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    return next((v for v in values if fits(v)), None)


def _within(shape: ModelShape, budget: int | FitBudget) -> Callable[[EngineConfig], bool]:
    """Whether a config fits `budget`: bytes of the whole (the tuner's), or a FitBudget (over several GPUs, each
    GPU's part checked too)."""
    if isinstance(budget, FitBudget):
        return lambda config: budget.fits(shape, config)
    return lambda config: predict(shape, config, on_gpu=True).total <= budget


def most_layers(shape: ModelShape, config: EngineConfig, budget: int | FitBudget) -> int | None:
    """The largest n_gpu_layers (counting the output layer, as llama.cpp does) predicted within `budget`."""
    within = _within(shape, budget)
    return _first(range(shape.n_layer + 1, -1, -1),
                  lambda n: within(config.model_copy(update={"n_gpu_layers": n, "n_cpu_moe": 0})))


class ExpertEnd(str, Enum):
    """Which end of the model the layers whose experts live in host memory are taken from. `first`: layers
    0..N-1, llama-server's --n-cpu-moe; `last`: the N nearest the output, where its --fit puts them. At the same
    count and VRAM the speed can differ: on an H100, 29 of 48 layers' experts, last instead of first, ran four
    streams 1.19x faster with TTFT 0.53x, one stream the same (docs/log/2026-12-06-h100-sixth-run.md); so the
    tuner measures both, and the fit at start takes the last."""

    first = "first"
    last = "last"

    def start(self, shape: ModelShape, n: int) -> int:
        """cpu_moe_start for `n` layers' experts at this end."""
        return 0 if self is ExpertEnd.first else max(shape.n_layer - n, 0)


def expert_placement(shape: ModelShape, n: int, end: ExpertEnd) -> dict[str, int]:
    """The engine settings that keep `n` layers' experts in host memory, taken from `end`."""
    return {"n_cpu_moe": n, "cpu_moe_start": end.start(shape, n)}


def fewest_expert_layers(shape: ModelShape, config: EngineConfig, budget: int | FitBudget,
                         end: ExpertEnd = ExpertEnd.first) -> int | None:
    """The smallest n_cpu_moe (all layers on the GPU otherwise), its layers taken from `end`, predicted within
    `budget`; None for a dense model, or when even every layer's experts in host memory do not fit."""
    if not shape.n_expert:
        return None
    within = _within(shape, budget)
    return _first(range(shape.n_layer + 1), lambda n: within(
        config.model_copy(update={"n_gpu_layers": -1, **expert_placement(shape, n, end)})))


def _place(shape: ModelShape, config: EngineConfig, budget: FitBudget) -> EngineConfig:
    """n_gpu_layers auto sized: see the module. The CPU, or a placement of the user's (n_cpu_moe, override_tensor),
    keeps every layer where llama.cpp puts it (-1)."""
    if AutoSetting.n_gpu_layers not in config.auto:
        return config
    everything = config.model_copy(update={"n_gpu_layers": -1})
    if budget.kind is DeviceKind.cpu or config.n_cpu_moe or config.override_tensor:
        return everything
    least = _least_context(shape, everything, MIN_CTX)
    # a mixture of experts with its context auto makes room for an agent's slot by moving experts, where that is
    # enough (whole layers never move for context: a dense model's decode would pay for every token of it)
    reserves = [_least_context(shape, everything, AGENT_CTX), least] if shape.n_expert else [least]
    for reserve in reserves:
        if budget.fits(shape, reserve):
            return everything
        moved = fewest_expert_layers(shape, reserve, budget, ExpertEnd.last)
        if moved is not None:
            return everything.model_copy(update=expert_placement(shape, moved, ExpertEnd.last))
    if shape.n_expert:
        experts = expert_placement(shape, shape.n_layer, ExpertEnd.last)
        layers = _first(range(shape.n_layer + 1, -1, -1), lambda n: budget.fits(
            shape, least.model_copy(update={"n_gpu_layers": n, **experts})))
        return config.model_copy(update={"n_gpu_layers": layers or 0, **experts})
    return config.model_copy(update={"n_gpu_layers": most_layers(shape, least, budget) or 0})


def _least_context(shape: ModelShape, config: EngineConfig, per_slot: int) -> EngineConfig:
    """`config` at the context the weights are placed beside: its own, or where auto, one slot (or its slots) of
    `per_slot` tokens (the trained length if shorter)."""
    slots = 1 if AutoSetting.n_parallel in config.auto else config.n_parallel
    if AutoSetting.n_ctx not in config.auto:
        return config.model_copy(update={"n_parallel": slots})
    return config.model_copy(update={"n_parallel": slots, "n_ctx": slots * min(per_slot, _longest(shape))})


# -- the context --------------------------------------------------------------------------------------------------
def _longest(shape: ModelShape) -> int:
    """The longest context a slot may have: the trained length (a header without one: an agent's)."""
    return shape.n_ctx_train or AGENT_CTX


def _size_context(shape: ModelShape, config: EngineConfig, budget: FitBudget) -> EngineConfig:
    """n_ctx and n_parallel auto sized (the weights placed): see the module."""
    auto_ctx, auto_slots = AutoSetting.n_ctx in config.auto, AutoSetting.n_parallel in config.auto
    floor = min(AGENT_CTX, _longest(shape))
    choices = AUTO_SLOTS if auto_slots else (config.n_parallel,)
    if not auto_ctx:
        if not auto_slots:
            return config
        slots = next((s for s in choices if config.n_ctx // s >= min(floor, config.n_ctx)), choices[-1])
        return config.model_copy(update={"n_parallel": slots})
    per_slot = 0
    for slots in choices:
        per_slot = largest_context(shape, config, slots, budget)
        if per_slot >= floor:
            break
    per_slot = per_slot or min(MIN_CTX, _longest(shape))  # nothing fits: the least, and the log line says so
    return config.model_copy(update={"n_parallel": slots, "n_ctx": per_slot * slots})


def largest_context(shape: ModelShape, config: EngineConfig, slots: int, budget: FitBudget) -> int:
    """The most tokens a slot can have (a multiple of CELL_STEP, at most the trained length) with `slots` slots
    within `budget`; 0 when not even CELL_STEP fits. The memory grows with the context, so a bisection."""
    longest = _longest(shape)
    steps = [min(k * CELL_STEP, longest) for k in range(1, -(-longest // CELL_STEP) + 1)]
    low, high = 0, len(steps)  # steps[:low] fit, steps[high:] do not
    while low < high:
        mid = (low + high) // 2
        if budget.fits(shape, config.model_copy(update={"n_parallel": slots, "n_ctx": steps[mid] * slots})):
            low = mid + 1
        else:
            high = mid
    return steps[low - 1] if low else 0
