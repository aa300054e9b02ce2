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
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine.llama import LlamaContext, LlamaModel  # noqa: E402  (first: the library load order)
from measure.loopback import parse_overrides  # noqa: E402
from bench_verify import timed_decode  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from measure.targets import prompt_tokens  # noqa: E402
from measure.workload import Prompts, PromptSet  # noqa: E402
from serving.engine.config import EngineConfig, SpecMode, default_threads  # noqa: E402
from serving.engine.core import Engine  # noqa: E402
from serving.engine.repack import use_extra_bufts  # noqa: E402
from serving.engine.request import FinishReason, SamplingParams  # noqa: E402
from serving.engine.speculate import Acceptance, PromptLookup, SpecSettings, StepCosts, draft_length  # noqa: E402

REPEATS = 7  # timed decodes per row count (median kept), after one untimed


def row_costs(config: EngineConfig, depth: int, most: int) -> dict[int, float]:
    """Seconds a step of k rows of one sequence costs amid one-row steps, as speculation runs, with `depth`
    cells cached, k = 1..most: for k = 1 a one-row decode after another (on a GPU one row replays a captured
    graph), for k > 1 the k-row decode plus what it adds to the one-row decode after it (which may have to
    rebuild its graph). Medians of REPEATS, the order of k alternated (drift hits every k alike)."""
    model = LlamaModel(config.model_path, config.n_gpu_layers, use_extra_bufts(config))
    ctx = LlamaContext(model, config.model_copy(update={"n_parallel": 1}), default_threads())
    vocab = model.n_vocab
    token = [(3 + 7 * j) % (vocab - 10) + 5 for j in range(most + 3)]
    try:
        timed_decode(ctx, [(17 + 31 * i) % (vocab - 10) + 5 for i in range(depth)], 0)
        one: list[float] = []
        verify: dict[int, list[float]] = {k: [] for k in range(2, most + 1)}
        after: dict[int, list[float]] = {k: [] for k in range(2, most + 1)}
        for r in range(REPEATS + 1):
            for k in verify if r % 2 else reversed(verify):
                timed_decode(ctx, token[:1], depth)
                lone = timed_decode(ctx, token[1:2], depth + 1)
                rows = timed_decode(ctx, token[2:2 + k], depth + 2)
                next_one = timed_decode(ctx, token[2 + k:3 + k], depth + 2 + k)
                ctx.forget(0, depth)
                if r:  # the first round is a warm-up
                    one.append(lone)
                    verify[k].append(rows)
                    after[k].append(next_one)
        t1 = statistics.median(one)
        return {1: t1, **{k: statistics.median(verify[k]) + statistics.median(after[k]) - t1 for k in verify}}
    finally:
        ctx.free()
        model.free()


def greedy_texts(config: EngineConfig, prompt_set: PromptSet, n: int, gen_tokens: int) -> list[tuple[list[int],
                                                                                                     list[int]]]:
    """(prompt tokens, greedy output tokens) for the set's first n prompts, speculation off, EOS honoured."""
    engine = Engine(config.model_copy(update={"spec_mode": SpecMode.off}))
    try:
        out = []
        for prompt in Prompts(prompt_set).round(n):
            tokens = prompt_tokens(engine, prompt)
            handle = engine.submit(tokens, SamplingParams(max_tokens=gen_tokens, temperature=0.0))
            generated: list[int] = []
            for chunk in handle:
                if chunk.finish_reason == FinishReason.error:
                    raise SystemExit(f"the generation failed: {chunk.error}")
                generated.extend(chunk.token_ids)
            out.append((tokens, generated))
        return out
    finally:
        engine.close()


@dataclass(frozen=True)
class LookupReplay:
    """Prompt lookup replayed over one real text: per step, the guesses offered and how many held."""

    offered: tuple[int, ...]
    held: tuple[int, ...]

    def tokens(self) -> int:
        return sum(h + 1 for h in self.held)


def replay(settings: SpecSettings, prompt: list[int], generated: list[int]) -> LookupReplay:
    """Step through `generated` as the scheduler would with every held guess kept: each step offers up to
    draft_max guesses after the tokens so far; the step yields the held ones and the next token."""
    lookup = PromptLookup(settings)
    offered, held = [], []
    done = 1  # the prompt's step gives the first token
    while done < len(generated):
        # k guesses yield up to k + 1 tokens: no more guesses than leave the text's last token to the step
        guesses = lookup.propose(prompt + generated[:done], min(settings.draft_max, len(generated) - done - 1))
        ok = 0
        while ok < len(guesses) and guesses[ok] == generated[done + ok]:
            ok += 1
        offered.append(len(guesses))
        held.append(ok)
        done += ok + 1
    return LookupReplay(tuple(offered), tuple(held))


def policy_replay(settings: SpecSettings, cost: dict[int, float], texts: list[tuple[list[int], list[int]]]) -> float:
    """Decode time without speculation / with it when the engine's own draft-length rule (draft_length, with a
    request's Acceptance, and StepCosts learning the measured costs of the steps it takes, as the engine's
    does) picks how many of prompt lookup's guesses each step verifies, over the same texts: what the policy
    gets of the ceilings, without timing noise."""
    step_costs = StepCosts()  # learns as the engine's does: from the steps the rule takes, over all texts
    plain = spent = 0.0
    for prompt, generated in texts:
        lookup, acceptance, done = PromptLookup(settings), Acceptance(), 1
        while done < len(generated):
            offered = lookup.propose(prompt + generated[:done], min(settings.draft_max, len(generated) - done - 1))
            guesses = offered[:draft_length(acceptance, step_costs, len(offered), 1, False)]
            held = 0
            while held < len(guesses) and guesses[held] == generated[done + held]:
                held += 1
            if guesses:
                acceptance.record(held, missed=held < len(guesses))
            step_costs.observe(len(guesses) + 1, cost[len(guesses) + 1])
            spent += cost[len(guesses) + 1]
            plain += (held + 1) * cost[1]
            done += held + 1
    return plain / spent


def ceilings(cost: dict[int, float], replays: list[LookupReplay]) -> dict[str, float]:
    """Decode time without speculation / with it, for the three ceilings (module docstring)."""
    most = max(cost)
    tokens = sum(r.tokens() for r in replays)
    plain = tokens * cost[1]
    oracle = sum(cost[min(h + 1, most)] for r in replays for h in r.held)
    every = sum(cost[min(g + 1, most)] for r in replays for g in r.offered)
    perfect = max((k * cost[1] / cost[k], k - 1) for k in cost)
    return {"perfect_drafter": perfect[0], "perfect_drafter_guesses": perfect[1],
            "lookup_oracle_length": plain / oracle, "lookup_every_guess": plain / every}


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
