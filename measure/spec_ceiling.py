"""How fast could speculation make one stream, at best (scripts/spec_ceiling.py)? The greedy texts a model
writes for a prompt set, prompt lookup replayed over them, and three ceilings from those replays and the
measured row costs (measure/verify_cost.py), each as decode time without speculation over decode time with it:

- perfect drafter: every guess holds, k per step, the best k: max over k of (k + 1) t(1) / t(k + 1);
- prompt lookup, oracle length: exactly the guesses that hold are verified (the best any length policy could
  do with these proposals);
- prompt lookup, every guess: all its proposals verified (what a fixed draft length does).

And where the engine's own draft-length rule lands, replayed over the same texts with the measured costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.engine import llama as _llama  # noqa: F401  (first: the library load order, see serving/engine/llama.py)
from measure.targets import prompt_tokens  # noqa: E402
from measure.workload import Prompts, PromptSet  # noqa: E402
from serving.engine.config import EngineConfig, SpecMode  # noqa: E402
from serving.engine.core import Engine  # noqa: E402
from serving.engine.request import FinishReason, SamplingParams  # noqa: E402
from serving.engine.speculate import Acceptance, PromptLookup, SpecSettings, StepCosts, draft_length  # noqa: E402

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
    """Decode time without speculation / with it, for the three ceilings (the module docstring)."""
    most = max(cost)
    tokens = sum(r.tokens() for r in replays)
    plain = tokens * cost[1]
    oracle = sum(cost[min(h + 1, most)] for r in replays for h in r.held)
    every = sum(cost[min(g + 1, most)] for r in replays for g in r.offered)
    perfect = max((k * cost[1] / cost[k], k - 1) for k in cost)
    return {"perfect_drafter": perfect[0], "perfect_drafter_guesses": perfect[1],
            "lookup_oracle_length": plain / oracle, "lookup_every_guess": plain / every}
