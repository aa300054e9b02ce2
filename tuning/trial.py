"""One Ray Tune trial: build (or rebuild) serving's Engine with the proposed config and measure it.

The Trainable is reused across trials (TuneConfig(reuse_actors=True)): `reset_config` keeps the engine and
its loaded weights, and the next `step` only rebuilds the llama.cpp context. A config whose predicted
memory is over budget is answered at once, without touching the engine.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from typing import Any

from serving.engine import llama as _llama  # noqa: F401  (load order: ray before libllama, see serving/engine/llama.py)

from ray import tune

from serving.engine.buffers import llama_buffers
from serving.engine.config import EngineConfig
from serving.engine.core import Engine, EngineError
from tuning.device import DeviceProbe
from serving.engine.memory import predict
from tuning.objective import Runner, SpeedMeasure, measure_engine
from tuning.plan import TrialSettings
from tuning.prune import BAR_KEY, Bar, Short, behind, short_tokens
from tuning.results import MeasuredRun, SpeedFigures, TrialResult
from tuning.space import to_engine_config

SHORT_PROMPTS = 1000  # prompt numbers a short measurement may use (fresh prefixes: no prompt-cache hits)


class ConfigTrial(tune.Trainable):
    """Ray Tune trainable measuring one engine config per `step` (a trial is one step): what every trial
    does around the measurement (the memory prediction, configs already measured, the constraints).
    Subclasses say where the engine is (`_measure`)."""

    def setup(self, config: dict[str, Any], settings: TrialSettings) -> None:  # type: ignore[override]
        self.settings = settings
        self.actor = f"{socket.gethostname()}:{os.getpid()}"
        self.measured: dict[EngineConfig, MeasuredRun] = {}  # what this actor already measured, per config

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        self.config = new_config  # the engine stays: the next step rebuilds only what changed
        return True

    def step(self) -> dict[str, Any]:
        """One trial; Ray Tune's result dict is the TrialResult's projection (tuning/results.py)."""
        return {**self.trial().to_attrs(), "done": True}

    def trial(self) -> TrialResult:
        s = self.settings
        params = {k: v for k, v in self.config.items() if k != BAR_KEY}  # the bar is the searcher's, not a setting
        line = Bar.from_dict(self.config[BAR_KEY]) if self.config.get(BAR_KEY) else None
        config = to_engine_config(params, s.base)
        predicted = predict(s.shape, config, s.on_gpu)
        result = TrialResult(params=params, n_ctx=config.n_ctx, mem_predicted=predicted.total,
                             mem_host_predicted=predicted.host if s.on_gpu else None,
                             mem_budget=s.budget_bytes, actor=self.actor,
                             capacity_tok_s=0.0 if s.workload.min_stream_tok_s is not None else None,
                             workload=s.traffic.workload.name if s.traffic is not None else "",
                             goodput_rps=0.0 if s.traffic is not None else None)
        if predicted.total > s.budget_bytes:
            result = replace(result, rejected="predicted memory over budget")
        elif s.on_gpu and s.ram_budget_bytes is not None and predicted.host > s.ram_budget_bytes:
            result = replace(result, rejected="predicted host memory over the RAM budget")
        elif config in self.measured:  # different parameters, same engine (e.g. n_ubatch clamped): no re-run
            result = result.measured(self.measured[config], reused=True)
        else:
            try:
                result = self._short_then_full(config, result, line)
            except (EngineError, RuntimeError) as exc:
                result = replace(result, error=str(exc))
        return result.constrained(s.budget_bytes, s.max_quality_loss)

    def _short_then_full(self, config: EngineConfig, result: TrialResult, line: Bar | None) -> TrialResult:
        """With pruning on, the short measurement first: pruned (no full measurement) when it is behind `line`,
        the searcher's bar (none for the baseline or before any trial was measured); then the full one."""
        self._prepare(config)  # the context built once, outside both timings: short_s and measure_s compare
        if self.settings.prune_below > 0:
            t0 = time.perf_counter()
            short = self._measure_short(config)
            result = replace(result, short_single_tok_s=short.single_tok_s, short_second=short.second,
                             short_s=time.perf_counter() - t0)
            if line is not None and behind(short, line):
                return replace(result, pruned=True)
        t0 = time.perf_counter()
        self.measured[config] = self._measure(config)
        return replace(result.measured(self.measured[config]), measure_s=time.perf_counter() - t0)

    def _prepare(self, config: EngineConfig) -> None:
        """Get the engine ready to run `config`, where this actor holds it (offline); in place the replica does."""
        return None

    def _measure(self, config: EngineConfig) -> MeasuredRun:
        raise NotImplementedError

    def _measure_short(self, config: EngineConfig) -> Short:
        """The short measurement (tuning/prune.py); offline only (tuning/plan.py's prune_below says why)."""
        raise NotImplementedError

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """A trial is one measurement: nothing to resume from (the study itself persists in Optuna)."""
        return None

    def load_checkpoint(self, checkpoint: Any) -> None:
        return None


class EngineTrial(ConfigTrial):
    """Trials on an engine of the tuner's own (`--offline`): loaded once per actor, then only the context
    is rebuilt per trial."""

    def setup(self, config: dict[str, Any], settings: TrialSettings) -> None:  # type: ignore[override]
        super().setup(config, settings)
        self.engine: Engine | None = None
        self.weight_buffers: dict[str, float] = {}  # llama.cpp's weight buffers (MiB by type) from the load
        self.runner = Runner(settings.workload)
        self.probe = DeviceProbe(settings.on_gpu)
        self.baseline_nll: float | None = None
        self.rebuild_s = 0.0  # the last load or context rebuild
        self.buffers: dict[str, dict[str, float]] = {}  # llama.cpp's buffers of the config built last

    def _build(self, config: EngineConfig) -> Engine:
        """Load (first trial) or rebuild the context, unless the engine runs `config` already (its short
        measurement built it); llama.cpp's buffer sizes are read as it allocates them, the weights' from the load
        (a rebuild keeps them), so each trial's memory can be set against the memory model term by term."""
        if self.engine is not None and self.engine.requested == config:
            return self.engine
        t0 = time.perf_counter()
        with llama_buffers() as buffers:
            if self.engine is None:
                self.probe.mark_baseline()
                self.engine = Engine(config)
                self.weight_buffers = dict(buffers.get("model", {}))
            else:
                self.engine.reconfigure(config)
        self.rebuild_s = time.perf_counter() - t0
        self.buffers = {**buffers, "model": self.weight_buffers}
        return self.engine

    def _prepare(self, config: EngineConfig) -> None:
        self._build(config)

    def _measure(self, config: EngineConfig) -> MeasuredRun:
        engine = self._build(config)
        measured = measure_engine(engine, self.runner, self.probe, self.baseline_nll, self.settings.traffic)
        self.baseline_nll = measured.nll_baseline
        return MeasuredRun(measurement=measured, setup_s=self.rebuild_s, buffers_mib=self.buffers)

    def _measure_short(self, config: EngineConfig) -> Short:
        """A quarter of the tokens, one round after the warm-up, on prompts of its own numbers."""
        workload = self.settings.workload
        short = replace(workload, gen_tokens=short_tokens(workload.gen_tokens), repeats=1, report_copy=False)
        figures = SpeedMeasure(short, self.runner.prompts.reserve(SHORT_PROMPTS))(self._build(config))
        return Short(single_tok_s=figures.single_tok_s, second=figures.second(self.settings.objective))

    def cleanup(self) -> None:
        if self.engine is not None:
            self.engine.close()


class ConfirmEngine:
    """The confirmation round's engine for an offline study (a Ray actor: `ray.remote(ConfirmEngine)`): one
    engine, loaded with the first config it measures, then its context rebuilt per config; the Tune actors are
    gone by then, so this loads the weights once."""

    def __init__(self) -> None:
        self.engine: Engine | None = None

    def measure(self, config: EngineConfig, measure: SpeedMeasure) -> SpeedFigures:
        if self.engine is None:
            self.engine = Engine(config)
        elif config != self.engine.requested:  # as asked, `auto` settings and all (engine.config is sized)
            self.engine.reconfigure(config)
        return measure(self.engine)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
