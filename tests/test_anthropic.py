"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens).

Unit lane: the translation alone (a request in, the chat messages, tools and tool choice the template and
the grammar get out; chunks in, Anthropic's events and message out) and the error shapes. Engine lane: the
real app on the embedded model behind a local HTTP server, driven by the official anthropic SDK (whole
answers, streams, an agent's tool loop, stop sequences, counting, errors and the API key), and a scripted
engine for what a real one cannot be made to do on demand (an error mid-stream, a full queue).

Every helper that collects a generation fails on an `error` event (the SDK raises on one; `stream_events`
asserts), so no test passes on an errored generation.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

MODEL = "claude-any-name"  # the server answers whatever model a client names, with the one it serves
WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def stream_events(text: str, allow_error: bool = False) -> list[dict[str, Any]]:
    """The events of one Anthropic SSE body (each `event:` line must name its data's type). An `error` event
    fails the test unless `allow_error`; a stream without `message_stop` (and no error) fails too."""
    events = []
    for frame in text.strip().split("\n\n"):
        lines = frame.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        event = json.loads(lines[1][len("data: "):])
        assert event["type"] == lines[0][len("event: "):], frame
        assert allow_error or event["type"] != "error", f"the stream carried an error event: {event}"
        events.append(event)
    assert events[-1]["type"] in (("message_stop", "error") if allow_error else ("message_stop",)), events[-2:]
    return events


# -- unit: requests in, template messages, tools and choice out ---------------------------------------
@pytest.mark.unit
def test_a_conversation_with_tool_turns_becomes_the_templates_messages() -> None:
    from serving.openai.anthropic_requests import MessagesRequest, conversation

    body = MessagesRequest.model_validate({
        "model": MODEL, "max_tokens": 50,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Use tools."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call it.", "signature": "x"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": True},
                {"type": "text", "text": "And so?"}]}]})
    chat = conversation(body)
    assert chat.prefill == ""
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "I should call it.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": "And so?"}]


@pytest.mark.unit
def test_what_recent_claude_code_sends_is_read() -> None:
    """Claude Code 2.1 sends a system-role message after the first user turn, tool_reference blocks in tool
    results, context_management, diagnostics, and cache_control with a scope: all read, none refused."""
    from serving.openai.anthropic_requests import MessagesRequest, conversation, tools_asked

    body = MessagesRequest.model_validate({
        "model": "claude-opus-4-8", "max_tokens": 32000, "stream": True, "metadata": {"user_id": "u"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "diagnostics": {"cache": True}, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral",
                                                                                    "scope": "global"}}],
        "tools": [{**WEATHER, "eager_input_streaming": True, "defer_loading": False}],
        "messages": [
            {"role": "user", "content": "Fix the bug."},
            {"role": "system", "content": [{"type": "text", "text": "Available agent types: none."}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
                                               "input": {"query": "weather"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "tool_reference", "tool_name": "get_weather"}, {"type": "text", "text": "found"}]}]}]})
    assert body.unsupported_fields() == [] and body.template_kwargs() == {"enable_thinking": True}
    chat = conversation(body)
    assert chat.messages[0] == {"role": "system", "content": "You are Claude Code.\n\nAvailable agent types: none."}
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[-1]["content"] == "found" and tools_asked(body).choice == "auto"


@pytest.mark.unit
def test_a_final_assistant_turn_is_a_prefill_the_answer_continues() -> None:
    from serving.openai.anthropic_requests import MessagesRequest, conversation

    body = MessagesRequest.model_validate({"max_tokens": 5, "system": "S", "messages": [
        {"role": "user", "content": "Sun in Greek? (A) Sol (B) Helios"},
        {"role": "assistant", "content": "The answer is ("}]})
    chat = conversation(body)
    assert chat.prefill == "The answer is ("
    assert chat.messages == [{"role": "system", "content": "S"},
                             {"role": "user", "content": "Sun in Greek? (A) Sol (B) Helios"}]


@pytest.mark.unit
@pytest.mark.parametrize("messages,system,tools,param,named", [
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}], None, None,
     "messages.0.content.0", "'image'"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                    "content": [{"type": "document", "source": {}}]}]}], None, None,
     "messages.0.content.0.content.0", "'document'"),
    ([{"role": "user", "content": "Hi"}], [{"type": "search_result", "source": "x"}], None, "system.0",
     "'search_result'"),
    ([{"role": "user", "content": "Hi"}], None, [{"type": "web_search_20250305", "name": "web_search"}],
     "tools.0.type", "'web_search_20250305'"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], None, None,
     "messages.0.content.0", "tool_use"),
])
def test_what_this_server_cannot_read_is_refused_by_name(messages: list[Any], system: Any, tools: Any,
                                                         param: str, named: str) -> None:
    from serving.front.errors import APIError
    from serving.openai.anthropic_requests import MessagesRequest, conversation, tools_asked

    body = MessagesRequest.model_validate({"max_tokens": 5, "messages": messages, "system": system, "tools": tools})
    with pytest.raises(APIError) as refused:
        conversation(body)
        tools_asked(body)
    assert refused.value.status == 400 and refused.value.param == param and named in refused.value.message


@pytest.mark.unit
@pytest.mark.parametrize("choice,expected", [
    (None, ("auto", None, False)),
    ({"type": "auto"}, ("auto", None, False)),
    ({"type": "any"}, ("required", None, False)),
    ({"type": "any", "disable_parallel_tool_use": False}, ("required", None, True)),
    ({"type": "tool", "name": "get_weather"}, ("required", "get_weather", False)),
    ({"type": "none"}, ("none", None, False)),
])
def test_tool_choice_is_the_openai_layers(choice: dict[str, Any] | None, expected: tuple[Any, ...]) -> None:
    from serving.openai.anthropic_requests import MessagesRequest, tools_asked

    body = MessagesRequest.model_validate({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}],
                                           "tools": [WEATHER], "tool_choice": choice})
    asked = tools_asked(body)
    assert (asked.choice, asked.named, asked.parallel) == expected
    assert asked.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}]


@pytest.mark.unit
def test_sampling_fields_bounds_and_the_fields_that_change_nothing() -> None:
    from pydantic import ValidationError

    from serving.openai.anthropic_requests import MessagesRequest

    base = {"messages": [{"role": "user", "content": "Hi"}]}
    body = MessagesRequest.model_validate({**base, "max_tokens": 9, "temperature": 0, "top_k": 5, "top_p": 0.5,
                                           "stop_sequences": ["\n\n", ""], "metadata": {"user_id": "u"},
                                           "service_tier": "auto", "thinking": {"type": "disabled"}})
    params = body.sampling_params(7, None)
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.stop) == (7, 0, 5, 0.5,
                                                                                               ("\n\n",))
    assert body.unsupported_fields() == [] and body.template_kwargs() == {"enable_thinking": False}
    assert MessagesRequest.model_validate({**base, "max_tokens": 1, "mcp_servers": [{"url": "x"}]}
                                          ).unsupported_fields() == ["mcp_servers"]
    for bad in ({}, {"max_tokens": 0}, {"max_tokens": 5, "temperature": 1.5},
                {"max_tokens": 5, "tool_choice": {"type": "tool"}}):
        with pytest.raises(ValidationError):
            MessagesRequest.model_validate({**base, **bad})


# -- unit: chunks in, events and message out ----------------------------------------------------------
def _answer(tools: bool = False, max_tokens: int = 100) -> Any:
    from serving.openai.anthropic_responses import MessageAnswer
    from serving.openai.responses import ChoiceState
    from serving.openai.tools import CallMode

    state = ChoiceState(0, reasoning=True, tools=CallMode.auto if tools else None)
    return MessageAnswer("served", 12, max_tokens, state)


def _run(answer: Any, pieces: list[str], reason: Any, completion_tokens: int | None = None,
         stop: str | None = None) -> list[dict[str, Any]]:
    from serving.engine.request import GenerationChunk, Usage

    events = answer.opening()
    usage = Usage(prompt_tokens=12, completion_tokens=completion_tokens or len(pieces), cached_tokens=4)
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        events += answer.feed(GenerationChunk(piece, [i], reason if last else None, usage if last else None))
    return events + answer.closing(stop)


def _accumulated(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message the anthropic SDK builds from these events (its stream's own accumulator, a private
    function of the SDK: what `messages.stream(...).get_final_message()` returns)."""
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    snapshot, bufs = None, {}
    for event in events:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=adapter.validate_python(event), current_snapshot=snapshot,
                                        json_bufs=bufs)
    assert snapshot is not None
    return snapshot.model_dump(mode="json", exclude_none=True)


@pytest.mark.unit
def test_text_streams_as_anthropics_event_sequence_and_the_whole_message_agrees() -> None:
    from serving.engine.request import FinishReason

    answer = _answer()
    events = _run(answer, ["Hel", "lo", " world"], FinishReason.stop)
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_delta", "content_block_stop",
                                           "message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["usage"]["input_tokens"] == 12
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                          "usage": {"input_tokens": 8, "output_tokens": 3, "cache_read_input_tokens": 4,
                                    "cache_creation_input_tokens": 0}}
    whole = answer.message(None)
    assert whole["content"] == [{"type": "text", "text": "Hello world"}] and whole["stop_reason"] == "end_turn"
    assert whole["type"] == "message" and whole["role"] == "assistant" and whole["model"] == "served"
    sdk = _accumulated(events)
    assert sdk["content"] == whole["content"] and sdk["stop_reason"] == "end_turn"


@pytest.mark.unit
def test_a_tool_call_streams_as_a_tool_use_block_with_input_json_deltas() -> None:
    from serving.engine.request import FinishReason

    answer = _answer(tools=True)
    pieces = ["\n"] + [CALL_TEXT[i:i + 5] for i in range(0, len(CALL_TEXT), 5)]
    events = _run(answer, pieces, FinishReason.stop)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert len(starts) == 1 and starts[0]["type"] == "tool_use" and starts[0]["id"].startswith("toolu_")
    assert starts[0]["name"] == "get_weather" and starts[0]["input"] == {}  # no text block for the newline
    partial = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(partial) > 2 and json.loads("".join(partial)) == {"city": "Paris"}
    whole = answer.message(None)
    assert whole["stop_reason"] == "tool_use" and whole["content"] == [
        {"type": "tool_use", "id": starts[0]["id"], "name": "get_weather", "input": {"city": "Paris"}}]
    assert _accumulated(events)["content"] == whole["content"]


@pytest.mark.unit
def test_thinking_text_and_stop_reasons() -> None:
    from serving.engine.request import FinishReason
    from serving.openai.anthropic_responses import matched_stop

    answer = _answer()
    events = _run(answer, ["<think>", "hmm", "</think>", "Yes."], FinishReason.stop, stop="##")
    whole = answer.message("##")
    assert whole["content"] == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                {"type": "text", "text": "Yes."}]
    assert whole["stop_reason"] == "stop_sequence" and whole["stop_sequence"] == "##"
    assert {"type": "signature_delta", "signature": ""} in [e.get("delta") for e in events]
    assert _accumulated(events)["content"] == whole["content"]
    cut = _answer(max_tokens=2)
    _run(cut, ["a", "b"], FinishReason.length)
    assert cut.message(None)["stop_reason"] == "max_tokens"
    full = _answer(max_tokens=50)  # the slot's context ended it before max_tokens
    _run(full, ["a", "b"], FinishReason.length)
    assert full.message(None)["stop_reason"] == "model_context_window_exceeded"
    empty = _answer()
    events = _run(empty, [""], FinishReason.stop)
    assert empty.message(None)["content"] == [{"type": "text", "text": ""}]
    assert [e["type"] for e in events].count("content_block_start") == 1
    assert matched_stop(("END", "##"), "Yes.", "Yes.## more") == "##"
    assert matched_stop(("END",), "Yes.", "Yes.") is None


@pytest.mark.unit
def test_errors_on_messages_paths_are_anthropics_shape_and_the_front_door_writes_them() -> None:
    from starlette.testclient import TestClient

    from serving.front.errors import APIError, ErrorDialect
    from serving.front.http import HttpRules

    assert ErrorDialect.of("/v1/messages") is ErrorDialect.anthropic
    assert ErrorDialect.of("/v1/messages/count_tokens") is ErrorDialect.anthropic
    assert ErrorDialect.of("/v1/messagesx") is ErrorDialect.openai is ErrorDialect.of("/v1/chat/completions")
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
                         (413, "request_too_large"), (500, "api_error"), (503, "overloaded_error"),
                         (529, "overloaded_error")):
        assert APIError(status, "why").anthropic_body() == {"type": "error", "error": {"type": kind,
                                                                                       "message": "why"}}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the door lets no request without the key through")

    door = TestClient(HttpRules("sekrit").around(app))
    denied = door.post("/v1/messages", json={})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert denied.json()["type"] == "error"
    assert door.post("/v1/chat/completions", json={}).json()["error"]["code"] == "invalid_api_key"


# -- engine: the real app behind a local server, the official SDK ------------------------------------
class _Host:
    """What the routes need of a replica, around one engine (the app as LlamaServer composes it, no Ray)."""

    def __init__(self, engine: Any) -> None:
        from serving.openai.anthropic_routes import MessagesRoutes
        from serving.openai.routes import OpenAIRoutes, build_api
        from serving.replica.metrics import ReplicaMetrics

        self.engine = engine
        self.metrics = ReplicaMetrics("anthropic-test", "test")
        self.api = build_api(OpenAIRoutes(self).router(), MessagesRoutes(self).router())

    def ready_engine(self) -> Any:
        return self.engine

    @contextlib.asynccontextmanager
    async def engine_turn(self) -> Any:
        yield self.engine

    def stream_spacing(self) -> float:
        return 0.0


@contextlib.contextmanager
def _served(app: Any) -> Iterator[str]:
    """`app` on a loopback port (uvicorn in a thread): the SDK speaks real HTTP to it."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(engine: Any) -> Iterator[tuple[str, _Host]]:
    """The real app over the session's engine, keyed (as `serve run ... api_key=...` serves it)."""
    from serving.front.http import HttpRules

    host = _Host(engine)
    with _served(HttpRules("sekrit").around(host.api)) as url:
        yield url, host


def _sdk(url: str, **kw: Any) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key=kw.pop("api_key", "sekrit"), max_retries=0, timeout=120, **kw)


def _wait_idle(engine: Any) -> None:
    deadline = time.monotonic() + 60
    while (stats := engine.snapshot()).slots_busy or stats.queue_depth:
        assert time.monotonic() < deadline, "a request kept its slot"
        time.sleep(0.05)


def _cancelled(host: _Host) -> float:
    """Requests the routes cancelled (their client went away), as the replica's metrics count them."""
    found = re.search(r'^llm_requests_total\{[^}]*reason="cancelled"[^}]*\} (\S+)$', host.metrics.exposition().decode(),
                      re.M)
    return float(found.group(1)) if found else 0.0


ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.mark.engine
def test_the_sdk_gets_a_message_and_the_same_text_streamed(served: tuple[str, _Host]) -> None:
    url, host = served
    client = _sdk(url)
    message = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body={"temperature": 0},
                                     extra_headers={"anthropic-version": "2023-06-01"})
    assert message.id.startswith("msg_") and message.model == host.engine.config.served_name
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].type == "text"
    text = message.content[0].text
    assert text.strip() and message.usage.output_tokens > 0
    counted = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted
    with client.messages.stream(model=MODEL, max_tokens=24, messages=ASK, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text == final.content[0].text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    prefilled = client.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[
        *ASK, {"role": "assistant", "content": "The three colours are"}])
    assert prefilled.content[0].text.strip() and not prefilled.content[0].text.startswith("The three")


@pytest.mark.engine
def test_an_agents_tool_loop_end_to_end(served: tuple[str, _Host]) -> None:
    """Asked with a tool it must use (`any`), the model calls it; given the result, it answers in text."""
    url, _ = served
    client = _sdk(url)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        kinds = [e.type for e in stream]
        first = stream.get_final_message()
    assert "content_block_start" in kinds and first.stop_reason == "tool_use"
    call, = [b for b in first.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather" and isinstance(call.input["city"], str)
    history = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "Sunny, 24 C"}]}]
    final = client.messages.create(model=MODEL, max_tokens=48, messages=history, tools=[WEATHER],
                                   tool_choice={"type": "auto"}, extra_body={"temperature": 0})
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"] and final.content[0].text.strip()
    named = client.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body={"temperature": 0})
    assert named.stop_reason == "tool_use" and named.content[-1].name == "get_weather"


@pytest.mark.engine
def test_a_stop_sequence_ends_the_answer_and_is_named(served: tuple[str, _Host]) -> None:
    url, _ = served
    client = _sdk(url)
    text = client.messages.create(model=MODEL, max_tokens=24, messages=ASK,
                                  extra_body={"temperature": 0}).content[0].text
    word = next(w for w in text.split()[1:] if len(w) > 2)
    cut = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, stop_sequences=["@@", word],
                                 extra_body={"temperature": 0})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[:text.index(word)]


@pytest.mark.engine
def test_refusals_are_anthropic_errors_and_the_server_keeps_serving(served: tuple[str, _Host]) -> None:
    import anthropic
    import httpx

    url, _ = served
    client = _sdk(url)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        _sdk(url, api_key="wrong").messages.create(model=MODEL, max_tokens=5, messages=ASK)
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bearer = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK},
                        headers={"Authorization": "Bearer sekrit"})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    with pytest.raises(anthropic.BadRequestError) as image:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert "'image'" in image.value.message
    assert image.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    missing = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "messages": ASK},
                         headers={"x-api-key": "sekrit"})
    assert missing.status_code == 400 and missing.json()["type"] == "error"
    assert "max_tokens" in missing.json()["error"]["message"]
    unknown = httpx.post(f"{url}/v1/messages/batches", json={}, headers={"x-api-key": "sekrit"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as long_prompt:
        client.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "user", "content": "word " * 2000}])
    assert "prompt is too long" in long_prompt.value.message
    assert client.messages.create(model=MODEL, max_tokens=3, messages=ASK).content


@pytest.mark.engine
def test_a_client_that_goes_away_frees_its_slot(served: tuple[str, _Host]) -> None:
    import httpx

    url, host = served
    _wait_idle(host.engine)
    cancelled = _cancelled(host)
    body = {"model": MODEL, "max_tokens": 900, "stream": True, "temperature": 0,  # greedy: 900 tokens, no EOS
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}]}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers={"x-api-key": "sekrit"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    _wait_idle(host.engine)
    assert _cancelled(host) == cancelled + 1, "the request ran on for nobody"


@pytest.mark.serve
def test_the_served_app_answers_anthropic_clients_through_the_ingress(serve_url: str) -> None:
    """The app `serve run` builds: the replica composes these routes, the ingress relays their events, the
    OpenAPI schema documents Anthropic's error JSON for them."""
    import httpx

    client = _sdk(serve_url, api_key="unused")
    with client.messages.stream(model=MODEL, max_tokens=12, messages=ASK, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=ASK, extra_body={"temperature": 0})
    assert streamed.strip() and streamed == final.content[0].text == whole.content[0].text
    assert client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    schema = httpx.get(f"{serve_url}/openapi.json", timeout=30).json()
    post = schema["paths"]["/v1/messages"]["post"]["responses"]
    assert "422" not in post and {"400", "401", "529"} <= set(post)
    assert post["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorBody")


# -- engine: a scripted engine for what a real one cannot be made to do ------------------------------
@pytest.fixture
def scripted() -> Iterator[Any]:
    from starlette.testclient import TestClient

    from tests.test_http import ScriptedEngine

    host = _Host(ScriptedEngine())
    with TestClient(host.api, raise_server_exceptions=False) as http:
        host.http = http  # type: ignore[attr-defined]
        yield host


@pytest.mark.engine
def test_an_engine_error_mid_stream_is_an_error_event_that_fails_collection(scripted: Any) -> None:
    from serving.engine.request import FinishReason, GenerationChunk

    scripted.engine.chunks = [GenerationChunk("Hello", [1]),
                              GenerationChunk(" wor", [2], FinishReason.error, error="llama_decode failed")]
    resp = scripted.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 9, "messages": ASK,
                                                    "stream": True})
    assert resp.status_code == 200
    with pytest.raises(AssertionError, match="error event"):
        stream_events(resp.text)  # what every test collecting a generation uses: it fails on the error
    events = stream_events(resp.text, allow_error=True)
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "Hello wor"
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "llama_decode failed"}}
    whole = scripted.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 9, "messages": ASK})
    assert whole.status_code == 500 and whole.json()["error"] == {"type": "api_error",
                                                                  "message": "llama_decode failed"}


@pytest.mark.engine
def test_a_full_queue_is_529_overloaded_with_retry_after(scripted: Any) -> None:
    from serving.engine.errors import QueueFullError

    scripted.engine.fail = QueueFullError(queued=64, limit=64, retry_after_s=7)
    resp = scripted.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 9, "messages": ASK})
    assert resp.status_code == 529 and resp.headers["retry-after"] == "7"
    assert resp.json()["error"]["type"] == "overloaded_error"
    scripted.engine.fail = None
    ok = scripted.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 9, "messages": ASK})
    assert ok.status_code == 200 and ok.json()["content"] == [{"type": "text", "text": "Hello world"}]
    assert ok.json()["stop_reason"] == "model_context_window_exceeded"  # 2 tokens of 9, cut by "length"
