"""Tool calls, reasoning and grammars: the pure parts, no model."""

from __future__ import annotations

import json

import pytest

from serving.reasoning import ThinkSplitter, split_reasoning
from serving.tools import ToolCallStream, messages_for_plain_template, parse_tool_calls


@pytest.mark.unit
@pytest.mark.parametrize("text,content,names", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", ["get_weather"]),
    ('Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
     '"arguments": {"x": 1}}</tool_call>', "Let me check.", ["a", "b"]),
    ('{"name": "lookup", "parameters": {"q": "llama"}}', "", ["lookup"]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 2}}', "", ["a", "b"]),
    ("Just words, no call.", "Just words, no call.", []),
    ('<tool_call>{"name": "broken", "arguments": </tool_call>', None, []),
    ('{"not": "a call"}', None, []),
])
def test_parse_tool_calls(text: str, content: str | None, names: list[str]) -> None:
    got_content, calls = parse_tool_calls(text)
    assert [c.name for c in calls] == names
    assert got_content == (text if content is None else content)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict) and call.id.startswith("call_")


@pytest.mark.unit
@pytest.mark.parametrize("pieces", [
    ["Sure", ". ", "<tool", "_call>\n{\"name\": \"f\", ", "\"arguments\": {\"a\": 1}}\n</tool_call>"],
    ["Sure. <tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>"],
])
def test_tool_call_stream_releases_content_and_holds_the_call(pieces: list[str]) -> None:
    stream = ToolCallStream()
    released = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    assert (released + rest).strip() == "Sure." and [c.name for c in calls] == ["f"]
    assert "<" not in released


@pytest.mark.unit
def test_tool_call_stream_gives_back_text_that_was_no_call() -> None:
    stream = ToolCallStream()
    released = "".join(stream.feed(p) for p in ["a <to", "ol party", " tonight"])
    rest, calls = stream.finish()
    assert released + rest == "a <tool party tonight" and calls == []


@pytest.mark.unit
def test_plain_template_messages_carry_tools_calls_and_results() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = messages_for_plain_template([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ], tools)
    assert msgs[0]["role"] == "system" and '"name": "f"' in msgs[0]["content"]
    assert "<tool_call>" in msgs[2]["content"] and msgs[3] == {"role": "user",
                                                                "content": "<tool_response>\n42\n</tool_response>"}


@pytest.mark.unit
@pytest.mark.parametrize("pieces,inside", [
    (["<think>\nplan ", "the answer", "</think>\n\nThe answer."], False),
    (["<thi", "nk>plan the answer</th", "ink>", "\n", "The answer."], False),
    (["plan the answer</think>The answer."], True),
])
def test_think_splitter(pieces: list[str], inside: bool) -> None:
    splitter = ThinkSplitter(inside)
    parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    reasoning = "".join(r for r, _ in parts).strip()
    content = "".join(c for _, c in parts)
    assert reasoning == "plan the answer" and content == "The answer."


@pytest.mark.unit
def test_text_without_think_is_all_content() -> None:
    assert split_reasoning("Hello <think> is just a word here") == ("", "Hello <think> is just a word here")
    assert split_reasoning("<think>unfinished") == ("unfinished", "")


@pytest.mark.engine
def test_grammars_compile_and_bad_schemas_say_why() -> None:
    from serving.structured import GrammarError, json_schema_grammar, response_format_grammar, tool_call_grammar

    assert "root ::=" in json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert response_format_grammar("text") is None
    assert "root" in response_format_grammar("json_object")
    grammar = tool_call_grammar([("f", {"type": "object", "properties": {"x": {"type": "string"}}}),
                                 ("g", {})], parallel=True)
    assert grammar.startswith("root ::= block") and "call ::=" in grammar
    with pytest.raises(GrammarError):
        json_schema_grammar("not a schema")
    with pytest.raises(GrammarError):
        response_format_grammar("yaml")


@pytest.mark.engine
def test_forced_call_schemas_get_length_bounds() -> None:
    from serving.structured import MAX_CALL_ITEMS, MAX_CALL_STRING, bounded

    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string", "enum": ["x"]},
                                               "c": {"type": "array", "items": {"type": "string", "maxLength": 3}}}}
    out = bounded(schema)
    assert out["properties"]["a"]["maxLength"] == MAX_CALL_STRING and "maxLength" not in out["properties"]["b"]
    assert out["properties"]["c"]["maxItems"] == MAX_CALL_ITEMS and out["properties"]["c"]["items"]["maxLength"] == 3
    assert "maxLength" not in schema["properties"]["a"]  # the caller's schema is left as it was


@pytest.mark.unit
def test_chat_template_sees_tools_and_template_kwargs() -> None:
    from serving.chat_template import ChatTemplate

    source = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
              "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    template = ChatTemplate(source, "<s>", "</s>")
    assert template.knows_tools
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = template.render([{"role": "user", "content": "hi"}], tools=tools, template_kwargs={"enable_thinking": False})
    assert out == "/no_think [f]user: hi\n"
    assert template.render([{"role": "user", "content": "hi"}], template_kwargs={"messages": "x"}) == "user: hi\n"
