"""measure/workload_cross.py (scripts/bench_workloads.py's): its arguments, the paired ratios and tables on
made-up figures, and one short cross run of two configs on the embedded model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from measure.replay import Arrivals, Outcome, ReplayFigures, ReplayRequest
from measure.slo import RequestLatency, Slo
from serving.engine.config import EngineConfig

SLO = Slo.parse("ttft_p95=1s,itl_p95=100ms")
REQUEST = ReplayRequest(prompt_tokens=40, output_tokens=8)


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    from measure import workload_cross  # tables and arguments only: libllama loads where the engine is built

    return workload_cross


def made(good: int, failed: int = 0, wall_s: float = 1.0, ttft_s: float = 0.1) -> ReplayFigures:
    """Figures of `good` requests within SLO and `failed` ones, over `wall_s` (goodput: good / wall_s)."""
    ok = Outcome(REQUEST, RequestLatency(True, ttft_s, ttft_s + 0.35, (0.05,) * 7, 8))
    bad = Outcome(REQUEST, RequestLatency(False, 0.01, 0.01, (), 0), "PromptTooLongError: too long")
    return ReplayFigures.of("w", [ok] * good + [bad] * failed, wall_s, SLO)


def runs(bench, goodput: dict[tuple[str, str], list[float]]):  # noqa: ANN001,ANN201
    """Runs with the given goodput (req/s) per (workload, config), one per round, 10 requests a second's run."""
    return [bench.Run(r, w, c, 0, made(round(g * 10), 10 - round(g * 10), wall_s=10.0))
            for (w, c), per_round in goodput.items() for r, g in enumerate(per_round)]


def args(*extra: str) -> list[str]:
    return ["--config", "a=configs/default.yaml", "--config", "b=configs/default.yaml", "--workload", "chat",
            "--slo", "ttft_p95=2s", *extra]


@pytest.mark.unit
def test_arguments_parse_into_named_configs_overrides_and_an_slo(bench) -> None:  # noqa: ANN001
    parsed = bench.parse_args(args("--engine", "n_ctx=1024", "--rate", "2.5", "--rounds", "2"))
    assert [name for name, _ in parsed.config] == ["a", "b"] and parsed.config[0][1] == Path("configs/default.yaml")
    assert parsed.engine == [("n_ctx", "1024")] and parsed.rate == 2.5 and parsed.rounds == 2
    assert str(parsed.slo) == "ttft_p95<=2.00s" and parsed.concurrency is None and parsed.warmup_requests == 4


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "message"), [
    (["--config", "a=x.yaml", "--workload", "chat", "--slo", "ttft_p95=2s"], "at least 2 configs"),
    (args("--config", "a=y.yaml"), "a are given twice"),
    (args("--config", "noname.yaml"), "expected NAME=PATH"),
    (args("--config", "=x.yaml"), "expected NAME=PATH"),
    (args("--engine", "n_ctx"), "expected KEY=VALUE"),
    (args("--engine", "n_ctx=1", "--engine", "n_ctx=2"), "n_ctx set twice"),
    (args("--rate", "2", "--concurrency", "4"), "not allowed with argument"),
    (args("--rate", "0"), "above 0"),
    (args("--rounds", "0"), "1 or more"),
    (args("--warmup-requests", "-1"), "0 or more"),
    (["--config", "a=x", "--config", "b=y", "--workload", "chat", "--slo", "ttft=2s"], "expected METRIC_pNN"),
    (["--config", "a=x", "--config", "b=y", "--slo", "ttft_p95=2s"], "--workload"),
])
def test_bad_arguments_stop_with_a_message_naming_the_fix(bench, capsys, argv, message) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.unit
def test_configs_and_workloads_are_checked_before_any_engine_loads(bench, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit, match="missing.yaml"):
        bench.load_configs([("a", tmp_path / "missing.yaml")], {})
    with pytest.raises(SystemExit, match="n_parallel"):
        bench.load_configs([("a", bench.REPO_ROOT / "configs" / "default.yaml")], {"n_parallel": "0"})
    with pytest.raises(SystemExit, match="neither a built-in"):
        bench.resolve_workload(str(tmp_path / "nothing.jsonl"), 4, 0)
    timed = tmp_path / "timed.jsonl"
    timed.write_text("".join(json.dumps({"prompt_tokens": 50, "output_tokens": 8, "arrival": 10.0 + i}) + "\n"
                             for i in range(6)))
    loaded = bench.resolve_workload(str(timed), 4, 0)
    assert loaded.name == "timed" and len(loaded.requests) == 4
    closed = bench.pace(loaded, None, None, None, 0)
    assert closed.arrivals is Arrivals.closed and closed.concurrency == 4  # the default: closed loop
    scaled = bench.pace(loaded, None, None, 2.0, 0)
    assert scaled.arrivals is Arrivals.open and scaled.rate_scale == 2.0
    poisson = bench.pace(bench.resolve_workload("chat", 5, 0), None, 3.0, None, 0)
    assert poisson.arrivals is Arrivals.open and poisson.requests[-1].arrival_s > 0
    with pytest.raises(SystemExit, match="no recorded arrival"):
        bench.pace(bench.resolve_workload("chat", 5, 0), None, None, 2.0, 0)


@pytest.mark.unit
def test_requests_beyond_a_slot_are_counted_as_unfit(bench) -> None:  # noqa: ANN001
    workload = bench.resolve_workload("chat", 16, 0)
    tight = EngineConfig(n_parallel=4, n_ctx=1024)  # 256 tokens a slot: chat's answers alone run to ~250
    roomy = EngineConfig(n_parallel=2, n_ctx=4096)
    assert 0 < bench.unfit_requests(workload, tight) <= 16
    assert bench.unfit_requests(workload, roomy) == 0 and roomy.n_ctx_per_slot >= workload.max_context
    assert bench.unfit_requests(workload.taking(1), EngineConfig(n_parallel=1, n_ctx=4096)) == 0


@pytest.mark.unit
def test_every_config_goes_first_in_turn(bench) -> None:  # noqa: ANN001
    assert bench.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    order = list(bench.schedule(["a", "b"], ["chat", "rag"], 2))
    assert order == [(0, "chat", "a"), (0, "chat", "b"), (0, "rag", "a"), (0, "rag", "b"),
                     (1, "chat", "b"), (1, "chat", "a"), (1, "rag", "b"), (1, "rag", "a")]


@pytest.mark.unit
def test_paired_ratio_is_the_median_of_same_round_ratios(bench) -> None:  # noqa: ANN001
    assert bench.paired_ratio({0: 1.0, 1: 3.0, 2: 2.0}, {0: 2.0, 1: 2.0, 2: 1.0}) == 1.5  # 0.5, 1.5, 2.0
    assert bench.paired_ratio({0: 1.0, 1: 2.0}, {0: 0.0, 1: 4.0}) == 0.5  # a round the reference did nothing: out
    assert bench.paired_ratio({0: 1.0}, {0: 0.0}) is None
    assert bench.paired_ratio({0: 1.0, 1: 1.0}, {1: 2.0}) == 0.5  # only rounds both ran


@pytest.mark.unit
def test_rows_rank_each_config_against_the_workloads_best(bench) -> None:  # noqa: ANN001
    measured = runs(bench, {("chat", "a"): [0.5, 0.6, 0.4], ("chat", "b"): [1.0, 0.8, 1.0]})
    assert bench.best_config(measured, "chat", ["a", "b"]) == "b"
    slow = [bench.Run(0, "rag", "a", 0, made(0, failed=4)), bench.Run(0, "rag", "b", 0, made(0)),
            bench.Run(0, "rag", "c", 0, made(3, ttft_s=5.0))]  # nothing good: the one that got requests done
    assert bench.best_config(slow, "rag", ["a", "b", "c"]) == "c" and bench.best_config(slow, "rag", ["a", "b"]) == "a"
    a, b = bench.workload_rows(measured, "chat", ["a", "b"], {"a": 3})
    assert (a.goodput_rps, b.goodput_rps) == (0.5, 1.0)
    assert a.ratio_to_best == pytest.approx(0.5) and b.ratio_to_best == 1.0  # 0.5, 0.75, 0.4 -> 0.5
    assert (a.met, a.rounds, a.failed, a.requests, a.unfit) == (0, 3, 15, 30, 3)
    assert (b.met, b.failed) == (2, 2) and b.ttft_p95_s == pytest.approx(0.1) and b.itl_p95_s == pytest.approx(0.05)
    warm = [bench.Run(-1, "chat", "a", 0, made(10, wall_s=1.0))]  # a warm-up counts in nothing
    assert bench.workload_rows(measured + warm, "chat", ["a", "b"], {})[0].goodput_rps == 0.5


@pytest.mark.unit
def test_cross_cells_pair_against_the_own_named_config_else_the_best(bench) -> None:  # noqa: ANN001
    measured = runs(bench, {("chat", "chat"): [0.8, 0.6], ("chat", "rag"): [0.4, 0.6],
                            ("rag", "chat"): [0.2, 0.2], ("rag", "rag"): [0.4, 0.5],
                            ("agent", "chat"): [0.3, 0.3], ("agent", "rag"): [0.6, 0.9]})
    cells = bench.cross_cells(measured, ["chat", "rag", "agent"], ["chat", "rag"])
    assert cells["rag"]["chat"].reference == "chat" and cells["rag"]["chat"].ratio == pytest.approx(0.75)  # .5, 1
    assert cells["chat"]["rag"].ratio == pytest.approx(0.45) and cells["rag"]["rag"].ratio == 1.0  # .5, .4
    assert cells["chat"]["agent"].reference == "rag" and cells["chat"]["agent"].ratio == pytest.approx(5 / 12)
    text = bench.cross_table(cells, ["chat", "rag", "agent"], 2)
    assert "| config \\ workload | chat (vs `chat`) | rag (vs `rag`) | agent (vs `rag`, its best) |" in text
    assert "| chat | **0.700 (1.000, SLO met 0/2)** | 0.200 (0.450, SLO met 0/2) | 0.300 (0.417, SLO met 0/2) |" in text
    assert ("| rag | 0.500 (0.750, SLO met 0/2) | **0.450 (1.000, SLO met 0/2)** "
            "| **0.750 (1.000, SLO met 0/2)** |") in text


@pytest.mark.unit
def test_a_config_that_misses_the_slo_is_never_the_best_and_scaled_workloads_keep_their_own_config(bench) -> None:  # noqa: ANN001
    # "short" fails the long half of the requests quickly and shows more goodput from the rest: it missed the
    # SLO (failed requests), so "long", which met it, is the workload's best; config `rag` is workload rag@0.5's own
    measured = [bench.Run(r, "rag@0.5", "short", 0, made(6, failed=4, wall_s=4.0)) for r in range(2)]
    measured += [bench.Run(r, "rag@0.5", "rag", 0, made(10, wall_s=10.0)) for r in range(2)]
    assert bench.best_config(measured, "rag@0.5", ["short", "rag"]) == "rag"
    assert bench.own_config("rag@0.5", ["short", "rag"]) == "rag" and bench.own_config("chat", ["rag"]) is None
    cells = bench.cross_cells(measured, ["rag@0.5"], ["short", "rag"])
    assert cells["short"]["rag@0.5"].reference == "rag" and cells["short"]["rag@0.5"].ratio == pytest.approx(1.5)
    text = bench.cross_table(cells, ["rag@0.5"], 2)
    assert "| rag@0.5 (vs `rag`) |" in text
    assert "| short | 1.500 (1.500, SLO met 0/2) |" in text and "| rag | **1.000 (1.000)** |" in text


@pytest.mark.unit
def test_the_tables_are_drawn_again_from_a_saved_report(bench, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    measured = runs(bench, {("chat", "a"): [1.0, 0.8], ("chat", "b"): [0.5, 0.5]})
    infos = [bench.WorkloadInfo("chat", "chat (made up)", 10, {"b": 2})]
    saved = {"configs": {"a": {}, "b": {}}, "slo": str(SLO), "rounds": 2, "runs": [bench.run_dict(r) for r in measured],
             "workloads": {"chat": {"describe": "chat (made up)", "requests": 10, "unfit_requests": {"b": 2}}}}
    path = tmp_path / "cross.json"
    path.write_text(json.dumps(saved))
    assert [bench.run_from_dict(bench.run_dict(r)) for r in measured] == measured
    assert bench.main(["--tables-from", str(path)]) == 0
    assert capsys.readouterr().out == bench.markdown(measured, infos, ["a", "b"], str(SLO), 2)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="not a report of this script"):
        bench.main(["--tables-from", str(tmp_path / "bad.json")])


@pytest.mark.unit
def test_the_workload_table_says_which_failures_come_from_a_short_context(bench) -> None:  # noqa: ANN001
    workload = bench.resolve_workload("chat", 10, 0)
    measured = runs(bench, {("chat", "a"): [1.0], ("chat", "b"): [0.0]})
    rows = bench.workload_rows(measured, "chat", ["a", "b"], {"b": 10})
    text = bench.workload_table(bench.WorkloadInfo.of(workload, {}), rows, "a", str(SLO))
    assert "best config: `a`" in text and "ttft_p95<=1.00s" in text
    assert "| a | 1.000 | 1.000 | 1/1 | 100ms | 50ms | 0/10 |" in text
    assert "| b | 0.000 | 0.000 | 0/1 | n/a | n/a | 10/10 (10 of 10 requests do not fit its context per slot) |" in text
    assert math.isnan(rows[1].ttft_p95_s)


@pytest.mark.engine
def test_two_configs_cross_one_workload_on_the_embedded_model(bench, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    configs = []
    for name, slots in (("two", 2), ("four", 4)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"engine:\n  n_parallel: {slots}\n  n_ctx: 1024\n  seed: 1234\n")
        configs += ["--config", f"{name}={path}"]
    shapes = tmp_path / "short.jsonl"
    shapes.write_text("".join(json.dumps({"prompt_tokens": 40, "output_tokens": 8}) + "\n" for _ in range(6)))
    out = tmp_path / "cross.json"
    assert bench.main([*configs, "--workload", str(shapes), "--slo", "ttft_p95=60s,itl_p95=10s", "--requests", "4",
                       "--rounds", "1", "--warmup-requests", "2", "--concurrency", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["configs"]) == {"two", "four"} and report["configs"]["four"]["engine"]["n_parallel"] == 4
    assert len(report["warmup"]) == 2 and len(report["runs"]) == 2
    for run in report["runs"]:
        assert run["figures"]["goodput_rps"] > 0 and run["figures"]["failed"] == 0 and run["slo_met"]
        assert run["figures"]["requests"] == 4
    assert len({run["salt"] for run in report["warmup"] + report["runs"]}) == 4  # no run shares another's prompts
    printed = capsys.readouterr()
    assert "### Workload `short`" in printed.out and "round 1/1, run 2/2" in printed.err
    assert out.with_suffix(".md").read_text() in printed.out
