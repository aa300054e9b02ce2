"""The OpenAI surface clients rely on, through the official openai client against the real stack:
structured output, tools, logprobs, n, list prompts, logit_bias, reasoning, utilities, stream framing.

Every helper here fails on an error (the openai client raises on an error status or an error event).
Streamed and whole answers are compared wherever both exist.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import pytest

from tests.conftest import N_PARALLEL

if TYPE_CHECKING:
    import openai

pytestmark = [pytest.mark.serve, pytest.mark.usefixtures("serve_url")]

PERSON = {"type": "object", "properties": {  # bounded, so a sampled answer ends well inside max_tokens
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                        "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


def collect_stream(stream: Any) -> dict[str, Any]:
    """Join a chat stream per choice: content, reasoning, tool calls, finish reason, logprobs, usage."""
    out: dict[str, Any] = {"choices": {}, "usage": None, "events": []}
    for event in stream:
        out["events"].append(event)
        if event.usage:
            out["usage"] = event.usage
        for c in event.choices:
            slot = out["choices"].setdefault(c.index, {"content": "", "reasoning": "", "tool_calls": {},
                                                       "finish": None, "logprobs": []})
            delta = c.delta
            slot["content"] += delta.content or ""
            slot["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:  # pieces: the deltas that carried some of the call
                got = slot["tool_calls"].setdefault(call.index, {"name": "", "arguments": "", "id": call.id,
                                                                 "pieces": 0})
                got["name"] += call.function.name or ""
                got["arguments"] += call.function.arguments or ""
                got["pieces"] += 1
            if c.logprobs and c.logprobs.content:
                slot["logprobs"] += c.logprobs.content
            slot["finish"] = c.finish_reason or slot["finish"]
    return out


# -- structured output -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,temperature", [(None, 0.0), (1, 0.8), (2, 1.0)])
def test_json_schema_output_always_validates(client: openai.OpenAI, model: str, seed: int | None,
                                             temperature: float) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model=model, messages=[{"role": "user", "content": "Describe a person."}], response_format=fmt,
              max_tokens=400, temperature=temperature, seed=seed)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    streamed = collect_stream(client.chat.completions.create(**kw, stream=True))
    assert streamed["choices"][0]["content"] == whole.choices[0].message.content


def test_json_object_mode_gives_a_json_object(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A colour as JSON."}],
                                          response_format={"type": "json_object"}, max_tokens=400, temperature=0)
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_completions_take_a_schema_and_a_raw_grammar(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt="Three primary colours:", max_tokens=20, temperature=0,
                                     extra_body={"grammar": 'root ::= colour (", " colour){0,2}\n'
                                                            'colour ::= "red" | "green" | "blue"'})
    assert resp.choices[0].finish_reason == "stop"
    assert set(resp.choices[0].text.split(", ")) <= {"red", "green", "blue"}
    resp = client.completions.create(model=model, prompt="A person as JSON:", max_tokens=300, temperature=0,
                                     extra_body={"json_schema": PERSON})
    jsonschema.validate(json.loads(resp.choices[0].text), PERSON)


def test_a_schema_that_cannot_compile_is_a_400_saying_why(client: openai.OpenAI, model: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "$ref": "#/nowhere"}}})
    assert info.value.body["param"] == "response_format" and "schema" in info.value.body["message"]


# -- tools -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,temperature", [(None, 0.0), (3, 0.9), (4, 1.0)])
def test_tool_choice_required_always_gives_a_valid_call(client: openai.OpenAI, model: str, seed: int | None,
                                                        temperature: float) -> None:
    resp = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                          temperature=temperature, seed=seed)  # no max_tokens: the slot bounds it
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id and call.type == "function"


def test_a_named_function_is_the_one_called_and_stream_agrees(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kw)
    calls = whole.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    streamed = collect_stream(client.chat.completions.create(**kw, stream=True))
    got = streamed["choices"][0]
    assert got["finish"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"].values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]


CITY = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
REPEATING_SEEDS = (3, 7, 8)  # where, let call again, the model repeats its call until max_tokens=64 cuts one
WHOLE: dict[str, Any] = {"top_p": 1.0, "extra_body": {"top_k": 0, "min_p": 0.0}}  # the seeds' sampler: no cut


@pytest.mark.parametrize("seed", REPEATING_SEEDS)
def test_a_forced_call_arrives_as_one_call_whole_and_streamed(client: openai.OpenAI, model: str, seed: int) -> None:
    """The reported bug: tool_choice required, max_tokens 64, and the model wrote the call again and again
    until the limit cut the last: no tool_calls, the markup in content. Unless parallel_tool_calls is true,
    the grammar ends the answer after one call. Streamed (an event per token: logprobs), its arguments come
    in pieces as they are generated, after a first delta with its id and name."""
    kw: dict[str, Any] = dict(model=model, messages=PARIS, tools=[CITY], tool_choice="required", max_tokens=64,
                              temperature=1.0, seed=seed, **WHOLE)
    client.chat.completions.create(**kw)  # the prompt cached for both below: a cold prefill rounds differently
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY["function"]["parameters"])
    got = collect_stream(client.chat.completions.create(**kw, stream=True, logprobs=True))["choices"][0]
    assert got["finish"] == "tool_calls" and got["content"] == ""
    [streamed] = got["tool_calls"].values()
    assert streamed["id"].startswith("call_") and streamed["name"] == "get_weather" and streamed["pieces"] > 3
    assert streamed["arguments"] == call.function.arguments  # the same seed: the same call


def test_parallel_forced_calls_cut_by_max_tokens_keep_the_complete_ones(client: openai.OpenAI, model: str) -> None:
    """parallel_tool_calls true lets the model call again, and at these seeds it repeats its call until
    max_tokens cuts one: the answer is the calls that completed, finish_reason length, no markup as content."""
    reasons = []
    for seed in REPEATING_SEEDS:
        choice = client.chat.completions.create(model=model, messages=PARIS, tools=[CITY], tool_choice="required",
                                                parallel_tool_calls=True, max_tokens=64, temperature=1.0,
                                                seed=seed, **WHOLE).choices[0]
        reasons.append(choice.finish_reason)
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), CITY["function"]["parameters"])
    assert "length" in reasons  # the premise: some answer was cut


def test_tool_choice_none_answers_in_text(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=16, temperature=0)
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content


def test_tool_results_are_fed_back(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=24,
                                            temperature=0, tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content


# -- logprobs, n, list prompts, logit_bias -----------------------------------------------------------
def test_chat_logprobs_one_per_completion_token(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=12, temperature=0,
              logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob
               for t in content)
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    streamed = collect_stream(client.chat.completions.create(**kw, stream=True))
    assert [t.token for t in streamed["choices"][0]["logprobs"]] == [t.token for t in content]
    # a stream asking for logprobs is never paced: one token per event, as llama-server sends them
    per_event = [len(c.logprobs.content) for e in streamed["events"] for c in e.choices
                 if c.logprobs and c.logprobs.content]
    assert per_event == [1] * len(content)


def test_completion_logprobs_shape(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt="The sky is", max_tokens=6, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert "".join(lp.tokens) == resp.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_n_choices(client: openai.OpenAI, model: str) -> None:
    import openai

    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a joke."}],
                                          n=3, max_tokens=16, temperature=1.0, seed=5)
    assert [c.index for c in resp.choices] == [0, 1, 2] and len({c.message.content for c in resp.choices}) > 1
    streamed = collect_stream(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell a joke."}], n=3, max_tokens=16, temperature=1.0,
        seed=5, stream=True, stream_options={"include_usage": True}))
    assert [streamed["choices"][i]["content"] for i in range(3)] == [c.message.content for c in resp.choices]
    assert streamed["usage"].completion_tokens == resp.usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ASK, n=N_PARALLEL + 1, max_tokens=4)


def test_completions_take_a_list_of_prompts(client: openai.OpenAI, model: str) -> None:
    single = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0).choices[0].text
              for p in ("The sky is", "Water is")]
    both = client.completions.create(model=model, prompt=["The sky is", "Water is"], max_tokens=5, temperature=0)
    assert [c.text for c in both.choices] == single
    tokens = client.completions.create(model=model, prompt=[[1, 504, 3300, 314]], max_tokens=3, temperature=0)
    assert tokens.choices[0].finish_reason in ("stop", "length")


def test_logit_bias_bans_and_forces(client: openai.OpenAI, model: str, serve_url: str) -> None:
    plain = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    first_id = httpx.post(f"{serve_url}/tokenize", json={"content": first}, timeout=30).json()["tokens"][0]
    banned = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0,
                                       logit_bias={str(first_id): -100})
    assert not banned.choices[0].text.startswith(first)
    forced = client.completions.create(model=model, prompt="The sky is", max_tokens=3, temperature=0,
                                       logit_bias={str(first_id): 100})
    assert forced.choices[0].text == first * 3


# -- reasoning ---------------------------------------------------------------------------------------
THINKING = 'root ::= "<think>" [a-z ]{3,40} "</think>" [A-Za-z ]{3,40}'


def test_think_text_goes_to_reasoning_content_streamed_and_whole(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, messages=[{"role": "user", "content": "Think, then answer: is ice cold?"}],
              max_tokens=60, temperature=0, extra_body={"grammar": THINKING})
    whole = client.chat.completions.create(**kw).choices[0].message
    reasoning = whole.model_extra.get("reasoning_content")
    assert reasoning and "<think>" not in (whole.content or "") and whole.content
    streamed = collect_stream(client.chat.completions.create(**kw, stream=True))["choices"][0]
    assert (streamed["reasoning"], streamed["content"]) == (reasoning, whole.content)
    raw = client.chat.completions.create(**{**kw, "extra_body": {"grammar": THINKING, "reasoning_format": "none"}})
    assert raw.choices[0].message.content.startswith("<think>")


# -- utilities, framing, unsupported fields ----------------------------------------------------------
def test_tokenize_detokenize_props(serve_url: str) -> None:
    text = "Hello 世界"
    tokens = httpx.post(f"{serve_url}/tokenize", json={"content": text}, timeout=30).json()["tokens"]
    assert httpx.post(f"{serve_url}/detokenize", json={"tokens": tokens}, timeout=30).json()["content"] == text
    pieces = httpx.post(f"{serve_url}/tokenize", json={"content": text, "with_pieces": True}, timeout=30).json()
    assert [p["id"] for p in pieces["tokens"]] == tokens and pieces["tokens"][0]["piece"] == "Hello"
    bad = httpx.post(f"{serve_url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    props = httpx.get(f"{serve_url}/props", timeout=30).json()
    assert props["total_slots"] == N_PARALLEL and "chat_template" in props


def test_chat_stream_is_framed_as_openai_frames_it(client: openai.OpenAI, model: str) -> None:
    events = collect_stream(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))["events"]
    first, closing, usage = events[0], events[-2], events[-1]
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert closing.choices[0].finish_reason in ("stop", "length") and not closing.choices[0].delta.content
    assert usage.choices == [] and usage.usage.completion_tokens > 0
    assert all(e.choices[0].finish_reason is None for e in events[:-2])


def test_responses_api_text_in_and_out(client: openai.OpenAI, model: str) -> None:
    whole = client.responses.create(model=model, input="Say hello.", instructions="Be brief.",
                                    max_output_tokens=12, temperature=0)
    assert whole.output_text and whole.usage.output_tokens > 0
    with client.responses.stream(model=model, input="Say hello.", instructions="Be brief.",
                                 max_output_tokens=12, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_") and final.id.startswith("resp_")


def test_unimplemented_fields_are_refused_by_name(client: openai.OpenAI, model: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4,
                                       extra_body={"prediction": {"type": "content", "content": "x"}})
    assert info.value.body["param"] == "prediction" and info.value.body["code"] == "unsupported_parameter"
    ok = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, user="someone",
                                        metadata={"k": "v"})
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_metrics_names(serve_url: str) -> None:
    text = httpx.get(f"{serve_url}/metrics", timeout=30).text
    for name in ("llm_time_to_first_token_seconds_bucket", "llm_e2e_request_latency_seconds_bucket",
                 "llm_inter_token_latency_seconds_bucket", "llm_prompt_tokens_total", "llm_generated_tokens_total",
                 "llm_queue_depth", "llm_slots_busy", "llm_kv_cells_used", "llm_engine_config",
                 "llm_prompt_cache_bytes", "llm_prompt_cache_entries"):
        assert name in text, name
