"""Unit tests of scripts/bench_serving.py parts that need no server: SSE parsing, metric arithmetic, percentiles.

The recorded streams mimic llama-server's byte layout (``data: {...}\\n\\n`` events, ``:`` pings, ``[DONE]``),
including its quirks: /v1/completions carries usage and timings in the finish chunk; chat opens with a
role-only delta and sends usage in a separate chunk with ``choices: []``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_serving", None)


def _event(obj) -> list[str]:
    return [f"data: {json.dumps(obj)}", ""]


def completions_stream() -> list[str]:
    """Three content chunks (the 2nd holds two tokens' text: UTF-8 held back), then the final usage chunk."""
    base = {"object": "text_completion", "model": "m", "id": "cmpl-1", "system_fingerprint": "b1-0c1e570"}
    lines: list[str] = []
    for text in ("Hello", " wörld", "!"):
        lines += _event({**base, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}]})
    lines += [":", ""]  # SSE ping (comment)
    lines += _event({**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
                     "usage": {"completion_tokens": 4, "prompt_tokens": 9, "total_tokens": 13},
                     "timings": {"predicted_per_second": 123.5, "predicted_n": 4}})
    lines += ["data: [DONE]", ""]
    return lines


def chat_stream() -> list[str]:
    base = {"object": "chat.completion.chunk", "model": "m", "id": "chatcmpl-1"}
    lines = _event({**base, "choices": [{"index": 0, "finish_reason": None,
                                         "delta": {"role": "assistant", "content": None}}]})
    for text in ("A", "B"):
        lines += _event({**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"content": text}}]})
    lines += _event({**base, "choices": [{"index": 0, "finish_reason": "length", "delta": {}}]})
    lines += _event({**base, "choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}})
    return lines + ["data: [DONE]", ""]


def test_sse_decoder_handles_comments_multiline_and_missing_final_blank(bench):
    lines = [": ping", "", "event: x", "data: {\"a\":", "data: 1}", "", "data:no-space"]
    assert list(bench.iter_sse_data(lines)) == ['{"a":\n1}', "no-space"]


def test_completions_stream_parsing(bench):
    payloads = list(bench.iter_sse_data(completions_stream()))
    assert payloads[-1] == "[DONE]"
    chunks = [bench.interpret_chunk(json.loads(p), "completions") for p in payloads[:-1]]
    assert [c.text for c in chunks] == ["Hello", " wörld", "!", ""]
    assert [c.has_output for c in chunks] == [True, True, True, False]
    final = chunks[-1]
    assert final.finish_reason == "length"
    assert final.usage["completion_tokens"] == 4
    assert final.timings["predicted_per_second"] == 123.5
    assert chunks[0].fingerprint == "b1-0c1e570"


def test_chat_stream_role_delta_is_not_output_and_usage_chunk_has_no_choices(bench):
    payloads = list(bench.iter_sse_data(chat_stream()))[:-1]
    chunks = [bench.interpret_chunk(json.loads(p), "chat") for p in payloads]
    assert [c.has_output for c in chunks] == [False, True, True, False, False]
    assert chunks[-1].usage == {"completion_tokens": 2, "prompt_tokens": 5}
    assert chunks[-2].finish_reason == "length"


def test_error_payload_raises(bench):
    with pytest.raises(bench.StreamError):
        bench.interpret_chunk({"error": {"code": 500, "message": "boom"}}, "completions")


def test_metrics_from_recorded_completions_stream(bench):
    """Usage says 4 tokens in 3 output chunks: weights are the average 4/3 per chunk."""
    record = bench.StreamRecord(t_start=10.0)
    times = iter([10.5, 10.6, 10.9, 11.0])
    for payload in list(bench.iter_sse_data(completions_stream()))[:-1]:
        record.absorb(bench.interpret_chunk(json.loads(payload), "completions"), next(times))
    m = bench.stream_metrics(record)
    assert m.completion_tokens == 4
    assert m.prompt_tokens == 9
    assert m.ttft_s == pytest.approx(0.5)
    assert m.decode_tok_s == pytest.approx(3 / 0.4)  # (4 - 1) / (10.9 - 10.5)
    assert m.itl_s == pytest.approx((0.1 * 3 / 4, 0.3 * 3 / 4))
    assert m.server_decode_tok_s == 123.5
    assert record.finish_reason == "length"


def test_metrics_with_explicit_token_counts_and_no_usage(bench):
    record = bench.StreamRecord(t_start=0.0)
    record.add_output(0.2, 1)
    record.add_output(0.3, 1)
    record.add_output(0.5, 4)  # an engine that batches 4 tokens into one chunk
    m = bench.stream_metrics(record)
    assert m.completion_tokens == 6
    assert m.itl_s == pytest.approx((0.1, 0.05))
    assert m.decode_tok_s == pytest.approx(5 / 0.3)


def test_metrics_fall_back_to_counting_chunks(bench):
    record = bench.StreamRecord(t_start=0.0)
    for t in (1.0, 1.5, 2.0):
        record.add_output(t, None)
    m = bench.stream_metrics(record)
    assert m.completion_tokens == 3
    assert m.decode_tok_s == pytest.approx(2.0)
    assert m.itl_s == pytest.approx((0.5, 0.5))


def test_stream_without_output_is_an_error(bench):
    with pytest.raises(bench.StreamError):
        bench.stream_metrics(bench.StreamRecord(t_start=0.0))


def test_round_summary_and_median(bench):
    s1 = bench.StreamMetrics(0.1, 10.0, 8, 5, (0.1, 0.2, 0.3), None)
    s2 = bench.StreamMetrics(0.3, 20.0, 6, 5, (0.4,), None)
    r = bench.round_summary([s1, s2], wall_s=2.0, expected_tokens=8)
    assert r["aggregate_tok_s"] == pytest.approx(7.0)
    assert r["decode_tok_s_per_stream"] == pytest.approx(15.0)
    assert r["ttft_ms_mean"] == pytest.approx(200.0)
    assert r["ttft_ms_max"] == pytest.approx(300.0)
    assert r["itl_ms_p50"] == pytest.approx(250.0)
    assert r["short_streams"] == 1
    assert r["server_decode_tok_s_per_stream"] is None
    med = bench.median_of_rounds([{**r, "aggregate_tok_s": x} for x in (5.0, 9.0, 7.5)])
    assert med["aggregate_tok_s"] == 7.5
    assert med["server_decode_tok_s_per_stream"] is None


def test_ratios(bench):
    r = bench.ratios({"aggregate_tok_s": 90.0, "ttft_ms_mean": 50.0, "itl_ms_p50": None},
                     {"aggregate_tok_s": 100.0, "ttft_ms_mean": 25.0, "itl_ms_p50": 2.0})
    assert r["aggregate_tok_s"] == pytest.approx(0.9)
    assert r["ttft_ms_mean"] == pytest.approx(2.0)
    assert r["itl_ms_p50"] is None


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (50, 2.5), (95, 3.85), (100, 4.0), (25, 1.75)])
def test_percentile_matches_linear_interpolation(bench, q, expected):
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_edge_cases(bench):
    assert math.isnan(bench.percentile([], 50))
    assert bench.percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        bench.percentile([1.0], 101)


def test_cli_helpers(bench):
    assert bench.parse_concurrency("1,4") == [1, 4]
    assert bench.check_loopback_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    assert bench.check_loopback_url("http://localhost:8000/v1") == "http://localhost:8000/v1"
    with pytest.raises(SystemExit):
        bench.check_loopback_url("http://10.0.0.1:8000/v1")
    assert bench.parse_scalar("4") == 4 and bench.parse_scalar("on") == "on"
    assert bench.parse_scalar("false") is False and bench.parse_scalar("q8_0") == "q8_0"
    assert len({bench.prompt_for(3, i) for i in range(40)}) == 40


def test_engine_config_yaml_keeps_on_off_as_strings(bench, tmp_path):
    cfg = tmp_path / "e.yaml"
    cfg.write_text("engine:\n  n_parallel: 2\n  flash_attn: on\n  type_k: q8_0\n")
    out = bench.load_engine_config(str(cfg), ["n_ctx=4096", "flash_attn=off"], model="/m.gguf")
    assert out == {"n_parallel": 2, "flash_attn": "off", "type_k": "q8_0", "n_ctx": 4096, "model": "/m.gguf"}
    cfg.write_text("flash_attn: on\nmodel: /x.gguf\n")
    assert bench.load_engine_config(str(cfg), [], model="/m.gguf") == {"flash_attn": "on", "model": "/x.gguf"}
