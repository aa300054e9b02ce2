"""A trial's record (tuning/results.py) through what carries it: Ray Tune's result dict and Optuna's storage."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tuning.results import CurvePoint, Measurement, MeasuredRun, Objective, TrafficFigures, TrialResult

pytestmark = pytest.mark.unit

MEASURED = Measurement(single_tok_s=101.5, aggregate_tok_s=236.0, ttft_ms=36.0, prefill_tok_s=2900.0, nll=2.31,
                       nll_baseline=2.30, mem_measured=18 * 2**30, weight_loads=1, weight_load_s=9.5,
                       capacity_tok_s=299.6, capacity_streams=8,
                       capacity_curve=(CurvePoint(streams=1, aggregate_tok_s=101.5, slowest_tok_s=104.0),
                                       CurvePoint(streams=8, aggregate_tok_s=299.6, slowest_tok_s=38.1)),
                       sm_clock_mhz=1980.0, throttle_reasons="", throttled=False)


def _trial() -> TrialResult:
    proposed = TrialResult(params={"n_parallel": 8, "n_batch": 1024, "type_k": "f16"}, n_ctx=65536,
                           mem_predicted=19 * 2**30, mem_budget=32 * 2**30, actor="host:1", capacity_tok_s=0.0)
    run = MeasuredRun(measurement=MEASURED, setup_s=0.03, held_s=7.5)
    return proposed.measured(run).constrained(32 * 2**30, 0.05)


def _through_storage(result: TrialResult, objective: Objective, tmp_path: Path) -> TrialResult:
    """`result` stored as a finished trial's user attributes in an SQLite study, and read back."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=storage, directions=["maximize", "maximize"])
    trial = study.ask()
    for key, value in result.to_attrs().items():
        trial.set_user_attr(key, value)
    study.tell(trial, [result.single_tok_s, result.second(objective)])
    return TrialResult.from_attrs(optuna.load_study(study_name="s", storage=storage).trials[0].user_attrs)


def test_a_trial_result_round_trips_through_optunas_storage(tmp_path: Path) -> None:
    result = replace(_trial(), is_baseline=True)
    back = _through_storage(result, Objective.capacity, tmp_path)
    assert back == result
    assert back.capacity_curve is not None and back.capacity_curve[1].slowest_tok_s == 38.1
    assert back.nll_delta == pytest.approx(0.01) and back.feasible and back.held_s == 7.5


def test_tunes_dict_carries_the_record_and_drops_its_own_bookkeeping() -> None:
    result = _trial()
    sent = {**result.to_attrs(), "done": True, "time_this_iter_s": 3.2, "trial_id": "abc"}
    assert TrialResult.from_tune(sent) == result


def test_a_trial_that_measured_nothing_is_infeasible_by_far() -> None:
    rejected = replace(TrialResult(params={}, n_ctx=4096, mem_predicted=40 * 2**30, mem_budget=32 * 2**30),
                       rejected="predicted memory over budget").constrained(32 * 2**30, 0.05)
    assert not rejected.feasible and rejected.constraint_mem >= 1e17 and rejected.constraint_quality >= 1e8
    assert "mem_measured" not in rejected.to_attrs(), "nothing measured: no figure recorded"


def test_attributes_of_another_version_are_kept_as_read() -> None:
    attrs = {**_trial().to_attrs(), "time_total_s": 12.0}
    back = TrialResult.from_attrs(attrs)
    assert back.extra == {"time_total_s": 12.0} and back.to_attrs() == attrs


TRAFFIC = TrafficFigures(workload="chat", requests=64, failed=0, goodput_rps=0.91, goodput_tok_s=230.0,
                         throughput_rps=1.02, output_tok_s=258.0, median_stream_tok_s=31.5, slo_met=False,
                         slo_violation=0.54, slo_outcome="missed: ttft_p95 2.31s > 1.50s (+54%)",
                         percentiles={"ttft_p95": (2.31, 2.02, 2.6, 64), "itl_p95": (0.061, 0.058, 0.066, 16000)},
                         errors=("PromptTooLongError: too long",))


def _traffic_trial() -> TrialResult:
    proposed = TrialResult(params={"n_parallel": 4}, n_ctx=8192, mem_predicted=2**30, mem_budget=2**31,
                           workload="chat", goodput_rps=0.0)
    measured = replace(MEASURED, traffic=TRAFFIC, capacity_tok_s=None, capacity_streams=None, capacity_curve=None)
    return proposed.measured(MeasuredRun(measurement=measured)).constrained(2**31, 0.05)


def test_a_traffic_trial_round_trips_and_its_slo_is_a_constraint(tmp_path: Path) -> None:
    """The replay's figures (goodput, the SLO's outcome, percentiles with their spread) survive the study's
    storage, goodput is the second objective, and a missed SLO makes the trial infeasible by its excess."""
    result = _traffic_trial()
    assert result.goodput_rps == 0.91 and result.second(Objective.goodput) == 0.91
    assert result.constraint_slo == pytest.approx(0.54) and not result.feasible
    back = _through_storage(result, Objective.goodput, tmp_path)
    assert back == result
    assert back.traffic is not None and back.traffic.percentile_text("ttft_p95") == "2.31 s [2.02-2.60]"
    assert back.traffic.percentile_text("itl_p95") == "61 ms [58-66]"


def test_a_traffic_trial_that_met_its_slo_is_feasible_and_one_never_measured_is_not() -> None:
    met = replace(TRAFFIC, slo_met=True, slo_violation=-0.2)
    budget = 32 * 2**30
    proposed = TrialResult(params={}, n_ctx=8192, mem_predicted=2**30, mem_budget=budget, workload="chat")
    measured = proposed.measured(MeasuredRun(measurement=replace(MEASURED, traffic=met))).constrained(budget, 0.05)
    assert measured.feasible and measured.constraint_slo == -0.2
    rejected = replace(proposed, rejected="predicted memory over budget").constrained(budget, 0.05)
    assert not rejected.feasible and rejected.constraint_slo >= 1e8
    benchmark = replace(proposed, workload="").measured(MeasuredRun(measurement=MEASURED)).constrained(budget, 0.05)
    assert benchmark.constraint_slo == 0.0 and benchmark.feasible, "no workload: no SLO to miss"


def test_a_searcher_gets_tunes_dict_flattened_and_the_record_comes_back_whole() -> None:
    """Ray Tune hands a searcher the result flattened (`traffic/goodput_rps`, `params/n_parallel`), as its
    flatten_dict does: the record is nested again, the replay's figures included."""
    def flatten(d: dict, prefix: str = "") -> dict:
        out: dict = {}
        for key, value in d.items():
            if isinstance(value, dict) and value:
                out.update(flatten(value, f"{prefix}{key}/"))
            else:
                out[f"{prefix}{key}"] = value
        return out

    result = _traffic_trial()
    flat = flatten({**result.to_attrs(), "done": True})
    assert "traffic/percentiles/ttft_p95" in flat and "params/n_parallel" in flat
    assert TrialResult.from_tune(flat) == result
