"""measure/http_path.py (scripts/bench_http_path.py's): its variant words, saved runs' tables and plots (the
rest needs a Serve app: run the script)."""

from __future__ import annotations

import argparse

import pytest

pytestmark = pytest.mark.engine  # the module imports serving.engine.llama (libllama) first, as every script does


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    from measure import http_path

    return http_path


def test_a_variant_is_a_name_serve_run_words_and_replica_environment(bench) -> None:  # noqa: ANN001
    v = bench.Variant.parse("fast:n_threads=1,stream_interval_ms=100:env:RAY_SERVE_X=0,Y=1")
    assert (v.name, v.args, v.env) == ("fast", {"n_threads": "1", "stream_interval_ms": "100"},
                                       {"RAY_SERVE_X": "0", "Y": "1"})
    assert bench.Variant.parse("default") == bench.Variant("default")
    for bad in ("", "in-process", "x:n_threads", ":a=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.Variant.parse(bad)


def test_a_saved_run_prints_paired_ratios_and_ttft_gaps_worked_out_from_its_rounds(bench) -> None:  # noqa: ANN001
    """The committed CPU run of docs/log/2026-12-04-cpu-http-pacing.md."""
    import json

    report = json.loads((bench.REPO_ROOT / "docs" / "results" / "bench_http_path_cpu_auto.json").read_text())
    assert "paired_ratios" not in report  # saved before the report carried them
    text = bench.table(bench.with_paired_ratios(report))  # a run from before send times: "-"
    assert ("| default | 1 | 66.9 | 81.1 | 285 | - | - | +34.7 [+3.2, +45.6] (95%: -0.3 to +51.4) "
            "| 0.957, 0.885 | 0.980, 0.938 |") in text


def test_a_traced_round_shows_each_streams_ttft_the_engines_own_and_the_paths(bench) -> None:  # noqa: ANN001
    from dataclasses import asdict

    from measure.metrics import StreamRecord

    http = StreamRecord(t_start=10.0015, t_sent=10.0045, output_times=[10.6485, 10.7], output_tokens=[1, 1],
                        engine_ttft_ms=587.0, request_id="a")
    in_process = StreamRecord(t_start=10.0, output_times=[10.3, 10.35], output_tokens=[1, 1])
    stamps = {"a": {"received": 10.0065, "submitted": 10.0085, "first_body": 10.6475}}
    traced = bench.traced_round([http, in_process], stamps)
    assert asdict(traced[0]) == pytest.approx(asdict(bench.StreamTrace(1.5, 4.5, 647.0, 587.0, 6.5, 8.5, 647.5)))
    assert asdict(traced[1]) == pytest.approx(asdict(bench.StreamTrace(0.0, None, 300.0, None)))
    assert bench.traced_round([http], {})[0].received_ms is None  # no stamps: a server that left none

    trace = {"direct": [[asdict(t) for t in traced]]}
    assert "| direct | 1 | 647 (587; 60), 300 (-) |" in bench.trace_table(trace)
    # send 3, to the app 2, in the app 2, engine 587, to the write 52 (647.5 - 8.5 - 587), to the client 1
    assert bench.ttft_parts(asdict(traced[0])) == pytest.approx((3.0, 2.0, 2.0, 587.0, 52.0, 1.0))
    assert sum(bench.ttft_parts(asdict(traced[0]))) == pytest.approx(traced[0].ttft_ms)
    assert bench.ttft_parts(asdict(traced[1])) is None


def test_the_parts_table_ranks_a_rounds_streams_by_when_they_reached_the_app(bench) -> None:  # noqa: ANN001
    def stream(received: float, ttft: float) -> dict[str, float]:
        return {"start_ms": 0.0, "sent_ms": 1.0, "ttft_ms": ttft, "engine_ttft_ms": 10.0, "received_ms": received,
                "submitted_ms": received + 1.0, "first_body_ms": ttft - 0.5}

    rounds = [[stream(9.0, 40.0), stream(2.0, 20.0)], [stream(3.0, 22.0), stream(7.0, 30.0)]]
    text = bench.parts_table({"direct": rounds})
    # first to arrive: to the app 1 and 2 ms (median 1.5), TTFT 20 and 22; the later ones: 6 and 8, 30 and 40
    assert "| direct | 1 | 2 | 1.0 | 1.5 | 1.0 | 10.0 | 7.0 | 0.5 | 21.0 |" in text
    assert "| direct | 2 | 2 | 1.0 | 7.0 | 1.0 | 10.0 | 15.5 | 0.5 | 35.0 |" in text


def test_the_probe_table_splits_each_requests_ttft_into_the_engines_own_and_the_paths(bench) -> None:  # noqa: ANN001
    """The path's share (TTFT minus the engine's own, request by request) is what the path costs without the
    engine's noise; an older report without the engine's figures prints '-' there."""
    probe = {"in-process": [10.0, 12.0, 11.0], "direct": [15.0, 20.0, 16.0]}
    own = {"in-process": [9.0, 11.0, 10.0], "direct": [10.0, 14.0, 11.0]}
    text = bench.probe_table(probe, own)
    assert "| in-process | 3 | 11.0 | 10.0 | 1.0 | - |" in text
    assert "| direct | 3 | 16.0 | 11.0 | 5.0 | +5.0 [+5.0, +6.5] |" in text
    assert "| direct | 3 | 16.0 | - | - | +5.0 [+5.0, +6.5] |" in bench.probe_table(probe)


def test_the_probe_pauses_before_each_request_and_takes_the_targets_in_each_order(
        bench, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """On a CPU the last target's engine threads spin on after its graph, on the cores this target's path needs:
    `pause_s` idles before every request (the warm-up aside), as the rounds' pause does."""
    import asyncio

    from measure.metrics import StreamRecord

    events: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        async def run_stream(self, prompt, max_tokens: int, ignore_eos: bool) -> StreamRecord:  # noqa: ANN001
            events.append(self.name)
            return StreamRecord(t_start=0.0, output_times=[0.002], output_tokens=[1], request_id=prompt.text)

    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        events.append(f"pause {seconds}")
        await real_sleep(0)

    monkeypatch.setattr(bench.asyncio, "sleep", sleep)
    records = asyncio.run(bench.first_token_probe([Fake("a"), Fake("b")], 2, 0.05))
    assert events == ["a", "b", "pause 0.05", "a", "pause 0.05", "b", "pause 0.05", "b", "pause 0.05", "a"]
    assert [r.request_id for r in records["a"]] == ["Request 1.", "Request 2."]


def test_the_plot_draws_every_gap_of_a_saved_run_levels_then_the_probe(bench, tmp_path) -> None:  # noqa: ANN001
    """`--plot` with `--from-json`: the committed CPU run (two servers, two levels, the probe) as PNG."""
    import json

    report = bench.with_paired_ratios(json.loads(
        (bench.REPO_ROOT / "docs" / "results" / "cpu_http_ci" / "bench_http_path_llama_server.json").read_text()))
    rows = bench.gap_rows(report)
    assert [label for label, _ in rows] == [
        "llama-server, 1 stream", "llama-server, 4 streams", "direct-engine, 1 stream", "direct-engine, 4 streams",
        "llama-server, probe", "direct-engine, probe"]
    probe = dict(rows)["direct-engine, probe"]
    assert probe.rounds == 192 and probe.ci_low is not None and probe.ci_low <= probe.median <= probe.ci_high
    bench.plot(report, tmp_path / "gaps.png")
    assert (tmp_path / "gaps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
