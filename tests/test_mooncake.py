"""Mooncake traces in and out (serving/engine/mooncake.py, measure/replay.py): a trace file loads as a workload
whose lines sharing leading hash_ids get prompts sharing those blocks' tokens; the recorded traffic exports as
a trace whose block ids share as the cache says prompts did; the export loads back; GET /traffic?format=mooncake
through the app's router (a stub replica: no Ray, no model)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from measure.metrics import StreamRecord
from measure.replay import Arrivals, PromptBuilder, Replayer, ReplayRequest, load_file
from measure.slo import Slo
from serving.engine.mooncake import BLOCK_TOKENS, MEDIA_TYPE, TraceLine, jsonl, trace_of
from serving.engine.traffic import RequestKind, RequestShape, TrafficRecord
from tests.test_replay import FILLER, FakeTarget, common_prefix, write_lines

B = BLOCK_TOKENS


def shape(arrival: float, prompt: int, cached: int = 0, output: int = 8) -> RequestShape:
    return RequestShape(arrival, RequestKind.greedy, prompt, cached, output)


def builder(salt: int = 0) -> PromptBuilder:
    return PromptBuilder(FakeTarget(), FILLER, salt)


# -- reading a trace ----------------------------------------------------------------------------------------------
TRACE = [  # the shape of Mooncake's tool-agent trace: a common first block, then two lines sharing 12 blocks
    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": list(range(14))},
    {"timestamp": 250, "input_length": 7322, "output_length": 490, "hash_ids": [0, *range(14, 28)]},
    {"timestamp": 1000, "input_length": 9013, "output_length": 3, "hash_ids": list(range(46, 64))},
    {"timestamp": 3000, "input_length": 6506, "output_length": 3, "hash_ids": [*range(46, 58), 64]},
    {"timestamp": 3000, "input_length": 300, "output_length": 0, "hash_ids": [99]},
]


@pytest.mark.unit
def test_a_mooncake_trace_loads_with_its_times_in_ms_and_its_shared_blocks(tmp_path: Path) -> None:
    work = load_file(write_lines(tmp_path / "toolagent.jsonl", TRACE))
    assert work.arrivals is Arrivals.open and work.name == "toolagent"
    assert [r.arrival_s for r in work.requests] == [0.0, 0.25, 1.0, 3.0, 3.0]
    assert [(r.prompt_tokens, r.output_tokens) for r in work.requests] == [
        (6758, 500), (7322, 490), (9013, 3), (6506, 3), (300, 1)]  # no output asks for one token
    assert work.requests[1].blocks == (0, *range(14, 28)) and work.requests[1].block_tokens == B
    assert [r.prefix_tokens for r in work.requests] == [0, B, 0, 12 * B, 0]  # leading blocks seen before
    assert all(r.kind is RequestKind.greedy and r.n == 1 for r in work.requests)
    assert "tokens shared" in work.describe()


@pytest.mark.unit
def test_a_trace_without_timestamps_is_a_closed_loop_in_file_order(tmp_path: Path) -> None:
    lines = [{k: v for k, v in line.items() if k != "timestamp"} for line in TRACE[:2]]
    work = load_file(write_lines(tmp_path / "untimed.jsonl", lines))
    assert work.arrivals is Arrivals.closed and [r.prompt_tokens for r in work.requests] == [6758, 7322]


@pytest.mark.unit
@pytest.mark.parametrize(("line", "message"), [
    ({"input_length": 10, "hash_ids": [0]}, "line 2: missing output_length"),
    ({"input_length": 10, "output_length": 1, "hash_ids": "0 1"}, "line 2: hash_ids is a list of integers"),
    ({"input_length": 0, "output_length": 1}, "line 2: input_length 0 < 1"),
])
def test_a_bad_trace_line_is_named(tmp_path: Path, line: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_file(write_lines(tmp_path / "bad.jsonl", [TRACE[0], line]))


@pytest.mark.unit
def test_lines_sharing_leading_hash_ids_get_prompts_sharing_those_blocks() -> None:
    """Exact lengths; equal leading ids, equal tokens, block by block; a differing id parts them at once;
    the same ids and length, the same prompt; another run's salt shares nothing."""
    b = builder()
    a = b.prompt(ReplayRequest(1300, 4, blocks=(0, 1, 2)), 0)
    c = b.prompt(ReplayRequest(1400, 4, blocks=(0, 1, 5)), 1)
    d = b.prompt(ReplayRequest(600, 4, blocks=(0, 7)), 2)
    e = b.prompt(ReplayRequest(100, 4, blocks=(9,)), 3)
    assert [len(p) for p in (a, c, d, e)] == [1300, 1400, 600, 100]
    assert common_prefix(a, c) == 2 * B and common_prefix(a, d) == B and common_prefix(a, e) == 0
    assert b.prompt(ReplayRequest(1300, 4, blocks=(0, 1, 2)), 7) == a
    assert common_prefix(builder(salt=1).prompt(ReplayRequest(1300, 4, blocks=(0, 1, 2)), 0), a) == 0


@pytest.mark.unit
def test_a_prompt_longer_than_its_blocks_ends_with_tokens_of_its_own() -> None:
    b = builder()
    x, y = (b.prompt(ReplayRequest(B + 40, 4, blocks=(3,)), number) for number in (0, 1))
    assert len(x) == len(y) == B + 40 and common_prefix(x, y) == B


@pytest.mark.unit
def test_scaled_lengths_keep_the_blocks_shared() -> None:
    """lengths_scaled shrinks the blocks with the prompts: two lines sharing a block still share all of it."""
    work = load_workload([TRACE[2], TRACE[3]]).lengths_scaled(0.25)
    first, second = work.requests
    assert first.block_tokens == B // 4 and second.prefix_tokens == 12 * B // 4
    b = builder()
    assert common_prefix(b.prompt(first, 0), b.prompt(second, 1)) == 12 * B // 4


def load_workload(lines: list[dict[str, Any]]) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return load_file(write_lines(Path(tmp) / "trace.jsonl", lines))


class RecordingTarget(FakeTarget):
    """A FakeTarget that keeps every prompt it is sent."""

    def __init__(self) -> None:
        super().__init__(pause_s=0.0)
        self.prompts: list[list[int]] = []

    async def run_tokens(self, tokens: list[int], max_tokens: int, temperature: float, n: int) -> StreamRecord:
        self.prompts.append(list(tokens))
        return await super().run_tokens(tokens, max_tokens, temperature, n)


@pytest.mark.unit
def test_a_replayed_trace_sends_prompts_that_share_the_traces_prefixes(tmp_path: Path) -> None:
    """The replayer (closed loop, one client: in file order) sends prompts whose common prefixes are the
    blocks their lines share."""
    lines = [{"input_length": 1200, "output_length": 2, "hash_ids": [1, 2, 3]},
             {"input_length": 1100, "output_length": 2, "hash_ids": [1, 2, 4]},
             {"input_length": 700, "output_length": 2, "hash_ids": [5, 6]}]
    work = load_file(write_lines(tmp_path / "t.jsonl", lines)).paced(Arrivals.closed, concurrency=1)
    target = RecordingTarget()
    figures = asyncio.run(Replayer(work, Slo.parse("ttft_p95=10s"), FILLER, salt=5).run(target))
    assert figures.failed == 0 and [len(p) for p in target.prompts] == [1200, 1100, 700]
    first, second, third = target.prompts
    assert common_prefix(first, second) == 2 * B and common_prefix(first, third) == 0


@pytest.mark.unit
def test_the_tuners_workload_flag_takes_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m tuning.search --workload TRACE.jsonl --slo ...`: the trace is what each trial replays, open loop
    at its recorded times, its shared blocks said in the workload line; --requests takes its first lines."""
    from tuning.options import parse_options
    from tuning.workloads import traffic_plan

    path = write_lines(tmp_path / "toolagent.jsonl", TRACE)
    opts, plan = traffic_plan(parse_options(["--workload", str(path), "--slo", "ttft_p95=2s", "--requests", "4",
                                             "--offline"]), None)
    assert plan is not None and opts.workload == str(path) and plan.workload.arrivals is Arrivals.open
    assert [r.blocks[:1] for r in plan.workload.requests] == [(0,), (0,), (46,), (46,)]
    assert "toolagent" in capsys.readouterr().out


# -- writing one --------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_requests_without_a_cache_hit_get_ids_of_their_own() -> None:
    lines = trace_of([shape(10.0, 1500), shape(10.5, 512), shape(11.0, 1)])
    assert [len(line.hash_ids) for line in lines] == [3, 1, 1]  # the last block partial
    ids = [i for line in lines for i in line.hash_ids]
    assert len(set(ids)) == len(ids)
    assert [line.timestamp_ms for line in lines] == [0.0, 500.0, 1000.0]


@pytest.mark.unit
def test_a_cache_hit_shares_its_whole_blocks_with_the_latest_earlier_prompt_long_enough() -> None:
    """Sessions A and B interleaved: each second turn found its first turn cached. A hit of 1100 tokens is two
    whole blocks; it links to the latest earlier prompt with two whole blocks (B's first turn, the latest
    long enough), a hit under a block shares nothing, a hit longer than any earlier prompt shares all its
    whole blocks."""
    a1, b1 = shape(0.0, 1500), shape(1.0, 1300)
    a2, b2 = shape(2.0, 1800, cached=1100), shape(3.0, 1600, cached=1400)
    small, long = shape(4.0, 900, cached=500), shape(5.0, 5000, cached=4000)
    lines = trace_of([b2, a1, small, a2, b1, long])  # any order: exported by arrival
    la1, lb1, la2, lb2, lsmall, llong = lines
    assert la2.hash_ids[:2] == lb1.hash_ids[:2] and la2.hash_ids[2] not in lb1.hash_ids
    assert lb2.hash_ids[:2] == la2.hash_ids[:2]  # the latest with two whole blocks is A's second turn
    assert not set(lsmall.hash_ids) & {i for line in lines[:4] for i in line.hash_ids}
    assert llong.hash_ids[:3] == lb2.hash_ids[:3]  # 7 blocks hit; the latest longest earlier prompt has 3 whole
    assert len(set(llong.hash_ids[3:])) == len(llong.hash_ids) - 3 == 7


@pytest.mark.unit
def test_a_line_writes_and_parses_as_mooncake_writes_it() -> None:
    line = TraceLine(300, 20, (4, 5), 1234.4)
    assert json.dumps(line.as_dict()) == '{"timestamp": 1234, "input_length": 300, "output_length": 20, ' \
                                         '"hash_ids": [4, 5]}'
    assert TraceLine.parse(line.as_dict()) == TraceLine(300, 20, (4, 5), 1234.0)
    text = jsonl([line, TraceLine(1, 1)])
    assert text.endswith("\n") and [json.loads(t) for t in text.splitlines()][1] == {
        "input_length": 1, "output_length": 1, "hash_ids": []}
    assert trace_of([]) == [] and jsonl([]) == ""


@pytest.mark.unit
def test_the_recorded_traffic_exported_loads_back_with_its_shapes_and_shared_blocks(tmp_path: Path) -> None:
    """Record -> trace -> workload: the same arrivals (ms), prompts and outputs; the cached prefixes in whole
    blocks; and the replayed prompts share exactly those."""
    record = TrafficRecord()
    for s in (shape(100.0, 2000), shape(100.25, 2600, cached=2100), shape(101.0, 700, cached=600),
              shape(101.5, 90, output=0)):
        record.add(s)
    summary = record.summary("r1")
    work = load_file(write_lines(tmp_path / "export.jsonl", jsonl(trace_of(summary.recent)).splitlines()))
    assert work.arrivals is Arrivals.open
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in work.requests] == [
        (0.0, 2000, 8), (0.25, 2600, 8), (1.0, 700, 8), (1.5, 90, 1)]
    assert [r.prefix_tokens for r in work.requests] == [0, 3 * B, B, 0]  # 4 blocks hit, 3 whole ones before
    b = builder()
    prompts = [b.prompt(r, i) for i, r in enumerate(work.requests)]
    assert common_prefix(prompts[0], prompts[1]) == 3 * B  # the first prompt's third block is partial: 3 shared
    assert common_prefix(prompts[1], prompts[2]) == B


# -- over the app's router ----------------------------------------------------------------------------------------
@pytest.mark.engine
def test_traffic_in_mooncake_format_through_the_router() -> None:
    """GET /traffic?format=mooncake: JSONL of the recent requests, the replicas not heard from in a header;
    recent= caps it; the JSON answer is unchanged; an unknown format is OpenAI's 400."""
    from starlette.testclient import TestClient

    from serving.openai.routes import build_api
    from serving.replica.control_routes import ControlRoutes

    record = TrafficRecord()
    for s in (shape(50.0, 1200), shape(50.5, 1300, cached=1100), shape(51.0, 40)):
        record.add(s)

    async def all_traffic() -> tuple[Any, int | None]:
        return record.summary("r1"), 1

    api = build_api(ControlRoutes(SimpleNamespace(all_traffic=all_traffic)).router())
    with TestClient(api) as http:
        resp = http.get("/traffic", params={"format": "mooncake"})
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(MEDIA_TYPE)
        assert resp.headers["x-replicas-missing"] == "1"
        lines = [json.loads(t) for t in resp.text.splitlines()]
        assert [(x["timestamp"], x["input_length"], x["output_length"]) for x in lines] == [
            (0, 1200, 8), (500, 1300, 8), (1000, 40, 8)]
        assert lines[1]["hash_ids"][:2] == lines[0]["hash_ids"][:2] and len(lines[1]["hash_ids"]) == 3
        last = http.get("/traffic", params={"format": "mooncake", "recent": 1})
        assert [json.loads(t)["input_length"] for t in last.text.splitlines()] == [40]
        assert http.get("/traffic", params={"format": "mooncake", "recent": 0}).text == ""
        summary = http.get("/traffic").json()
        assert summary["replicas_missing"] == 1 and summary["totals"]["requests"] == 3
        bad = http.get("/traffic", params={"format": "csv"})
        assert bad.status_code == 400 and "error" in bad.json()
        documented = http.get("/openapi.json").json()["paths"]["/traffic"]["get"]
        assert set(documented["responses"]["200"]["content"]) == {"application/json", MEDIA_TYPE}
        assert {"name": "format", "in": "query"}.items() <= documented["parameters"][1].items()
