"""The search space (overridable from YAML) and its validity rules, as an Optuna define-by-run function.

Every point it proposes is a valid EngineConfig: n_ubatch is clamped to n_batch, a quantised V cache forces flash
attention on, context is searched per slot and never below `min_ctx_per_slot` (the tuner must not win by starving
context), up to agent-sized contexts (64k and 128k a slot) where the model and memory allow, placement is set only
when the weights do not fit the budget with the smallest config: then each point's placement is the most of the
model its other settings leave room for (`PlacementFit`: for a mixture of experts the fewest layers whose experts
live in host memory, `n_cpu_moe`, taken from the first layers or the last (`expert_end`, searched); else the most
layers on the GPU, `n_gpu_layers`), and `n_threads` for what the CPU computes is searched (the space's list, else
`thread_choices`, unless the base config sets it), and speculative decoding (`spec_mode`) only when the space lists
more than `off`, its draft bound and busy-slot limit only for the configs that speculate (measure it with
`--prompt-set both`: prompt lookup pays on text that copies its prompt), and where each engine holds several GPUs
how the model spreads over them (`split_mode`: by layer or by row).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from serving.engine.config import CacheType, EngineConfig, FlashAttn, SpecMode, SplitMode
from serving.engine.fit import ExpertEnd, expert_placement, fewest_expert_layers, most_layers
from serving.engine.memory import ModelShape

DEFAULT_SPACE_FILE = Path(__file__).resolve().parent.parent / "configs" / "search_space.yaml"


class SearchSpace(BaseModel):
    """Candidate values per setting; configs/search_space.yaml holds the defaults."""

    model_config = ConfigDict(extra="forbid")

    n_parallel: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16])
    n_batch: list[int] = Field(default_factory=lambda: [128, 256, 512, 1024, 2048])
    n_ubatch: list[int] = Field(default_factory=lambda: [128, 256, 512, 1024, 2048])
    ctx_per_slot: list[int] = Field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072],
                                    description="tokens per slot; those over the model's trained length, or more "
                                    "than the budget holds beside the weights, are dropped (tuning/plan.py)")
    type_k: list[CacheType] = Field(default_factory=lambda: [CacheType.f16, CacheType.q8_0, CacheType.q4_0])
    type_v: list[CacheType] = Field(default_factory=lambda: [CacheType.f16, CacheType.q8_0, CacheType.q4_0])
    flash_attn: list[FlashAttn] = Field(default_factory=lambda: [FlashAttn.on, FlashAttn.off])
    kv_unified: list[bool] = Field(default_factory=lambda: [False, True], description="one K/V buffer per slot "
                                   "or one for all (kv_unified), searched with 2 or more slots")
    spec_mode: list[SpecMode] = Field(default_factory=lambda: [SpecMode.off],
                                      description="speculative decoding modes to search; [off] = not searched")
    spec_draft_max: list[int] = Field(default_factory=lambda: [16], description="the most guesses per step, "
                                      "with speculation on; one value = not searched")
    spec_max_busy: list[int] = Field(default_factory=lambda: [1], description="speculate while at most this many "
                                     "slots are busy, with speculation on; one value = not searched")
    n_threads: list[int] = Field(default_factory=list, description="CPU threads to search when part of the "
                                 "model lives in host memory; [] = all, one fewer and half of an engine's "
                                 "default, unless the base config sets n_threads")
    expert_end: list[ExpertEnd] = Field(default_factory=lambda: [ExpertEnd.first, ExpertEnd.last],
                                        description="a mixture of experts that does not fit: which end of the "
                                        "model the layers whose experts live in host memory come from; one "
                                        "value = not searched")
    split_mode: list[SplitMode] = Field(default_factory=lambda: [SplitMode.layer],
                                        description="engines of several GPUs (gpus_per_replica): how the model "
                                        "spreads over them, searched there when the space lists more than one "
                                        "(the shipped space: layer and row); one GPU: the base config's")

    @field_validator("n_parallel", "n_batch", "n_ubatch", "ctx_per_slot", "spec_draft_max", "spec_max_busy")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        if not values or any(v < 1 for v in values):
            raise ValueError("needs at least one value, all positive")
        return sorted(set(values))

    @field_validator("n_threads")
    @classmethod
    def _threads(cls, values: list[int]) -> list[int]:
        if any(v < 1 for v in values):
            raise ValueError("thread counts are positive")
        return sorted(set(values))

    @field_validator("kv_unified")
    @classmethod
    def _layouts(cls, values: list[bool]) -> list[bool]:
        if not values:
            raise ValueError("needs at least one value: [false], [true] or both")
        return sorted(set(values))

    @field_validator("expert_end")
    @classmethod
    def _ends(cls, values: list[ExpertEnd]) -> list[ExpertEnd]:
        if not values:
            raise ValueError("needs at least one value: [first], [last] or both")
        return list(dict.fromkeys(values))

    @field_validator("split_mode")
    @classmethod
    def _splits(cls, values: list[SplitMode]) -> list[SplitMode]:
        if not values:
            raise ValueError("needs at least one value: layer, row or none")
        return list(dict.fromkeys(values))

    def for_gpus(self, gpus_per_engine: int, base: EngineConfig) -> SearchSpace:
        """This space where each engine holds `gpus_per_engine` GPUs: with fewer than two there is nothing to
        split, and split_mode stays the base config's (not searched)."""
        return self if gpus_per_engine > 1 else self.model_copy(update={"split_mode": [base.split_mode]})

    @field_validator("flash_attn", "spec_mode", mode="before")
    @classmethod
    def _yaml_bools(cls, values: list[Any]) -> list[Any]:
        """YAML reads a bare `off` as false."""
        return [("on" if v else "off") if isinstance(v, bool) else v for v in values]

    @classmethod
    def from_yaml(cls, path: Path | None) -> SearchSpace:
        path = path or DEFAULT_SPACE_FILE
        if not path.exists():
            raise FileNotFoundError(f"search space file {path} not found")
        return cls(**(yaml.safe_load(path.read_text()) or {}))

    def contexts(self, min_ctx_per_slot: int, longest: int = 0) -> list[int]:
        """Per-slot contexts allowed: at least `min_ctx_per_slot` and at most `longest` (the model's trained
        length; 0: unknown). Where the space has none as long as the least (a recorded request longer than the
        space), that least itself is the one context searched, with a warning: a study never refuses to run
        for the space's list."""
        allowed = [c for c in self.ctx_per_slot if min_ctx_per_slot <= c <= (longest or c)]
        if allowed:
            return allowed
        print(f"warning: no ctx_per_slot of the search space ({self.ctx_per_slot}) is >= {min_ctx_per_slot} "
              f"tokens{f' and <= the trained {longest}' if longest else ''}: searching {min_ctx_per_slot} "
              "tokens per slot only (add values to the space for more)", file=sys.stderr)
        return [min_ctx_per_slot]


EXPERT_END = "expert_end"  # drawn, and in a trial's settings, but what the engine gets is n_cpu_moe and cpu_moe_start
NOT_ENGINE_SETTINGS = frozenset({"ctx_per_slot", EXPERT_END})


class PlacementKnob(str, Enum):
    """What moves between the GPU and host memory when the model does not fit."""

    layers = "n_gpu_layers"  # whole layers (a dense model)
    experts = "n_cpu_moe"  # the expert tensors of N layers (a mixture of experts), from one end (ExpertEnd)


@dataclass(frozen=True)
class PlacementFit:
    """A point's placement, derived from its other settings: the most of the model on the GPU that the memory
    model (serving/engine/memory.py) predicts within the budget, given the point's context, slots, K/V types and batch
    (its compute buffers). Not drawn: decode reads every weight once per token, from host memory far slower
    than from the GPU's, so less on the GPU is never faster, and a drawn placement wastes trials on the slow
    end or on configs that do not fit. What the search trades is the rest against room for weights (a q8_0
    cache or a smaller batch for more experts on the GPU), which is what llama-server's --fit leaves fixed."""

    shape: ModelShape
    base: EngineConfig
    budget: int

    @property
    def knob(self) -> PlacementKnob:
        return PlacementKnob.experts if self.shape.n_expert else PlacementKnob.layers

    def __call__(self, params: dict[str, Any], end: ExpertEnd = ExpertEnd.first) -> dict[str, int]:
        """The placement's engine settings for a point's settings (`suggest`'s names), a mixture of experts'
        layers taken from `end`; where nothing fits, the least on the GPU, which the trial then refuses as over
        the budget before it loads."""
        config = to_engine_config(params, self.base)
        if self.knob is PlacementKnob.experts:
            moved = fewest_expert_layers(self.shape, config, self.budget, end)
            return expert_placement(self.shape, self.shape.n_layer if moved is None else moved, end)
        return {PlacementKnob.layers.value: most_layers(self.shape, config, self.budget) or 0}


@dataclass(frozen=True)
class PlacementSearch:
    """Where a model that does not fit lives: each point's placement from `fit`, the thread counts searched
    with it (one: set, none: the base config's), and for a mixture of experts the ends its layers are taken
    from (more than one: searched)."""

    fit: PlacementFit
    threads: tuple[int, ...] = ()
    ends: tuple[ExpertEnd, ...] = (ExpertEnd.first,)


def thread_choices(threads: int) -> tuple[int, ...]:
    """Thread counts to search for what the CPU computes once part of the model lives in host memory, given
    the threads an engine there runs by default (every CPU it may use): all, one fewer, and half. The CPU's
    share decides the speed then (on the 16-core H100 machine an MoE with 29 layers' experts in host memory
    decoded 1.5x faster on 16 threads than on 8: docs/log/2026-12-05-h100-first-run.md), and one fewer leaves a
    core to the step loop's Python and the HTTP path, which otherwise stall llama.cpp's barriers on a busy core."""
    return tuple(sorted({threads, max(threads - 1, 1), max(threads // 2, 1)}))


def suggest(trial: Any, space: SearchSpace, contexts: list[int], placement: PlacementSearch | None) -> dict[str, Any]:
    """Define-by-run: draw one config's settings from `trial` (an optuna.Trial). Names match EngineConfig,
    except ctx_per_slot, which `to_engine_config` turns into n_ctx, and the drawn expert_end (Ray Tune keeps every
    drawn value in a trial's settings), which the placement has turned into n_cpu_moe and cpu_moe_start."""
    params: dict[str, Any] = {
        "n_parallel": trial.suggest_categorical("n_parallel", space.n_parallel),
        "n_batch": trial.suggest_categorical("n_batch", space.n_batch),
        "n_ubatch": trial.suggest_categorical("n_ubatch", space.n_ubatch),
        "ctx_per_slot": trial.suggest_categorical("ctx_per_slot", contexts),
        "type_k": trial.suggest_categorical("type_k", [t.value for t in space.type_k]),
        "type_v": trial.suggest_categorical("type_v", [t.value for t in space.type_v]),
    }
    if CacheType(params["type_v"]).is_quantized:
        params["flash_attn"] = FlashAttn.on.value  # llama.cpp needs it for a quantised V cache
    else:
        params["flash_attn"] = trial.suggest_categorical("flash_attn", [f.value for f in space.flash_attn])
    if len(space.split_mode) > 1:
        params["split_mode"] = trial.suggest_categorical("split_mode", [m.value for m in space.split_mode])
    if params["n_parallel"] > 1:
        values = space.kv_unified
        params["kv_unified"] = trial.suggest_categorical("kv_unified", values) if len(values) > 1 else values[0]
    if placement is not None:
        if len(placement.threads) > 1:
            params["n_threads"] = trial.suggest_categorical("n_threads", list(placement.threads))
        elif placement.threads:
            params["n_threads"] = placement.threads[0]
        end = placement.ends[0]
        if placement.fit.knob is PlacementKnob.experts and len(placement.ends) > 1:
            end = ExpertEnd(trial.suggest_categorical(EXPERT_END, [e.value for e in placement.ends]))
        params.update(placement.fit(params, end))
    if space.spec_mode != [SpecMode.off]:  # searched only when the space asks: it changes what is measured
        params["spec_mode"] = trial.suggest_categorical("spec_mode", [m.value for m in space.spec_mode])
    if params.get("spec_mode", SpecMode.off.value) != SpecMode.off.value:  # its settings matter only when on
        for name in ("spec_draft_max", "spec_max_busy"):
            values = getattr(space, name)
            params[name] = trial.suggest_categorical(name, values) if len(values) > 1 else values[0]
    return params


class SpaceFunction:
    """The define-by-run function handed to OptunaSearch (a class, so Ray Tune can pickle it)."""

    def __init__(self, space: SearchSpace, contexts: list[int], placement: PlacementSearch | None) -> None:
        self.space, self.contexts, self.placement = space, contexts, placement

    def __call__(self, trial: Any) -> dict[str, Any]:
        return suggest(trial, self.space, self.contexts, self.placement)


def to_engine_config(params: dict[str, Any], base: EngineConfig) -> EngineConfig:
    """Trial settings on top of the base config (model, threads, ...); n_ubatch clamped to n_batch."""
    fields = {k: v for k, v in params.items() if k not in NOT_ENGINE_SETTINGS}
    fields["n_ubatch"] = min(fields["n_ubatch"], fields["n_batch"])
    fields["n_ctx"] = params["ctx_per_slot"] * params["n_parallel"]
    return EngineConfig(**{**base.model_dump(exclude_none=True), **fields})
