"""`--sampler prior`: an Optuna sampler whose first proposals are tuning/prior.py's ranking, best predicted first,
and TPE after them.

Why a sampler of its own rather than `enqueue_trial` of the ranking's head: the ranking is walked as the study
goes, so a point is skipped when the study already holds its engine (the baseline, a proposal answered from an
earlier trial) or when its K/V types already failed the quality probe in a measured trial (the roofline says a
quantised cache reads fewer bytes; it says nothing of quality, which the study learns after one trial of it).
Enqueued trials are fixed before the first runs and could do neither. Why TPE after: the prediction cannot
tell apart most of the space (tuning/prior.py: ties), and TPE, reading every trial the ranking proposed,
searches the rest on measurements. The ranking takes TPE's random start (`prior_trials`, TPE's
`n_startup_trials`), so `prior` against `tpe` is the question of issue 45: does a predicted start beat a
random one.

A setting the ranking does not hold (threads, speculation, split mode) is drawn by the sampler after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from serving.engine.config import CacheType, FlashAttn

RANK_ATTR = "prior_rank"  # a trial's system attribute: its place in the ranking (absent: not proposed by it)
FIXED_ATTR = "fixed_params"  # Optuna's mark of an enqueued trial (the baseline): its settings are given


def engine_key(params: dict[str, Any]) -> tuple[Any, ...]:
    """What makes the engine, of a point's settings: n_ubatch as it is clamped to n_batch, flash attention on
    with a quantised V cache (Optuna's own params lack what suggest() set without drawing it)."""
    n_batch, type_v = params.get("n_batch", 0), params.get("type_v")
    flash = FlashAttn.on.value if type_v is not None and CacheType(type_v).is_quantized else params.get("flash_attn")
    unified = bool(params.get("kv_unified")) if params.get("n_parallel", 1) > 1 else None  # one value: not drawn
    return (params.get("n_parallel"), n_batch, min(params.get("n_ubatch", 0), n_batch), params.get("ctx_per_slot"),
            params.get("type_k"), type_v, flash, unified)


def settings(trial: FrozenTrial) -> dict[str, Any]:
    """A trial's settings as suggest() made them: the record's (tuning/recording.py), else Optuna's drawn ones."""
    recorded = trial.user_attrs.get("params")
    return dict(recorded) if isinstance(recorded, dict) and recorded else dict(trial.params)


class PriorSampler(BaseSampler):
    """The ranking's next point for each of the first `prior_trials` trials the sampler is asked for, then
    `then`'s proposals (the module docstring says why)."""

    def __init__(self, ranking: Sequence[dict[str, Any]], prior_trials: int, then: BaseSampler) -> None:
        self._ranking = list(ranking)
        self._prior_trials = prior_trials
        self._then = then
        self._points: dict[int, dict[str, Any]] = {}  # trial number -> the point proposed for it

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._then.before_trial(study, trial)
        if FIXED_ATTR in trial.system_attrs:
            return
        others = [t for t in study.get_trials(deepcopy=False) if t.number != trial.number]
        if sum(RANK_ATTR in t.system_attrs for t in others) >= self._prior_trials:
            return
        found = next_point(self._ranking, others)
        if found is not None:
            index, point = found
            study._storage.set_trial_system_attr(trial._trial_id, RANK_ATTR, index)
            self._points[trial.number] = point

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        if trial.number in self._points:
            return {}
        return self._then.infer_relative_search_space(study, trial)

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if trial.number in self._points:
            return {}
        return self._then.sample_relative(study, trial, search_space)

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        point = self._points.get(trial.number, {})
        if param_name in point:
            return point[param_name]
        return self._then.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self._points.pop(trial.number, None)
        self._then.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._then.reseed_rng()


def next_point(ranking: Sequence[dict[str, Any]], trials: Sequence[FrozenTrial]) -> tuple[int, dict[str, Any]] | None:
    """The first ranked point whose engine no trial holds yet and whose K/V types no measured trial found over the
    quality margin; None when the ranking is spent."""
    tried = {engine_key(settings(t)) for t in trials}
    lossy = {(settings(t).get("type_k"), settings(t).get("type_v")) for t in trials if _lossy(t)}
    for index, point in enumerate(ranking):
        if engine_key(point) not in tried and (point["type_k"], point["type_v"]) not in lossy:
            return index, point
    return None


def _lossy(trial: FrozenTrial) -> bool:
    """A trial whose quality probe ran and found the NLL over the margin (tuning/results.py's constraint)."""
    attrs = trial.user_attrs
    return trial.state is TrialState.COMPLETE and "nll_delta" in attrs and attrs.get("constraint_quality", 0) > 0
