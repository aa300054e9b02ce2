"""The synthetic trace maker (measure/traces.py): valid Mooncake lines that the replay reads back, turns that
share their session's earlier blocks, agent sessions that share the long prefix, the same lines for a seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from measure.replay import Arrivals, load_file
from measure.traces import DEFAULT_REQUESTS, Shape, TraceSpec, main, make_trace
from serving.engine.mooncake import BLOCK_TOKENS, TraceLine, blocks_of, jsonl

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shape", list(Shape))
def test_lines_are_mooncake_and_replay_reads_them(shape: Shape, tmp_path: Path) -> None:
    lines = make_trace(TraceSpec(shape, 24, duration_s=30.0))
    path = tmp_path / "t.jsonl"
    path.write_text(jsonl(lines))
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        assert list(line) == ["timestamp", "input_length", "output_length", "hash_ids"]
        parsed = TraceLine.parse(line)
        assert len(parsed.hash_ids) == blocks_of(parsed.input_length)
    times = [line.timestamp_ms for line in lines]
    assert times == sorted(times) and times[0] == 0 and times[-1] == pytest.approx(30_000)
    workload = load_file(path)
    assert workload.arrivals is Arrivals.open and len(workload.requests) == 24


def test_chat_turns_start_with_their_conversations_earlier_blocks() -> None:
    lines = make_trace(TraceSpec(Shape.chat, 40))
    assert all(1 <= line.output_length <= 400 for line in lines)
    assert 500 <= min(line.input_length for line in lines) and max(line.input_length for line in lines) <= 4000
    follow_ups = 0
    for i, line in enumerate(lines):
        earlier = [e for e in lines[:i] if e.hash_ids[0] == line.hash_ids[0] and e.input_length >= BLOCK_TOKENS]
        if earlier:  # a later turn: it starts with every whole block of its conversation's last prompt
            last = earlier[-1]
            whole = last.input_length // BLOCK_TOKENS
            assert line.hash_ids[:whole] == last.hash_ids[:whole] and line.input_length > last.input_length
            follow_ups += 1
    assert follow_ups >= 10
    firsts = {line.hash_ids[0] for line in lines}
    assert len(firsts) >= 6  # several conversations, interleaved


def test_agent_sessions_share_the_long_prefix() -> None:
    lines = make_trace(TraceSpec(Shape.agent, DEFAULT_REQUESTS[Shape.agent]))
    prefix = min(len(line.hash_ids) for line in lines) - 1
    assert prefix * BLOCK_TOKENS >= 7000  # 8-16k tokens of system prompt and tools, in whole blocks
    assert len({line.hash_ids[:prefix] for line in lines}) == 1
    assert all(50 <= line.output_length <= 200 for line in lines)
    assert len({line.hash_ids[prefix] for line in lines}) < len(lines)  # sessions go on: later turns share more


def test_seeded_and_scaled() -> None:
    spec = TraceSpec(Shape.agent, 12, length_scale=0.25, seed=3)
    assert make_trace(spec) == make_trace(spec)
    assert make_trace(spec) != make_trace(TraceSpec(Shape.agent, 12, length_scale=0.25, seed=4))
    full = make_trace(TraceSpec(Shape.agent, 12, seed=3))
    for f, s in zip(full, make_trace(spec), strict=True):  # the same draws, each length rounded once or twice
        assert abs(f.input_length * 0.25 - s.input_length) <= 2 and abs(f.output_length * 0.25 - s.output_length) <= 1
    with pytest.raises(ValueError):
        TraceSpec(Shape.chat, 0)


def test_command_writes_both_shapes(tmp_path: Path) -> None:
    assert main(["--out-dir", str(tmp_path), "--requests", "5", "--length-scale", "0.1", "--duration", "4"]) == 0
    for shape in Shape:
        assert len((tmp_path / f"{shape.value}.jsonl").read_text().splitlines()) == 5
    with pytest.raises(SystemExit):
        main(["--out-dir", str(tmp_path), "--length-scale", "0"])
