"""The soak and fuzz scripts' pure logic (measure/soak.py, measure/api_fuzz.py: SSE parsing, judging outcomes,
/health, HAR analysis); no server."""

from __future__ import annotations

import pytest

from measure import api_fuzz as fuzz
from measure import loopback, soak

pytestmark = pytest.mark.unit


def outcome(**kw):
    base = {"kind": "chat", "stream": False, "status": 200}
    return soak.Outcome(**{**base, **kw})


def test_sse_lines() -> None:
    assert soak.parse_sse_data(": comment") is None
    assert soak.parse_sse_data("data: [DONE]") == ("done", None)
    assert soak.parse_sse_data('data: {"error": {"message": "boom"}}') == ("error", "boom")
    assert soak.parse_sse_data("data: {not json") == ("bad", "{not json")
    kind, obj = soak.parse_sse_data('data: {"choices": [{"delta": {"content": "Hi"}, "finish_reason": null}]}')
    assert kind == "chunk" and soak.chunk_text(obj) == ("Hi", None)
    assert soak.chunk_text({"choices": [{"text": "x", "finish_reason": "length"}]}) == ("x", "length")


def test_outcome_ok_and_label() -> None:
    assert outcome().ok and outcome().label == "200"
    assert outcome(stream=True, done=True).ok
    truncated = outcome(stream=True, done=False, events=3)
    assert not truncated.ok and truncated.label == "200-truncated"
    assert outcome(stream=True, done=True, error_event="x").label == "200-error-event"
    assert outcome(stream=True, dropped=True).label == "200"
    assert outcome(status=None, error="ReadTimeout(x)").label == "no-status:ReadTimeout"


def test_overload_accepts_200_and_openai_503_only() -> None:
    good = [outcome(), outcome(status=503, openai_error=True, retry_after="1")]
    assert soak.judge_overload(good) == ([], [])
    failures, warnings = soak.judge_overload([outcome(), outcome(status=503, openai_error=True)])
    assert not failures and warnings == ["503 without Retry-After"]
    failures, _ = soak.judge_overload([outcome(), outcome(status=503, body="Service Unavailable")])
    assert len(failures) == 1 and "without OpenAI error JSON" in failures[0]
    failures, _ = soak.judge_overload([outcome(), outcome(status=500, body="x")])
    assert len(failures) == 1
    assert soak.judge_overload([outcome(status=503, openai_error=True)])[0] == ["no request succeeded"]


def test_kill_judge_takes_openai_errors_only() -> None:
    clean = [outcome(), outcome(status=503, openai_error=True, body="{}"),
             outcome(stream=True, events=2, error_event="the engine replica stopped", done=True)]
    failures, seen = soak.judge_kill(clean, t_kill=0.0)
    assert failures == [] and seen["outcomes"]["stream-cut(error-event, [DONE])"] == 1
    failures, _ = soak.judge_kill([outcome(status=500, body="Internal Server Error")], t_kill=0.0)
    assert failures and failures[0].startswith("not OpenAI's error JSON")
    failures, _ = soak.judge_kill([outcome(stream=True, events=2, error="RemoteProtocolError(peer closed)")],
                                  t_kill=0.0)
    assert failures and failures[0].startswith("stream cut without")
    failures, _ = soak.judge_kill([outcome(status=None, error="Timeout(no end within 60 s)")], t_kill=0.0)
    assert failures and failures[0].startswith("hung")
    failures, _ = soak.judge_kill([outcome(status=None, error="ConnectError(refused)")], t_kill=0.0)
    assert failures and failures[0].startswith("no HTTP status")


def test_health_judge_and_percentile() -> None:
    S = soak.HealthSample
    samples = [S(1.0, "a", 200, 0.01), S(2.0, "a", 503, 0.02), S(3.0, "a", 200, 1.5)]
    verdict = soak.judge_health(samples)
    assert not verdict["passed"] and verdict["violations"] == 2 and verdict["over_bound"] == 1
    assert soak.judge_health(samples[:2], down=(1.5, 2.5))["passed"]
    assert not soak.judge_health([S(1.0, "a", None, 5.0, "ReadTimeout")])["passed"]
    assert soak.percentile([], 50) is None
    assert soak.percentile([3, 1, 2], 50) == 2 and soak.percentile(list(range(1, 101)), 99) == 99


def test_overrides_parse_like_serve_run() -> None:
    assert loopback.parse_overrides(["n_parallel=2", "model=/x.gguf"]) == {"n_parallel": "2", "model": "/x.gguf"}
    with pytest.raises(ValueError):
        loopback.parse_overrides(["n_parallel"])


def test_fuzz_caps_generation_and_keeps_invalid_values() -> None:
    chat, comp, resp = "/v1/chat/completions", "/v1/completions", "/v1/responses"
    assert fuzz.cap_generation({"messages": []}, 8, chat) == {"messages": [], "max_completion_tokens": 8}
    assert fuzz.cap_generation({"messages": [], "max_tokens": 99}, 8, chat) == {"messages": [], "max_tokens": 8}
    assert fuzz.cap_generation({"prompt": "x"}, 8, comp) == {"prompt": "x", "max_tokens": 8}
    assert fuzz.cap_generation({"prompt": "x", "max_tokens": 10**9}, 8, comp)["max_tokens"] == 8
    assert fuzz.cap_generation({"prompt": "x", "max_tokens": "many"}, 8, comp)["max_tokens"] == "many"
    assert fuzz.cap_generation({"prompt": "x", "max_tokens": True}, 8, comp)["max_tokens"] is True
    assert fuzz.cap_generation({"messages": [], "max_completion_tokens": 215.0}, 8, chat)["max_completion_tokens"] == 8
    assert fuzz.cap_generation({"prompt": "x", "max_tokens": 2.5}, 8, comp)["max_tokens"] == 2.5
    assert fuzz.cap_generation({"input": "x"}, 8, resp) == {"input": "x", "max_output_tokens": 8}
    # routes that do not generate get their body as generated (an extra field would be a 400 there)
    assert fuzz.cap_generation({"content": "x"}, 8, "/tokenize") == {"content": "x"}
    assert fuzz.cap_generation([1, 2], 8, comp) == [1, 2]
    assert fuzz.drop_fields({"a": 1, "b": 2}, ["a"]) == {"b": 2}


def test_fuzz_response_rules() -> None:
    ok_stream = 'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert fuzz.response_problem(200, "text/event-stream; charset=utf-8", ok_stream) is None
    assert "error event" in fuzz.response_problem(200, "text/event-stream", 'data: {"error": {"message": "m"}}\n\n')
    assert "[DONE]" in fuzz.response_problem(200, "text/event-stream", 'data: {"choices": []}\n\n')
    assert fuzz.response_problem(400, "application/json", '{"error": {"message": "bad"}}') is None
    assert "OpenAI error" in fuzz.response_problem(400, "application/json", '{"detail": "bad"}')
    assert "non-JSON" in fuzz.response_problem(200, "text/plain", "hello")
    assert fuzz.response_problem(500, "text/plain", "Internal Server Error").startswith("server error 500")
    assert fuzz.response_problem(200, "text/event-stream", 'data: {"choices": []}\n\n') == fuzz.INCOMPLETE_STREAM
    # the Responses API ends with response.completed, and reports errors as typed events
    done = 'event: response.completed\ndata: {"type": "response.completed", "response": {"error": null}}\n\n'
    assert fuzz.response_problem(200, "text/event-stream", done) is None
    failed = 'event: response.failed\ndata: {"type": "response.failed", "response": {"error": {"message": "m"}}}\n\n'
    assert "response.failed" in fuzz.response_problem(200, "text/event-stream", failed)
    typed_error = 'data: {"type": "error", "message": "x"}\n\n'
    assert "error event" in fuzz.response_problem(200, "text/event-stream", typed_error)
    # a non-JSON type the schema declares (Prometheus text on /metrics) is fine; undeclared it is not
    paths = {"/metrics": {"get": {"responses": {"200": {"content": {"text/plain; version=1.0.0": {}}}}}}}
    declared = fuzz.documented_types(paths, "GET", "/metrics", 200)
    assert declared == {"text/plain"}
    assert fuzz.response_problem(200, "text/plain; version=1.0.0; charset=utf-8", "# HELP x", declared) is None
    assert fuzz.response_problem(200, "text/plain", "# HELP x") is not None
    assert fuzz.documented_types(paths, "GET", "/nope", 200) == set()


def test_fuzz_har_analysis_lists_server_errors_with_their_requests() -> None:
    def entry(method, path, status, text, body=None):
        return {"request": {"method": method, "url": f"http://127.0.0.1:1{path}",
                            **({"postData": {"text": body}} if body else {})},
                "response": {"status": status, "content": {"mimeType": "application/json", "text": text}}}

    har = {"log": {"entries": [
        entry("GET", "/health", 200, '{"status": "ok"}'),
        entry("POST", "/v1/completions", 500, '{"error": {"message": "boom"}}', '{"prompt": "x"}'),
        entry("POST", "/v1/completions", 500, '{"error": {"message": "boom"}}', '{"prompt": "y"}'),
        entry("POST", "/v1/completions", 400, '{"detail": []}', '{"prompt": 1}'),
    ]}}
    cut = entry("POST", "/v1/completions", 200, 'data: {"choices": []}\n\n', '{"prompt": "z", "stream": true}')
    cut["response"]["content"]["mimeType"] = "text/event-stream"
    har["log"]["entries"].append(cut)
    a = fuzz.analyse_har(har, {"/health": {}, "/v1/completions": {}})
    assert a["requests"] == 5 and a["server_errors"] == 2 and a["other_problems"] == 1
    assert a["incomplete_streams"] == 1
    assert a["never_2xx"] == []
    assert fuzz.analyse_har(har, {"/health": {"get": {}}, "/tokenize": {"post": {}}})["never_2xx"] == ["POST /tokenize"]
    assert a["by_operation"]["POST /v1/completions"] == {"500": 2, "400": 1, "200": 1}
    groups = fuzz.group_problems(a["problems"])
    assert groups[0]["status"] == 500 and groups[0]["count"] == 2 and groups[0]["request_body"] == '{"prompt": "x"}'
