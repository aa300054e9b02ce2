"""Constrained decoding: OpenAI's `response_format` and forced tool calls become llama.cpp GBNF grammars.

The JSON-schema-to-GBNF conversion is llama-cpp-python's (the same converter llama-server's Python tooling
uses); the grammar is then enforced token by token in the sampler chain (serving/llama.py), so the output
parses whatever the model's size. Why GBNF rather than llguidance: measured per-token cost and the reason
are in docs/performance.md ("Constrained decoding").
"""

from __future__ import annotations

import json
from typing import Any

from serving.llama import JSON_GBNF, SchemaConverter


class GrammarError(ValueError):
    """A schema or grammar we cannot compile; the message says why (answered with 400)."""


def schema_rules(schema: Any, rule: str = "") -> tuple[str, str]:
    """GBNF rules for a JSON schema and the name of its top rule (`root` when `rule` is empty)."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "request")
        top = converter.visit(resolved, rule)
        return str(converter.format_grammar()), str(top)
    except Exception as exc:  # the converter raises plain errors (or asserts) on what it does not support
        raise GrammarError(f"the JSON schema cannot be compiled to a grammar: {exc}") from exc


def json_schema_grammar(schema: Any) -> str:
    return schema_rules(schema)[0]


def response_format_grammar(kind: str, schema: Any | None = None) -> str | None:
    """`text` -> no grammar; `json_object` -> any JSON object; `json_schema` -> that schema."""
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_GBNF
    if kind == "json_schema":
        if schema is None:
            raise GrammarError("response_format json_schema needs json_schema.schema")
        return json_schema_grammar(schema)
    raise GrammarError(f"unknown response_format type {kind!r}")


MAX_CALL_STRING = 256  # characters of a string argument that set no maxLength
MAX_CALL_ITEMS = 32  # items of an array argument that sets no maxItems
MAX_PARALLEL_CALLS = 8  # calls in one forced answer with parallel_tool_calls


def bounded(schema: Any) -> Any:
    """The schema with a length bound on every string and array that has none.

    A forced call must end: a sampled string can otherwise run on until max_tokens and leave the call
    unfinished, which a small model does at high temperature. Bounded, every call closes well within a
    slot. Only forced calls get this; response_format schemas are taken as given.
    """
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    kind = out.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and not {"enum", "const", "pattern", "format", "maxLength"} & out.keys():
        out["maxLength"] = MAX_CALL_STRING
    if "array" in kinds and "maxItems" not in out:
        out["maxItems"] = MAX_CALL_ITEMS
    return out


def tool_call_grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """A grammar for one (or, with `parallel`, one or more) Hermes-style calls:
    <tool_call>\\n{"name": <one of the functions>, "arguments": <its parameters>}\\n</tool_call>,
    the parameters bounded (see `bounded`)."""
    if not functions:
        raise GrammarError("tool_choice needs at least one tool")
    variants = [{"type": "object", "properties": {"name": {"const": name},
                                                  "arguments": bounded(params or {"type": "object"})},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, params in functions]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    rules, call = schema_rules(schema, "call")
    repeat = f' ("\\n" block){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    return f'root ::= block{repeat}\nblock ::= "<tool_call>\\n" {call} "\\n</tool_call>"\n{rules}'
