"""OptunaSearch that stores each trial's measurements in the Optuna study before telling it the result.

Ray Tune's OptunaSearch tells Optuna only the objective values. The constraint function (memory and quality
feasibility) and the report need the rest of what a trial measured, so it is written to the trial's user
attributes first; the study's storage then holds everything, and a resumed study reports all of it.
"""

from __future__ import annotations

from typing import Any

from ray.tune.search.optuna import OptunaSearch


class RecordingOptunaSearch(OptunaSearch):
    """OptunaSearch plus user attributes: `recorded` result keys, the params, and the baseline mark."""

    def __init__(self, *args: Any, recorded: tuple[str, ...], first_is_baseline: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recorded = recorded
        self._first_is_baseline = first_is_baseline

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        ot_trial = self._ot_trials.get(trial_id)
        if ot_trial is not None and result:
            for key in self._recorded:
                if key in result:
                    ot_trial.set_user_attr(key, result[key])
            ot_trial.set_user_attr("params", _params(result))
            ot_trial.set_user_attr("is_baseline", self._first_is_baseline and ot_trial.number == 0)
        super().on_trial_complete(trial_id, result, error)


def _params(result: dict[str, Any]) -> dict[str, Any]:
    """The trial's settings from its result, nested or flattened by Tune ('params/n_parallel')."""
    nested = result.get("params")
    if isinstance(nested, dict):
        return dict(nested)
    return {key.split("/", 1)[1]: value for key, value in result.items() if key.startswith("params/")}
