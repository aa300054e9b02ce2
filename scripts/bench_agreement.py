#!/usr/bin/env python3
"""Do the tuner's figures and the benchmark's agree? Both measures on one engine, at every stream count.

The tuner's capacity curve (measure/workload.py `Runner.capacity`: per stream count a warm-up round, then one
measured round) and `scripts/bench_serving.py --in-process` (`Runner.levels`: a warm-up round per level, then the
median of `--repeats` rounds) run the same workload on the same Engine class, so they must agree. An in-place H200
study measured 87-90 tok/s at 2 streams for every config with 4 or more slots, where bench_serving gave 165 on the
same config: this script puts the two side by side on one engine, first as loaded and then after the context was
rebuilt from another config (what a trial does: `Engine.reconfigure`), and prints their ratio per stream count.

    python scripts/bench_agreement.py --engine n_parallel=4 --engine n_ctx=8192 --engine type_k=q8_0 \\
        --engine type_v=q8_0 --engine flash_attn=on --from n_parallel=2 --from n_ctx=4096
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/engine/llama.py)
from measure.provenance import provenance, write_report  # noqa: E402
from measure.targets import EngineTarget  # noqa: E402
from measure.workload import Runner, Workload, capacity_levels  # noqa: E402
from serving.engine.config import load_engine_config  # noqa: E402
from serving.engine.core import Engine  # noqa: E402

BAR = 0.05  # the bar: the two measures within 5% at every level


def overrides(items: list[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"error: expected KEY=VALUE, got {item!r}")
        fields[key.strip()] = value
    return fields


async def both(engine: Engine, workload: Workload, first_request: int) -> list[dict[str, Any]]:
    """Per stream count: the benchmark's median aggregate and slowest decode, and the tuner's capacity point."""
    target = EngineTarget(engine)
    slots = engine.config.n_parallel
    levels = tuple(capacity_levels(slots))
    bench = await Runner(Workload(gen_tokens=workload.gen_tokens, levels=levels, repeats=workload.repeats),
                         first_request).levels([target])
    tuner = await Runner(workload, first_request + 100_000).capacity(target, slots, 0.0)
    rows = []
    for point in tuner.curve:
        median = bench[target.name][point.streams].median
        rows.append({"streams": point.streams, "bench_aggregate": median.aggregate_tok_s,
                     "bench_slowest": median.slowest_decode_tok_s or 0.0, "tuner_aggregate": point.aggregate_tok_s,
                     "tuner_slowest": point.slowest_tok_s,
                     "ratio": point.aggregate_tok_s / median.aggregate_tok_s if median.aggregate_tok_s else 0.0})
    return rows


def table(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"### {title}", "", "| streams | bench aggregate (slowest) | tuner aggregate (slowest) | tuner / bench |",
             "| --- | --- | --- | --- |"]
    for r in rows:
        flag = "" if abs(r["ratio"] - 1) <= BAR else " **off by more than 5%**"
        lines.append(f"| {r['streams']} | {r['bench_aggregate']:.1f} ({r['bench_slowest']:.1f}) | "
                     f"{r['tuner_aggregate']:.1f} ({r['tuner_slowest']:.1f}) | {r['ratio']:.3f}{flag} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=REPO_ROOT / "configs" / "default.yaml", help="engine config YAML")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="engine setting")
    p.add_argument("--from", dest="from_", action="append", default=[], metavar="KEY=VALUE",
                   help="settings of the config the engine is loaded with first, then rebuilt from (a trial's way)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, help="JSON report")
    args = p.parse_args(argv)
    config = load_engine_config(args.config, overrides(args.engine))
    workload = Workload(gen_tokens=args.gen_tokens, repeats=args.repeats)
    report: dict[str, Any] = {**provenance(), "command": " ".join(["python", "scripts/bench_agreement.py",
                                                                   *(argv or sys.argv[1:])]),
                              "config": config.to_yaml_dict()}
    engine = Engine(config)
    try:
        report["loaded"] = asyncio.run(both(engine, workload, 1))
        print(table(f"loaded with the config ({config.n_parallel} slots)", report["loaded"]), flush=True)
        if args.from_:
            engine.reconfigure(load_engine_config(args.config, {**overrides(args.engine), **overrides(args.from_)}))
            engine.reconfigure(config)
            report["rebuilt"] = asyncio.run(both(engine, workload, 1_000_000))
            print(table("after a rebuild from the --from config (a trial's path)", report["rebuilt"]), flush=True)
    finally:
        engine.close()
    if args.out:
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
