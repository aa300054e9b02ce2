"""Which settings mattered (tuning/importance.py) and its report section (tuning/report.py): on a small synthetic
study with two maximised objectives, each driven by a setting of its own, in SQLite storage as the tuner keeps it."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tuning import importance, report
from tuning.results import Objective

pytestmark = pytest.mark.unit


def study(tmp_path: Path, trials: int, answered: int = 0) -> Any:
    """`n_parallel` drives the second objective, `n_batch` the first, `type_k` neither; `kv_unified` is drawn
    only with more than one slot (conditional, as in the tuner's space) and matters to neither. The last
    `answered` trials repeat trial 0's point as a proposal answered from its measurement."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    made = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                               directions=["maximize", "maximize"], sampler=optuna.samplers.RandomSampler(seed=1))
    noise = random.Random(2)

    def objective(trial: Any) -> tuple[float, float]:
        slots = trial.suggest_categorical("n_parallel", [1, 2, 4, 8])
        batch = trial.suggest_categorical("n_batch", [256, 512, 1024, 2048])
        trial.suggest_categorical("type_k", ["f16", "q8_0"])
        if slots > 1:
            trial.suggest_categorical("kv_unified", [False, True])
        return batch / 100 + noise.random() * 0.1, slots * 10 + noise.random()

    made.optimize(objective, n_trials=trials)
    first = made.trials[0]
    for _ in range(answered):
        made.add_trial(optuna.trial.create_trial(params=first.params, distributions=first.distributions,
                                                 values=first.values, user_attrs={"answered_from": 0}))
    return made


def test_each_objective_names_the_setting_that_drives_it(tmp_path: Path) -> None:
    found = importance.importances(study(tmp_path, 40, answered=5), ("single stream", "goodput req/s"))
    assert found.trials == 40 and found.objectives == ("single stream", "goodput req/s")
    by_name = {s.setting: s.shares for s in found.settings}
    assert set(by_name) == {"n_parallel", "n_batch", "type_k", "kv_unified"}  # the conditional one too
    assert max(by_name, key=lambda name: by_name[name][0]) == "n_batch"
    assert max(by_name, key=lambda name: by_name[name][1]) == "n_parallel"
    for j in (0, 1):
        assert sum(shares[j] for shares in by_name.values()) == pytest.approx(1.0)
    assert found.settings[0].setting in {"n_batch", "n_parallel"}  # the most important first
    for idle in ("type_k", "kv_unified"):
        assert by_name[idle][0] < by_name["n_batch"][0] and by_name[idle][1] < by_name["n_parallel"][1]


def test_answered_proposals_count_once(tmp_path: Path) -> None:
    """Seven measured configs and three answered proposals: still too few to say anything."""
    with pytest.raises(ValueError, match="7 distinct configs measured; importances need 8"):
        importance.importances(study(tmp_path, 7, answered=3), ("a", "b"))


def test_the_report_section_has_a_table_and_a_bar_plot(tmp_path: Path) -> None:
    section = report.importance_section(study(tmp_path, 20), Objective.goodput, tmp_path)
    text = "\n".join(section)
    assert (tmp_path / report.IMPORTANCE_PLOT).stat().st_size > 1000
    assert section[0] == "## Which settings mattered" and f"]({report.IMPORTANCE_PLOT})" in text
    assert "| setting | median stream | goodput req/s |" in text and "| `n_parallel` |" in text
    assert "PED-ANOVA" in text and "20 distinct configs" in text
    page = report.markdown([], None, "balanced", {}, "pareto.png", importances=section)
    assert page.index("## Pareto front") < page.index("## Which settings mattered") < page.index("## All trials")


def test_too_few_trials_is_a_line_and_no_plot(tmp_path: Path) -> None:
    section = report.importance_section(study(tmp_path, 3), Objective.aggregate, tmp_path)
    assert section[2] == "Not computed: 3 distinct configs measured; importances need 8."
    assert not (tmp_path / report.IMPORTANCE_PLOT).exists()


def test_the_report_from_storage_alone_has_the_section(tmp_path: Path) -> None:
    """`python -m tuning.report STORAGE STUDY OUT_DIR` draws the importances too."""
    study(tmp_path, 10)
    out = tmp_path / "out"
    assert report.main([f"sqlite:///{tmp_path / 'optuna.db'}", "s", str(out)]) == 0
    assert "## Which settings mattered" in (out / "report.md").read_text() and (out / "importance.png").exists()


def test_importances_import_neither_ray_nor_libllama() -> None:
    code = ("import sys, tuning.importance, tuning.report; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'ray', 'llama_cpp', 'sklearn'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
