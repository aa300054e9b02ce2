"""Tool calls, reasoning and grammars: the pure parts, no model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from serving.openai.reasoning import ThinkSplitter, split_reasoning
from serving.openai.tools import CallMode, ToolCallStream, messages_for_plain_template, parse_tool_calls


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
    released = "".join(stream.feed(p)[0] for p in pieces)
    rest, _ = stream.finish()
    assert (released + rest).strip() == "Sure." and [c.name for c in stream.calls] == ["f"]
    assert "<" not in released


@pytest.mark.unit
def test_tool_call_stream_gives_back_text_that_was_no_call() -> None:
    stream = ToolCallStream()
    released = "".join(stream.feed(p)[0] for p in ["a <to", "ol party", " tonight"])
    rest, _ = stream.finish()
    assert released + rest == "a <tool party tonight" and stream.calls == []


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": [1, {"x": "}"}]}}\n</tool_call>'


@pytest.mark.unit
@pytest.mark.parametrize("mode", list(CallMode))
def test_a_call_streams_its_arguments_as_they_come(mode: CallMode) -> None:
    """Fed a token at a time, a call goes out as OpenAI streams one: its id and name first, then its
    arguments in pieces, each as soon as it is generated, not at the block's end."""
    stream = ToolCallStream(mode)
    sent: list[tuple[int, Any]] = []
    for at in range(0, len(CALL), 3):
        content, pieces = stream.feed(CALL[at:at + 3])
        assert content == ""
        sent += [(at, p) for p in pieces]
    assert stream.finish() == ("", [])
    first = sent[0][1]
    assert first.id and first.id.startswith("call_") and first.name == "get_weather" and first.index == 0
    assert all(p.id is None and p.index == 0 for _, p in sent[1:]) and len(sent) > 10
    arguments = "".join(p.arguments for _, p in sent)
    assert json.loads(arguments) == {"city": 'Pa"ris', "days": [1, {"x": "}"}]}
    assert sent[-1][0] < CALL.index("</tool_call>")  # all of it out before the block closed
    assert [(c.id, c.name, c.arguments) for c in stream.calls] == [(first.id, "get_weather", arguments)]


@pytest.mark.unit
@pytest.mark.parametrize("cut", [len(CALL) + 5, len(CALL) + 40])
def test_a_forced_answer_cut_by_the_token_limit_keeps_its_complete_calls(cut: int) -> None:
    """The reported bug: the same call again and again until max_tokens cuts the last. The complete calls
    are the answer; the cut one is not a call, and none of the markup is content."""
    text = (CALL + "\n") * 3
    stream = ToolCallStream(CallMode.forced)
    content = stream.feed(text[:cut])[0] + stream.finish()[0]
    assert content == "" and len(stream.calls) == 1
    assert json.loads(stream.calls[0].arguments)["city"] == 'Pa"ris'


@pytest.mark.unit
@pytest.mark.parametrize("mode,content", [(CallMode.forced, ""), (CallMode.auto, '<tool_call>\n{"name": "get_')])
def test_a_call_cut_in_its_name_is_no_call(mode: CallMode, content: str) -> None:
    stream = ToolCallStream(mode)
    cut = CALL[:CALL.index("weather")]
    assert stream.feed(cut)[0] + stream.finish()[0] == content and stream.calls == []


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
def test_guides_compile_and_bad_schemas_say_why() -> None:
    from serving.engine.request import ConstraintKind
    from serving.openai.structured import GrammarError, json_schema_guide, response_format_guide, tool_call_guide

    guide = json_schema_guide({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert guide.kind is ConstraintKind.guide and '"a"' in guide.text
    assert response_format_guide("text") is None
    object_guide = response_format_guide("json_object")
    assert object_guide is not None and object_guide.kind is ConstraintKind.guide
    call = tool_call_guide([("f", {"type": "object", "properties": {"x": {"type": "string"}}}), ("g", {})],
                           parallel=True)
    assert call.text.startswith("start: block") and "%json" in call.text and '"anyOf"' in call.text
    for bad, why in (("not a schema", "must be an object"), ({"type": "nope"}, "nope"),
                     ({"$ref": "#/missing"}, "missing")):
        with pytest.raises(GrammarError, match=why):
            json_schema_guide(bad)
    with pytest.raises(GrammarError):
        response_format_guide("yaml")
    with pytest.raises(GrammarError, match="cannot be compiled"):
        tool_call_guide([("f", {"type": "object", "properties": 3})], parallel=False)


@pytest.mark.engine
def test_forced_call_schemas_get_length_bounds() -> None:
    from serving.openai.structured import CALL_BOUNDS, bounded

    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string", "enum": ["x"]},
                                               "c": {"type": "array", "items": {"type": "string", "maxLength": 3}}}}
    out = bounded(schema, CALL_BOUNDS)
    assert out["properties"]["a"]["maxLength"] == CALL_BOUNDS.string and "maxLength" not in out["properties"]["b"]
    assert out["properties"]["c"]["maxItems"] == CALL_BOUNDS.items and out["properties"]["c"]["items"]["maxLength"] == 3
    assert "maxLength" not in schema["properties"]["a"]  # the caller's schema is left as it was


@pytest.mark.engine  # serving.openai.structured loads libllama (its schema converter)
def test_bounds_keep_what_the_schema_says() -> None:
    """A default never makes a schema unsatisfiable (minLength over it), JSON values (enum, const) are not
    schemas, and a property may be named like a keyword."""
    from serving.openai.structured import ANSWER_BOUNDS, bounded

    schema = {"type": "object", "properties": {
        "long": {"type": "string", "minLength": 5000}, "many": {"type": "array", "minItems": 100},
        "enum": {"type": "string"}, "pick": {"enum": [{"type": "string"}]}, "mine": {"type": "string", "maxLength": 9}}}
    props = bounded(schema, ANSWER_BOUNDS)["properties"]
    assert props["long"]["maxLength"] == 5000 and props["many"]["maxItems"] == 100
    assert props["enum"]["maxLength"] == ANSWER_BOUNDS.string and props["pick"] == {"enum": [{"type": "string"}]}
    assert props["mine"]["maxLength"] == 9


@pytest.mark.engine
def test_answer_schemas_are_bounded_too() -> None:
    """response_format json_schema (and llama-server's json_schema) get bounds where the schema sets none,
    so an answer closes on its own; a bound the client set is its own."""
    from serving.openai.structured import ANSWER_BOUNDS, json_schema_guide, response_format_guide

    assert json_schema_guide({"type": "string"}) == json_schema_guide({"type": "string",
                                                                         "maxLength": ANSWER_BOUNDS.string})
    assert response_format_guide("json_schema", {"type": "string"}) == json_schema_guide({"type": "string"})
    assert json_schema_guide({"type": "string", "maxLength": 3}) != json_schema_guide({"type": "string"})


@pytest.mark.unit
def test_chat_template_sees_tools_and_template_kwargs() -> None:
    from serving.engine.chat_template import ChatTemplate

    source = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
              "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    template = ChatTemplate(source, "<s>", "</s>")
    assert template.knows_tools
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = template.render([{"role": "user", "content": "hi"}], tools=tools, template_kwargs={"enable_thinking": False})
    assert out == "/no_think [f]user: hi\n"
    assert template.render([{"role": "user", "content": "hi"}], template_kwargs={"messages": "x"}) == "user: hi\n"


@pytest.fixture(scope="module")
def costs() -> Iterator[ModuleType]:
    """measure/constrained.py, guide_costs' modes, answers and replay (it loads libllama: the tests using it are
    in lane engine)."""
    from measure import constrained

    yield constrained


@pytest.mark.engine
def test_guide_costs_replays_each_modes_answer_through_its_guide(costs: ModuleType) -> None:
    """scripts/guide_costs.py's answers stay valid for bench_constrained's guides (a refused token is an
    error there, not a figure), and every call is timed once per token."""
    from serving.engine.config import EngineConfig
    from serving.engine.llama import LlamaModel

    model = LlamaModel(EngineConfig().model_path, n_gpu_layers=0)
    try:
        for name, mode in costs.modes().items():
            tokens = model.tokenize(costs.ANSWERS[name], add_special=False, parse_special=True)
            spent = costs.replay(model, mode.guide.text, tokens)
            assert {len(seconds) for seconds in spent.values()} == {len(tokens)}
        with pytest.raises(RuntimeError, match="refuses"):
            costs.replay(model, costs.modes()["json_schema"].guide.text, model.tokenize("[1]", add_special=False))
    finally:
        model.free()


class Unmaskable:
    """A guide whose mask fails (as llguidance's does on a buffer of the wrong size)."""

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        raise ValueError(f"no mask into {size} bytes")


@pytest.mark.engine
def test_a_guide_masks_ahead_what_llguidance_masks_inline(costs: ModuleType) -> None:
    """The mask a guide computes when its context's decode is launched (serving/engine/guided.py) is, at every
    token of an answer, the one llguidance computes inline, whether the due masks were computed or it was asked
    first; its bit refuses what the mask refuses; the best allowed token wins over a better refused one; a mask
    that fails fails the guide that reads it, and the other due masks are still computed."""
    import numpy as np

    from serving.engine.config import EngineConfig
    from serving.engine.guided import DueMasks, Guided
    from serving.engine.llama import LlamaModel

    model = LlamaModel(EngineConfig().model_path, n_gpu_layers=0)
    due = DueMasks()
    try:
        grammar = costs.modes()["json_schema"].guide.text
        guided = Guided(model.guides.matcher(grammar), model.n_vocab, due)
        inline = model.guides.matcher(grammar)
        mask = np.zeros((model.n_vocab + 31) // 32, dtype=np.uint32)
        tokens = model.tokenize(costs.ANSWERS["json_schema"], add_special=False, parse_special=True)
        for i, token in enumerate(tokens):
            if i % 2:  # every other token as a decode would: the due masks computed before any is read
                due.compute()
            inline.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            expected = np.unpackbits(mask.view(np.uint8), bitorder="little")[:model.n_vocab].astype(bool)
            assert np.array_equal(guided.allowed(), expected)
            refused = int(np.flatnonzero(~expected)[0])
            assert guided.allows(token) and not guided.allows(refused)
            logits = np.zeros(model.n_vocab, dtype=np.float32)
            logits[[refused, token]] = [5.0, 1.0]
            assert guided.best(logits) == token
            guided.advance(token)
            assert inline.consume_token(token)
        fresh = Guided(model.guides.matcher(grammar), model.n_vocab, due)
        with pytest.raises(RuntimeError, match="refused token"):
            fresh.advance(int(np.flatnonzero(~fresh.allowed())[0]))
        failing = Guided(Unmaskable(), model.n_vocab, due)  # type: ignore[arg-type]
        other = Guided(model.guides.matcher(grammar), model.n_vocab, due)
        due.compute()
        with pytest.raises(RuntimeError, match="mask failed"):
            failing.allows(0)
        assert other.allowed().any()
    finally:
        model.free()
