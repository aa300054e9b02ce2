"""Constrained decoding: OpenAI's `response_format`, llama-server's `json_schema` and forced tool calls become
llguidance grammars, enforced with a token mask (serving/engine/llama.py's SamplerChain); a client's raw GBNF
`grammar` goes to llama.cpp's grammar sampler as llama-server takes it.

Why llguidance: it computes the whole mask in ~10-40 us (serving/engine/guided.py computes it while the model decodes,
so sampling pays a bit lookup), where llama.cpp's grammar sampler took ~10-18 us to check one token and 3-5 ms
for a pass over the vocabulary on every rejected token (the embedded model, this CPU;
docs/log/2026-12-05-cpu-structured-llguidance.md). Compiled grammars are cached per text, so one schema sent again
is not compiled again.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from llguidance import LLMatcher

from serving.engine.request import Constraint, ConstraintKind


class GrammarError(ValueError):
    """A schema or grammar we cannot compile; the message says why (answered with 400)."""


class ConstraintFields(Protocol):
    """The fields of a request body that ask for a constraint (serving/openai/requests.py's completion requests)."""

    grammar: str | None
    json_schema: dict[str, Any] | None
    response_format: Any


def constraint_of(body: ConstraintFields) -> Constraint | None:
    """The constraint a request's `grammar`, `json_schema` or `response_format` asks for (at most one of
    them), compiled once, by the route; ValueError (GrammarError) names what is wrong."""
    fmt = body.response_format
    asked = [name for name, given in (("grammar", body.grammar is not None),
                                      ("json_schema", body.json_schema is not None),
                                      ("response_format", fmt is not None and fmt.type != "text")) if given]
    if len(asked) > 1:
        raise ValueError(f"send one of {', '.join(asked)}, not several")
    if body.grammar is not None:
        return Constraint(ConstraintKind.gbnf, body.grammar)
    if body.json_schema is not None:
        return json_schema_guide(body.json_schema)
    if fmt is None:
        return None
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ValueError("response_format json_schema needs a json_schema object")
        return response_format_guide("json_schema", fmt.json_schema.schema_)
    if fmt.type == "json_object" and fmt.schema_:
        return json_schema_guide(fmt.schema_)
    return response_format_guide(fmt.type)


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, text: str) -> str:
    """An llguidance grammar from a JSON schema (as canonical JSON text) or a Lark grammar, checked; cached,
    so a schema sent again costs a dictionary lookup."""
    grammar = LLMatcher.grammar_from_json_schema(text) if kind == "json" else LLMatcher.grammar_from_lark(text)
    ok, error = _validated(grammar)
    if not ok:
        raise GrammarError(f"the JSON schema cannot be compiled: {error}" if kind == "json" else error)
    return grammar


def _validated(grammar: str) -> tuple[bool, str]:
    """Whether llguidance can use the grammar, and its error if not (warnings are not errors)."""
    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as exc:  # a schema llguidance's compiler rejects outright
        return False, str(exc)
    return not is_error, "; ".join(messages)


# JSON as OpenAI's and Python's json.dumps write it: ", " and ": ", no other whitespace (a model may not pad an
# answer with newlines and indentation until max_tokens), as llama.cpp's schema grammars allow little
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _schema_text(schema: Any) -> str:
    """The schema as llguidance compiles it: closed (see `closed`), in JSON_STYLE; its properties in the order
    given (an answer's keys follow it)."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return json.dumps({**closed(schema), "x-guidance": JSON_STYLE}, separators=(",", ":"))


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say otherwise: an answer
    holds the properties the schema lists, as llama.cpp's schema-to-grammar converter reads a schema (JSON
    Schema itself would allow any others, and a small model then invents one and rambles in it)."""
    def close(out: dict[str, Any]) -> dict[str, Any]:
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    return _each_schema(schema, close)


@dataclass(frozen=True)
class Bounds:
    """Bounds given to the strings, arrays and numbers of a schema that set none (see `bounded`)."""

    string: int  # characters
    items: int
    magnitude: int = 10**15 - 1  # integers and numbers: |value| <= this (15 digits, exact in a double and in JS)
    decimals: int = 6  # numbers: digits after the point (multipleOf 10^-6: money, coordinates to 0.1 m, shares)


CALL_BOUNDS = Bounds(string=256, items=32)  # a forced call's arguments: names, cities, queries
ANSWER_BOUNDS = Bounds(string=1000, items=64)  # an answer's fields; 1000: the longest llama.cpp parses
MAX_PARALLEL_CALLS = 8  # calls in one forced answer with parallel_tool_calls: true
_VALUES = frozenset({"enum", "const", "default", "examples"})  # JSON values, not schemas: left as they are
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def bounded(schema: Any, bounds: Bounds) -> Any:
    """The schema with a length bound on every string and array that has none, and a range (and, for a number,
    a precision) on every integer and number that has none; a bound the schema sets is kept (and a default
    never undercuts its minLength / minItems / minimum).

    A constrained answer must end: a sampled string can otherwise run on until max_tokens and leave the
    JSON unfinished, which a small model does (greedy, it repeats itself inside a string), and so can a
    number's digits (`2000000000000...`). Bounded, an answer whose schema is all bounded closes on its own,
    within max_tokens when they allow its size.
    """
    def bound(out: dict[str, Any]) -> dict[str, Any]:
        kind = out.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if "string" in kinds and not {"enum", "const", "pattern", "format", "maxLength"} & out.keys():
            out["maxLength"] = max(bounds.string, _int(out.get("minLength")))
        if "array" in kinds and "maxItems" not in out:
            out["maxItems"] = max(bounds.items, _int(out.get("minItems")))
        if {"integer", "number"} & set(kinds) and not {"enum", "const"} & out.keys():
            out.update(_number_bounds(out, bounds, decimals="number" in kinds))
        return out

    return _each_schema(schema, bound)


def _number_bounds(schema: dict[str, Any], bounds: Bounds, decimals: bool) -> dict[str, Any]:
    """The keywords that make a number's text end (llguidance turns them into a finite pattern): a range where
    the schema sets no end of it (past the schema's own other end when that lies beyond the default), and for a
    number that is not an integer a multipleOf of 10^-decimals (digits after the point), unless it sets one.
    A bounded number has no exponent in llguidance's grammar."""
    low = _number(schema, "minimum", "exclusiveMinimum")
    high = _number(schema, "maximum", "exclusiveMaximum")
    added: dict[str, Any] = {}
    if high is None:
        added["maximum"] = bounds.magnitude if low is None or low < bounds.magnitude else low + bounds.magnitude
    if low is None:
        added["minimum"] = -bounds.magnitude if high is None or high > -bounds.magnitude else high - bounds.magnitude
    if decimals and "multipleOf" not in schema:
        added["multipleOf"] = 10.0 ** -bounds.decimals
    return added


def _number(schema: dict[str, Any], *keys: str) -> int | float | None:
    """The first of `keys` the schema gives as a number (draft 4's boolean exclusiveMinimum is none)."""
    for key in keys:
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value
    return None


def _each_schema(schema: Any, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of `schema` with `change` applied to every schema object in it, innermost first; JSON values
    (enum, const, default, examples) are left as they are, and in a map of names to schemas (properties,
    $defs, ...) a name is never taken for a keyword (a property may be named "enum")."""
    if isinstance(schema, list):
        return [_each_schema(s, change) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _VALUES else ({n: _each_schema(sub, change) for n, sub in v.items()}
                                      if k in _SCHEMA_MAPS and isinstance(v, dict) else _each_schema(v, change))
           for k, v in schema.items()}
    return change(out)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def json_schema_guide(schema: Any) -> Constraint:
    """The constraint of an answer that validates against `schema`, its strings and arrays bounded
    (ANSWER_BOUNDS where the schema sets no bound)."""
    return Constraint(ConstraintKind.guide, _compiled("json", _schema_text(bounded(schema, ANSWER_BOUNDS))))


def response_format_guide(kind: str, schema: Any | None = None) -> Constraint | None:
    """`text` -> none; `json_object` -> any JSON object; `json_schema` -> that schema."""
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.guide, _compiled("json", _schema_text({"type": "object"})))
    if kind == "json_schema":
        if schema is None:
            raise GrammarError("response_format json_schema needs json_schema.schema")
        return json_schema_guide(schema)
    raise GrammarError(f"unknown response_format type {kind!r}")


def tool_call_guide(functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> Constraint:
    """One Hermes-style call (or, with `parallel`, up to MAX_PARALLEL_CALLS):
    <tool_call>\\n{"name": <one of the functions>, "arguments": <its parameters>}\\n</tool_call>,
    the parameters bounded (CALL_BOUNDS). Once its last call can close, only end-of-generation follows, so
    one call ends the answer right after it."""
    if not functions:
        raise GrammarError("tool_choice needs at least one tool")
    variants = [{"type": "object", "properties": {"name": {"const": name},
                                                  "arguments": bounded(params or {"type": "object"}, CALL_BOUNDS)},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, params in functions]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    _compiled("json", _schema_text(schema))  # a bad parameters schema says so as a schema error
    repeat = f' ("\\n" block){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    lark = f'start: block{repeat}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {_schema_text(schema)}\n'
    return Constraint(ConstraintKind.guide, _compiled("lark", lark))
