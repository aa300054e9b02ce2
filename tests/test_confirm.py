"""The confirmation round's logic (tuning/confirm.py) with a fake measurement: rotation, paired ratios, the
pick and the within-noise verdict."""

from __future__ import annotations

import pytest

from serving.config import EngineConfig
from tuning.confirm import Candidate, Figures, confirm, decide, markdown, rotation

pytestmark = pytest.mark.unit

A, B, BASE = (EngineConfig(n_parallel=n, n_ctx=1024 * n) for n in (1, 2, 4))


def _candidates() -> list[Candidate]:
    return [Candidate(7, "a", A), Candidate(3, "b", B), Candidate(0, "base", BASE, is_baseline=True)]


def _measure(figures: dict[EngineConfig, list[tuple[float, float]]], order: list[int]) -> object:
    """Replays each config's (single, aggregate) per call, and records the order configs were measured in."""
    calls = {c: 0 for c in figures}
    index = {A: 0, B: 1, BASE: 2}

    def measure(config: EngineConfig) -> Figures:
        single, second = figures[config][calls[config]]
        calls[config] += 1
        order.append(index[config])
        return Figures(single, second)

    return measure


def test_rounds_rotate_so_drift_hits_every_candidate_alike() -> None:
    assert [rotation(r, 3) for r in range(3)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]


def test_ratios_are_paired_within_a_round_and_the_pick_is_on_their_medians() -> None:
    # the machine slows by half in round 2: raw figures swing, the paired ratios do not
    figures = {A: [(100, 200), (50, 100), (100, 200)], B: [(101, 240), (50.5, 120), (101, 240)],
               BASE: [(50, 100), (25, 50), (50, 100)]}
    order: list[int] = []
    confirmed = confirm(_candidates(), reference=2, rounds=3, measure=_measure(figures, order))
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    a, b, base = confirmed
    assert a.single_ratio == [2.0, 2.0, 2.0] and b.second_ratio == [2.4, 2.4, 2.4]
    assert base.single_ratio == [1.0, 1.0, 1.0]
    verdict = decide(confirmed, "balanced")  # b: within 5% of a's single, better aggregate
    assert verdict.pick is b and verdict.runner_up is a and verdict.metric == "second"
    assert not verdict.within_noise
    assert decide(confirmed, "single").pick is b and decide(confirmed, "aggregate").pick is b
    text = markdown(confirmed, verdict, _candidates()[2], 3)
    assert "## Confirmation round" in text and "| 3 **(pick)** |" in text and "ahead of the runner-up" in text


def test_a_lead_inside_the_spread_is_reported_as_within_noise() -> None:
    figures = {A: [(100, 200), (100, 190), (100, 210)], B: [(100, 195), (100, 185), (100, 200)],
               BASE: [(50, 100), (50, 100), (50, 100)]}
    confirmed = confirm(_candidates(), reference=2, rounds=3, measure=_measure(figures, []))
    verdict = decide(confirmed, "aggregate")
    assert verdict.pick.candidate.number == 7 and verdict.within_noise
    assert "**within noise**" in markdown(confirmed, verdict, _candidates()[2], 3)
