"""What a trial measures, on serving's own Engine: the shared workload (measure/workload.py) plus memory and
quality.

Trials differ only in the engine config; the workload (prompts, generation length, greedy, warm-up,
medians, the TTFT definition) is the one the benchmark scripts run too. `measure_engine` is the whole
measurement of an engine already running a trial's config, wherever that engine lives: in the tuner's own
actor (tuning/trial.py), or inside a serving replica (`InPlaceMeasure`, sent there by tuning/inplace.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from importlib import resources

from measure.targets import EngineTarget
from measure.workload import Capacity, PromptSet, Runner, Speed, Workload
from serving.engine.config import CacheType
from serving.engine.core import Engine
from serving.replica.node import node_label
from tuning.device import DeviceProbe
from tuning.results import CurvePoint, Measurement, SpeedFigures
from tuning.workloads import TrafficPlan

__all__ = ["InPlaceMeasure", "Runner", "Speed", "SpeedMeasure", "Workload", "baseline_nll",
           "measure_engine", "quality_tokens"]

QUALITY_PROBE_CTX = 1024


def quality_tokens(engine: Engine) -> list[int]:
    """The shipped quality-probe text, tokenised for this model."""
    text = resources.files("tuning").joinpath("data/quality.txt").read_text(encoding="utf-8")
    return engine.tokenize_prompt(text)


def baseline_nll(engine: Engine) -> float:
    """NLL of the quality text with an f16 K/V cache, the reference for the quality guard; the engine is
    switched to the reference config for it and back to the config it ran."""
    config = engine.config
    reference = config.model_copy(update={
        "type_k": CacheType.f16, "type_v": CacheType.f16, "n_parallel": 1, "n_ctx": QUALITY_PROBE_CTX,
    })
    engine.reconfigure(reference)
    try:
        return engine.score(quality_tokens(engine))
    finally:
        engine.reconfigure(config)


def measure_engine(engine: Engine, runner: Runner, probe: DeviceProbe, baseline: float | None,
                   traffic: TrafficPlan | None = None) -> Measurement:
    """Speed, memory and quality of `engine` as it runs now; `baseline` (the f16 NLL) is measured when None.
    On a traffic workload the speed is its replay's: the median request's decode tok/s stands for the single
    stream, output tok/s for the aggregate, and goodput beside them. Runs the workload in an event loop of
    its own: call it from a thread that has none running."""
    mem_measured = probe.memory_in_use()
    if traffic is not None:
        return _traffic_measurement(engine, runner, probe, baseline, traffic, mem_measured)
    speed, capacity, copy = asyncio.run(_speed_figures(runner, EngineTarget(engine)))
    nll = engine.score(quality_tokens(engine))
    reference = baseline_nll(engine) if baseline is None else baseline
    curve = (tuple(CurvePoint(streams=p.streams, aggregate_tok_s=p.aggregate_tok_s, slowest_tok_s=p.slowest_tok_s)
                   for p in capacity.curve) if capacity is not None else None)
    return Measurement(
        single_tok_s=speed.single_tok_s, aggregate_tok_s=speed.aggregate_tok_s, ttft_ms=speed.ttft_ms,
        prefill_tok_s=speed.prefill_tok_s, nll=nll, nll_baseline=reference, mem_measured=mem_measured,
        weight_loads=engine.weight_loads, weight_load_s=engine.weight_load_s,
        capacity_tok_s=capacity.tok_s if capacity is not None else None,
        capacity_streams=capacity.streams if capacity is not None else None, capacity_curve=curve,
        single_copy_tok_s=copy, node=node_label(), **probe.state())


def _traffic_measurement(engine: Engine, runner: Runner, probe: DeviceProbe, baseline: float | None,
                         traffic: TrafficPlan, mem_measured: int) -> Measurement:
    figures = traffic.replay(engine, runner.prompts.reserve(len(traffic.workload.requests)))
    nll = engine.score(quality_tokens(engine))
    reference = baseline_nll(engine) if baseline is None else baseline
    ttft = figures.percentiles.get("ttft_p50", (0.0, 0.0, 0.0, 0))[0]
    return Measurement(
        single_tok_s=figures.median_stream_tok_s, aggregate_tok_s=figures.output_tok_s, ttft_ms=1000 * ttft,
        prefill_tok_s=0.0, nll=nll, nll_baseline=reference, mem_measured=mem_measured,
        weight_loads=engine.weight_loads, weight_load_s=engine.weight_load_s, traffic=figures, node=node_label(),
        **probe.state())


async def _speed_figures(runner: Runner, target: EngineTarget) -> tuple[Speed, Capacity | None, float | None]:
    speed = await runner.speed(target)
    return speed, await capacity_figures(runner, target), await copy_figures(runner, target)


async def copy_figures(runner: Runner, target: EngineTarget) -> float | None:
    """With `report_copy`: the single stream on the copy prompt set too (where prompt lookup pays), the median
    decode tok/s of `repeats` runs after a warm-up; the objectives stay on the workload's own set."""
    workload = runner.workload
    if not workload.report_copy:
        return None
    copy = Runner(replace(workload, prompt_set=PromptSet.copy, levels=(1,), report_copy=False),
                  runner.prompts.next_number)
    return (await copy.speed(target)).single_tok_s


async def capacity_figures(runner: Runner, target: EngineTarget) -> Capacity | None:
    """The capacity figure and curve at the config's slot count, when the workload asks for them."""
    floor = runner.workload.min_stream_tok_s
    if floor is None:
        return None
    return await runner.capacity(target, target.engine.config.n_parallel, floor)


@dataclass(frozen=True)
class InPlaceMeasure:
    """A trial's measurement, run inside a serving replica on the engine that serves (pickled there by
    reference). Memory is the whole device's (weights included): in place there is no "before the engine
    loaded" to subtract, and the budget is what the device holds."""

    workload: Workload
    on_gpu: bool
    first_request: int
    baseline: float | None = None
    traffic: TrafficPlan | None = None

    def __call__(self, engine: Engine) -> Measurement:
        probe = DeviceProbe(self.on_gpu, whole_device=True)
        return measure_engine(engine, Runner(self.workload, self.first_request), probe, self.baseline,
                              self.traffic)


@dataclass(frozen=True)
class SpeedMeasure:
    """The workload's speed alone (no memory, no quality), for the confirmation round (tuning/confirm.py);
    like InPlaceMeasure it can run inside a serving replica."""

    workload: Workload
    first_request: int
    traffic: TrafficPlan | None = None

    def __call__(self, engine: Engine) -> SpeedFigures:
        if self.traffic is not None:
            figures = self.traffic.replay(engine, self.first_request)
            return SpeedFigures(single_tok_s=figures.median_stream_tok_s, aggregate_tok_s=figures.output_tok_s,
                                goodput_rps=figures.goodput_rps)
        return asyncio.run(self._measure(Runner(self.workload, self.first_request), EngineTarget(engine)))

    @staticmethod
    async def _measure(runner: Runner, target: EngineTarget) -> SpeedFigures:
        speed = await runner.speed(target)
        capacity = await capacity_figures(runner, target)
        return SpeedFigures(single_tok_s=speed.single_tok_s, aggregate_tok_s=speed.aggregate_tok_s,
                            capacity_tok_s=capacity.tok_s if capacity is not None else None)
