"""Unit tests of the device benchmark's pure parts (measure/device_bench.py) and measure/device.py's arithmetic:
roofline and bandwidth, the named configs, and the final table.

The device phases themselves need llama-server, a model and (for the figures that matter) a GPU; they are
exercised by the CPU smoke run described in the script's docstring, not here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from measure.device import Bandwidth, measure_bandwidth, roofline_tok_s

GiB = 1 << 30


@pytest.fixture(scope="module")
def bd():
    """measure/device_bench.py, scripts/bench_device.py's logic.

    It imports serving.engine.llama (libllama) first, as every script does: the tests using it are in lane engine."""
    from measure import device_bench

    return device_bench


@pytest.mark.unit
def test_bandwidth_counts_read_and_write() -> None:
    bw = Bandwidth.of(GiB, [0.5, 0.25, 1.0])
    assert bw.median_s == 0.5 and bw.copies == 3
    assert bw.bytes_per_s == pytest.approx(4 * GiB)
    assert bw.best_bytes_per_s == pytest.approx(8 * GiB)
    assert bw.worst_bytes_per_s == pytest.approx(2 * GiB)


@pytest.mark.unit
def test_bandwidth_ignores_zero_times_and_refuses_none() -> None:
    assert Bandwidth.of(100, [0.0, 1.0]).copies == 1
    with pytest.raises(ValueError):
        Bandwidth.of(100, [0.0])


@pytest.mark.unit
def test_roofline_matches_device_notes() -> None:
    # shared/device-notes.md: 4.18 TB/s over a 15.32 GB model -> ~273 tok/s single stream
    assert roofline_tok_s(4.18e12, 15_320_000_000) == pytest.approx(272.8, abs=0.5)
    # the seed article's own ceiling: 900 GB/s / 14.5 GB ~= 62 tok/s
    assert roofline_tok_s(900e9, 14_500_000_000) == pytest.approx(62.07, abs=0.01)


@pytest.mark.unit
@pytest.mark.parametrize("bw, per_token", [(None, 10), (1e9, None), (1e9, 0), (0.0, 10), (1e9, -5)])
def test_roofline_missing_inputs(bw, per_token):
    assert roofline_tok_s(bw, per_token) is None


@pytest.mark.unit
def test_bandwidth_measured_in_a_child_on_the_host() -> None:
    bw = measure_bandwidth(cuda=False, gib=0.001, repeats=2, timeout_s=60)
    assert bw.copies == 2 and bw.bytes_per_s > 0 and "numpy" in bw.method


@pytest.mark.engine
def test_ratio(bd):
    assert bd.ratio(50.0, 100.0) == 0.5
    assert bd.ratio(None, 100.0) is None
    assert bd.ratio(50.0, None) is None
    assert bd.ratio(50.0, 0.0) is None


@pytest.mark.engine
def test_parse_configs(bd):
    assert bd.parse_configs("np4, article") == ["np4", "article"]
    with pytest.raises(argparse.ArgumentTypeError, match="choose from"):
        bd.parse_configs("article,nope")
    assert bd.parse_configs(" , ") == []  # none: only --placement's (main refuses a run with neither)
    name, config = bd.parse_placement("cpu-moe8:n_cpu_moe=8,n_threads=12")
    assert name == "cpu-moe8" and config.n_cpu_moe == 8 and config.n_threads == 12
    assert config.n_parallel == bd.ARTICLE.n_parallel  # the article's config underneath
    for bad in ("article:n_cpu_moe=1", "nocolon", "x:n_cpu_moe=-1", "x:override_tensor=a=GPU"):
        with pytest.raises(argparse.ArgumentTypeError):
            bd.parse_placement(bad)
    assert bd.without_placement(["-ngl", "999", "-c", "4096", "--n-cpu-moe", "3", "-ot", "x=CPU", "-fa", "on"]) == \
        ["-c", "4096", "-fa", "on"]


@pytest.mark.engine
def test_placements_that_differ_only_in_what_fit_decides_share_its_run(bd):
    """--fit's command leaves the placement out, so two placements of one config would run it twice, alike."""
    names = [bd.parse_placement(p) for p in ("l30:n_gpu_layers=30", "l31:n_gpu_layers=31",
                                             "t8:n_gpu_layers=30,n_threads=8")]
    args = argparse.Namespace(model=Path("/m.gguf"), threads=None)
    run = bd.Run(args=args, gpu=None, report={}, configs=dict(names))
    assert run.fit_flags("l30") == run.fit_flags("l31")
    assert run.fit_flags("t8") != run.fit_flags("l30") and "8" in run.fit_flags("t8")
    assert "-ngl" not in run.fit_flags("l30")

@pytest.mark.engine
def test_the_named_configs_are_the_articles(bd):
    article, np4 = bd.CONFIGS["article"], bd.CONFIGS["np4"]
    assert (article.n_ctx, article.n_parallel, article.n_batch, article.type_k.value) == (4096, 2, 512, "q8_0")
    assert (np4.n_ctx, np4.n_parallel, np4.n_batch, np4.flash_attn.value) == (8192, 4, 512, "on")


def _results(single: float, agg: float, ttft: float) -> dict:
    return {"1": {"median": {"decode_tok_s": single, "aggregate_tok_s": single, "ttft_ms": ttft}},
            "4": {"median": {"decode_tok_s": agg / 4, "aggregate_tok_s": agg, "ttft_ms": 99.0}}}


def _report() -> dict:
    return {
        "roofline_tok_s_single_stream": 200.0,
        "configs": {"article": {
            "predicted": {"total": 16 * GiB},
            "targets": {
                "ours HTTP": {"error": "RuntimeError: boom", "results": None, "memory": {"loaded_idle": None}},
                "llama-server": {"error": None, "results": _results(100.0, 160.0, 50.0),
                                 "memory": {"loaded_idle": 15 * GiB, "after_workload": 15.5 * GiB}},
                "ours in-process": {"error": None, "results": _results(90.0, 176.0, 60.0),
                                    "memory": {"loaded_idle": 15 * GiB}},
            }}},
    }


@pytest.mark.engine
def test_build_rows_orders_targets_and_computes_ratios(bd):
    rows = bd.build_rows(_report())
    assert [r.target for r in rows] == ["llama-server", "ours in-process", "ours HTTP"]
    ref, ours, http = rows
    assert (ref.ratio_single, ref.ratio_multi) == (1.0, 1.0)
    assert ours.ratio_single == pytest.approx(0.9) and ours.ratio_multi == pytest.approx(1.1)
    assert ours.roofline_fraction == pytest.approx(0.45) and ours.ttft_ms == 60.0
    assert ref.memory_measured == 15.5 * GiB  # after the workload wins over right-after-load
    assert ours.memory_measured == 15 * GiB and ours.memory_predicted == 16 * GiB
    assert http.error == "RuntimeError: boom" and http.single_tok_s is None and http.ratio_single is None


@pytest.mark.engine
def test_build_rows_without_llama_server_has_no_ratios(bd):
    report = _report()
    del report["configs"]["article"]["targets"]["llama-server"]
    report["roofline_tok_s_single_stream"] = None
    ours = bd.build_rows(report)[0]
    assert ours.ratio_single is None and ours.roofline_fraction is None and ours.single_tok_s == 90.0


@pytest.mark.engine
def test_format_table(bd):
    text = bd.format_table(bd.build_rows(_report()), "VRAM")
    lines = text.splitlines()
    assert "VRAM GiB meas / pred" in lines[0] and "mem" not in lines[0]
    assert len({len(line) for line in lines[:3]}) == 1  # header, rule and rows line up
    assert "0.900 / 1.100" in text and "45.0" in text and "15.00 / 16.00" in text
    http = next(i for i, line in enumerate(lines) if "ours HTTP" in line)
    assert "- / -" in lines[http] and lines[http + 1].strip() == "! RuntimeError: boom"


@pytest.mark.engine
def test_format_table_empty(bd):
    assert len(bd.format_table([]).splitlines()) == 2


@pytest.mark.engine
def test_describe_error_names_the_limit(bd):
    assert bd.describe_error(TimeoutError(), 600) == "TimeoutError: phase exceeded 600 s"
    assert bd.describe_error(ValueError("bad"), 600) == "ValueError: bad"


@pytest.mark.unit
def test_a_pick_becomes_bench_device_settings(tmp_path) -> None:
    """scripts/device/pick-settings.py turns the tuner's written pick into bench_device.py's `--placement`
    settings (the GPU recipe benches the pick against llama-server --fit); a file without a pick fails."""
    import subprocess
    import sys

    from serving.engine.config import EngineConfig
    from tuning.writeback import write_config

    pick = EngineConfig(n_parallel=3, n_ctx=6144, n_batch=256, n_ubatch=128, n_cpu_moe=29, n_threads=15)
    write_config(tmp_path / "tuned.yaml", pick, header="a pick")
    out = subprocess.run([sys.executable, "scripts/device/pick-settings.py", str(tmp_path / "tuned.yaml")],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert "n_cpu_moe=29" in out and "n_threads=15" in out and "model" not in out
    (tmp_path / "empty.yaml").write_text("# no pick\n")
    assert subprocess.run([sys.executable, "scripts/device/pick-settings.py", str(tmp_path / "empty.yaml")],
                          capture_output=True).returncode != 0
