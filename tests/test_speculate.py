"""Prompt lookup on its own: what it proposes, and that it never matches the suffix with itself."""

from __future__ import annotations

from serving.speculate import PromptLookup, SpecSettings


def test_proposes_what_followed_the_last_occurrence() -> None:
    lookup = PromptLookup(SpecSettings(ngram_min=2, ngram_max=3))
    text = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert lookup.propose(text, 4) == [4, 5, 9, 9]
    assert lookup.propose(text + [4], 2) == [5, 9]


def test_prefers_the_longest_and_latest_match() -> None:
    lookup = PromptLookup(SpecSettings(ngram_min=1, ngram_max=3))
    tokens = [7, 1, 2, 50, 8, 2, 60, 1, 2]
    assert lookup.propose(tokens, 1) == [50]  # "1 2" beats the later "2"
    assert PromptLookup(SpecSettings(ngram_min=1, ngram_max=1)).propose(tokens, 1) == [60]


def test_no_match_no_guess_and_no_self_match() -> None:
    lookup = PromptLookup(SpecSettings())
    assert lookup.propose([1, 2, 3, 4], 5) == []
    assert lookup.propose([5, 5], 3) == []  # the only "5 5" is the suffix itself


# -- on the real model -------------------------------------------------------------------------------
import pytest  # noqa: E402

from serving.config import EngineConfig  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.request import SamplingParams  # noqa: E402
from tests.helpers import collect  # noqa: E402

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def sub(a, b):
    """Return a minus b."""
    return a - b
'''
COPY = f"Repeat this code exactly, then stop:\n\n{CODE}\nHere it is again:\n"


@pytest.fixture(scope="module")
def pair() -> tuple[Engine, Engine]:
    plain = Engine(EngineConfig(n_parallel=2, n_ctx=2048, seed=3))
    spec = Engine(EngineConfig(n_parallel=2, n_ctx=2048, seed=3, spec_mode="ngram", spec_draft_max=8))
    yield plain, spec
    plain.close()
    spec.close()


def _chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenize_prompt(engine.render_chat([{"role": "user", "content": text}]))


def test_greedy_text_is_identical_with_speculation(pair: tuple[Engine, Engine]) -> None:
    plain, spec = pair
    for text in (COPY, "Write two sentences about autumn."):
        params = SamplingParams(max_tokens=96, temperature=0.0)
        assert collect(spec.submit(_chat(spec, text), params)).text == \
            collect(plain.submit(_chat(plain, text), params)).text
    counters = spec.stats()["counters"]
    assert counters["spec_accepted"] > 0  # it did speculate, and some guesses held


def test_stop_strings_and_max_tokens_inside_a_draft_end_where_plain_decoding_does(pair) -> None:  # noqa: ANN001
    plain, spec = pair
    prompt = _chat(plain, COPY)
    for params in (SamplingParams(max_tokens=9, temperature=0.0), SamplingParams(max_tokens=80, temperature=0.0,
                                                                                 stop=("minus",))):
        a, b = collect(plain.submit(prompt, params)), collect(spec.submit(prompt, params))
        assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)


def test_rollback_leaves_the_cache_exactly_the_tokens_it_holds(pair: tuple[Engine, Engine]) -> None:
    """A follow-up that reuses the speculating slot's cache must answer as an engine with nothing cached."""
    plain, spec = pair
    first = _chat(spec, COPY)
    answer = collect(spec.submit(first, SamplingParams(max_tokens=64, temperature=0.0)))
    follow = first + answer.tokens + spec.tokenize_prompt(" Now explain it.")[1:]  # [1:]: no second BOS
    reused = collect(spec.submit(follow, SamplingParams(max_tokens=24, temperature=0.0)))
    assert reused.usage.cached_tokens >= len(first) + len(answer.tokens) - 1
    fresh = Engine(EngineConfig(n_parallel=1, n_ctx=1024, seed=3))
    try:
        assert collect(fresh.submit(follow, SamplingParams(max_tokens=24, temperature=0.0))).text == reused.text
    finally:
        fresh.close()


def test_sampled_requests_stay_seeded_with_speculation(pair: tuple[Engine, Engine]) -> None:
    _, spec = pair
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=11)
    prompt = _chat(spec, COPY)
    assert collect(spec.submit(prompt, params)).text == collect(spec.submit(prompt, params)).text
