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
