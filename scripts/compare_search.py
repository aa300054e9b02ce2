"""Benchmark the tuner itself: TPE vs random search with the same trial count, and both vs the article baseline.

Runs `python -m tuning.search` twice (each in its own process and Ray instance) on the same model, space,
budget and seed, `--sampler tpe` and `--sampler random`, then reads both studies back and writes a table:
the pick of each (by --prefer), its single-stream and 4-way figures, ratios to the article's config (trial 0
of each study), wall time and time spent loading weights. A benchmark, not a test: figures vary run to run.

    python scripts/compare_search.py --trials 40 --results-dir results/compare [-- extra tuning.search flags]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_study(sampler: str, args: argparse.Namespace, extra: list[str]) -> float:
    """One study in a fresh process; returns its wall time in seconds."""
    cmd = [sys.executable, "-m", "tuning.search", "--trials", str(args.trials), "--sampler", sampler,
           "--seed", str(args.seed), "--study-name", f"compare-{sampler}-seed{args.seed}",
           "--results-dir", str(args.results_dir), "--out", str(args.results_dir / f"tuned-{sampler}.yaml"),
           "--prefer", args.prefer, "--no-apply", *extra]
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True)
    return time.perf_counter() - t0


def summarise(sampler: str, wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    import optuna

    from tuning import report

    study = optuna.load_study(study_name=f"compare-{sampler}-seed{args.seed}",
                              storage=f"sqlite:///{(args.results_dir / 'optuna.db').resolve()}")
    rows = report.rows_from_study(study)
    pick = report.pick(rows, args.prefer)
    baseline = next((r for r in rows if r.is_baseline), None)
    loads, load_s = report.weight_loads(rows)
    return {
        "sampler": sampler, "trials": len(rows), "feasible": sum(r.feasible for r in rows), "wall_s": wall_s,
        "weight_loads": loads, "weight_load_s": load_s,
        "pick": pick.label() if pick else None, "pick_trial": pick.number if pick else None,
        "single_tok_s": pick.single if pick else None, "aggregate_tok_s": pick.second if pick else None,
        "baseline_single_tok_s": baseline.single if baseline else None,
        "baseline_aggregate_tok_s": baseline.second if baseline else None,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| sampler | trials (feasible) | pick | single tok/s (x baseline) | 4-way tok/s (x baseline) | wall s | weight loads (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        def ratio(key: str, r: dict = r) -> str:
            base = r[f"baseline_{key}"]
            return f"{r[key]:.1f} ({r[key] / base:.2f}x)" if r[key] and base else "-"
        lines.append(f"| {r['sampler']} | {r['trials']} ({r['feasible']}) | `{r['pick']}` | {ratio('single_tok_s')} "
                     f"| {ratio('aggregate_tok_s')} | {r['wall_s']:.0f} | {r['weight_loads']} ({r['weight_load_s']:.1f}) |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefer", default="balanced", choices=["balanced", "single", "aggregate"])
    p.add_argument("--results-dir", type=Path, default=REPO / "results" / "compare")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    rows = [summarise(s, run_study(s, args, extra), args) for s in ("tpe", "random")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    meta = {"date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "cpu": platform.processor() or platform.machine(), "commit": commit,
            "command": " ".join([sys.executable, *sys.argv]), "prefer": args.prefer}
    md = "\n".join([f"- {k}: {v}" for k, v in meta.items()] + ["", table(rows)]) + "\n"
    (args.results_dir / "compare.md").write_text(md)
    (args.results_dir / "compare.json").write_text(json.dumps({**meta, "studies": rows}, indent=2))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
