"""Issue 45: the `prior` sampler's ranking (memory model and roofline), pruning trials measured short first, the
time to a good pick, and the sampler comparison's table, on synthetic shapes and fake studies."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from serving.engine.config import EngineConfig
from serving.engine.memory import ModelShape, predict
from tuning import prune
from tuning.compare import StudyRun, compare, table
from tuning.prior import kv_bytes_per_cell, predict_rates, rank
from tuning.report import TrialRow, finished_s, pick, prune_saving, rows_from_study, time_to
from tuning.results import Objective, TrialResult
from tuning.space import SearchSpace, suggest, to_engine_config

SHAPE = ModelShape(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim_k=128, head_dim_v=128,
                   n_ff=11008, n_vocab=32000, n_ctx_train=32768, weight_bytes=4 * 2**30, token_embd_bytes=2**28)
SPACE = SearchSpace(n_parallel=[1, 4], n_batch=[256, 512], n_ubatch=[256, 512], ctx_per_slot=[2048, 8192],
                    type_k=["f16", "q4_0"], type_v=["f16", "q4_0"], flash_attn=["on", "off"], kv_unified=[False])
BASE = EngineConfig()


def ranked(seed: int = 0, budget: int = 2**40, depth: int = 4096, **kw: Any) -> list[dict[str, Any]]:
    return [r.point for r in rank(SPACE, [2048, 8192], SHAPE, BASE, budget, False, depth, 4, False, seed, **kw)]


# -- the prior's ranking ------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_config_over_the_budget_is_never_proposed() -> None:
    def need(point: dict[str, Any]) -> int:
        return predict(SHAPE, to_engine_config(point, BASE), on_gpu=False).total

    everything = ranked()
    budget = sorted(need(p) for p in everything)[len(everything) // 2]
    kept = ranked(budget=budget)
    assert kept and len(kept) < len(everything)
    assert all(need(p) <= budget for p in kept)


@pytest.mark.unit
def test_more_kv_bytes_per_token_ranks_lower() -> None:
    """At a long depth the K/V read per token weighs: a q4_0 cache ranks above f16 at the same slots."""
    order = ranked(depth=32768)
    first_f16 = next(i for i, p in enumerate(order) if p["type_k"] == "f16" and p["type_v"] == "f16")
    last_q4 = max(i for i, p in enumerate(order) if p["type_k"] == "q4_0" and p["type_v"] == "q4_0"
                  and p["n_parallel"] == order[first_f16]["n_parallel"])
    assert last_q4 < first_f16
    f16 = to_engine_config({**order[first_f16]}, BASE)
    q4 = to_engine_config({**order[first_f16], "type_k": "q4_0", "type_v": "q4_0"}, BASE)
    assert kv_bytes_per_cell(SHAPE, q4.type_k, q4.type_v) < kv_bytes_per_cell(SHAPE, f16.type_k, f16.type_v)
    assert predict_rates(SHAPE, q4, 32768, 4).single > predict_rates(SHAPE, f16, 32768, 4).single
    assert order[0]["n_parallel"] == 4, "four streams share one read of the weights: more slots rank first"


@pytest.mark.unit
def test_ties_are_broken_by_the_seed_and_the_ranking_is_reproducible() -> None:
    assert ranked(seed=1) == ranked(seed=1)
    assert ranked(seed=1) != ranked(seed=2), "batch sizes and flash attention are ties the seed orders"
    assert sorted(map(str, ranked(seed=1))) == sorted(map(str, ranked(seed=2))), "the same configs"
    clamped = [(p["n_batch"], p["n_ubatch"]) for p in ranked()]
    assert (256, 512) not in clamped, "an n_ubatch clamped to n_batch is its twin, proposed once"


@pytest.mark.unit
def test_the_prior_sampler_walks_the_ranking_skips_lossy_kv_types_and_leaves_the_baseline_alone() -> None:
    import optuna

    from tuning.prior_sampler import PriorSampler, engine_key

    order = ranked(depth=32768)
    sampler = PriorSampler(order, prior_trials=3, then=optuna.samplers.RandomSampler(seed=0))
    study = optuna.create_study(directions=["maximize", "maximize"], sampler=sampler)
    study.enqueue_trial({**order[-1]})  # the baseline: its settings are given, the ranking is not spent on it
    proposed = []
    for _ in range(5):
        trial = study.ask()
        params = suggest(trial, SPACE, [2048, 8192], None)
        if trial.number == 1:  # the first ranked point: its K/V types fail the quality probe
            trial.set_user_attr("nll_delta", 0.5)
            trial.set_user_attr("constraint_quality", 0.49)
        study.tell(trial, [1.0, 1.0])
        proposed.append(params)
    assert proposed[0] == order[-1] and proposed[1] == order[0]
    lossy = (order[0]["type_k"], order[0]["type_v"])
    assert all((p["type_k"], p["type_v"]) != lossy for p in proposed[2:4])
    assert proposed[2] == next(p for p in order[1:] if (p["type_k"], p["type_v"]) != lossy)
    assert len({engine_key(p) for p in proposed[:4]}) == 4, "an engine the study holds is not proposed again"
    ranked_trials = [t for t in study.trials if "prior_rank" in t.system_attrs]
    assert len(ranked_trials) == 3, "three from the ranking, then the sampler after it"


# -- pruning ------------------------------------------------------------------------------------------------
def measured(short: tuple[float, float], full: tuple[float, float] | None, feasible: bool = True) -> prune.Measured:
    return prune.Measured(prune.Short(*short), None if full is None else prune.Short(*full), feasible)


@pytest.mark.unit
def test_a_trial_behind_on_every_objective_the_pick_reads_is_pruned() -> None:
    trials = [measured((100.0, 200.0), (110.0, 210.0)), measured((90.0, 300.0), (95.0, 320.0))]
    line = prune.bar(trials, "balanced", 0.8)
    assert line == prune.Bar(single_tok_s=80.0, second=240.0), "each objective's leader's short figure"
    assert prune.behind(prune.Short(70.0, 200.0), line)
    assert not prune.behind(prune.Short(70.0, 250.0), line), "ahead on one objective the balanced pick reads"
    single = prune.bar(trials, "single", 0.8)
    assert single is not None and prune.behind(prune.Short(70.0, 1000.0), single)
    assert prune.bar(trials, "balanced", 0.0) is None and prune.bar([], "balanced", 0.8) is None
    assert prune.Bar.from_dict(line.to_dict()) == line
    assert prune.short_tokens(64) == 16 and prune.short_tokens(8) == 8


@pytest.mark.unit
def test_one_short_run_reading_high_does_not_set_the_bar() -> None:
    """The CPU studies that pruned every trial from their seventh on: a short run that read high, and a full
    run that did not, set the bar above what later short runs reached. The bar is the leader's (best in
    full) short figure, the leader is feasible, and after three prunes in a row a trial is measured in full."""
    lucky = measured((200.0, 400.0), (100.0, 200.0))
    leader = measured((110.0, 220.0), (120.0, 240.0))
    assert prune.bar([lucky, leader], "balanced", 0.8) == prune.Bar(single_tok_s=88.0, second=176.0)
    refused = measured((300.0, 600.0), (300.0, 600.0), feasible=False)  # fast, and refused by the quality probe
    assert prune.bar([leader, refused], "balanced", 0.8) == prune.Bar(single_tok_s=88.0, second=176.0)
    assert prune.bar([refused], "balanced", 0.8) is None, "no feasible leader yet: measure in full"
    behind = measured((10.0, 10.0), None)
    assert prune.bar([leader, behind, behind], "balanced", 0.8) is not None
    assert prune.pruned_in_a_row([leader, behind, behind, behind]) == prune.MAX_PRUNED_IN_A_ROW
    assert prune.bar([leader, behind, behind, behind], "balanced", 0.8) is None, "then one trial in full"


def row(number: int, single: float, second: float, **kw: Any) -> TrialRow:
    return TrialRow(number, TrialResult(params={"n_parallel": 1}, n_ctx=1024, mem_predicted=1, mem_budget=2,
                                        single_tok_s=single, aggregate_tok_s=second, feasible=True, **kw))


@pytest.mark.unit
def test_a_pruned_trial_is_never_the_pick_and_its_saving_is_counted() -> None:
    from tuning.report import pruned_rows

    class Trial:
        def __init__(self, number: int, state: str, attrs: dict[str, Any]) -> None:
            self.number, self.user_attrs, self.params = number, attrs, {}
            self.state = type("State", (), {"name": state})()

    pruned_attrs = row(1, 0.0, 0.0, pruned=True, short_single_tok_s=10.0, short_second=10.0,
                       short_s=2.0).result.to_attrs()
    study = type("Study", (), {"trials": [
        Trial(0, "COMPLETE", row(0, 50.0, 90.0, is_baseline=True, short_s=2.0, measure_s=20.0).result.to_attrs()),
        Trial(1, "PRUNED", {**pruned_attrs, "single_tok_s": 999.0, "aggregate_tok_s": 999.0}),
        Trial(2, "COMPLETE", row(2, 55.0, 80.0, short_s=2.0, measure_s=30.0).result.to_attrs())]})()
    rows, pruned = rows_from_study(study), pruned_rows(study)
    assert [r.number for r in rows] == [0, 2] and [r.number for r in pruned] == [1]
    winner = pick(rows, "aggregate")
    assert winner is not None and winner.number == 0
    saving = prune_saving(rows, pruned)
    assert (saving.pruned, saving.shorts, saving.short_s) == (1, 3, 6.0)
    assert saving.full_median_s == 30.0 and saving.saved_s == 24.0


# -- the time to a good pick --------------------------------------------------------------------------------
@pytest.mark.unit
def test_time_to_95_percent_of_the_best_from_trial_timestamps() -> None:
    t0 = datetime(2026, 12, 7, 12, 0, 0)

    class Trial:
        def __init__(self, number: int, start_s: float, end_s: float) -> None:
            self.number = number
            self.datetime_start = t0 + timedelta(seconds=start_s)
            self.datetime_complete = t0 + timedelta(seconds=end_s)

    finished = finished_s(type("Study", (), {"trials": [Trial(0, 0, 10), Trial(1, 10, 25), Trial(2, 25, 40),
                                                        Trial(3, 40, 60)]})())
    assert finished == {0: 10.0, 1: 25.0, 2: 40.0, 3: 60.0}
    rows = [row(0, 50, 60), row(1, 50, 96), row(2, 50, 100), row(3, 50, 99)]
    assert time_to(rows, finished, 100.0, "aggregate") == 25.0, "96 is within 95% of 100"
    assert time_to(rows, finished, 100.0, "single") is None
    infeasible = [TrialRow(1, TrialResult(params={}, n_ctx=1, mem_predicted=1, mem_budget=1, aggregate_tok_s=99.0))]
    assert time_to(infeasible, finished, 100.0, "aggregate") is None, "an infeasible trial is no good pick"


# -- the comparison -----------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_compare_table_from_fake_studies() -> None:
    def study(arm: str, seed: int, seconds: list[float], seconds_figures: list[float], pruned: int = 0) -> StudyRun:
        rows = tuple(row(i, 50.0, f) for i, f in enumerate(seconds_figures))
        cut = tuple(row(len(rows) + i, 0.0, 0.0, pruned=True) for i in range(pruned))
        return StudyRun(arm, seed, sum(seconds), rows, cut, {i: s for i, s in enumerate(seconds)})

    studies = [study("tpe", 0, [10, 20, 30, 40], [60, 70, 100, 80]),
               study("tpe", 1, [10, 20, 30, 40], [60, 90, 80, 80]),
               study("prior", 0, [5, 10, 20, 30, 40], [96, 70, 80, 90], pruned=1),
               study("prior", 1, [5, 10, 20, 30, 40], [60, 60, 60, 60], pruned=1)]
    result = compare(studies, [2, 4], "aggregate")
    assert result.best == 100.0 and result.best_study == "tpe seed 0"
    by = {(r.arm, r.trials): r for r in result.rows}
    tpe2, tpe4, prior2 = by[("tpe", 2)], by[("tpe", 4)], by[("prior", 2)]
    assert tpe2.best_ratio is not None and (tpe2.best_ratio.low, tpe2.best_ratio.high) == (0.7, 0.9)
    assert tpe4.best_ratio is not None and tpe4.best_ratio.high == 1.0
    assert tpe2.time_to_near_best_s is None, "neither seed had a trial within 95% of 100 in its first two"
    assert tpe4.time_to_near_best_s is not None and tpe4.time_to_near_best_s.of == 1
    assert prior2.time_to_near_best_s is not None and prior2.time_to_near_best_s.median == 5.0
    assert by[("prior", 4)].pruned is not None and by[("prior", 4)].pruned.median == 0.0
    text = table(result)
    assert "| tpe | 2 | 2 | 0.80 (0.70-0.90) | not reached [0/2] |" in text
    assert "| prior | 2 | 2 |" in text


# -- the searcher and the trial, through their real code (Ray's libraries, no cluster) ---------------------
@pytest.mark.engine
def test_the_searcher_passes_a_bar_but_not_to_the_baseline_and_tells_a_pruned_trial_as_pruned() -> None:
    from functools import partial

    import optuna

    from tuning.recording import RecordingOptunaSearch
    from tuning.space import SpaceFunction

    space = SearchSpace(n_parallel=[1, 2], n_batch=[256, 512], n_ubatch=[256], ctx_per_slot=[1024],
                        type_k=["f16"], type_v=["f16"], flash_attn=["on"], kv_unified=[False])
    baseline = {"n_parallel": 1, "n_batch": 256, "n_ubatch": 256, "ctx_per_slot": 1024, "type_k": "f16",
                "type_v": "f16", "flash_attn": "on"}
    searcher = RecordingOptunaSearch(
        space=SpaceFunction(space, [1024], None), metric=["single_tok_s", "aggregate_tok_s"], mode=["max", "max"],
        points_to_evaluate=[baseline], sampler=optuna.samplers.RandomSampler(seed=0), study_name="prune",
        storage=optuna.storages.InMemoryStorage(), first_is_baseline=True,
        canonical=partial(to_engine_config, base=EngineConfig()), objective=Objective.aggregate,
        prune_prefer="balanced", prune_below=0.8)
    first = searcher.suggest("t0")
    assert first is not None and prune.BAR_KEY not in first, "the baseline is never pruned: no bar"
    searcher.on_trial_complete("t0", result={"single_tok_s": 50.0, "aggregate_tok_s": 90.0, "params": baseline,
                                             "short_single_tok_s": 40.0, "short_second": 80.0, "feasible": True})
    second = searcher.suggest("t1")
    assert second is not None and second[prune.BAR_KEY] == {"single_tok_s": 32.0, "second": 64.0}
    params = {k: v for k, v in second.items() if k != prune.BAR_KEY}
    searcher.on_trial_complete("t1", result={"single_tok_s": 0.0, "aggregate_tok_s": 0.0, "params": params,
                                             "pruned": True, "short_single_tok_s": 10.0, "short_second": 10.0})
    study = searcher._ot_study
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED"]
    assert study.trials[1].user_attrs["pruned"] and prune.BAR_KEY not in study.trials[1].user_attrs["params"]
    winner = pick(rows_from_study(study), "balanced")
    assert winner is not None and winner.number == 0, "a pruned trial is never the pick"


@pytest.mark.engine
def test_a_trial_behind_its_bar_skips_the_full_measurement_and_the_baseline_is_measured_in_full() -> None:
    from tuning.objective import Workload
    from tuning.plan import TrialSettings
    from tuning.results import Measurement, MeasuredRun
    from tuning.trial import EngineTrial

    base = EngineConfig()
    trial = object.__new__(EngineTrial)  # the trainable's logic without a Ray Tune actor around it
    trial.settings = TrialSettings(base=base, shape=ModelShape.from_gguf(base.model_path), budget_bytes=2**40,
                                   on_gpu=False, workload=Workload(), max_quality_loss=0.1, prune_below=0.8)
    trial.actor, trial.measured = "test", {}
    full: list[EngineConfig] = []

    def fake_full(config: EngineConfig) -> MeasuredRun:
        full.append(config)
        return MeasuredRun(measurement=Measurement(
            single_tok_s=50.0, aggregate_tok_s=90.0, ttft_ms=1.0, prefill_tok_s=1.0, nll=2.0, nll_baseline=2.0,
            mem_measured=1, weight_loads=1, weight_load_s=0.1))

    trial._prepare = lambda config: None  # type: ignore[method-assign]
    trial._measure = fake_full  # type: ignore[method-assign]
    trial._measure_short = lambda config: prune.Short(10.0, 20.0)  # type: ignore[method-assign]
    params = {"n_parallel": 2, "n_batch": 256, "n_ubatch": 256, "ctx_per_slot": 1024, "type_k": "f16",
              "type_v": "f16", "flash_attn": "on"}
    trial.config = dict(params)  # the baseline: no bar
    kept = trial.step()
    trial.config = {**params, "n_batch": 512, prune.BAR_KEY: {"single_tok_s": 32.0, "second": 64.0}}
    pruned = trial.step()
    assert len(full) == 1 and not kept["pruned"] and kept["single_tok_s"] == 50.0 and kept["short_single_tok_s"] == 10
    assert pruned["pruned"] and pruned["single_tok_s"] == 0.0 and not pruned["feasible"]
    assert prune.BAR_KEY not in pruned["params"], "the bar is the searcher's, not a setting"
