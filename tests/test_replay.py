"""Traffic workloads and their replay (measure/replay.py): the built-in workloads, recorded and file workloads,
Poisson pacing, token prompts of exact lengths with shared prefixes, and the replayer's open and closed loops
on a fake token target (no engine: the target is a protocol)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from measure.metrics import StreamRecord
from measure.replay import (DEFAULT_CONCURRENCY, SAMPLED_TEMPERATURE, Arrivals, Builtin, PromptBuilder, ReplayFigures,
                            Replayer, ReplayRequest, TrafficWorkload, builtin, from_shapes, load_file)
from measure.slo import Slo
from serving.engine.request import FinishReason
from serving.engine.traffic import RequestKind, RequestShape, TrafficRecord

pytestmark = pytest.mark.unit

real_sleep = asyncio.sleep  # the fake target's own pauses, whatever a test patches asyncio.sleep with
FILLER = " ".join(f"w{i}" for i in range(1000))  # 1000 distinct words: 1000 distinct token ids


def word_ids(text: str) -> list[int]:
    """A deterministic stand-in tokenizer: one token per whitespace word, its id a hash of the word."""
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") for w in text.split()]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two prompts share (what a slot's prefix cache would find)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def workload(*requests: ReplayRequest, arrivals: Arrivals = Arrivals.closed, concurrency: int = 2,
             rate_scale: float = 1.0) -> TrafficWorkload:
    return TrafficWorkload("test", "constructed", requests, arrivals=arrivals, concurrency=concurrency,
                           rate_scale=rate_scale)


class FakeTarget:
    """A TokenTarget that generates `max_tokens` one-token chunks, pausing `pause_s` per token, and counts how
    many requests it holds at once. Requests are told apart by their prompt length:
    `fail` maps a prompt length to the exception its request raises, `empty` lists prompt lengths answered
    with a stream that produced nothing; `ttft` maps a prompt length to a made-up TTFT (the chunk times are
    then synthetic too: first at t_start + ttft, then one each `gap_s`); `block` maps a prompt length to
    seconds its call holds the event loop (time.sleep) right after stamping its start."""

    name = "fake"

    def __init__(self, pause_s: float = 0.002, fail: dict[int, Exception] | None = None,
                 empty: Sequence[int] = (), ttft: dict[int, float] | None = None, gap_s: float = 0.02,
                 block: dict[int, float] | None = None) -> None:
        self.pause_s, self.fail, self.empty, self.block = pause_s, fail or {}, set(empty), block or {}
        self.ttft, self.gap_s = ttft or {}, gap_s
        self.in_flight = self.most_in_flight = 0
        self.calls: list[tuple[float, int, int, float, int]] = []  # (start, prompt length, max_tokens, temp, n)

    def tokenize(self, text: str) -> list[int]:
        return word_ids(text)

    async def run_tokens(self, tokens: list[int], max_tokens: int, temperature: float, n: int) -> StreamRecord:
        record = StreamRecord(t_start=time.perf_counter())
        self.calls.append((record.t_start, len(tokens), max_tokens, temperature, n))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(self.block.get(len(tokens), 0.0))  # as a synchronous submit would: nothing else runs
        try:
            for _ in range(max_tokens):
                await real_sleep(self.pause_s)
                if len(tokens) not in self.ttft:
                    record.add_output(time.perf_counter(), n, "x" * n)
            if len(tokens) in self.fail:
                raise self.fail[len(tokens)]
            if len(tokens) in self.empty:
                return StreamRecord(t_start=record.t_start, t_end=time.perf_counter())
            if len(tokens) in self.ttft:
                first = record.t_start + self.ttft[len(tokens)]
                for i in range(max_tokens):
                    record.add_output(first + i * self.gap_s, n, "x" * n)
            record.completion_tokens, record.finish_reason = max_tokens * n, "length"
            record.t_end = record.output_times[-1]
            return record
        finally:
            self.in_flight -= 1


def replay(work: TrafficWorkload, target: FakeTarget, slo: str = "ttft_p95=10s", salt: int = 0) -> ReplayFigures:
    return asyncio.run(Replayer(work, Slo.parse(slo), FILLER, salt=salt).run(target))


# -- built-in workloads ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", list(Builtin))
def test_builtin_workloads_are_deterministic_for_a_seed(which: Builtin) -> None:
    """The same seed, the same requests (a study compares configs on one workload); another seed, others.
    Closed loop at the default concurrency, as documented."""
    work = builtin(which, 40, seed=1)
    assert work == builtin(which, 40, seed=1)
    assert work.requests != builtin(which, 40, seed=2).requests
    assert len(work.requests) == 40 and work.name == which.value
    assert work.arrivals is Arrivals.closed and work.concurrency == DEFAULT_CONCURRENCY
    assert all(r.arrival_s == 0.0 for r in work.requests) and work.rate_per_s is None


def test_chat_is_a_32_token_system_prompt_and_short_questions_with_long_answers() -> None:
    """The lengths the chat workload documents: 32 shared tokens, a capped lognormal question and answer."""
    requests = builtin(Builtin.chat, 400, seed=0).requests
    assert all(r.prefix_tokens == 32 and r.group == 0 and r.kind is RequestKind.sampled for r in requests)
    assert all(33 <= r.prompt_tokens <= 32 + 600 and 1 <= r.output_tokens <= 600 for r in requests)
    assert 100 < statistics.median(r.prompt_tokens - 32 for r in requests) < 140  # the ~120-token question
    assert 210 < statistics.median(r.output_tokens for r in requests) < 290  # the ~250-token answer


def test_rag_is_long_prompts_and_short_answers() -> None:
    """2000-6000-token prompts (200 of them shared instructions), 32-128-token answers, the whole range used."""
    requests = builtin(Builtin.rag, 400, seed=0).requests
    assert all(2000 <= r.prompt_tokens <= 6000 and 32 <= r.output_tokens <= 128 for r in requests)
    assert all(r.prefix_tokens == 200 and r.kind is RequestKind.greedy for r in requests)
    assert min(r.prompt_tokens for r in requests) < 2500 and max(r.prompt_tokens for r in requests) > 5500


def test_agent_turns_grow_over_their_sessions_prefix_and_sessions_interleave() -> None:
    """Each session (prefix group) is 4-8 turns; turn 1 is 1500 + 150..400 tokens, each next one 150..400 more,
    all of it the session's shared stream (prefix == prompt), so each turn contains the last. Sessions take
    turns (round robin), as concurrent clients would send them."""
    requests = builtin(Builtin.agent, 64, seed=5).requests
    assert len(requests) == 64
    assert all(r.prefix_tokens == r.prompt_tokens and r.group >= 1 for r in requests)
    assert all(40 <= r.output_tokens <= 160 for r in requests)
    groups = sorted({r.group for r in requests})
    assert groups == list(range(1, len(groups) + 1)) and len(groups) >= 64 // 8
    for g in groups:
        lengths = [r.prompt_tokens for r in requests if r.group == g]
        assert 1650 <= lengths[0] <= 1900
        assert all(150 <= b - a <= 400 for a, b in zip(lengths, lengths[1:], strict=False)), (g, lengths)
        assert len(lengths) <= 8 and (len(lengths) >= 4 or g == groups[-1])  # the last may be cut at the count
    assert [r.group for r in requests[:len(groups)]] == groups  # every session's first turn before any second


def test_max_context_is_the_prompt_plus_one_choices_share_of_the_output() -> None:
    """Two choices of 9 output tokens: each holds ceil(9 / 2) = 5 in its slot, beside its 100-token prompt."""
    work = workload(ReplayRequest(100, 9, n=2), ReplayRequest(103, 1), ReplayRequest(50, 40))
    assert work.max_context == 105 and work.max_choices == 2
    assert [r.context_tokens for r in work.requests] == [105, 104, 90]


def test_requests_and_workloads_reject_what_cannot_be_replayed() -> None:
    """Impossible shapes fail where they are made, not half-way through a replay."""
    with pytest.raises(ValueError, match="prefix_tokens 11 outside"):
        ReplayRequest(10, 5, prefix_tokens=11)
    with pytest.raises(ValueError, match="needs a prompt"):
        ReplayRequest(0, 5)
    with pytest.raises(ValueError, match="holds no request"):
        workload()
    with pytest.raises(ValueError, match="concurrency >= 1"):
        workload(ReplayRequest(10, 5), concurrency=0)


# -- recorded traffic -------------------------------------------------------------------------------------------
def shapes() -> list[RequestShape]:
    """Three recorded requests, out of order: wall-clock arrivals, a cache hit, one hit covering the whole
    prompt, a constrained one with two choices that produced nothing."""
    return [
        RequestShape(1000.5, RequestKind.greedy, prompt_tokens=80, cached_tokens=40, output_tokens=20),
        RequestShape(1000.0, RequestKind.sampled, prompt_tokens=50, cached_tokens=0, output_tokens=10),
        RequestShape(1002.0, RequestKind.constrained, prompt_tokens=100, cached_tokens=100, output_tokens=0, n=2,
                     max_tokens=64, finish=FinishReason.length, streamed=True),
    ]


def test_from_shapes_keeps_the_gaps_between_arrivals_and_the_cached_share() -> None:
    """Arrival times become offsets from the first; cached tokens become the shared prefix (always leaving a
    token of the prompt to evaluate); a constrained request replays as sampled; one that produced nothing asks
    for a token per choice. Open loop: a recorded traffic is replayed at its own pace."""
    work = from_shapes(shapes(), "recorded", "GET /traffic")
    assert work.arrivals is Arrivals.open
    assert [r.arrival_s for r in work.requests] == [0.0, 0.5, 2.0]
    assert [r.prompt_tokens for r in work.requests] == [50, 80, 100]
    assert [r.prefix_tokens for r in work.requests] == [0, 40, 99]
    assert all(r.prefix_tokens < r.prompt_tokens for r in work.requests)
    assert [r.kind for r in work.requests] == [RequestKind.sampled, RequestKind.greedy, RequestKind.sampled]
    assert [(r.output_tokens, r.n) for r in work.requests] == [(10, 1), (20, 1), (2, 2)]
    assert work.span_s == 2.0 and work.rate_per_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no request recorded"):
        from_shapes([], "recorded", "GET /traffic")


def write_lines(path: Path, lines: Sequence[Any]) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_load_file_with_arrivals_is_an_open_loop_in_arrival_order(tmp_path: Path) -> None:
    """Every line timed: open loop, sorted by arrival, offsets from the first; optional keys read."""
    path = write_lines(tmp_path / "peak.jsonl", [
        {"prompt_tokens": 30, "output_tokens": 5, "arrival": 12.5},
        "",  # blank lines are skipped
        {"prompt_tokens": 20, "output_tokens": 4, "arrival": 10.0, "prefix_tokens": 8, "group": 3},
        {"prompt_tokens": 40, "output_tokens": 6, "arrival": 11.0, "kind": "sampled", "n": 3},
    ])
    work = load_file(path)
    assert work.name == "peak" and work.arrivals is Arrivals.open and str(path) in work.source
    assert [(r.arrival_s, r.prompt_tokens) for r in work.requests] == [(0.0, 20), (1.0, 40), (2.5, 30)]
    assert (work.requests[0].prefix_tokens, work.requests[0].group) == (8, 3)
    assert (work.requests[1].kind, work.requests[1].n) == (RequestKind.sampled, 3)


def test_load_file_without_arrivals_is_a_closed_loop(tmp_path: Path) -> None:
    """Without an arrival on every line there is no pace to keep: closed loop, in file order."""
    path = write_lines(tmp_path / "mix.jsonl", [
        {"prompt_tokens": 30, "output_tokens": 5, "arrival": 3.0},
        {"prompt_tokens": 20, "output_tokens": 4, "cached_tokens": 25},
    ])
    work = load_file(path)
    assert work.arrivals is Arrivals.closed
    assert [(r.prompt_tokens, r.arrival_s) for r in work.requests] == [(30, 0.0), (20, 0.0)]
    assert work.requests[1].prefix_tokens == 19  # a cache hit over the whole prompt leaves one token


@pytest.mark.parametrize(("lines", "message"), [
    ([{"prompt_tokens": 3, "output_tokens": 1}, {"prompt_tokens": 3}, {"prompt_tokens": 3, "output_tokens": 1}],
     r"line 2: missing output_tokens"),
    ([{"prompt_tokens": 3, "output_tokens": 1}, "", "{not json"], r"line 3: "),
    (["[1, 2]"], r"line 1: each line is a JSON object"),
    ([{"prompt_tokens": 3, "output_tokens": 1, "kind": "creative"}], r"line 1: 'creative' is not a valid"),
    ([{"prompt_tokens": 3, "output_tokens": 1, "prefix_tokens": 2, "group": None}], r"line 1: "),
    (["", "  "], r"no request in it"),
])
def test_load_file_names_the_bad_line(tmp_path: Path, lines: list[Any], message: str) -> None:
    """A hand-written file's mistake is reported with its line number (blank lines count)."""
    with pytest.raises(ValueError, match=message):
        load_file(write_lines(tmp_path / "bad.jsonl", lines))


def test_load_file_names_the_line_of_a_bad_arrival(tmp_path: Path) -> None:
    """An unreadable arrival is a bad line like any other: its number is in the error."""
    path = write_lines(tmp_path / "bad.jsonl", [{"prompt_tokens": 3, "output_tokens": 1, "arrival": 1.0},
                                                {"prompt_tokens": 3, "output_tokens": 1, "arrival": "soon"}])
    with pytest.raises(ValueError, match="line 2"):
        load_file(path)


def test_load_file_of_a_missing_file_is_a_value_error(tmp_path: Path) -> None:
    """The CLI turns ValueErrors into messages: an unreadable file is one too."""
    with pytest.raises(ValueError, match="workload file"):
        load_file(tmp_path / "absent.jsonl")


def test_traffic_recent_requests_load_as_they_replay_from_the_record(tmp_path: Path) -> None:
    """GET /traffic's `recent.requests` entries, written one a line (extra keys max_tokens, possibly null,
    finish and streamed included), load as the same workload as the shapes themselves."""
    record = TrafficRecord()
    for shape in shapes():
        record.add(shape)
    entries = record.summary("r1").as_dict()["recent"]["requests"]
    assert set(entries[0]) == {"arrival", "kind", "prompt_tokens", "cached_tokens", "output_tokens", "n",
                               "max_tokens", "finish", "streamed"}
    assert entries[0]["max_tokens"] is None
    work = load_file(write_lines(tmp_path / "traffic.jsonl", entries))
    assert work.arrivals is Arrivals.open
    assert work.requests == from_shapes(shapes(), "recorded", "GET /traffic").requests


def test_a_literal_traffic_line_loads(tmp_path: Path) -> None:
    """One /traffic entry as a user would paste it: null max_tokens, constrained kind, a cache hit."""
    line = ('{"arrival": 1717000000.25, "kind": "constrained", "prompt_tokens": 412, "cached_tokens": 256, '
            '"output_tokens": 37, "n": 1, "max_tokens": null, "finish": "stop", "streamed": true}')
    (request,) = load_file(write_lines(tmp_path / "one.jsonl", [line])).requests
    assert request == ReplayRequest(prompt_tokens=412, output_tokens=37, prefix_tokens=256, kind=RequestKind.sampled)


# -- pacing -----------------------------------------------------------------------------------------------------
def test_paced_at_a_rate_draws_poisson_arrivals() -> None:
    """500 requests at 20/s: arrivals from 0, in order, mean gap 1/20 s (within 15%: the standard error of a
    mean of 499 exponential gaps is 4.5%), gaps spread as an exponential's (as many as large as the mean:
    coefficient of variation about 1); the same seed, the same times; the shapes are untouched."""
    base = builtin(Builtin.chat, 500, seed=0)
    work = base.paced(Arrivals.open, rate_per_s=20.0, seed=3)
    times = [r.arrival_s for r in work.requests]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert work.arrivals is Arrivals.open and times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.15)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.2)
    assert work.rate_per_s == pytest.approx(20.0, rel=0.15)
    assert work == base.paced(Arrivals.open, rate_per_s=20.0, seed=3)
    assert work != base.paced(Arrivals.open, rate_per_s=20.0, seed=4)
    assert [r.prompt_tokens for r in work.requests] == [r.prompt_tokens for r in base.requests]


def test_paced_without_a_rate_keeps_the_recorded_times() -> None:
    """Changing how requests are sent (loop, clients, speed) keeps the recorded shapes and times."""
    work = from_shapes(shapes(), "recorded", "GET /traffic")
    closed = work.paced(Arrivals.closed, concurrency=7)
    assert closed.arrivals is Arrivals.closed and closed.concurrency == 7 and closed.requests == work.requests
    faster = work.paced(Arrivals.open, rate_scale=2.0)
    assert faster.rate_scale == 2.0 and faster.requests == work.requests and faster.concurrency == work.concurrency
    assert "2.00 requests/s (recorded x2)" in faster.describe()
    assert work.taking(2).requests == work.requests[:2] and work.taking(99).requests == work.requests


# -- prompts ------------------------------------------------------------------------------------------------------
def builder(salt: int = 0) -> PromptBuilder:
    return PromptBuilder(FakeTarget(), FILLER, salt)


def test_prompts_have_exactly_the_requested_length() -> None:
    """Any mix of prompt and prefix lengths, longer than the filler too (it wraps around)."""
    b = builder()
    for prompt, prefix, group in ((1, 0, 0), (1, 1, 0), (5, 0, 0), (80, 40, 1), (80, 80, 1), (2500, 1200, 2),
                                  (3000, 0, 0), (3, 3, 4)):
        tokens = b.prompt(ReplayRequest(prompt, 4, prefix_tokens=prefix, group=group), number=prompt + prefix)
        assert len(tokens) == prompt, (prompt, prefix, group)


def test_one_groups_requests_share_their_common_prefix() -> None:
    """Group 1, prefixes 50 and 30: the first 30 tokens are the same, then one continues the shared stream and
    the other starts its own tokens."""
    b = builder()
    a = b.prompt(ReplayRequest(80, 4, prefix_tokens=50, group=1), 0)
    c = b.prompt(ReplayRequest(90, 4, prefix_tokens=30, group=1), 1)
    assert common_prefix(a, c) == 30


def test_a_prompt_does_not_depend_on_what_was_built_before() -> None:
    """A group's stream grows when a longer prefix is asked for: the shorter prefixes built before are its
    beginning, so the order requests are built in changes no prompt."""
    short, long = ReplayRequest(60, 4, prefix_tokens=20, group=1), ReplayRequest(300, 4, prefix_tokens=250, group=1)
    first = builder()
    one_way = (first.prompt(short, 0), first.prompt(long, 1))
    second = builder()
    other_way = (second.prompt(long, 1), second.prompt(short, 0))
    assert one_way == tuple(reversed(other_way))
    assert one_way[1][:20] == one_way[0][:20]


def test_agent_turns_contain_the_previous_turn() -> None:
    """Built through the prompt builder, each agent turn's prompt starts with the whole previous turn of its
    session (a slot holding that turn finds all of it cached)."""
    b = builder()
    requests = builtin(Builtin.agent, 24, seed=1).requests
    prompts = [b.prompt(r, i) for i, r in enumerate(requests)]
    for g in {r.group for r in requests}:
        turns = [p for p, r in zip(prompts, requests, strict=True) if r.group == g]
        for before, after in zip(turns, turns[1:], strict=False):
            assert after[:len(before)] == before


def test_one_groups_requests_differ_right_after_an_equal_prefix() -> None:
    """Two requests of group 1 with 40 prefix tokens each share exactly those 40 and no more."""
    b = builder()
    a = b.prompt(ReplayRequest(80, 4, prefix_tokens=40, group=1), 0)
    c = b.prompt(ReplayRequest(80, 4, prefix_tokens=40, group=1), 1)
    assert common_prefix(a, c) == 40


def test_requests_without_a_prefix_differ_at_token_0() -> None:
    """Two requests without a shared prefix: a prefix cache finds nothing of one in the other."""
    b = builder()
    assert common_prefix(b.prompt(ReplayRequest(50, 4), 0), b.prompt(ReplayRequest(50, 4), 1)) == 0


def test_runs_with_different_salts_share_nothing_at_the_start() -> None:
    """Every run gets its own salt "so one run never finds another's prefixes cached"."""
    request = ReplayRequest(50, 4, prefix_tokens=30, group=1)
    assert common_prefix(builder(salt=1).prompt(request, 0), builder(salt=2).prompt(request, 0)) == 0


# -- replaying --------------------------------------------------------------------------------------------------
def test_closed_loop_never_holds_more_than_concurrency_requests() -> None:
    """12 requests, 3 clients: the target holds 3 at once at most (and does reach 3); every request is sent
    once, with its exact prompt length, its output split over its choices, its kind's temperature."""
    requests = [ReplayRequest(10 + i, 3 * (1 + i % 2), n=1 + i % 2,
                              kind=RequestKind.sampled if i % 3 == 0 else RequestKind.greedy) for i in range(12)]
    target = FakeTarget()
    figures = replay(workload(*requests, concurrency=3), target)
    assert target.most_in_flight == 3
    assert figures.requests == 12 and figures.failed == 0 and figures.errors == ()
    sent = {length: (max_tokens, temp, n) for _, length, max_tokens, temp, n in target.calls}
    assert len(target.calls) == 12
    assert sent == {r.prompt_tokens: (3, SAMPLED_TEMPERATURE if r.kind is RequestKind.sampled else 0.0, r.n)
                    for r in requests}


def test_closed_loop_with_one_client_sends_in_order_one_at_a_time() -> None:
    """One client: the workload's order, each request after the last one ended."""
    target = FakeTarget()
    replay(workload(*(ReplayRequest(20 - i, 2) for i in range(6)), concurrency=1), target)
    assert target.most_in_flight == 1
    assert [length for _, length, *_ in target.calls] == [20, 19, 18, 17, 16, 15]


def test_open_loop_starts_each_request_no_earlier_than_its_arrival() -> None:
    """Listed out of order, arrivals 0.2, 0, 0.1, 0.3 s: the target sees them in arrival order, none started
    more than 50 ms before it was due (the replay's clock starts after this test's `before`)."""
    arrivals = {10: 0.2, 11: 0.0, 12: 0.1, 13: 0.3}
    target = FakeTarget()
    before = time.perf_counter()
    figures = replay(workload(*(ReplayRequest(p, 2, arrival_s=a) for p, a in arrivals.items()),
                              arrivals=Arrivals.open), target)
    assert figures.failed == 0
    started = {length: start - before for start, length, *_ in target.calls}
    assert sorted(started, key=started.__getitem__) == [11, 12, 10, 13]
    for length, due in arrivals.items():
        assert started[length] >= due - 0.05, (length, started[length], due)


def test_open_loop_divides_arrivals_by_rate_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """At rate_scale 3, arrivals 0, 0.3 and 0.6 s are due at 0, 0.1 and 0.2 s: the replayer waits that long
    (seen through asyncio.sleep), and the last one does not start before 0.15 s."""
    waits: list[float] = []
    replaying = threading.get_ident()

    async def recording_sleep(delay: float, result: Any = None) -> Any:
        if threading.get_ident() == replaying:  # another test's thread left running may sleep too
            waits.append(delay)
        return await real_sleep(delay, result)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    target = FakeTarget()
    before = time.perf_counter()
    replay(workload(*(ReplayRequest(10 + i, 2, arrival_s=0.3 * i) for i in range(3)), arrivals=Arrivals.open,
                    rate_scale=3.0), target)
    assert len(waits) == 3
    assert waits == pytest.approx([0.0, 0.1, 0.2], abs=0.05)  # not 0.3 / 0.6 (unscaled)
    assert all(w <= due + 1e-6 for w, due in zip(waits, (0.0, 0.1, 0.2), strict=True))
    assert {length: start - before for start, length, *_ in target.calls}[12] >= 0.15


def test_open_loop_latencies_count_from_the_due_time() -> None:
    """Request A (due at 0) holds the event loop for 0.2 s; request B, due at 0.02 s, can start only then.
    Both answer in about 2 ms of their own (made-up times), but B's TTFT and E2E "from the client's clock
    (arrival = when it was due)" include the ~0.18 s it waited to be sent (else an open loop hides the
    lateness a slow client side adds: coordinated omission)."""
    target = FakeTarget(ttft={10: 0.001, 11: 0.001}, gap_s=0.001, block={10: 0.2})
    figures = replay(workload(ReplayRequest(10, 2, arrival_s=0.0), ReplayRequest(11, 2, arrival_s=0.02),
                              arrivals=Arrivals.open), target)
    starts = {length: start for start, length, *_ in target.calls}
    assert starts[11] - starts[10] >= 0.15  # B did start late
    assert figures.percentiles["e2e_p99"].value >= 0.1
    assert figures.percentiles["ttft_p99"].value >= 0.1


def test_a_failing_request_is_an_outcome_not_the_runs_end() -> None:
    """Of six requests, one raises and one streams nothing: both count as failed, with their errors listed;
    the other four succeed, and the SLO is missed with a violation of at least 1."""
    target = FakeTarget(fail={12: RuntimeError("boom")}, empty=[14])
    figures = replay(workload(*(ReplayRequest(10 + i, 2) for i in range(6)), concurrency=2), target)
    assert figures.requests == 6 and figures.failed == 2
    assert figures.errors == ("RuntimeError: boom", "StreamError: the stream produced no output") or \
        figures.errors == ("StreamError: the stream produced no output", "RuntimeError: boom")
    assert figures.throughput_rps * figures.wall_s == pytest.approx(4)
    assert figures.output_tok_s * figures.wall_s == pytest.approx(4 * 2)
    assert not figures.slo.met and figures.slo.failed == 2 and figures.slo.violation >= 1.0


def test_goodput_counts_only_the_good_requests() -> None:
    """Six requests, two with a (made-up) TTFT of 2 s, four of 10 ms, under ttft_p50=1s: four are good.
    Goodput is those four (and their tokens) per second of the run; throughput all six. The percentiles are
    the made-up latencies: TTFT p50 10 ms, every gap 20 ms."""
    ttft = {10: 0.01, 11: 2.0, 12: 0.01, 13: 0.01, 14: 2.0, 15: 0.01}
    target = FakeTarget(ttft=ttft, gap_s=0.02)
    work = workload(*(ReplayRequest(p, 3 + i) for i, p in enumerate(ttft)), concurrency=3)
    figures = replay(work, target, slo="ttft_p50=1s")
    wall = figures.wall_s
    assert figures.failed == 0 and figures.slo.good == 4 and figures.slo.met
    assert figures.goodput_rps * wall == pytest.approx(4) and figures.throughput_rps * wall == pytest.approx(6)
    assert figures.goodput_tok_s * wall == pytest.approx(sum(r.output_tokens for r in work.requests
                                                             if ttft[r.prompt_tokens] < 1))
    assert figures.output_tok_s * wall == pytest.approx(sum(r.output_tokens for r in work.requests))
    assert figures.goodput_rps <= figures.throughput_rps and figures.goodput_tok_s <= figures.output_tok_s
    assert figures.percentiles["ttft_p50"].value == pytest.approx(0.01, abs=2e-3)  # from due, a hair earlier
    assert figures.percentiles["itl_p99"].value == pytest.approx(0.02)
    assert figures.percentiles["e2e_p95"].value >= 2.0
    assert set(figures.percentiles) == {f"{m}_p{p}" for m in ("ttft", "itl", "e2e") for p in (50, 95, 99)}


def test_a_tight_slo_leaves_no_goodput() -> None:
    """Every TTFT (0.5 s, made up) over a 100 ms bound: throughput but no goodput, violation 0.5 / 0.1 - 1."""
    figures = replay(workload(ReplayRequest(10, 3), ReplayRequest(11, 3)), FakeTarget(ttft={10: 0.5, 11: 0.5}),
                     slo="ttft_p50=100ms")
    assert figures.goodput_rps == 0.0 and figures.throughput_rps > 0 and not figures.slo.met
    assert figures.slo.violation == pytest.approx(0.5 / 0.1 - 1, abs=0.02)
