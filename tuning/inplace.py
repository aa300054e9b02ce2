"""In-place studies: the trials run inside the serving replicas, on the engines (and weights) that serve.

On one GPU that is serving, a second engine beside the replica would be a second copy of the weights on
the card and a measurement competing with live traffic for bandwidth. In place, each replica is a trial
slot: a trial takes its engine between client requests (serving/replica/trials.py), rebuilds only the context,
and runs the same measurement as an offline trial (tuning/objective.py's `measure_engine`), with the
memory of the whole device. The study ends with a config published to every replica: the pick, or, when
the study is interrupted, the config they served before.

The replicas may change under a study (num_replicas=auto follows the cluster): each trial goes to a replica that
exists then (Serve routes it, away from those in a trial), one that appears takes trials in turn, and one lost
mid-trial fails that trial with the reason, while the study goes on with the others.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from ray.tune import Callback

from serving.engine.config import EngineConfig
from serving.replica.trials import TrialRun
from tuning.objective import InPlaceMeasure, SpeedMeasure
from tuning.plan import TrialSettings
from tuning.results import Measurement, MeasuredRun, SpeedFigures, TrialResult
from tuning.serving_app import engine_handle
from tuning.trial import ConfigTrial

REQUESTS_PER_TRIAL = 1000  # request numbers each trial's prompts may use (fresh prefixes across trials)
# what a trial's actor asks for: it only sends the config and the measurement to a replica, so it lives on the head
# node, which a cluster never loses: a node lost mid-study fails the trial its replica ran (the report shows the
# error), never the trial's own actor
ON_HEAD = {"cpu": 0.01, "node:__internal_head__": 0.001}
LOST = ("the replica running this trial was lost (its node left the cluster, or it died); the study goes on with "
        "the others")


class ReplicaTrial(ConfigTrial):
    """A trial run by a serving replica: this actor only sends the config and the measurement there."""

    def setup(self, config: dict[str, Any], settings: TrialSettings, app: str,  # type: ignore[override]
              study: str, trials: int) -> None:
        super().setup(config, settings)
        self.handle = engine_handle(app)
        self.study, self.trials = study, trials
        self.baseline: float | None = None  # the f16 NLL, measured by the first trial and passed on
        self.requests = itertools.count(1, REQUESTS_PER_TRIAL)

    def _measure(self, config: EngineConfig) -> MeasuredRun:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError

        measure = InPlaceMeasure(self.settings.workload, self.settings.on_gpu, next(self.requests), self.baseline,
                                 self.settings.traffic)
        try:
            run: TrialRun = self.handle.tune_trial.remote(self.study, self.trials, config,
                                                          measure).result()
        except (ActorDiedError, ActorUnavailableError) as exc:  # its node left the cluster, or it died
            raise RuntimeError(f"{LOST}: {type(exc).__name__}") from exc
        except RayError as exc:  # the replica could not run it (a config that does not build)
            raise RuntimeError(f"the replica could not run this trial: {exc}") from exc
        measured: Measurement = run.measured
        self.baseline = measured.nll_baseline
        # the replica's weight loads (its start-up's included), not the engine's: a trial must add none
        measured = replace(measured, weight_loads=run.weight_loads)
        return MeasuredRun(measurement=measured, setup_s=run.setup_s, held_s=run.held_s)


def replica_speed(app: str, study: str, trials: int, config: EngineConfig, measure: SpeedMeasure) -> SpeedFigures:
    """One speed measurement of `config` on a serving replica, as a trial of the study (its turn, its
    context rebuilt), for the confirmation round."""
    run: TrialRun = engine_handle(app).tune_trial.remote(study, trials, config, measure).result()
    figures: SpeedFigures = run.measured
    return figures


class FirstTrialNotice(Callback):
    """Says, once, how long the first measured trial held its replica: how long client requests that arrive
    during a trial wait, and about how long the study will take."""

    def __init__(self, trials: int, replicas: int) -> None:
        self.trials, self.replicas, self.said = trials, max(replicas, 1), False

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        held = TrialResult.from_tune(result).held_s
        if self.said or not held:
            return
        self.said = True
        minutes = held * self.trials / self.replicas / 60
        print(f"the first trial held its replica for {held:.1f} s: client requests arriving during a trial wait "
              f"up to about that long; {self.trials} trials take about {minutes:.0f} min", flush=True)
