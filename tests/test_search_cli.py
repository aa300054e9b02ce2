"""The tuner's command line without Ray or a model: its options, where it decides to run, and the one sentence
on the pick that its output, tuned.yaml and the report share."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from serving.engine.config import EngineConfig
from tuning.confirm import Candidate, Confirmation, Confirmed, decide, with_served
from tuning.options import Prefer, SearchOptions, Where, _parser, parse_options
from tuning.report import TrialRow, config_label
from tuning.results import Objective, TrialResult
from serving.replica.node import DeviceMemory, ReplicaPlace
from tuning.gpus import TrialSlots
from tuning.report import nodes_section
from tuning.errors import UserError
from tuning.plan import budget_bytes, choose_device
from tuning.search import pick_summary, plan_line
from tuning.serving_app import serving_app
from tuning.workloads import least_context, traffic_plan

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
    in_place = plan_line(opts, base, APP, on_gpu=False, slots=TrialSlots(), budget=2**30, min_ctx=2048)
    assert "in place on Serve app 'llama'" in in_place and "Ctrl-C puts back" in in_place
    assert "--offline" in in_place and "\n" not in in_place
    offline = plan_line(opts, base, None, on_gpu=False, slots=TrialSlots(), budget=2**30, min_ctx=2048)
    assert "offline" in offline and "configs/tuned.yaml" in offline and "serve run serving.app:main" in offline


def _gpu(node: str, total_gib: int, offload: bool = True) -> ReplicaPlace:
    """A free GPU as a probe on its node reports it."""
    gpu = DeviceMemory(0, "H200", total_gib * 2**30, 2**28) if offload else None
    return ReplicaPlace(replica="trial slot", node_id=node * 8, node_ip="10.0.0.1", hostname=f"host-{node}",
                        visible_devices="0", gpus=(gpu,) if gpu else (), offload=offload, threads=16)


def test_offline_trials_take_their_device_and_budget_from_the_gpus_nodes_not_the_tuners_machine() -> None:
    """Two nodes' GPUs (80 and 40 GiB), read where they are: GPU trials, two at a time, one per GPU, and a budget
    the smaller fits; this machine has no GPU and is never asked."""
    opts = parse_options(["--offline"])
    slots = TrialSlots((_gpu("a", 80), _gpu("b", 40)))
    assert choose_device(opts, total=2, free=2, slots=slots)
    assert budget_bytes(opts, True, slots.gpu_memory_total) == 39 * 2**30
    assert slots.count == 2 and slots.resources == {"gpu": 1, "cpu": 1}
    line = plan_line(opts, EngineConfig(), None, on_gpu=True, slots=slots, budget=39 * 2**30, min_ctx=2048)
    assert "2 trial(s) at a time, one per GPU on 2 nodes" in line and "on the CPU" not in line


def test_declared_gpus_whose_engines_cannot_offload_give_cpu_trials_one_per_gpu_or_a_clear_error() -> None:
    """A cluster declaring GPUs its llama.cpp build cannot use (as the cluster tests' nodes do) runs CPU trials, one
    per declared GPU, as its serving replicas run; `--device gpu` there, or nodes that differ, is an error naming
    the node."""
    none = TrialSlots((_gpu("a", 80, offload=False), _gpu("b", 80, offload=False)))
    assert not choose_device(parse_options(["--offline"]), total=2, free=2, slots=none)
    assert none.resources == {"gpu": 1, "cpu": 1} and none.count == 2
    line = plan_line(parse_options(["--offline"]), EngineConfig(), None, on_gpu=False, slots=none, budget=2**30,
                     min_ctx=2048)
    assert "one per GPU on 2 nodes (their engines on the CPU" in line
    with pytest.raises(UserError, match=r"host-a \(10.0.0.1\), host-b \(10.0.0.1\).*--device cpu"):
        choose_device(parse_options(["--offline", "--device", "gpu"]), total=2, free=2, slots=none)
    mixed = TrialSlots((_gpu("a", 80), _gpu("b", 80, offload=False)))
    with pytest.raises(UserError, match=r"on host-b \(10.0.0.1\)"):
        choose_device(parse_options(["--offline"]), total=2, free=2, slots=mixed)
    assert TrialSlots().count == 1 and TrialSlots().resources == {"cpu": 1}


def test_the_report_says_which_node_measured_which_trial_when_there_were_several() -> None:
    rows = [TrialRow(n, TrialResult(params={}, n_ctx=1, mem_predicted=1, mem_budget=2, node=node))
            for n, node in ((0, "h/aaaa"), (1, "h/bbbb"), (2, "h/aaaa"))]
    assert nodes_section(rows) == ["Trials measured on 2 nodes (host/Ray node): h/aaaa: #0, #2; h/bbbb: #1.", ""]
    assert nodes_section(rows[:1]) == []


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


def test_in_place_the_served_config_joins_the_confirmation_and_the_line_says_when_it_stays() -> None:
    from serving.engine.config import embedded_model_path
    from serving.engine.memory import ModelShape, predict

    settings = SimpleNamespace(shape=ModelShape.from_gguf(embedded_model_path()), on_gpu=False)
    pick = Candidate(7, "pick", EngineConfig(n_parallel=2))
    base = Candidate(0, "base", EngineConfig(), is_baseline=True)
    marked = with_served([pick, base], EngineConfig(), settings)  # the baseline is what is served
    assert [c.is_served for c in marked] == [False, True] and len(marked) == 2
    served = EngineConfig(n_parallel=8, n_ctx=8192)
    added = with_served([pick, base], served, settings)[-1]
    assert (added.number, added.is_served, added.config, added.name) == (-1, True, served, "the served config")
    assert added.label == "np8 b2048/512 c1024/slot f16/f16 fa-auto"
    assert config_label(served.model_copy(update={"kv_unified": True})).endswith("fa-auto kvu")
    assert added.memory == predict(settings.shape, served, False).total > 0
    confirmed = [Confirmed(base, [100.0] * 3, [100.0] * 3, [1.0] * 3, [1.0] * 3),
                 Confirmed(pick, [100.0] * 3, [140.0] * 3, [1.0] * 3, [1.4, 1.42, 1.44]),
                 Confirmed(added, [100.0] * 3, [141.0] * 3, [1.0] * 3, [1.41, 1.43, 1.45])]
    verdict = decide(confirmed, "aggregate")
    assert verdict.keeps_served
    line = Confirmation(None, verdict, base, 3, "").summary(Objective.aggregate)
    assert line.startswith("the served config stays: no candidate beat it over 3 interleaved confirmation rounds")
    assert "trial 7, measured 1.420x against 1.430x for the served config" in line, line


def test_a_parse_error_names_the_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_options(["--trials", "0"])
    assert "--trials must be at least 1" in capsys.readouterr().err


def test_repo_relative_defaults_show_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    text = _parser().format_help()
    assert "(default: configs/tuned.yaml)" in text and str(Path(__file__).parents[1]) not in text


# -- traffic workloads ----------------------------------------------------------------------------------------

def test_a_workload_makes_goodput_the_objective_and_its_best_the_pick() -> None:
    plain = parse_options([])
    assert plain.objective is Objective.aggregate and plain.prefer is Prefer.balanced
    chat = parse_options(["--workload", "chat", "--slo", "ttft_p95=2s"])
    assert chat.objective is Objective.goodput and chat.prefer is Prefer.aggregate
    assert chat.replay_requests == 100, "a p95 needs 100 requests for 5 beyond it"
    assert parse_options(["--workload", "rag", "--slo", "e2e_p99=30s"]).replay_requests == 500
    assert parse_options(["--workload", "rag", "--requests", "12"]).replay_requests == 12
    assert parse_options(["--workload", "rag", "--prefer", "balanced"]).prefer is Prefer.balanced


@pytest.mark.parametrize("argv,message", [
    (["--slo", "ttft_p97=1s"], "--slo: .*percentile is one of"),
    (["--workload", "chat", "--objective", "aggregate"], "on a --workload the objective is goodput"),
    (["--objective", "goodput"], "--objective goodput needs --workload"),
    (["--offline", "--slo", "ttft_p95=1s"], "--slo offline needs --workload"),
    (["--offline", "--workload", "live"], "needs the app"),
    (["--workload", "no-such-file.jsonl"], "not live, chat, rag, agent, benchmark, or an existing file"),
    (["--workload", "benchmark", "--slo", "ttft_p95=1s"], "--slo needs a traffic workload"),
    (["--workload", "chat", "--rate", "0"], "--rate, --rate-scale and --length-scale must be above 0"),
], ids=["percentile", "objective", "goodput-alone", "slo-offline", "live-offline", "file", "bench-slo", "rate"])
def test_traffic_flags_that_do_not_fit_are_usage_errors(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_options(argv)
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def _recorded(count: int) -> Any:
    from serving.engine.traffic import RequestKind, RequestShape, TrafficRecord

    record = TrafficRecord(limit=100)
    for i in range(count):
        record.add(RequestShape(arrival=1000.0 + 0.5 * i, kind=RequestKind.greedy, prompt_tokens=100 + i,
                                cached_tokens=20, output_tokens=30))
    return lambda app: (record.summary("r1"), None)


def test_in_place_the_recorded_traffic_is_the_workload_once_there_is_enough(capsys: pytest.CaptureFixture) -> None:
    from measure.replay import Arrivals

    opts, plan = traffic_plan(parse_options(["--requests", "40"]), APP, _recorded(50))
    assert plan is not None and opts.workload == "live" and opts.objective is Objective.goodput
    workload = plan.workload
    assert len(workload.requests) == 40 and workload.arrivals is Arrivals.open, "the latest 40, at their times"
    assert workload.requests[0].prompt_tokens == 110 and workload.rate_per_s == pytest.approx(2.0)
    assert "workload: live" in capsys.readouterr().out
    fixed_opts, fixed = traffic_plan(parse_options(["--workload", "benchmark"]), APP, _recorded(50))
    assert fixed is None and fixed_opts.objective is Objective.aggregate, "the fixed benchmark when asked for"
    few_opts, none = traffic_plan(parse_options([]), APP, _recorded(5))
    assert none is None and few_opts.objective is Objective.aggregate
    assert "recorded 5 client requests" in capsys.readouterr().out
    with pytest.raises(UserError, match="has recorded 5 requests"):
        traffic_plan(parse_options(["--slo", "ttft_p95=1s"]), APP, _recorded(5))


def test_offline_a_built_in_workload_is_replayed_closed_loop_or_at_a_rate() -> None:
    from measure.replay import Arrivals

    _, plan = traffic_plan(parse_options(["--workload", "rag", "--requests", "10", "--concurrency", "2"]), None)
    assert plan is not None and plan.workload.arrivals is Arrivals.closed and plan.workload.concurrency == 2
    assert len(plan.workload.requests) == 10 and str(plan.slo) == "none"
    _, poisson = traffic_plan(parse_options(["--workload", "chat", "--rate", "3", "--requests", "200"]), None)
    assert poisson is not None and poisson.workload.arrivals is Arrivals.open
    assert poisson.workload.rate_per_s == pytest.approx(3.0, rel=0.2)
    _, small = traffic_plan(parse_options(["--workload", "rag", "--requests", "10", "--length-scale", "0.25"]), None)
    assert small is not None and small.workload.name == "rag@0.25"
    assert all(500 <= r.prompt_tokens <= 1500 and r.prefix_tokens == 50 for r in small.workload.requests)
    nothing_opts, nothing = traffic_plan(parse_options([]), None)
    assert nothing is None and nothing_opts.workload is None


def test_every_slot_holds_the_workloads_largest_request(capsys: pytest.CaptureFixture[str]) -> None:
    shape = SimpleNamespace(n_ctx_train=8192)
    _, plan = traffic_plan(parse_options(["--workload", "rag", "--requests", "30"]), None)
    assert least_context(parse_options([]), shape, None) == 2048  # type: ignore[arg-type]
    need = plan.workload.max_context
    assert 2048 < need <= 6128 and least_context(parse_options([]), shape, plan) == need  # type: ignore[arg-type]
    assert least_context(parse_options(["--min-ctx-per-slot", "1024"]), shape, plan) == 1024  # type: ignore[arg-type]
    # longer than the model was trained for: slots hold the trained length, with a warning; the study runs
    assert least_context(parse_options([]), SimpleNamespace(n_ctx_train=4096), plan) == 4096  # type: ignore[arg-type]
    assert "over the model's training context of 4096" in capsys.readouterr().err


def _traffic_row(number: int, goodput: float, violation: float) -> TrialRow:
    from tuning.results import TrafficFigures

    figures = TrafficFigures(workload="rag", requests=24, failed=0, goodput_rps=goodput, goodput_tok_s=goodput * 80,
                             throughput_rps=0.5, output_tok_s=40.0, median_stream_tok_s=30.0,
                             slo_met=violation <= 0, slo_violation=violation,
                             slo_outcome="met (24/24 requests good)" if violation <= 0 else
                             f"missed: ttft_p95 {3 * (1 + violation):.2f}s > 3.00s (+{100 * violation:.0f}%)",
                             percentiles={"ttft_p95": (3.0 * (1 + violation), 2.5, 3.5, 24)})
    params = {"n_parallel": 2, "n_batch": 512, "n_ubatch": 512, "ctx_per_slot": 8192, "type_k": "q8_0",
              "type_v": "q8_0", "flash_attn": "on"}
    result = TrialResult(params=params, n_ctx=16384, mem_predicted=1, mem_budget=2, workload="rag",
                         goodput_rps=goodput, traffic=figures, single_tok_s=30.0, mem_measured=1, nll=1.0,
                         nll_baseline=1.0, nll_delta=0.0)
    return TrialRow(number, result.constrained(2, 0.01), Objective.goodput)


def test_a_traffic_report_shows_goodput_the_slo_and_who_came_closest() -> None:
    from tuning import report

    missed = [_traffic_row(0, 0.1, 0.8), _traffic_row(1, 0.2, 0.3)]
    text = report.markdown(missed, None, "aggregate", {}, "pareto.png")
    assert "No trial met the SLO" in text and "Closest: trial 1" in text and "(+30%)" in text
    assert text.count("| goodput req/s |") == 2, "both tables are the traffic table, the empty front's too"
    rows = [*missed, _traffic_row(2, 0.4, -0.1)]
    winner = report.pick(rows, "aggregate")
    assert winner is not None and winner.number == 2, "the only one within the SLO"
    text = report.markdown(rows, winner, "aggregate", {}, "pareto.png")
    assert "Latency of the pick on `rag`" in text and "| TTFT | " in text and "2.70 s [2.50-3.50] (24)" in text


def test_goodputs_within_two_percent_tie_and_the_config_furthest_under_the_slo_wins() -> None:
    """Open loop at one rate, every config that keeps up serves the same requests/s: the pick is then the one with
    the most headroom under the SLO (it holds the most traffic beyond that rate), not the one that drew the higher
    figure nor the one using less memory (the H100 headline's study picked np2 over np4 by 50 MB, at TTFT p95
    1.43 s against 0.58 s)."""
    from dataclasses import replace

    from tuning import report

    roomy, tight, slow = _traffic_row(0, 0.85, -0.7), _traffic_row(1, 0.86, -0.3), _traffic_row(2, 0.70, -0.9)
    roomy = TrialRow(0, replace(roomy.result, mem_measured=2 * 2**30, single_tok_s=40.0), Objective.goodput)
    tight = TrialRow(1, replace(tight.result, mem_measured=2**30, single_tok_s=50.0), Objective.goodput)
    winner = report.pick([roomy, tight, slow], "aggregate")
    assert winner is not None and winner.number == 0, "the most headroom among the goodput ties"


def test_headrooms_within_a_tenth_of_a_bound_tie_and_the_cheaper_config_wins() -> None:
    """A p95 of a few dozen requests is no finer than a tenth of its bound: within that, less memory wins."""
    from dataclasses import replace

    from tuning import report

    big, small, slow = _traffic_row(0, 0.86, -0.5), _traffic_row(1, 0.85, -0.45), _traffic_row(2, 0.70, -0.6)
    big = TrialRow(0, replace(big.result, mem_measured=2 * 2**30, single_tok_s=50.0), Objective.goodput)
    small = TrialRow(1, replace(small.result, mem_measured=2**30, single_tok_s=40.0), Objective.goodput)
    winner = report.pick([big, small, slow], "aggregate")
    assert winner is not None and winner.number == 1
