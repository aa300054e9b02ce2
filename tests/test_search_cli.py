"""The tuner's command line without Ray or a model: its options, where it decides to run, and the one sentence
on the pick that its output, tuned.yaml and the report share."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from serving.config import EngineConfig
from tuning.confirm import Candidate, Confirmed, decide
from tuning.options import SearchOptions, Where, _parser, parse_options
from tuning.report import TrialRow
from tuning.results import TrialResult
from tuning.search import Confirmation, UserError, pick_summary, plan_line, serving_app

pytestmark = pytest.mark.unit

APP = SimpleNamespace(name="llama", replicas=1, serving=EngineConfig())


def test_importing_the_tuner_loads_neither_ray_nor_libllama() -> None:
    """`python -m tuning.search --help` and a bad flag answer at once; the engine loads where it is used."""
    import subprocess

    code = "import sys, tuning.search; print(sorted({'ray', 'llama_cpp', 'optuna'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_defaults_are_the_records_and_every_flag_is_explained() -> None:
    assert parse_options([]) == SearchOptions()
    actions = [a for a in _parser()._actions if a.option_strings and a.dest != "help"]
    assert actions and all(a.help for a in actions), [a.option_strings for a in actions if not a.help]
    groups = [g.title for g in _parser()._action_groups]
    assert "where the trials run" in groups and "how the pick is made" in groups


@pytest.mark.parametrize("argv,where", [([], Where.auto), (["--in-place"], Where.in_place),
                                        (["--offline"], Where.offline)])
def test_where_the_trials_run_is_one_choice(argv: list[str], where: Where) -> None:
    assert parse_options(argv).where is where


def test_in_place_and_offline_exclude_each_other(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_options(["--in-place", "--offline"])
    assert info.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_options_are_frozen() -> None:
    with pytest.raises(AttributeError):
        parse_options([]).trials = 3


def _find(app: Any) -> Any:
    def find(name: str | None) -> Any:
        if isinstance(app, Exception):
            raise app
        return app
    return find


@pytest.mark.parametrize("argv,found,expect", [
    ([], APP, APP),  # an app is serving: in place, with one replica too
    ([], None, None),  # nothing serving: offline
    ([], ConnectionError("no Serve"), None),  # no Serve in this cluster: offline
    (["--offline"], APP, None),
    (["--in-place"], APP, APP),
], ids=["auto-serving", "auto-nothing", "auto-no-serve", "offline", "in-place"])
def test_where_a_study_runs(argv: list[str], found: Any, expect: Any) -> None:
    assert serving_app(parse_options(argv), _find(found)) is expect


@pytest.mark.parametrize("argv,found,message", [
    (["--in-place"], None, "no running Serve app with engine replicas"),
    (["--app-name", "chat"], None, "no running Serve app named 'chat'"),
    (["--in-place"], ConnectionError("refused"), "cannot reach a Serve app"),
    ([], LookupError("several Serve apps run engine replicas (a, b): pass --app-name"), "pass --app-name"),
    ([], SimpleNamespace(name="llama", replicas=0, serving=EngineConfig()), "has no running engine replica"),
], ids=["in-place-nothing", "named-missing", "in-place-unreachable", "ambiguous", "no-replica"])
def test_where_a_study_cannot_run_is_a_clear_error(argv: list[str], found: Any, message: str) -> None:
    with pytest.raises(UserError, match=message):
        serving_app(parse_options(argv), _find(found))


def test_the_plan_line_says_what_a_study_does_to_clients() -> None:
    opts, base = parse_options([]), EngineConfig()
    in_place = plan_line(opts, base, APP, on_gpu=False, gpus=0, budget=2**30, min_ctx=2048)
    assert "in place on Serve app 'llama'" in in_place and "Ctrl-C puts back" in in_place
    assert "--offline" in in_place and "\n" not in in_place
    offline = plan_line(opts, base, None, on_gpu=False, gpus=0, budget=2**30, min_ctx=2048)
    assert "offline" in offline and "configs/tuned.yaml" in offline and "serve run serving.app:main" in offline


def _row(number: int, single: float, second: float, baseline: bool = False) -> TrialRow:
    params = {"n_parallel": 2, "n_batch": 512, "n_ubatch": 512, "ctx_per_slot": 2048, "type_k": "q8_0",
              "type_v": "q8_0", "flash_attn": "on"}
    return TrialRow(number, TrialResult(params=params, n_ctx=4096, mem_predicted=1, mem_budget=2, single_tok_s=single,
                                        aggregate_tok_s=second, feasible=True, is_baseline=baseline))


def test_the_pick_line_carries_the_confirmed_paired_ratios() -> None:
    """The search measured the pick once (1.02x / 1.40x the baseline); the confirmation rounds say 1.053 / 1.446:
    the pick line (and so tuned.yaml's header and the report) must say the latter."""
    baseline, pick = _row(0, 100.0, 100.0, baseline=True), _row(7, 102.0, 140.0)
    b = Candidate(0, "base", EngineConfig(), is_baseline=True)
    p = Candidate(7, "pick", EngineConfig(n_parallel=2))
    confirmed = [Confirmed(b, [98.0, 100.0, 101.0], [99.0, 100.0, 102.0], [1.0] * 3, [1.0] * 3),
                 Confirmed(p, [103.0, 105.0, 106.0], [143.0, 145.0, 147.0], [1.05, 1.053, 1.06],
                           [1.44, 1.446, 1.45])]
    verdict = decide(confirmed, "balanced")
    done = Confirmation(pick, verdict, b, 3, "## Confirmation round\n")
    line = pick_summary("s", pick, [baseline, pick], done, parse_options([]))
    assert "105.0 tok/s single, 145.0 4-way aggregate tok/s" in line, line
    assert "single stream 1.053x, 4-way aggregate 1.446x the article baseline" in line, line
    assert "1.02x" not in line and "1.40x" not in line
    unconfirmed = pick_summary("s", pick, [baseline, pick], None, parse_options(["--confirm-rounds", "0"]))
    assert "102.0 tok/s single" in unconfirmed and "1.02x" in unconfirmed and "1.40x" in unconfirmed


def test_a_parse_error_names_the_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_options(["--trials", "0"])
    assert "--trials must be at least 1" in capsys.readouterr().err


def test_repo_relative_defaults_show_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    text = _parser().format_help()
    assert "(default: configs/tuned.yaml)" in text and str(Path(__file__).parents[1]) not in text
