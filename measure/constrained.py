"""The constrained modes the benchmarks measure (scripts/bench_constrained.py, scripts/guide_costs.py): each
kind of constrained request with its constraint as the server compiles it (an llguidance guide) and as GBNF
(llama.cpp's grammar sampler, the reference), one valid answer of each, and what each of a guide's calls costs
per token when that answer is replayed through it (no decoding: only the vocabulary is loaded).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from serving.engine import llama  # first: the library load order, see serving/engine/llama.py
import numpy as np  # noqa: E402
from llama_cpp.llama_grammar import JSON_GBNF, SchemaConverter  # noqa: E402  (pure Python: GBNF, the reference)
from serving.openai.structured import (  # noqa: E402
    ANSWER_BOUNDS, CALL_BOUNDS, bounded, response_format_guide, tool_call_guide,
)
from serving.engine.request import Constraint  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 40},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                       "maxItems": 4}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
# An object with an array of objects holding an array of objects: the shape whose forced call was measured
# slower than its JSON schema (issue 43, docs/log/2026-12-07-cpu-forced-call-nested.md)
ORDER: dict[str, Any] = {"type": "object", "properties": {
    "customer": {"type": "string"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"},
        "options": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "value": {"type": "string"}}, "required": ["name", "value"]}}},
        "required": ["sku", "qty", "options"]}}},
    "required": ["customer", "items"]}
PLACE_ORDER: dict[str, Any] = {"type": "function", "function": {
    "name": "place_order", "description": "Place an order", "parameters": ORDER}}


@dataclass(frozen=True)
class Mode:
    """One kind of constrained request: its question, the tools its prompt shows (none: a plain question), and its
    constraint as the server compiles it (an llguidance guide) and as GBNF (llama.cpp's grammar sampler, the
    reference)."""

    text: str
    tools: tuple[dict[str, Any], ...]
    guide: Constraint
    gbnf: str


def gbnf_of(schema: dict[str, Any], rule: str = "") -> tuple[str, str]:
    """GBNF rules for a JSON schema (llama-cpp-python's converter, as llama-server's Python tooling) and the
    name of its top rule."""
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    top = converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "request"), rule)
    return str(converter.format_grammar()), str(top)


def tool_mode(text: str, tool: dict[str, Any]) -> Mode:
    """A forced call of `tool`: its guide as the server compiles it, and its GBNF the same Hermes-style block."""
    name, params = tool["function"]["name"], tool["function"]["parameters"]
    call = {"type": "object", "properties": {"name": {"const": name}, "arguments": bounded(params, CALL_BOUNDS)},
            "required": ["name", "arguments"], "additionalProperties": False}
    rules, top = gbnf_of(call, "call")
    gbnf = f'root ::= "<tool_call>\\n" {top} "\\n</tool_call>"\n{rules}'
    return Mode(text, (tool,), tool_call_guide([(name, params)], parallel=False), gbnf)


def schema_mode(text: str, schema: dict[str, Any]) -> Mode:
    """An answer to `schema` (response_format json_schema), no tools shown."""
    guide = response_format_guide("json_schema", schema)
    assert guide is not None
    return Mode(text, (), guide, gbnf_of(bounded(schema, ANSWER_BOUNDS))[0])


def modes() -> dict[str, Mode]:
    """The constrained modes. The nested pair is one schema (ORDER: arrays of objects in an object) as a
    forced call's arguments and as a json_schema answer, the question the same."""
    json_object = response_format_guide("json_object")
    assert json_object is not None
    order = "Order two red A1 widgets and one B7 gadget for Alice."
    return {
        "json_object": Mode("Describe a person as JSON: name, age, city and hobbies.", (), json_object, JSON_GBNF),
        "json_schema": schema_mode("Describe a person: name, age, city and hobbies.", PERSON),
        "tool_call": tool_mode("What's the weather in Paris, in celsius?", WEATHER),
        "json_schema_nested": schema_mode(order, ORDER),
        "tool_call_nested": tool_mode(order, PLACE_ORDER),
    }


# One valid answer per mode (its PERSON schema, its get_weather tool, its ORDER schema and place_order tool).
_ORDERED = {"customer": "Alice", "items": [{"sku": "A1", "qty": 2, "options": [{"name": "color", "value": "red"}]},
                                           {"sku": "B7", "qty": 1, "options": []}]}
ANSWERS = {
    "json_object": json.dumps({"name": "Alice", "age": 34, "note": "likes chess and long walks"}),
    "json_schema": json.dumps({"name": "Alice Smith", "age": 34, "city": "Paris",
                               "hobbies": ["reading", "hiking", "chess"]}),
    "tool_call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                 '\n</tool_call>',
    "json_schema_nested": json.dumps(_ORDERED),
    "tool_call_nested": "<tool_call>\n" + json.dumps({"name": "place_order", "arguments": _ORDERED}) + "\n</tool_call>",
}
CALLS = ("check", "advance", "mask", "unpack")


def replay(model: llama.LlamaModel, grammar: str, tokens: list[int]) -> dict[str, list[float]]:
    """Seconds of each call at each token of `tokens`, through a fresh matcher of `grammar`."""
    guide = model.guides.matcher(grammar)
    mask = np.zeros((model.n_vocab + 31) // 32, dtype=np.int32)
    spent: dict[str, list[float]] = {call: [] for call in CALLS}

    def timed(call: str, work: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = work()
        spent[call].append(time.perf_counter() - start)
        return out

    for token in tokens:
        timed("mask", lambda: guide.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes))
        timed("unpack", lambda: np.unpackbits(mask.view(np.uint8), bitorder="little")[:model.n_vocab].astype(bool))
        if timed("check", partial(guide.validate_tokens, [token])) != 1:
            raise RuntimeError(f"the guide refuses token {token} ({model.token_text(token)!r}) of its own answer")
        if not timed("advance", partial(guide.consume_token, token)):
            raise RuntimeError(f"the guide could not advance on token {token}: {guide.get_error()}")
    return spent


def summary(seconds: list[float]) -> dict[str, float]:
    """A call's figures in microseconds: median and mean (the table), and the worst."""
    micro = [1e6 * s for s in seconds]
    return {"median_us": statistics.median(micro), "mean_us": statistics.fmean(micro), "max_us": max(micro)}
