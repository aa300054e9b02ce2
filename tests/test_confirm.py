"""The confirmation round's logic (tuning/confirm.py) with a fake measurement: rotation, paired ratios, the
pick and the within-noise verdict."""

from __future__ import annotations

import pytest

from serving.engine.config import EngineConfig
from tuning.confirm import Candidate, Figures, Verdict, confirm, decide, markdown, rotation

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


def test_within_noise_the_config_using_less_memory_is_picked() -> None:
    """np4 and np8 reach the same aggregate within noise: the pick is the one that costs less memory, whichever
    drew the higher median; a clear lead still wins whatever its memory."""
    big, small = EngineConfig(n_parallel=8, n_ctx=16384), EngineConfig(n_parallel=4, n_ctx=8192)
    gib = 2**30
    candidates = [Candidate(17, "np8", big, memory=24 * gib), Candidate(47, "np4", small, memory=18 * gib),
                  Candidate(0, "base", BASE, is_baseline=True, memory=16 * gib)]
    figures = {big: [(100, 232), (100, 229), (100, 236)], small: [(100, 230), (100, 228), (100, 233)],
               BASE: [(100, 160), (100, 160), (100, 160)]}
    calls = {c: 0 for c in figures}

    def measure(config: EngineConfig) -> Figures:
        single, second = figures[config][calls[config]]
        calls[config] += 1
        return Figures(single, second)

    confirmed = confirm(candidates, reference=2, rounds=3, measure=measure)
    verdict = decide(confirmed, "balanced")
    assert verdict.pick.candidate.number == 47 and verdict.by_memory and verdict.within_noise
    assert verdict.runner_up is not None and verdict.runner_up.candidate.number == 17
    assert "picked for its memory (18.00 GiB against 24.00 GiB)" in markdown(confirmed, verdict, candidates[2], 3)
    figures[big] = [(100, 260), (100, 262), (100, 259)]  # a lead outside the noise: the bigger one
    calls = {c: 0 for c in figures}
    clear = decide(confirm(candidates, reference=2, rounds=3, measure=measure), "balanced")
    assert clear.pick.candidate.number == 17 and not clear.by_memory and not clear.within_noise


def test_a_baseline_that_beats_every_candidate_is_the_pick() -> None:
    """A chat study measured its pick at 0.4x the baseline's goodput in the confirmation round: writing that
    config would make the service worse than what it ran."""
    figures = {A: [(100, 40), (100, 42), (100, 41)], B: [(100, 35), (100, 36), (100, 34)],
               BASE: [(100, 100), (100, 101), (100, 99)]}
    confirmed = confirm(_candidates(), reference=2, rounds=3, measure=_measure(figures, []))
    assert decide(confirmed, "aggregate").pick.candidate.is_baseline


def _served_round(served_figures: list[tuple[float, float]]) -> tuple[list[Candidate], Verdict]:
    """The pick A, the baseline, and the config served now (no trial: number -1), measured over 3 rounds."""
    served = EngineConfig(n_parallel=8, n_ctx=8192)
    candidates = [Candidate(7, "a", A, memory=2), Candidate(0, "base", BASE, is_baseline=True, memory=1),
                  Candidate(-1, "np8", served, memory=3, is_served=True)]
    figures = {A: [(100, 200), (100, 204), (100, 198)], BASE: [(100, 100)] * 3, served: served_figures}
    calls = {c: 0 for c in figures}

    def measure(config: EngineConfig) -> Figures:
        calls[config] += 1
        return Figures(*figures[config][calls[config] - 1])

    return candidates, decide(confirm(candidates, reference=1, rounds=3, measure=measure), "aggregate")


def test_in_place_a_pick_must_beat_the_served_config_and_a_tie_keeps_it() -> None:
    """The served config is a candidate: within noise of the best it stays (a switch buys nothing measurable),
    though it costs more memory; a clear lead over it is picked."""
    candidates, tie = _served_round([(100, 197), (100, 201), (100, 199)])
    assert tie.keeps_served and tie.kept_served and not tie.by_memory and tie.within_noise
    assert tie.runner_up is not None and tie.runner_up.candidate.number == 7
    text = markdown([tie.pick, tie.runner_up], tie, candidates[1], 3)
    assert "| - (served) **(pick)** | np8 |" in text and "Pick: the served config on the" in text
    assert "the served config stays" in text
    candidates, beaten = _served_round([(100, 150), (100, 152), (100, 149)])
    assert beaten.pick.candidate.number == 7 and not beaten.keeps_served and not beaten.kept_served
    assert "| - (served) |" in markdown([beaten.pick, beaten.runner_up], beaten, candidates[1], 3)  # type: ignore[list-item]
