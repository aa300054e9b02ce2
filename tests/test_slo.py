"""Latency targets (measure/slo.py): parsing `--slo`, the percentiles a run is judged on (with their bootstrap
spread), which requests count as good, and the constraint value Optuna steers by. Pure: constructed records."""

from __future__ import annotations

import math
import random

import pytest

from measure.slo import (PERCENTILES, Latency, RequestLatency, Slo, SloOutcome, Target, evaluate, samples, spread,
                         tail_count)

pytestmark = pytest.mark.unit


def lat(ttft: float, e2e: float | None = None, itl: tuple[float, ...] = (), ok: bool = True,
        tokens: int | None = None) -> RequestLatency:
    """One request's latencies; E2E defaults to TTFT plus its gaps, tokens to one more than its gaps."""
    return RequestLatency(ok=ok, ttft_s=ttft, e2e_s=ttft + sum(itl) if e2e is None else e2e, itl_s=itl,
                          output_tokens=len(itl) + 1 if tokens is None else tokens)


def hundred() -> list[RequestLatency]:
    """TTFT 0.01 .. 1.00 s (p95 = 0.9505 s by linear interpolation), E2E = TTFT + 1 s (p50 = 1.505 s)."""
    return [lat(0.01 * i, e2e=0.01 * i + 1.0) for i in range(1, 101)]


# -- parsing ---------------------------------------------------------------------------------------------------
def test_parse_reads_seconds_milliseconds_and_bare_seconds() -> None:
    """The documented form, with s, ms and a bare number (seconds), several targets in the order given."""
    slo = Slo.parse("ttft_p95=1.5s,itl_p95=80ms,e2e_p99=20")
    assert slo.targets == (Target(Latency.ttft, 95, 1.5), Target(Latency.itl, 95, 0.08),
                           Target(Latency.e2e, 99, 20.0))


def test_parse_tolerates_spaces_and_empty_parts() -> None:
    """What a shell or a config file hands over: spaces around parts and units, a trailing comma."""
    slo = Slo.parse(" ttft_p50 = 250 ms , e2e_p90=.5 s,")
    assert slo.targets == (Target(Latency.ttft, 50, 0.25), Target(Latency.e2e, 90, 0.5))


@pytest.mark.parametrize(("text", "message"), [
    ("", "at least one target"),
    (" , ", "at least one target"),
    ("tpot_p95=1s", "the metric is one of ttft, itl, e2e"),
    ("ttft_p97=1s", "the percentile is one of p50, p90, p95, p99"),
    ("ttft_p95=0s", "the bound must be above 0"),
    ("itl_p95=0ms", "the bound must be above 0"),
    ("ttft_p95=1s,ttft_p95=900ms", "ttft_p95 is given twice"),
    ("ttft_p95", "expected METRIC_pNN=VALUE"),
    ("ttft_p95=1h", "expected METRIC_pNN=VALUE"),
    ("ttft=1s", "expected METRIC_pNN=VALUE"),
])
def test_parse_rejects_bad_targets_with_a_clear_message(text: str, message: str) -> None:
    """Every mistake is a ValueError that names what is wrong (the CLI prints it as is)."""
    with pytest.raises(ValueError, match=message):
        Slo.parse(text)


def test_a_bad_part_is_named_in_the_error() -> None:
    """With several targets, the message says which one is wrong."""
    with pytest.raises(ValueError, match="'itl_p97=80ms'"):
        Slo.parse("ttft_p95=1s,itl_p97=80ms")


@pytest.mark.parametrize("text", ["ttft_p95=1..5s", "ttft_p95=.s"])
def test_a_malformed_number_is_named_in_the_error(text: str) -> None:
    """A number the pattern lets through but float() cannot read gets the same clear message as any other."""
    with pytest.raises(ValueError, match=f"SLO target '{text}'"):
        Slo.parse(text)


@pytest.mark.parametrize(("text", "needed"), [
    ("ttft_p95=1s", 100),  # 5 samples beyond p95: 5 / 5%
    ("e2e_p99=10s", 500),  # 5 / 1%
    ("ttft_p50=1s,e2e_p90=2s", 50),  # the most any per-request target needs
    ("itl_p99=50ms", 0),  # ITL has a sample per token gap, not per request
    ("ttft_p95=1s,itl_p99=50ms", 100),
])
def test_min_samples_leaves_five_samples_beyond_each_per_request_percentile(text: str, needed: int) -> None:
    """How many requests a run needs before its percentiles are worth reporting."""
    assert Slo.parse(text).min_samples() == needed


def test_tail_count() -> None:
    """The counts behind min_samples, for every percentile a target may name."""
    assert [tail_count(p) for p in PERCENTILES] == [10, 50, 100, 500]


def test_bound_is_the_tightest_target_on_a_latency() -> None:
    """A request is good only within the tightest of several targets on one latency; unbounded: inf."""
    slo = Slo.parse("ttft_p95=1s,ttft_p50=300ms")
    assert slo.bound(Latency.ttft) == pytest.approx(0.3)
    assert slo.bound(Latency.itl) == math.inf


# -- one request: good or not -----------------------------------------------------------------------------------
def test_good_uses_the_requests_own_ttft_mean_itl_and_e2e() -> None:
    """TTFT 0.4 s, gaps 50 and 150 ms (mean 100 ms), E2E 1 s: the mean gap decides, not the worst one."""
    request = lat(0.4, e2e=1.0, itl=(0.05, 0.15))
    assert request.mean_itl_s == pytest.approx(0.1)
    assert request.good(Slo.parse("ttft_p95=500ms,itl_p95=120ms,e2e_p99=2s"))
    assert not request.good(Slo.parse("ttft_p95=300ms"))  # its TTFT is over
    assert not request.good(Slo.parse("itl_p95=90ms"))  # its mean gap is over, though one gap is within
    assert not request.good(Slo.parse("e2e_p50=900ms"))  # its E2E is over
    assert not request.good(Slo.parse("ttft_p50=300ms,ttft_p99=5s"))  # the tightest TTFT bound applies


def test_a_failed_request_is_never_good() -> None:
    """An error is not goodput, however fast it came back, with or without targets."""
    assert not lat(0.001, ok=False).good(Slo.parse("ttft_p95=10s"))
    assert not lat(0.001, ok=False).good(Slo())


def test_one_token_has_no_gap_and_a_mean_itl_of_zero() -> None:
    """A one-token answer has no inter-token gap: it cannot break an ITL bound."""
    request = lat(0.1, itl=())
    assert request.mean_itl_s == 0.0 and request.good(Slo.parse("itl_p95=1ms"))


# -- a run: met or missed, by how much ----------------------------------------------------------------------------
def test_a_met_slo_has_headroom_as_a_negative_violation() -> None:
    """TTFT p95 0.9505 s against 1 s: met, violation 0.9505 / 1 - 1 (the headroom left, below 0)."""
    outcome = evaluate(hundred(), Slo.parse("ttft_p95=1s"))
    assert outcome.met and outcome.misses == ()
    (target, observed), = outcome.observed
    assert target == Target(Latency.ttft, 95, 1.0)
    assert observed.value == pytest.approx(0.9505)
    assert outcome.violation == pytest.approx(0.9505 - 1.0)
    assert outcome.violation <= 0
    assert outcome.describe() == "met (100/100 requests good)"


def test_a_missed_slo_reports_the_worst_targets_excess() -> None:
    """Two targets missed (TTFT p95 0.9505 s > 0.5 s: +90%, E2E p50 1.505 s > 1 s: +50.5%), one met: the
    violation is the worst excess, and both misses are listed."""
    outcome = evaluate(hundred(), Slo.parse("ttft_p95=500ms,e2e_p50=1s,ttft_p50=2s"))
    assert not outcome.met
    assert [(m.target.metric, m.target.pct) for m in outcome.misses] == [(Latency.ttft, 95), (Latency.e2e, 50)]
    assert [m.excess for m in outcome.misses] == pytest.approx([0.9505 / 0.5 - 1, 1.505 / 1.0 - 1])
    assert outcome.violation == pytest.approx(0.9505 / 0.5 - 1)
    assert outcome.describe() == "missed: ttft_p95 950ms > 500ms (+90%); e2e_p50 1.50s > 1.00s (+50%)"


def test_attainment_is_the_share_of_good_requests() -> None:
    """TTFT 0.01 .. 1.00 s under a 0.705 s bound: the first 70 are good."""
    outcome = evaluate(hundred(), Slo.parse("ttft_p50=705ms"))
    assert outcome.good == 70 and outcome.requests == 100
    assert outcome.attainment == pytest.approx(0.7)
    assert evaluate([], Slo.parse("ttft_p50=1s")).attainment == 0.0


def test_a_failed_request_fails_the_run_but_not_the_percentiles() -> None:
    """One error among fast requests: unmet, violation at least 1, yet the percentiles are the successful
    requests' alone (the failed one's huge latency is not a sample)."""
    slo = Slo.parse("ttft_p95=1s")
    clean = evaluate(hundred(), slo)
    failed = evaluate([*hundred(), lat(100.0, ok=False, tokens=0)], slo)
    assert not failed.met and failed.misses == () and failed.failed == 1
    assert failed.violation >= 1.0
    assert failed.observed[0][1].value == clean.observed[0][1].value
    assert failed.good == 100 and failed.requests == 101
    assert failed.describe() == "missed: 1 failed"


def test_no_successful_request_misses_every_target() -> None:
    """Nothing to take a percentile of (NaN) is a miss, never a pass."""
    outcome = evaluate([lat(0.1, ok=False)], Slo.parse("ttft_p95=1s"))
    assert not outcome.met and len(outcome.misses) == 1 and math.isnan(outcome.observed[0][1].value)
    assert outcome.violation == 1.0


def test_an_slo_without_targets_counts_every_successful_request_as_good() -> None:
    """No targets: goodput is throughput; a failure still leaves the run unmet."""
    outcome = evaluate([lat(5.0), lat(50.0), lat(0.1, ok=False)], Slo())
    assert outcome.good == 2 and outcome.violation == 1.0 and not outcome.met
    assert evaluate([lat(5.0)], Slo()).violation == 0.0 and str(Slo()) == "none"


def test_itl_percentile_is_over_every_gap_of_every_request() -> None:
    """Nine gaps of 10 ms and one of 500 ms (two requests): p95 of the ten gaps is 10 + 0.55 * 490 ms; a
    failed request's gaps are not samples."""
    requests = [lat(0.1, itl=(0.01,) * 9), lat(0.1, itl=(0.5,)), lat(0.1, itl=(9.0,) * 5, ok=False)]
    assert sorted(samples(requests, Latency.itl)) == [0.01] * 9 + [0.5]
    outcome = evaluate(requests, Slo.parse("itl_p95=100ms"))
    assert outcome.observed[0][1].value == pytest.approx(0.01 + 0.55 * 0.49)
    assert outcome.violation == pytest.approx((0.01 + 0.55 * 0.49) / 0.1 - 1)


def test_samples_are_one_per_successful_request_for_ttft_and_e2e() -> None:
    """TTFT and E2E percentiles are over requests, failed ones left out."""
    requests = [lat(0.1, e2e=1.0), lat(0.2, e2e=2.0), lat(0.3, e2e=3.0, ok=False)]
    assert samples(requests, Latency.ttft) == [0.1, 0.2]
    assert samples(requests, Latency.e2e) == [1.0, 2.0]


# -- the spread of a percentile -----------------------------------------------------------------------------------
def test_spread_brackets_the_percentile_and_is_deterministic() -> None:
    """Skewed latencies (lognormal, 200 samples): the bootstrap interval holds the percentile itself, and the
    same data gives the same report."""
    rng = random.Random(7)
    values = [rng.lognormvariate(-2.0, 0.8) for _ in range(200)]
    ordered = sorted(values)
    for pct in PERCENTILES:
        s = spread(values, pct)
        assert s.low <= s.value <= s.high, (pct, s)
        assert s.low < s.high  # 200 distinct values: a rerun can move it
        assert s.samples == 200 and s.pct == pct
        assert spread(values, pct) == s
        assert spread(list(reversed(values)), pct).value == s.value
    p50 = spread(values, 50).value
    assert p50 == pytest.approx((ordered[99] + ordered[100]) / 2)


def test_spread_of_constant_values_has_no_width() -> None:
    """Identical samples: every resample has the same percentile."""
    s = spread([0.25] * 30, 95)
    assert (s.value, s.low, s.high) == (0.25, 0.25, 0.25)


def test_spread_is_stable_only_with_enough_samples_beyond_it() -> None:
    """p95 needs 100 samples (5 beyond it), p50 10; no samples: NaN and unstable."""
    values = [float(i) for i in range(99)]
    assert not spread(values, 95).stable
    assert spread([*values, 99.0], 95).stable
    assert not spread(values[:9], 50).stable and spread(values[:10], 50).stable
    empty = spread([], 95)
    assert math.isnan(empty.value) and empty.samples == 0 and not empty.stable
    assert str(empty) == "n/a [n/a-n/a]"


def test_outcome_properties_on_a_constructed_outcome() -> None:
    """`violation` with no targets and no failures is 0; `met` needs no miss and no failure."""
    outcome = SloOutcome(observed=(), misses=(), failed=0, good=3, requests=4)
    assert outcome.met and outcome.violation == 0.0 and outcome.attainment == pytest.approx(0.75)
    assert SloOutcome((), (), failed=2, good=0, requests=2).violation == 1.0


def test_a_run_where_every_request_failed_says_so_in_words() -> None:
    failed = [RequestLatency(False, 0.1, 0.1, (), 0)] * 3
    text = evaluate(failed, Slo.parse("ttft_p95=2s")).describe()
    assert "no sample" in text and "nan" not in text and "3 failed" in text
