"""Sampling features on the real engine: logit bias (ban and force), grammars, logprobs."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import pytest

from serving.engine.request import SamplingParams
from tests.helpers import collect

if TYPE_CHECKING:
    from serving.engine.core import Engine

pytestmark = pytest.mark.engine

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _prompt(engine: Engine, text: str) -> list[int]:
    return engine.tokenize_prompt(engine.render_chat([{"role": "user", "content": text}]))


def test_logit_bias_bans_and_forces(engine: Engine) -> None:
    prompt = _prompt(engine, "Say hello.")
    plain = collect(engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0)))
    banned = collect(engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                          logit_bias=((plain.tokens[0], -math.inf),))))
    assert plain.tokens[0] not in banned.tokens
    forced = collect(engine.submit(prompt, SamplingParams(max_tokens=4, temperature=0.0, logit_bias=((42, 100.0),))))
    assert forced.tokens == [42] * 4


@pytest.mark.parametrize("kind", ["guide", "gbnf"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 1), (0.9, 2), (1.2, 3)])
def test_a_json_schema_constraint_always_gives_valid_json(engine: Engine, temperature: float, seed: int | None,
                                                          kind: str) -> None:
    """Greedy and sampled, as the server compiles a schema (an llguidance guide) and as a client's raw GBNF."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from serving.engine.request import Constraint, ConstraintKind
    from serving.openai.structured import json_schema_guide

    constraint = json_schema_guide(PERSON) if kind == "guide" else Constraint(
        ConstraintKind.gbnf, json_schema_to_gbnf(json.dumps(PERSON)))
    params = SamplingParams(max_tokens=200, temperature=temperature, seed=seed, constraint=constraint)
    gen = collect(engine.submit(_prompt(engine, "Describe a person."), params))
    value = json.loads(gen.text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and isinstance(value["name"], str)


def test_a_constraint_that_does_not_compile_is_refused(engine: Engine) -> None:
    from serving.engine.request import Constraint, ConstraintKind

    with pytest.raises(ValueError, match="grammar"):
        engine.submit([1, 2, 3], SamplingParams(constraint=Constraint(ConstraintKind.gbnf, "root ::= ( unclosed")))
    with pytest.raises(ValueError, match="constraint"):
        engine.submit([1, 2, 3], SamplingParams(constraint=Constraint(ConstraintKind.guide, "start: ( unclosed")))


def test_logprobs_one_per_token_from_the_raw_distribution(engine: Engine) -> None:
    prompt = _prompt(engine, "Name a colour.")
    gen = collect(engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)))
    handle = engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))
    logprobs = [lp for chunk in handle for lp in chunk.logprobs]
    assert [lp.token for lp in logprobs] == gen.tokens
    for lp in logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0] == (lp.token, lp.logprob)  # greedy: the chosen token is the most likely
        assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-6
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_n_choices_share_one_prefill_and_match_solo_runs(engine: Engine) -> None:
    prompt = _prompt(engine, "Write a line about the sea.")
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=40)
    solo = [collect(engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.9, seed=40 + i))).text
            for i in range(3)]
    before = engine.stats()["counters"]["prompt_tokens_evaluated"]
    choices = [collect(h).text for h in engine.submit_choices(prompt, params, 3)]
    evaluated = engine.stats()["counters"]["prompt_tokens_evaluated"] - before
    assert choices == solo
    assert evaluated <= len(prompt)  # one prefill at most (a cached prefix makes it less)
    with pytest.raises(ValueError, match="slots"):
        engine.submit_choices(prompt, params, engine.config.n_parallel + 1)


def test_a_sampler_chain_that_sorts_agrees_with_greedy_token_after_token(engine: Engine) -> None:
    """top_k=1 sorts the candidates and leaves one: every token must still be the argmax (the reused
    candidate array must be laid out afresh for each token)."""
    prompt = _prompt(engine, "Name three rivers.")
    greedy = collect(engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    chained = collect(engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.7, top_k=1, seed=3)))
    assert chained.tokens == greedy.tokens
