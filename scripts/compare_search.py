"""Benchmark the tuner itself: samplers over seeds at the same trial count, and measuring short first or not.

Runs `python -m tuning.search` once per (sampler, seed), each in its own process and Ray instance, on the same
model, space and budget, then reads every study back (tuning/compare.py) and writes compare.json (with
provenance), compare.md and compare.png: per sampler and checkpoint, the best pick within the first N trials as a
ratio to the best pick of any study (median, min-max over seeds), the time to 95% of that best, pruned trials and
wall time. `--prune-ab` runs every study again with `--no-prune` (arm `SAMPLER/no-prune`) for the saving. The
confirmation round is skipped (`--confirm-rounds 0`): the comparison reads the search's own picks. Studies already
recorded in RESULTS_DIR/walls.json are read back, not run again (an interrupted comparison resumes). A benchmark,
not a test: figures vary run to run.

    python scripts/compare_search.py --seeds 0,1,2,3,4 --samplers tpe,random,prior --trials 40 --checkpoints 20,40 \\
        --results-dir results/compare [-- extra tuning.search flags]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from measure.provenance import provenance, write_report  # noqa: E402
from tuning.compare import NO_PRUNE, StudyRun, compare, from_study, plot, prune_ab, table  # noqa: E402
from tuning.results import Objective  # noqa: E402


def study_name(arm: str, seed: int) -> str:
    return f"compare-{arm.replace('/', '-')}-seed{seed}"


def run_study(arm: str, seed: int, args: argparse.Namespace, extra: list[str]) -> float:
    """One study in a fresh process; returns its wall time in seconds."""
    sampler, _, off = arm.partition("/")
    prune = ["--no-prune"] if off == NO_PRUNE else ["--prune-below", str(args.prune_below)]
    cmd = [sys.executable, "-m", "tuning.search", "--trials", str(args.trials), "--sampler", sampler,
           "--seed", str(seed), "--study-name", study_name(arm, seed), "--results-dir", str(args.results_dir),
           "--out", str(args.results_dir / f"tuned-{study_name(arm, seed)}.yaml"), "--prefer", args.prefer,
           "--no-apply", "--confirm-rounds", "0", *prune, *extra]
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True)
    return time.perf_counter() - t0


def read_back(arm: str, seed: int, wall_s: float, args: argparse.Namespace) -> StudyRun:
    import optuna

    study = optuna.load_study(study_name=study_name(arm, seed),
                              storage=f"sqlite:///{(args.results_dir / 'optuna.db').resolve()}")
    return from_study(study, arm, seed, wall_s, Objective(args.objective))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0", help="comma-separated seeds, one study per sampler and seed")
    p.add_argument("--samplers", default="tpe,random,prior", help="comma-separated tuning.search samplers")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--checkpoints", default="", help="trial counts to read each study at (default: --trials)")
    p.add_argument("--prefer", default="balanced", choices=["balanced", "single", "aggregate"])
    p.add_argument("--objective", default="aggregate", choices=[o.value for o in Objective],
                   help="the second objective the studies ran with (pass --objective to tuning.search too)")
    prune = p.add_mutually_exclusive_group()
    prune.add_argument("--prune-below", type=float, default=0.8, help="tuning.search's --prune-below")
    prune.add_argument("--no-prune", dest="prune_below", action="store_const", const=0.0)
    p.add_argument("--prune-ab", action="store_true", help="every study also with --no-prune (the saving)")
    p.add_argument("--results-dir", type=Path, default=REPO / "results" / "compare")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    seeds = [int(s) for s in args.seeds.split(",")]
    checkpoints = [int(c) for c in args.checkpoints.split(",")] if args.checkpoints else [args.trials]
    samplers = args.samplers.split(",")
    arms = samplers + ([f"{s}/{NO_PRUNE}" for s in samplers] if args.prune_ab else [])
    args.results_dir.mkdir(parents=True, exist_ok=True)
    walls_path = args.results_dir / "walls.json"
    walls: dict[str, float] = json.loads(walls_path.read_text()) if walls_path.exists() else {}
    for seed in seeds:  # seeds outermost: a comparison cut short holds every arm at the seeds it reached
        for arm in arms:
            if study_name(arm, seed) not in walls:
                walls[study_name(arm, seed)] = run_study(arm, seed, args, extra)
                walls_path.write_text(json.dumps(walls, indent=2))
    studies = [read_back(arm, seed, walls[study_name(arm, seed)], args) for arm in arms for seed in seeds]
    result = compare(studies, checkpoints, args.prefer)
    md = "\n".join([f"Best pick of all studies: {result.best:.1f} ({result.best_study}), {args.prefer} pick.", "",
                    table(result), "", *prune_ab(result)]) + "\n"
    (args.results_dir / "compare.md").write_text(md)
    plot(result, args.results_dir / "compare.png")
    write_report(args.results_dir / "compare.json", {
        "provenance": provenance(), "arms": arms, "seeds": seeds, "checkpoints": checkpoints,
        "tuning_search_flags": extra, "comparison": asdict(result),
        "studies": [{"arm": s.arm, "seed": s.seed, "wall_s": s.wall_s, "trials": len(s.run_order),
                     "pruned": len(s.pruned), "best": {n: s.best_within(n, args.prefer) for n in checkpoints}}
                    for s in studies]})
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
