#!/usr/bin/env python3
"""How fast could speculation make one stream on this machine, at best? The ceiling scripts/bench_spec.py's
measured speed-up sits under, from two things measured here: what a step of k rows of one sequence costs
against one row as speculation meets it, amid one-row steps (t(k), through the engine's own context), and
the greedy text the model writes for each prompt of a set (speculation off, EOS honoured, prompts of
measure/workload.py).

Three ceilings, each as decode time without speculation over decode time with it (the scheduler's own
per-step work, the same either way, left out):
- perfect drafter: every guess holds, k per step, the best k: max over k of (k + 1) t(1) / t(k + 1). No
  drafter can beat it on this machine;
- prompt lookup, oracle length: prompt lookup (serving/engine/speculate.py, the config's n-gram sizes and draft_max)
  proposes at each step of the real text, and exactly the guesses that hold are verified (an oracle for the
  draft length: the best any length policy could do with these proposals);
- prompt lookup, every guess: all its proposals verified (what a fixed draft length does).
And where the engine's own rule lands (serving/engine/speculate.py's draft_length, replayed over the same texts with
the measured costs): not a ceiling, the policy's share of them without the noise of timing a whole run.

    python scripts/spec_ceiling.py --gen-tokens 128 --out results/spec_ceiling.json
    python scripts/spec_ceiling.py --engine type_k=q8_0 --engine type_v=q8_0 --engine flash_attn=on
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine import llama as _llama  # noqa: E402,F401  (first: the library load order)
from measure.loopback import parse_overrides  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from measure.spec_ceiling import ceilings, greedy_texts, policy_replay, replay  # noqa: E402
from measure.verify_cost import row_costs  # noqa: E402
from measure.workload import PromptSet  # noqa: E402
from serving.engine.config import EngineConfig, SpecMode  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set (the set's first n)")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="engine setting")
    parser.add_argument("--prompt-set", choices=[s.value for s in PromptSet], action="append",
                        help="the sets to run (default: copy, then plain)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "spec_ceiling.json")
    args = parser.parse_args(argv)
    config = EngineConfig(**{"n_parallel": 1, "n_ctx": 4096, "seed": 1, "spec_mode": SpecMode.ngram,
                             **parse_overrides(args.engine)})
    settings = config.speculation
    assert settings is not None
    report: dict[str, object] = {"provenance": provenance(), "config": config.to_yaml_dict(), "sets": {}}
    print("| prompt set | tokens | steps offering guesses | guesses held | perfect drafter | "
          "prompt lookup, oracle length | prompt lookup, every guess | prompt lookup, the engine's rule |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for prompt_set in [PromptSet(s) for s in args.prompt_set or (PromptSet.copy.value, PromptSet.plain.value)]:
        texts = greedy_texts(config, prompt_set, args.prompts, args.gen_tokens)
        depth = max(len(p) for p, _ in texts) + args.gen_tokens // 2
        cost = row_costs(config, depth, settings.draft_max + 1)
        replays = [replay(settings, p, g) for p, g in texts]
        figures = ceilings(cost, replays)
        figures["lookup_engine_policy"] = policy_replay(settings, cost, texts)
        offered = sum(sum(1 for g in r.offered if g) for r in replays)
        steps = sum(len(r.offered) for r in replays)
        guessed = sum(sum(r.offered) for r in replays)
        held = sum(sum(r.held) for r in replays)
        report["sets"][prompt_set.value] = {  # type: ignore[index]
            "depth": depth, "row_cost_ms": {k: v * 1e3 for k, v in cost.items()},
            "ceilings": figures, "replays": [asdict(r) for r in replays]}
        print(f"| {prompt_set.value} | {sum(r.tokens() for r in replays)} | {offered} of {steps} "
              f"| {held} of {guessed} | {figures['perfect_drafter']:.2f}x "
              f"({figures['perfect_drafter_guesses']} guesses) | {figures['lookup_oracle_length']:.2f}x "
              f"| {figures['lookup_every_guess']:.2f}x | {figures['lookup_engine_policy']:.2f}x |", flush=True)
        print(f"  t(k)/t(1) at {depth} cells: " + ", ".join(f"{k}: {cost[k] / cost[1]:.2f}"
                                                          for k in (2, 3, 4, 8, 12, 16, 17) if k in cost))
    write_report(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
