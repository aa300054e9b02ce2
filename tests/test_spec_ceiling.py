"""measure/spec_ceiling.py's arithmetic (scripts/spec_ceiling.py's) on made-up texts and costs (the measuring
needs the model: run the script)."""

from __future__ import annotations


import pytest

from serving.engine.speculate import SpecSettings

pytestmark = pytest.mark.engine  # the module imports serving.engine.llama (libllama) first, as every script does

SETTINGS = SpecSettings(draft_max=8, ngram_min=2, ngram_max=3)
PROMPT = list(range(100, 140))  # 40 distinct tokens
COPY = PROMPT[10:34]  # the text repeats 24 tokens of its prompt verbatim
FRESH = list(range(500, 524))  # nothing to look up
FLAT = {k: 1.0 for k in range(1, 10)}  # a verify costs what one row does
LINEAR = {k: float(k) for k in range(1, 10)}  # every row costs a decode


@pytest.fixture(scope="module")
def ceiling():  # noqa: ANN201
    from measure import spec_ceiling

    yield spec_ceiling


def test_replay_keeps_every_held_guess_and_counts_each_token_once(ceiling) -> None:  # noqa: ANN001
    copied = ceiling.replay(SETTINGS, PROMPT, COPY)
    assert copied.tokens() == len(COPY) - 1  # the prompt's step gives the first token
    assert sum(copied.held) > 15 and all(h <= g for h, g in zip(copied.held, copied.offered, strict=True))
    fresh = ceiling.replay(SETTINGS, PROMPT, FRESH)
    assert sum(fresh.offered) == 0 and fresh.tokens() == len(FRESH) - 1


def test_ceilings_price_steps_by_their_rows(ceiling) -> None:  # noqa: ANN001
    copied = [ceiling.replay(SETTINGS, PROMPT, COPY)]
    flat = ceiling.ceilings(FLAT, copied)
    assert flat["perfect_drafter"] == 9.0 and flat["perfect_drafter_guesses"] == 8  # 9 tokens for one row's cost
    assert flat["lookup_oracle_length"] > 2.0
    linear = ceiling.ceilings(LINEAR, copied)
    assert linear["perfect_drafter"] == 1.0  # where rows cost a decode each, nothing can pay
    assert linear["lookup_oracle_length"] == pytest.approx(1.0)
    assert linear["lookup_every_guess"] <= 1.0


def test_the_engines_rule_replayed_guesses_where_verifying_is_cheap_and_not_where_it_is_not(ceiling) -> None:  # noqa: ANN001,E501
    texts = [(PROMPT, COPY), (PROMPT, FRESH)]
    cheap = ceiling.policy_replay(SETTINGS, FLAT, texts)
    assert cheap > 1.5
    assert ceiling.policy_replay(SETTINGS, LINEAR, texts) <= 1.0
