"""scripts/bench_http_path.py's variant words (the rest needs a Serve app: run the script)."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers import script_module

pytestmark = pytest.mark.engine  # the script imports serving.llama (libllama) first, as every script does


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    yield from script_module("bench_http_path")


def test_a_variant_is_a_name_serve_run_words_and_replica_environment(bench) -> None:  # noqa: ANN001
    v = bench.Variant.parse("fast:n_threads=1,stream_interval_ms=100:env:RAY_SERVE_X=0,Y=1")
    assert (v.name, v.args, v.env) == ("fast", {"n_threads": "1", "stream_interval_ms": "100"},
                                       {"RAY_SERVE_X": "0", "Y": "1"})
    assert bench.Variant.parse("default") == bench.Variant("default")
    for bad in ("", "in-process", "x:n_threads", ":a=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.Variant.parse(bad)


def test_a_saved_run_prints_paired_ratios_and_ttft_gaps_worked_out_from_its_rounds(bench) -> None:  # noqa: ANN001
    """The committed CPU run of docs/performance.md ("The HTTP path: what a streamed token costs")."""
    import json

    report = json.loads((bench.REPO_ROOT / "docs" / "results" / "bench_http_path_cpu_auto.json").read_text())
    assert "paired_ratios" not in report  # saved before the report carried them
    text = bench.table(bench.with_paired_ratios(report))  # a run from before send times: "-"
    assert "| default | 1 | 66.9 | 81.1 | 285 | - | - | +34.7 [+3.2, +45.6] | 0.957, 0.885 | 0.980, 0.938 |" in text


def test_a_traced_round_shows_each_streams_ttft_the_engines_own_and_the_paths(bench) -> None:  # noqa: ANN001
    from measure.metrics import StreamFigures

    http = bench._traced(0.0015, StreamFigures(0.647, 40.0, 16, 50, 0, (), send_s=0.003, engine_ttft_s=0.587))
    from dataclasses import asdict

    assert asdict(http) == pytest.approx(asdict(bench.StreamTrace(1.5, 4.5, 647.0, 587.0)))
    in_process = bench._traced(0.0, StreamFigures(0.3, 40.0, 16, 50, 0, ()))

    text = bench.trace_table({"direct": [[asdict(http), asdict(in_process)]]})
    assert "| direct | 1 | 647 (587; 60), 300 (-) |" in text
