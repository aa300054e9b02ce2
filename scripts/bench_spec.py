#!/usr/bin/env python3
"""Speculative decoding (prompt lookup) on vs off, through our engine, on the real embedded model.

Each round loads an engine with speculation off and one with it on (same config but `spec_mode`; the 135M
model loads in a fraction of a second), one at a time so neither's idle threads compete with the other, and
runs the same requests on each, alternating which goes first, for both prompt sets of measure/workload.py (`copy`: edit code / quote a
text, `plain`: free writing), single stream and `--concurrency` streams. Reported per set: median decode
tok/s of a single stream, median aggregate tok/s, the on/off ratios, the acceptance rate (accepted / drafted
guesses), and whether the greedy texts were identical (they must be: speculation is lossless).

Random-weight models cannot measure acceptance (their greedy loops flatter lookup), hence the real model.

    python scripts/bench_spec.py --rounds 5 --out docs/results/bench_spec_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/llama.py)
from measure.provenance import provenance  # noqa: E402
from measure.targets import EngineTarget  # noqa: E402
from measure.workload import PromptSet, Runner, Workload  # noqa: E402
from serving.config import EngineConfig, SpecMode  # noqa: E402
from serving.engine import Engine  # noqa: E402


def round_of(configs: dict[SpecMode, EngineConfig], prompt_set: PromptSet, args: argparse.Namespace,
             first: SpecMode, number: int) -> dict[SpecMode, dict[str, Any]]:
    """One round: the same single and concurrent requests on both configs, `first` going first."""
    workload = Workload(gen_tokens=args.gen_tokens, levels=(1, args.concurrency), prompt_set=prompt_set,
                        honour_eos=True)  # an EOS-less greedy loop would flatter prompt lookup
    order = [first, *(m for m in configs if m != first)]
    return {mode: asyncio.run(_measure(configs[mode], workload, number)) for mode in order}


async def _measure(config: EngineConfig, workload: Workload, number: int) -> dict[str, Any]:
    """A warm-up, then one single stream and one concurrent round; the request numbers (hence the prompts)
    are the same on every engine of the round."""
    engine = Engine(config)
    target = EngineTarget(engine)
    try:
        await Runner(workload).round(target, 1)
        runner = Runner(workload, first_request=number * 1000)
        before = engine.stats()["counters"]
        single, single_streams = await runner.run_round(target, 1)
        multi, multi_streams = await runner.run_round(target, workload.concurrency)
        after = engine.stats()["counters"]
    finally:
        engine.close()
    return {"single_tok_s": single.decode_tok_s, "aggregate_tok_s": multi.aggregate_tok_s,
            "texts": [s.text for s in single_streams + multi_streams],
            "drafted": after["spec_drafted"] - before["spec_drafted"],
            "accepted": after["spec_accepted"] - before["spec_accepted"]}


def summarise(rounds: list[dict[SpecMode, dict[str, Any]]]) -> dict[str, Any]:
    med = {m.value: {k: statistics.median(v for r in rounds if (v := r[m][k]) is not None)  # None: EOS at once
                     for k in ("single_tok_s", "aggregate_tok_s")} for m in rounds[0]}
    on, off = med[SpecMode.ngram.value], med[SpecMode.off.value]
    drafted = sum(r[SpecMode.ngram]["drafted"] for r in rounds)
    accepted = sum(r[SpecMode.ngram]["accepted"] for r in rounds)
    return {"median": med,
            "on_over_off": {k: on[k] / off[k] for k in on},
            "acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
            "greedy_identical": all(r[SpecMode.ngram]["texts"] == r[SpecMode.off]["texts"] for r in rounds)}


def table(results: dict[str, dict[str, Any]], concurrency: int) -> str:
    lines = [f"| prompt set | single tok/s on / off | x | {concurrency}-way tok/s on / off | x | acceptance "
             "| greedy identical |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, res in results.items():
        on, off, x = res["median"]["ngram"], res["median"]["off"], res["on_over_off"]
        acc = "-" if res["acceptance"] is None else f"{res['acceptance']:.0%} of {res['drafted']}"
        lines.append(f"| {name} | {on['single_tok_s']:.1f} / {off['single_tok_s']:.1f} | {x['single_tok_s']:.2f} "
                     f"| {on['aggregate_tok_s']:.1f} / {off['aggregate_tok_s']:.1f} | {x['aggregate_tok_s']:.2f} "
                     f"| {acc} | {res['greedy_identical']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="n_threads (default: all CPUs)")
    parser.add_argument("--max-busy", type=int, default=1, help="spec_max_busy of the speculating engine")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_spec.json")
    args = parser.parse_args(argv)
    base = EngineConfig(n_parallel=args.concurrency, n_ctx=args.concurrency * 2048, seed=1, n_threads=args.threads)
    configs = {SpecMode.off: base,
               SpecMode.ngram: base.model_copy(update={"spec_mode": SpecMode.ngram, "spec_draft_max": args.draft_max,
                                                       "spec_max_busy": args.max_busy})}
    results = {}
    for prompt_set in (PromptSet.copy, PromptSet.plain):
        rounds = []
        for i in range(args.rounds):
            first = SpecMode.off if i % 2 == 0 else SpecMode.ngram
            rounds.append(round_of(configs, prompt_set, args, first, i + 1))
            print(f"{prompt_set.value} round {i + 1}/{args.rounds}: "
                  + ", ".join(f"{m.value} {r['single_tok_s'] or 0:.1f}/{r['aggregate_tok_s']:.1f}"
                              for m, r in rounds[-1].items()), flush=True)
        results[prompt_set.value] = summarise(rounds)
    report = {"provenance": provenance(), "config": base.to_yaml_dict(), "draft_max": args.draft_max,
              "max_busy": args.max_busy, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(table(results, args.concurrency))
    print(f"wrote {args.out}")
    return 0 if all(r["greedy_identical"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
