"""Which settings mattered: each searched setting's importance for each objective, from the study's trials.

A Pareto front and a pick say what won, not why; a reader choosing what to pin or to search next wants to know
which settings moved the figures. Optuna's importance evaluators answer that from the trials alone. This uses
PED-ANOVA (Optuna 5's default evaluator), for two reasons: it needs nothing beyond Optuna (fANOVA and
mean-decrease-impurity need scikit-learn, which this project does not depend on for anything else), and it
counts conditional settings (`flash_attn` only where the V cache is not quantised, `kv_unified` only with
several slots, the speculation settings only with speculation: tuning/space.py), which the other evaluators drop
unless every trial has them.

PED-ANOVA asks how much each setting's values differ between the best trials and all of them: importance to
reach the top, not to move the average. The best are the top quarter (TARGET_QUANTILE), not Optuna's default
10%: a study here has 20-40 trials, and a density of the top 2-4 is noise (on a synthetic 40-trial study whose
objectives each hang on one setting, 10% ranked an idle setting above it; a quarter gave it 90%). Each
objective is asked separately (`target`: the objective's value, negated where it is maximised, as PED-ANOVA
ranks low values best). Each engine config counts once: a proposal answered from another trial's measurement
(`answered_from`) repeats a point, and would weigh it twice. Importances are shares (they sum to 1 per
objective).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tuning.results import TrialResult

if TYPE_CHECKING:  # Optuna is imported where it is used: the tuner's --help loads none of it
    import optuna
    from optuna.study import StudyDirection
    from optuna.trial import FrozenTrial

MIN_TRIALS = 8  # distinct measured configs before importances say anything (TPE's random start is 8 trials)
TARGET_QUANTILE = 0.25  # "the best trials": the top quarter on the objective (the module docstring says why)
EVALUATOR = "PED-ANOVA"


@dataclass(frozen=True)
class SettingImportance:
    """One setting's share of importance, per objective (in the study's objective order)."""

    setting: str
    shares: tuple[float, ...]


@dataclass(frozen=True)
class Importances:
    """Every setting's importance per objective, the most important (on any objective) first."""

    objectives: tuple[str, ...]  # the objectives' labels, as the report names them
    settings: tuple[SettingImportance, ...]
    trials: int  # distinct measured configs they were computed over


def measured_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The completed trials that measured a config of their own (not answered from another's measurement)."""
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.values is not None and TrialResult.from_attrs(dict(t.user_attrs)).answered_from is None]


def importances(study: optuna.Study, labels: Sequence[str]) -> Importances:
    """Importances over the study's measured configs; ValueError saying why when there are too few of them
    (fewer than MIN_TRIALS) or the evaluator cannot read them (a resumed study whose space changed)."""
    import optuna

    trials = measured_trials(study)
    if len(trials) < MIN_TRIALS:
        raise ValueError(f"{len(trials)} distinct configs measured; importances need {MIN_TRIALS}")
    distinct = optuna.create_study(directions=study.directions)
    distinct.add_trials(trials)
    per_objective = [_shares(distinct, i, direction) for i, direction in enumerate(study.directions)]
    names = sorted({name for shares in per_objective for name in shares},
                   key=lambda name: -max(shares.get(name, 0.0) for shares in per_objective))
    settings = tuple(SettingImportance(name, tuple(shares.get(name, 0.0) for shares in per_objective))
                     for name in names)
    return Importances(tuple(labels), settings, len(trials))


def _shares(study: optuna.Study, index: int, direction: StudyDirection) -> dict[str, float]:
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances
    from optuna.study import StudyDirection

    sign = -1.0 if direction is StudyDirection.MAXIMIZE else 1.0
    with warnings.catch_warnings():  # "computes the importances ... to achieve low target values": the sign does
        warnings.simplefilter("ignore", UserWarning)
        return get_param_importances(study, evaluator=PedAnovaImportanceEvaluator(target_quantile=TARGET_QUANTILE),
                                     target=lambda t: sign * t.values[index])


def table(imp: Importances) -> str:
    """A markdown table: setting, then its share per objective (in percent)."""
    head = "| setting | " + " | ".join(imp.objectives) + " |\n|---|" + "---|" * len(imp.objectives)
    rows = [f"| `{s.setting}` | " + " | ".join(f"{100 * share:.0f}%" for share in s.shares) + " |"
            for s in imp.settings]
    return "\n".join([head, *rows])


def plot(imp: Importances, path: Path) -> None:
    """Horizontal bars, one group per setting (the most important on top), one bar per objective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count, height = len(imp.settings), 0.8 / len(imp.objectives)
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.45 * count))
    for j, label in enumerate(imp.objectives):
        ax.barh([count - 1 - i + (j - (len(imp.objectives) - 1) / 2) * height for i in range(count)],
                [s.shares[j] for s in imp.settings], height=height, label=label)
    ax.set_yticks(range(count), [s.setting for s in reversed(imp.settings)])
    ax.set_xlabel(f"importance ({EVALUATOR}, share per objective)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
