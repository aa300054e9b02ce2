"""Default bounds that make a constrained answer end: integers and numbers get a range and a precision, as
strings and arrays get a length (serving/openai/structured.py's `bounded`); the schema's own bounds win.

The grammar tests feed text byte by byte to llguidance's matcher (a byte vocabulary: no model), the engine
test has the embedded model answer a schema of bare integer and number fields."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from serving.engine.request import FinishReason

if TYPE_CHECKING:
    from serving.engine.core import Engine

M = 10**15 - 1  # the default magnitude: 15 digits
NUMBER = {"minimum": -M, "maximum": M, "multipleOf": 1e-6}
INTEGER = {"minimum": -M, "maximum": M}


@pytest.mark.unit
@pytest.mark.parametrize("schema,added", [
    ({"type": "integer"}, INTEGER),
    ({"type": "number"}, NUMBER),
    ({"type": ["number", "null"]}, NUMBER),
    ({"type": ["integer", "string"]}, {**INTEGER, "maxLength": 1000}),
    ({"type": "integer", "minimum": 0}, {"maximum": M}),
    ({"type": "integer", "exclusiveMaximum": 10}, {"minimum": -M}),
    ({"type": "number", "minimum": 1, "maximum": 5}, {"multipleOf": 1e-6}),
    ({"type": "number", "multipleOf": 0.25}, INTEGER),
    ({"type": "integer", "minimum": 10**16}, {"maximum": 10**16 + M}),  # never below the schema's own minimum
    ({"type": "number", "exclusiveMaximum": -10**17}, {"minimum": -10**17 - M, "multipleOf": 1e-6}),
    ({"type": "integer", "minimum": 3, "exclusiveMinimum": True}, {"maximum": M}),  # draft 4's boolean form
    ({"type": "integer", "enum": [1, 2]}, {}),
    ({"type": "number", "const": 2.5}, {}),
])
def test_integers_and_numbers_get_a_range_unless_the_schema_sets_one(schema: dict[str, Any],
                                                                    added: dict[str, Any]) -> None:
    from serving.openai.structured import ANSWER_BOUNDS, bounded

    assert bounded(schema, ANSWER_BOUNDS) == {**schema, **added}


@pytest.mark.unit
def test_numbers_are_bounded_wherever_they_sit_and_the_callers_schema_is_left_alone() -> None:
    from serving.openai.structured import CALL_BOUNDS, bounded

    schema = {"type": "object", "properties": {
        "people": {"type": "integer"}, "minimum": {"type": "number"},  # a property named like a keyword
        "rows": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "fixed": {"enum": [{"type": "integer"}]}}, "$defs": {"n": {"type": "number", "maximum": 3}}}
    out = bounded(schema, CALL_BOUNDS)
    props = out["properties"]
    assert props["people"] == {"type": "integer", **INTEGER} and props["minimum"] == {"type": "number", **NUMBER}
    assert props["rows"]["items"]["anyOf"][0] == {"type": "integer", **INTEGER}
    assert props["fixed"] == {"enum": [{"type": "integer"}]}  # a JSON value, not a schema
    assert out["$defs"]["n"] == {"type": "number", "maximum": 3, "minimum": -M, "multipleOf": 1e-6}
    assert schema["properties"]["people"] == {"type": "integer"}


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, for llguidance's matcher without a model."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _fed(grammar: str, text: str) -> tuple[int, bool]:
    """How many bytes of `text` the grammar takes, and whether it may end there."""
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    matcher = LLMatcher(LLTokenizer(TokenizerWrapper(_Bytes())), grammar, log_level=0)
    data = list(text.encode())
    taken = matcher.try_consume_tokens(data)
    return taken, taken == len(data) and matcher.is_accepting()


@pytest.mark.unit
def test_an_integers_digits_end_and_a_schemas_range_is_kept() -> None:
    from serving.openai.structured import json_schema_guide

    grammar = json_schema_guide({"type": "integer"}).text
    assert _fed(grammar, "9" * 15) == (15, True) and _fed(grammar, "-" + "9" * 15) == (16, True)
    assert _fed(grammar, "2" + "0" * 40) == (15, False)  # the 16th digit is refused: the number has ended
    own = json_schema_guide({"type": "integer", "minimum": 0, "maximum": 10**18}).text
    assert _fed(own, "1" + "0" * 18) == (19, True) and _fed(own, "-1")[0] == 0


@pytest.mark.unit
def test_a_numbers_digits_end_on_both_sides_of_the_point() -> None:
    from serving.openai.structured import json_schema_guide

    grammar = json_schema_guide({"type": "object", "properties": {"price": {"type": "number"}},
                                 "required": ["price"]}).text
    assert _fed(grammar, '{"price": 3.141592}') == (19, True)
    assert _fed(grammar, '{"price": -12}') == (14, True)
    assert _fed(grammar, '{"price": 3.1415926')[0] == 18  # the seventh decimal is refused
    assert _fed(grammar, '{"price": ' + "2" * 16)[0] == 10 + 15
    assert _fed(grammar, '{"price": 1e5}')[0] == 11  # no exponent in a bounded number
    own = json_schema_guide({"type": "number", "multipleOf": 0.5}).text
    assert _fed(own, "2.5") == (3, True) and _fed(own, "2.25")[0] < 4


# -- the embedded model on bare integer and number fields ----------------------------------------------
PEOPLE = {"type": "object", "properties": {"people": {"type": "integer"}}, "required": ["people"]}
PRICE = {"type": "object", "properties": {"price": {"type": "number"}}, "required": ["price"]}
SURVEY = {"type": "object", "properties": {"year": {"type": "integer"}, "people": {"type": "integer"},
                                           "share": {"type": "number"}}, "required": ["year", "people", "share"]}
POPULATION, WATER, COFFEE = ("What is the world population in 2000?", "What fraction of the earth is water?",
                             "What does a coffee cost? Answer in JSON.")


@pytest.mark.engine
@pytest.mark.parametrize("question,schema,seed,temperature", [  # each ran to max_tokens without number bounds
    (POPULATION, PEOPLE, None, 0.0),  # {"people": 711888888888888888...
    (WATER, PEOPLE, None, 0.0),  # {"people": 333333333333333333...
    (WATER, PEOPLE, 1, 0.8),
    (POPULATION, PRICE, None, 0.0),  # {"price": 2.188888888888888888...
    (COFFEE, SURVEY, 1, 0.8),  # ... "share": 0.01222233249030982321...
])
def test_an_answer_of_bare_numbers_ends_before_max_tokens(engine: Engine, question: str, schema: dict[str, Any],
                                                          seed: int | None, temperature: float) -> None:
    """The route's path from a chat request to tokens: response_format json_schema, the chat template, the
    engine; the answer must end on its own (finish_reason stop, never length) and parse to the schema's types."""
    from serving.openai.requests import ChatCompletionRequest
    from serving.openai.structured import constraint_of
    from tests.helpers import collect

    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": question}], "max_tokens": 100, "temperature": temperature,
        "seed": seed, "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    params = body.sampling_params(engine.n_ctx_slot, constraint_of(body))
    prompt = engine.tokenize_prompt(engine.render_chat([m.as_template_dict() for m in body.messages]))
    answer = collect(engine.submit(prompt, params), allow=(FinishReason.stop,))  # fails on an error chunk too
    value = json.loads(answer.text)
    assert set(value) == set(schema["properties"]), answer.text
    for key, field in schema["properties"].items():
        assert isinstance(value[key], int if field["type"] == "integer" else int | float) and abs(value[key]) <= M
