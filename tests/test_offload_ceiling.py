"""measure/offload_ceiling.py's arithmetic on a made-up scripts/bench_device.py report (measuring needs a GPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

GIB = 1024**3
BASE = {"n_ctx": 4096, "n_parallel": 2, "n_threads": None}


@pytest.fixture(scope="module")
def ceiling():  # noqa: ANN201
    from measure import offload_ceiling

    return offload_ceiling


def row(config: str, target: str, single: float, multi: float, predicted: int = 0,
        error: str | None = None) -> dict[str, Any]:
    return {"config": config, "target": target, "single_tok_s": single, "multi_tok_s": multi,
            "memory_predicted": predicted, "memory_measured": predicted, "error": error}


def report() -> dict[str, Any]:
    """Ours at n = 0, 10, 20, 30 on the line 4 + 0.5 n ms (single) and 2 + 0.25 n ms (4-way, per token),
    17 GiB less 0.3 GiB a layer; --fit at 50 / 100 tok/s; a placement with other threads far off the line,
    and a failed one, both to be left out."""
    configs, table = {}, []
    for n in (0, 10, 20, 30):
        configs[f"e{n}"] = {"engine_config": {**BASE, "n_cpu_moe": n}}
        table.append(row(f"e{n}", "ours in-process", 1000 / (4 + 0.5 * n), 1000 / (2 + 0.25 * n),
                         int((17 - 0.3 * n) * GIB)))
        table.append(row(f"e{n}", "llama-server --fit", 50.0, 100.0))
    configs["t8"] = {"engine_config": {**BASE, "n_cpu_moe": 29, "n_threads": 8}}
    table += [row("t8", "ours in-process", 5.0, 5.0, int(8.3 * GIB)), row("t8", "llama-server --fit", 20.0, 20.0)]
    configs["broken"] = {"engine_config": {**BASE, "n_cpu_moe": 5}}
    table.append(row("broken", "ours in-process", 1.0, 1.0, 0, error="out of memory"))
    return {"date": "2026-12-06", "commit": "abc", "device": "GPU", "configs": configs, "table": table,
            "command": "scripts/bench_device.py --placement e0:n_cpu_moe=0 --fit-budget 8GiB --skip-http"}


def test_the_line_the_layers_and_the_vram_a_ratio_needs(ceiling) -> None:  # noqa: ANN001
    result = ceiling.analyse(report(), 1.2)
    assert [p["n_cpu_moe"] for p in result["points"]] == [0, 10, 20, 30]  # t8 and the failed row left out
    assert result["vram_per_layer_gib"] == pytest.approx(0.3)
    assert result["budget_gib"] == 8.0
    single, multi = result["needs"]
    assert single["ms_per_token"]["slope"] == pytest.approx(0.5)
    assert single["ms_per_token"]["intercept"] == pytest.approx(4.0)
    assert single["fit_layers"] == pytest.approx(32.0)  # 20 ms = 4 + 0.5 n
    assert single["layers_needed"] == 25  # 1000 / 60 = 16.67 ms -> n <= 25.3
    assert single["vram_needed_gib"] == pytest.approx(17 - 0.3 * 25)
    assert multi["fit_layers"] == pytest.approx(32.0)  # 10 ms = 2 + 0.25 n
    assert multi["layers_needed"] == 25


def test_a_ratio_out_of_reach_names_no_vram(ceiling) -> None:  # noqa: ANN001
    single = ceiling.analyse(report(), 6.0)["needs"][0]  # 300 tok/s: faster than every expert on the GPU
    assert single["layers_needed"] == -1 and single["vram_needed_gib"] is None


def test_the_cli_writes_table_json_and_plot_and_refuses_one_placement(ceiling, tmp_path: Path,  # noqa: ANN001
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "placement.json"
    source.write_text(json.dumps(report()), encoding="utf-8")
    out, png = tmp_path / "ceiling.json", tmp_path / "ceiling.png"
    assert ceiling.main([str(source), "--out", str(out), "--plot", str(png)]) == 0
    assert "| single | 4.00 + 0.500 n (1.000) | 50.0 | 32.0 | 25 | 9.50 |" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["needs"][0]["layers_needed"] == 25
    assert png.stat().st_size > 0
    one = report()
    one["table"] = [r for r in one["table"] if r["config"] in ("e10", "t8")]
    source.write_text(json.dumps(one), encoding="utf-8")
    assert ceiling.main([str(source)]) == 2
    assert "two or more n_cpu_moe" in capsys.readouterr().err
