#!/usr/bin/env python3
"""Speculative decoding (prompt lookup, and draft models with --draft-model) on vs off, through our engine, on
the real embedded model.

Each round loads an engine with speculation off and one per speculating config (same config but `spec_mode`;
the 135M model loads in a fraction of a second), one at a time so no idle engine's threads compete, and runs
the same requests on each, in an order rotated every round, for both prompt sets of measure/workload.py (`copy`: edit code / quote a
text, `plain`: free writing), single stream and `--concurrency` streams. Reported per set: median decode
tok/s of a single stream, median aggregate tok/s, the on/off ratios, the acceptance rate (accepted / drafted
guesses), and whether the greedy texts were identical, single stream and concurrent (speculation is lossless;
with an f16 cache past 512 cells llama.cpp's CPU logits still depend on the batch a row is decoded in:
scripts/batch_numerics.py).

Random-weight models cannot measure acceptance (their greedy loops flatter lookup), hence the real model.

    python scripts/bench_spec.py --rounds 5 --out docs/results/bench_spec_cpu.json
    python scripts/make_draft_gguf.py --layers 12 --out results/draft-12.gguf    # a draft sharing the vocabulary
    python scripts/bench_spec.py --no-ngram --draft-model results/draft-12.gguf --draft-model <the model itself>
    python scripts/bench_spec.py --engine type_k=q8_0 --engine type_v=q8_0 --engine flash_attn=on   # the
        article's cache: llama.cpp's CPU attention is then batch-invariant (scripts/batch_numerics.py)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/engine/llama.py)
from measure.loopback import parse_overrides  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from measure.design import rotated  # noqa: E402
from measure.targets import EngineTarget  # noqa: E402
from measure.workload import PromptSet, Runner, Workload  # noqa: E402
from serving.engine.config import EngineConfig, SpecMode  # noqa: E402
from serving.engine.core import Engine  # noqa: E402


OFF = "off"


def round_of(configs: dict[str, EngineConfig], prompt_set: PromptSet, args: argparse.Namespace, shift: int,
             number: int) -> dict[str, dict[str, Any]]:
    """One round: the same single and concurrent requests on every config, in an order rotated by `shift`."""
    workload = Workload(gen_tokens=args.gen_tokens, levels=(1, args.concurrency), prompt_set=prompt_set,
                        honour_eos=True)  # an EOS-less greedy loop would flatter prompt lookup
    names = list(configs)
    return {name: asyncio.run(_measure(configs[name], workload, number)) for name in rotated(names, shift)}


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
            "single_texts": [s.text for s in single_streams], "multi_texts": [s.text for s in multi_streams],
            "drafted": after["spec_drafted"] - before["spec_drafted"],
            "accepted": after["spec_accepted"] - before["spec_accepted"]}


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per speculating config: medians, on/off ratios, acceptance, and whether every greedy text was the
    one speculation off gave, single stream and concurrent apart (concurrent streams' batches depend on timing,
    and llama.cpp's CPU logits on the batch: scripts/batch_numerics.py)."""
    med = {name: {k: statistics.median(v for r in rounds if (v := r[name][k]) is not None)  # None: EOS at once
                  for k in ("single_tok_s", "aggregate_tok_s")} for name in rounds[0]}
    out = {}
    for name in (n for n in med if n != OFF):
        drafted = sum(r[name]["drafted"] for r in rounds)
        accepted = sum(r[name]["accepted"] for r in rounds)
        out[name] = {"median": med[name], "off": med[OFF],
                     "on_over_off": {k: med[name][k] / med[OFF][k] for k in med[name]},
                     "acceptance": accepted / drafted if drafted else None, "drafted": drafted,
                     "accepted": accepted,
                     "greedy_identical": {kind: all(r[name][f"{kind}_texts"] == r[OFF][f"{kind}_texts"] for r in rounds)
                                          for kind in ("single", "multi")}}
    return out


def table(results: dict[str, dict[str, Any]], concurrency: int) -> str:
    lines = [f"| prompt set | speculation | single tok/s on / off | x | {concurrency}-way tok/s on / off | x "
             f"| acceptance | greedy identical (single / {concurrency}-way) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for prompt_set, per_config in results.items():
        for name, res in per_config.items():
            on, off, x = res["median"], res["off"], res["on_over_off"]
            acc = "-" if res["acceptance"] is None else f"{res['acceptance']:.0%} of {res['drafted']}"
            same = res["greedy_identical"]
            lines.append(f"| {prompt_set} | {name} | {on['single_tok_s']:.1f} / {off['single_tok_s']:.1f} "
                         f"| {x['single_tok_s']:.2f} | {on['aggregate_tok_s']:.1f} / {off['aggregate_tok_s']:.1f} "
                         f"| {x['aggregate_tok_s']:.2f} | {acc} | {same['single']} / {same['multi']} |")
    return "\n".join(lines)


def configs_of(args: argparse.Namespace) -> dict[str, EngineConfig]:
    base = EngineConfig(**{"n_parallel": args.concurrency, "n_ctx": args.concurrency * 2048, "seed": 1,
                           "n_threads": args.threads, **parse_overrides(args.engine)})
    spec = {"spec_draft_max": args.draft_max, "spec_max_busy": args.max_busy}
    configs = {OFF: base}
    if not args.no_ngram:
        configs[SpecMode.ngram.value] = base.model_copy(update={"spec_mode": SpecMode.ngram, **spec})
    for path in args.draft_model:
        configs[f"draft {path.name}"] = EngineConfig(**{**base.model_dump(exclude_none=True), **spec,
                                                         "spec_mode": SpecMode.draft, "draft_model": path,
                                                         "spec_draft_p_min": args.draft_p_min})
    return configs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="n_threads (default: all CPUs)")
    parser.add_argument("--max-busy", type=int, default=1, help="spec_max_busy of the speculating engines")
    parser.add_argument("--draft-model", type=Path, action="append", default=[],
                        help="also measure spec_mode draft with this draft model (repeat for more)")
    parser.add_argument("--draft-p-min", type=float, default=0.75, help="spec_draft_p_min of the draft engines")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="engine setting of every config (e.g. type_k=q8_0: batch-invariant CPU attention)")
    parser.add_argument("--no-ngram", action="store_true", help="leave prompt lookup out")
    parser.add_argument("--prompt-set", choices=[s.value for s in PromptSet], action="append",
                        help="the sets to run (default: copy, then plain)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_spec.json")
    args = parser.parse_args(argv)
    configs = configs_of(args)
    results = {}
    for prompt_set in [PromptSet(s) for s in args.prompt_set or (PromptSet.copy.value, PromptSet.plain.value)]:
        rounds = []
        for i in range(args.rounds):
            rounds.append(round_of(configs, prompt_set, args, i, i + 1))
            print(f"{prompt_set.value} round {i + 1}/{args.rounds}: "
                  + ", ".join(f"{name} {r['single_tok_s'] or 0:.1f}/{r['aggregate_tok_s']:.1f}"
                              for name, r in rounds[-1].items()), flush=True)
        results[prompt_set.value] = summarise(rounds)
    report = {"provenance": provenance(), "configs": {n: c.to_yaml_dict() for n, c in configs.items()},
              "results": results}
    write_report(args.out, report)
    print(table(results, args.concurrency))
    print(f"wrote {args.out}")
    return 0 if all(all(r["greedy_identical"].values()) for per in results.values() for r in per.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
