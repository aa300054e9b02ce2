"""OptunaSearch that stores each trial's measurements and constraints in the Optuna study before telling it the
result, and answers from the study a proposal it already measured.

Ray Tune's OptunaSearch tells Optuna only the objective values. The constraint function (memory and quality
feasibility) and the report need the rest of what a trial measured, so it is written to the trial's user
attributes first; the study's storage then holds everything, and a resumed study reports all of it.

With pruning on (tuning/prune.py), each proposal carries the bar its short measurement must reach, from the short
figures of the trials the study holds (none for the baseline, which is never pruned); a trial that fell behind it
is told to Optuna as PRUNED, with its short figures among its attributes, so the report counts it and never picks
it, and TPE counts it among the worse trials.

Different parameters can make the same engine (an n_ubatch above n_batch is clamped to it): on the H200 a
40-trial study measured only 24 distinct configs. A proposal whose engine config a completed trial of the
study already measured is told that trial's results at once (marked `answered_from`), and the sampler is
asked again, so Ray Tune's trials go to configs not yet measured and the sampler still learns the point.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

from ray.tune.search.optuna import OptunaSearch

from tuning import prune
from tuning.results import Objective, TrialResult

MAX_ANSWERED = 10  # proposals answered from the study per suggestion before one runs anyway (a small space)


class RecordingOptunaSearch(OptunaSearch):
    """OptunaSearch plus user attributes: `recorded` result keys, the params, and the baseline mark."""

    def __init__(self, *args: Any, first_is_baseline: bool, canonical: Callable[[dict[str, Any]], Hashable],
                 objective: Objective, prune_prefer: str = "balanced", prune_below: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._objective = objective  # the second objective: the bar's leader on it is read from its full figure
        self._first_is_baseline = first_is_baseline
        self._canonical = canonical  # params -> the engine they make (tuning.space.to_engine_config)
        self._prune_prefer, self._prune_below = prune_prefer, prune_below  # --prefer, --prune-below (0: off)

    def suggest(self, trial_id: str) -> dict | None:
        """The sampler's next proposal whose engine the study has not measured yet, with its short bar."""
        params = super().suggest(trial_id)
        for _ in range(MAX_ANSWERED):
            twin = self._measured_twin(params) if params is not None else None
            if twin is None:
                break
            self._answer(self._ot_trials.pop(trial_id), params or {}, twin)
            params = super().suggest(trial_id)
        line = self._bar(trial_id) if params is not None else None
        return {**params, prune.BAR_KEY: line.to_dict()} if params is not None and line is not None else params

    def _bar(self, trial_id: str) -> prune.Bar | None:
        """The bar for this trial's short measurement; None for the baseline, or with pruning off."""
        if self._first_is_baseline and self._ot_trials[trial_id].number == 0:
            return None
        from optuna.trial import TrialState

        study: Any = self._ot_study
        records = [TrialResult.from_attrs(t.user_attrs)
                   for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))]
        measured = [prune.Measured(prune.Short(r.short_single_tok_s, r.short_second or 0.0),
                                   None if r.pruned else prune.Short(r.single_tok_s, r.second(self._objective)),
                                   r.feasible)
                    for r in records if r.short_single_tok_s is not None and r.answered_from is None]
        return prune.bar(measured, self._prune_prefer, self._prune_below)

    def _measured_twin(self, params: dict[str, Any]) -> Any:
        from optuna.trial import TrialState

        key = self._canonical(params)
        study: Any = self._ot_study  # set by OptunaSearch's setup before any suggestion
        for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            record = TrialResult.from_attrs(trial.user_attrs)
            if record.params and record.answered_from is None and self._canonical(record.params) == key:
                return trial
        return None

    def _answer(self, ot_trial: Any, params: dict[str, Any], twin: Any) -> None:
        record = replace(TrialResult.from_attrs(twin.user_attrs), params=dict(params), is_baseline=False,
                         answered_from=twin.number)
        self._record(ot_trial, record)
        study: Any = self._ot_study
        if record.pruned:  # the twin was pruned: so is this proposal of its engine
            from optuna.trial import TrialState

            study.tell(ot_trial, state=TrialState.PRUNED)
        else:
            study.tell(ot_trial, twin.values)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        ot_trial = self._ot_trials.get(trial_id)
        if ot_trial is not None:  # before Optuna is told: the sampler reads the constraints of finished trials
            record = replace(TrialResult.from_tune(result or {}), params=_params(result or {}),
                             is_baseline=self._first_is_baseline and ot_trial.number == 0)
            self._record(ot_trial, record)
            if record.pruned and trial_id not in self._completed_trials:  # no full figures: Optuna's PRUNED
                from optuna.trial import TrialState

                study: Any = self._ot_study
                study.tell(ot_trial, state=TrialState.PRUNED)
                self._completed_trials.add(trial_id)
                return
        super().on_trial_complete(trial_id, result, error)

    @staticmethod
    def _record(ot_trial: Any, record: TrialResult) -> None:
        """The record as the trial's user attributes, and its constraints (feasible when <= 0)."""
        for key, value in record.to_attrs().items():
            ot_trial.set_user_attr(key, value)
        ot_trial.set_constraint("memory", record.constraint_mem)
        ot_trial.set_constraint("quality", record.constraint_quality)
        if record.workload:  # a study on a traffic workload: its SLO too (every trial of it has one)
            ot_trial.set_constraint("slo", record.constraint_slo)


def _params(result: dict[str, Any]) -> dict[str, Any]:
    """The trial's settings from its result, nested or flattened by Tune ('params/n_parallel')."""
    nested = result.get("params")
    if isinstance(nested, dict):
        return dict(nested)
    return {key.split("/", 1)[1]: value for key, value in result.items() if key.startswith("params/")}
