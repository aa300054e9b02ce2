"""The traffic record (serving/engine/traffic.py): bounded, mergeable over replicas, never holding text; recorded by
the engine for client requests only; /traffic and the request histograms of /metrics over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from serving.engine.request import Constraint, ConstraintKind, FinishReason, SamplingParams, Usage
from serving.engine.traffic import (CACHED_FRACTION_EDGES, TOKEN_EDGES, Histogram, RequestKind, RequestShape,
                             ShapeInProgress, TrafficRecord, TrafficSummary, TrafficTag, merge_summaries)
from tests.conftest import assert_generated, sse_events

SECRET = "Zanzibar-quokka-marmalade 7731"  # a prompt whose text (or token ids) must never be kept


def shape(arrival: float, prompt: int = 10, output: int = 5, **kw: Any) -> RequestShape:
    return RequestShape(arrival, kw.pop("kind", RequestKind.greedy), prompt, kw.pop("cached", 0), output, **kw)


# -- the record ----------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_record_is_bounded_and_its_totals_count_everything() -> None:
    record = TrafficRecord(limit=100)
    for i in range(10_000):
        record.add(shape(float(i), prompt=i % 300 + 1, output=i % 7, n=1 + i % 2))
    assert len(record) == 100 and record.count == 10_000
    summary = record.summary("r1")
    assert summary.totals.requests == 10_000 and summary.totals.choices == 15_000
    assert summary.totals.prompt_tokens == sum(i % 300 + 1 for i in range(10_000))
    assert sum(summary.prompt_tokens.counts) == sum(summary.output_tokens.counts) == 10_000
    assert [s.arrival for s in summary.recent] == [float(i) for i in range(9_900, 10_000)]  # the latest 100
    assert summary.arrival_rate_per_s == pytest.approx(1.0)


@pytest.mark.unit
def test_histogram_buckets_are_prometheus_le_buckets() -> None:
    record = TrafficRecord()
    for prompt, cached in ((1, 0), (2, 1), (3, 3), (100_001, 0)):
        record.add(shape(0.0, prompt=prompt, cached=cached))
    summary = record.summary()
    counts = dict(zip([*TOKEN_EDGES, "inf"], summary.prompt_tokens.counts, strict=True))
    assert counts[1] == 1 and counts[2] == 1 and counts[5] == 1 and counts["inf"] == 1
    fractions = dict(zip([*CACHED_FRACTION_EDGES, "over"], summary.cached_fraction.counts, strict=True))
    assert fractions[0.0] == 2 and fractions[0.5] == 1 and fractions[1.0] == 1


@pytest.mark.unit
def test_since_hands_out_each_shape_once_and_all_of_a_new_record() -> None:
    record = TrafficRecord(limit=10)
    for i in range(3):
        record.add(shape(float(i)))
    first, seen = record.since(0)
    assert [s.arrival for s in first] == [0.0, 1.0, 2.0] and seen == 3
    assert record.since(seen) == ([], 3)
    for i in range(3, 30):
        record.add(shape(float(i)))
    later, seen = record.since(seen)
    assert [s.arrival for s in later] == [float(i) for i in range(20, 30)] and seen == 30  # what the window holds
    fresh = TrafficRecord()  # an engine replaced: its count starts again below what was seen
    fresh.add(shape(5.0))
    assert [s.arrival for s in fresh.since(seen)[0]] == [5.0]


@pytest.mark.unit
def test_a_request_with_n_choices_is_one_shape_complete_when_its_last_choice_ends() -> None:
    params = SamplingParams(max_tokens=9, temperature=0.8)
    progress = ShapeInProgress.start(12, params, 3, TrafficTag(streamed=True), arrival=100.0)
    assert progress.end_choice(Usage(12, 4, cached_tokens=8), FinishReason.length) is None
    assert progress.end_choice(Usage(12, 2, cached_tokens=0), FinishReason.stop) is None
    done = progress.end_choice(Usage(12, 0), FinishReason.cancelled)
    assert done == RequestShape(100.0, RequestKind.sampled, 12, 8, 6, n=3, max_tokens=9,
                                finish=FinishReason.cancelled, streamed=True)


@pytest.mark.parametrize("params,kind", [
    (SamplingParams(temperature=0.0), RequestKind.greedy),
    (SamplingParams(temperature=0.7), RequestKind.sampled),
    (SamplingParams(temperature=0.0, constraint=Constraint(ConstraintKind.gbnf, 'root ::= "a"')),
     RequestKind.constrained),
])
@pytest.mark.unit
def test_request_kind(params: SamplingParams, kind: RequestKind) -> None:
    assert RequestKind.of(params) == kind


# -- merging replicas ----------------------------------------------------------------------------------
@pytest.mark.unit
def test_two_replicas_summaries_merge() -> None:
    a, b = TrafficRecord(limit=50, clock=lambda: 10.0), TrafficRecord(limit=40, clock=lambda: 5.0)
    for i in range(60):
        a.add(shape(2.0 * i, prompt=30, output=3, kind=RequestKind.sampled))  # even arrivals
        b.add(shape(2.0 * i + 1, prompt=3000, output=700, finish=FinishReason.length))  # odd arrivals
    sa, sb = a.summary("a"), b.summary("b")
    merged = sa.merged(sb)
    assert merged.replicas == ("a", "b") and merged.since == 5.0
    assert merged.totals.requests == 120 and merged.totals.output_tokens == 60 * 3 + 60 * 700
    assert merged.by_kind == {RequestKind.sampled: 60, RequestKind.greedy: 60}
    assert merged.by_finish == {FinishReason.stop: 60, FinishReason.length: 60}
    assert merged.prompt_tokens.counts == tuple(x + y for x, y in zip(sa.prompt_tokens.counts,
                                                                       sb.prompt_tokens.counts, strict=True))
    # interleaved in arrival order, bounded by the shorter window (40), which reaches back no further than
    # either side's oldest: complete, no gap
    arrivals = [s.arrival for s in merged.recent]
    assert merged.limit == 40 and arrivals == [float(t) for t in range(80, 120)]
    assert merged.arrival_rate_per_s == pytest.approx(1.0)
    assert merge_summaries([sa, sb]) == merged
    assert sb.merged(sa).recent == merged.recent


@pytest.mark.unit
def test_histograms_with_other_edges_do_not_merge() -> None:
    with pytest.raises(ValueError, match="bucket edges"):
        Histogram.empty((1, 2)).merged(Histogram.empty((1, 3)))


# -- no text -------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_shape_has_no_field_that_could_hold_text() -> None:
    allowed = {"float", "int", "int | None", "bool", "RequestKind", "FinishReason"}
    assert {f.name: f.type for f in fields(RequestShape) if f.type not in allowed} == {}
    assert set(shape(0.0).as_dict()) == {f.name for f in fields(RequestShape)}  # JSON shows every field


@pytest.mark.engine
def test_the_engine_records_a_client_request_without_its_text_and_not_untagged_work(engine: Any) -> None:
    from tests.helpers import collect

    tokens = engine.tokenize_prompt(SECRET)
    before = engine.traffic_summary("here").totals.requests
    collect(engine.submit(tokens, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))  # untagged
    assert engine.traffic_summary("here").totals.requests == before
    handles = engine.submit_choices(tokens, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), 2,
                                    traffic=TrafficTag(streamed=False))
    generated = [collect(h) for h in handles]
    summary = engine.traffic_summary("here")
    assert summary.totals.requests == before + 1
    last = summary.recent[-1]
    assert (last.prompt_tokens, last.output_tokens, last.n, last.kind) == (len(tokens), 8, 2, RequestKind.greedy)
    for kept in (repr(summary), json.dumps(summary.as_dict())):
        for word in [SECRET, *SECRET.split(), generated[0].text.strip()]:
            assert word not in kept
        assert ", ".join(map(str, tokens)) not in kept and ",".join(map(str, tokens)) not in kept
        assert ", ".join(map(str, generated[0].tokens)) not in kept


@pytest.mark.unit
def test_the_traffic_module_imports_neither_libllama_nor_ray() -> None:
    code = ("import sys, serving.engine.traffic; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'ray', 'llama_cpp', 'serving.engine.llama'} or m == 'serving.engine.llama'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# -- asking every replica (fake handles: no Ray) -------------------------------------------------------
class FakePeers:
    def __init__(self, answers: list[Any] | Exception) -> None:
        self.answers = answers

    def broadcast(self, method: str) -> Any:
        assert method == "traffic_summary"

        async def results_async(timeout_s: float, return_exceptions: bool) -> list[Any]:
            if isinstance(self.answers, Exception):
                raise self.answers
            return self.answers

        return SimpleNamespace(results_async=results_async)


@pytest.mark.engine
def test_gather_merges_every_answer_and_counts_the_missing() -> None:
    from serving.replica.control_routes import gather_traffic

    own, other = TrafficSummary.empty("a", since=1.0), TrafficSummary.empty("b", since=2.0)
    merged, missing = asyncio.run(gather_traffic(FakePeers([other, own, RuntimeError("lost")]), own))
    assert merged.replicas == ("a", "b") and missing == 1
    merged, missing = asyncio.run(gather_traffic(FakePeers([other]), own))  # the broadcast missed this one
    assert merged.replicas == ("a", "b") and missing == 0
    for peers in (FakePeers(TimeoutError("slow")), object(), None):  # cannot ask all: this replica, said so
        assert asyncio.run(gather_traffic(peers, own)) == (own, None)


# -- over HTTP -----------------------------------------------------------------------------------------
def _traffic(url: str, **params: Any) -> dict[str, Any]:
    resp = httpx.get(f"{url}/traffic", params=params, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def _histogram_count(metrics: str, name: str) -> float:
    found = re.search(rf"^{name}_count\{{[^}}]*\}} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.serve
def test_traffic_over_http_counts_the_completions_with_their_token_numbers(serve_url: str) -> None:
    before = _traffic(serve_url)
    metrics_before = httpx.get(f"{serve_url}/metrics", timeout=30).text
    with httpx.Client(timeout=120) as http:
        greedy = assert_generated(http.post(f"{serve_url}/v1/completions", json={
            "prompt": SECRET, "max_tokens": 5, "temperature": 0, "ignore_eos": True}).json())
        two = assert_generated(http.post(f"{serve_url}/v1/completions", json={
            "prompt": "Rivers of", "max_tokens": 3, "temperature": 0.8, "n": 2, "ignore_eos": True}).json())
        with http.stream("POST", f"{serve_url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200
            events = sse_events(resp.iter_lines())
    streamed = events[-1]["usage"]
    after = _traffic(serve_url)
    assert after["replicas_missing"] == 0 and len(after["replicas"]) == 1
    usages = [greedy["usage"], two["usage"], streamed]
    delta = {k: after["totals"][k] - before["totals"][k] for k in after["totals"]}
    assert delta == {"requests": 3, "choices": 4, "streamed": 1,
                     "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
                     "cached_tokens": sum(_cached(u) for u in usages),
                     "output_tokens": sum(u["completion_tokens"] for u in usages)}
    shapes = after["recent"]["requests"][-3:]
    assert [(s["prompt_tokens"], s["output_tokens"], s["n"], s["kind"], s["streamed"]) for s in shapes] == [
        (greedy["usage"]["prompt_tokens"], 5, 1, "greedy", False),
        (two["usage"]["prompt_tokens"], 6, 2, "sampled", False),
        (streamed["prompt_tokens"], streamed["completion_tokens"], 1, "sampled", True)]
    assert shapes[0]["arrival"] <= shapes[1]["arrival"] <= shapes[2]["arrival"]
    assert sum(after["histograms"]["output_tokens"]["counts"]) == after["totals"]["requests"]
    assert SECRET not in json.dumps(after)
    assert _traffic(serve_url, recent=1)["recent"]["requests"] == shapes[-1:]

    metrics = httpx.get(f"{serve_url}/metrics", timeout=30).text
    for name in ("llm_request_prompt_tokens", "llm_request_generation_tokens", "llm_request_params_n"):
        assert f"# TYPE {name} histogram" in metrics
        assert _histogram_count(metrics, name) == _histogram_count(metrics_before, name) + 3, name
    assert re.search(r'^llm_request_params_n_bucket\{le="2\.0"[^}]*\} \S+$', metrics, re.M)


@pytest.mark.serve
def test_traffic_refuses_bad_input_with_openai_error_json(serve_url: str) -> None:
    resp = httpx.get(f"{serve_url}/traffic", params={"recent": "-1"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "recent", resp.text
