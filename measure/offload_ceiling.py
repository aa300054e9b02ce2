"""What VRAM would a mixture of experts need to run R times as fast as llama-server `--fit` does at a budget?

With some layers' experts in host memory, a token's time is the GPU's part plus the CPU's reads of those
layers' active experts: close to a line in the number of such layers, t(n) = a + b n. scripts/bench_device.py
measures ours at several `n_cpu_moe` (its `--placement NAME:n_cpu_moe=N`) and llama-server `--fit on` at the
budget (`--fit-budget`) in one run. This script fits the line to ours (single stream, and the 4-way aggregate
as time per token), finds the n that R x `--fit`'s speed needs, and the VRAM the memory model predicts for
that n (a line in n too: each layer's experts weigh the same). Where that VRAM exceeds the budget, no
placement of experts within the budget reaches R x `--fit` on this machine: the CPU's reads set the rate.

    python scripts/bench_device.py --model MOE.gguf --llama-server llama-server --configs "" \
        --placement e29:n_cpu_moe=29 --placement e19:n_cpu_moe=19 --placement e0:n_cpu_moe=0 \
        --fit-budget 8GiB --fit-only --skip-http --json-out placement_moe.json
    python scripts/offload_ceiling.py placement_moe.json --ratio 1.2 --plot ceiling.png --out ceiling.json

Rows used: ours in-process whose engine settings differ only in `n_cpu_moe` (the largest such group; other
placements, e.g. another thread count, are left out), each against the `--fit` run measured beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OURS = "ours in-process"
FIT = "llama-server --fit"
GIB = 1024**3
REPO_ROOT = Path(__file__).resolve().parents[1]

from serving.engine.units import parse_bytes  # noqa: E402


@dataclass(frozen=True)
class Point:
    """One placement of ours: its experts in host memory, speeds, and the VRAM predicted and measured."""

    n_cpu_moe: int
    single_tok_s: float
    multi_tok_s: float
    vram_predicted: int
    vram_measured: int | None


@dataclass(frozen=True)
class Line:
    """y = intercept + slope x, by least squares, and how well it fits (r^2)."""

    intercept: float
    slope: float
    r2: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x

    def solve(self, y: float) -> float:
        return (y - self.intercept) / self.slope


@dataclass(frozen=True)
class Need:
    """For one load (single stream or 4-way): the time line, `--fit`'s speed, and what R x it would need."""

    load: str
    ms_per_token: Line  # ours: ms per token against n_cpu_moe
    fit_tok_s: float
    fit_layers: float  # the n at which ours would run as fast as --fit
    ratio: float
    layers_needed: int  # the most experts-in-host layers that still reach ratio x --fit (-1: none does)
    vram_needed_gib: float | None  # predicted for layers_needed


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Line:
    """Least squares through two or more points with at least two distinct xs (ValueError otherwise)."""
    if len(set(xs)) < 2:
        raise ValueError("a line needs placements at two or more n_cpu_moe values")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return Line(intercept, slope, 1.0 - ss_res / ss_tot if ss_tot else 1.0)


def points(report: dict[str, Any]) -> tuple[list[Point], dict[str, float]]:
    """Ours at each n_cpu_moe of the largest group of configs alike but for it, and --fit's speeds beside
    them (the median of the --fit rows paired with those configs: one run, repeated in the table)."""
    groups: dict[str, list[str]] = {}
    for name, entry in report["configs"].items():
        settings = {k: v for k, v in entry["engine_config"].items() if k != "n_cpu_moe"}
        groups.setdefault(json.dumps(settings, sort_keys=True), []).append(name)
    largest: list[str] = max(groups.values(), key=len)
    names = set(largest)
    rows = [row for row in report["table"] if row["config"] in names and row.get("error") is None]
    found = [Point(report["configs"][row["config"]]["engine_config"]["n_cpu_moe"], row["single_tok_s"],
                   row["multi_tok_s"], row["memory_predicted"], row.get("memory_measured"))
             for row in rows if row["target"] == OURS]
    fit_rows = [row for row in rows if row["target"] == FIT]
    if not found or not fit_rows:
        raise ValueError(f"no '{OURS}' and '{FIT}' rows for one group of placements")
    fit = {"single": statistics.median(r["single_tok_s"] for r in fit_rows),
           "multi": statistics.median(r["multi_tok_s"] for r in fit_rows)}
    return sorted(found, key=lambda p: p.n_cpu_moe), fit


def need(load: str, found: Sequence[Point], fit_tok_s: float, ratio: float, vram: Line) -> Need:
    """The line of ms per token for `load`, and the experts-in-host layers and VRAM that ratio x --fit needs."""
    speeds = [p.single_tok_s if load == "single" else p.multi_tok_s for p in found]
    line = fit_line([p.n_cpu_moe for p in found], [1000.0 / s for s in speeds])
    layers = math.floor(line.solve(1000.0 / (ratio * fit_tok_s)))
    if layers < 0:
        return Need(load, line, fit_tok_s, line.solve(1000.0 / fit_tok_s), ratio, -1, None)
    return Need(load, line, fit_tok_s, line.solve(1000.0 / fit_tok_s), ratio, layers, vram.at(layers) / GIB)


def budget(command: str) -> float | None:
    """The --fit-budget the benchmark ran with, in GiB (None if it had none)."""
    words = shlex.split(command)
    return parse_bytes(words[words.index("--fit-budget") + 1]) / GIB if "--fit-budget" in words[:-1] else None


def analyse(report: dict[str, Any], ratio: float) -> dict[str, Any]:
    found, fit = points(report)
    vram = fit_line([p.n_cpu_moe for p in found], [float(p.vram_predicted) for p in found])
    return {"source": {k: report.get(k) for k in ("date", "commit", "command", "device")},
            "budget_gib": budget(report.get("command", "")),
            "points": [asdict(p) for p in found], "vram_per_layer_gib": -vram.slope / GIB,
            "needs": [asdict(need(load, found, fit[load], ratio, vram)) for load in ("single", "multi")]}


def table(result: dict[str, Any]) -> str:
    lines = ["| load | ms/token = a + b n (r^2) | --fit tok/s | ours as fast as --fit at n | "
             f"{result['needs'][0]['ratio']}x --fit needs n <= | VRAM predicted there, GiB |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for item in result["needs"]:
        line = item["ms_per_token"]
        vram = "-" if item["vram_needed_gib"] is None else f"{item['vram_needed_gib']:.2f}"
        lines.append(f"| {item['load']} | {line['intercept']:.2f} + {line['slope']:.3f} n ({line['r2']:.3f}) | "
                     f"{item['fit_tok_s']:.1f} | {item['fit_layers']:.1f} | {item['layers_needed']} | {vram} |")
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], labels: Sequence[str], path: Path) -> None:
    """Ours' single-stream speed against predicted VRAM per run, the fitted curve, --fit and ratio x --fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result, label in zip(results, labels, strict=True):
        pts, single = result["points"], result["needs"][0]
        xs = [p["vram_predicted"] / GIB for p in pts]
        ax.plot(xs, [p["single_tok_s"] for p in pts], "o-", label=f"ours, {label}")
        ax.axhline(single["fit_tok_s"], ls="--", lw=1, color="grey")
        ax.axhline(single["ratio"] * single["fit_tok_s"], ls=":", lw=1, color="black")
        if single["vram_needed_gib"] is not None:
            ax.axvline(single["vram_needed_gib"], ls=":", lw=1, color="red")
        if result["budget_gib"] is not None:
            ax.axvline(result["budget_gib"], ls="-", lw=1, color="green")
    ax.set_xlabel("VRAM predicted for the placement, GiB")
    ax.set_ylabel("single-stream tok/s")
    ax.set_title("Experts in host memory: speed against VRAM\n(green: the budget; grey dashed: --fit; "
                 "black dotted: ratio x --fit; red dotted: the VRAM that needs)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=Path, help="scripts/bench_device.py --json-out files")
    p.add_argument("--ratio", type=float, default=1.2, help="the speed over --fit asked (default 1.2)")
    p.add_argument("--out", type=Path, help="the results as JSON")
    p.add_argument("--plot", type=Path, help="single-stream speed against VRAM, as PNG")
    args = p.parse_args(argv)
    results = []
    for path in args.reports:
        try:
            result = analyse(json.loads(path.read_text(encoding="utf-8")), args.ratio)
        except (ValueError, KeyError) as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            return 2
        results.append(result)
        print(f"{path} ({result['source']['date']}, {result['source']['commit']}; budget "
              f"{result['budget_gib']} GiB): {result['vram_per_layer_gib']:.3f} GiB per layer's experts on the GPU")
        print(table(result))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        plot(results, [path.stem for path in args.reports], args.plot)
    return 0

