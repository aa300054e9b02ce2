"""Anthropic's Messages API requests (POST /v1/messages and /v1/messages/count_tokens) and their translation into
what the OpenAI layer renders and the engine runs: chat messages in the template's shape (OpenAI's, as
ChatMessage.as_template_dict gives them), tools as OpenAI functions, the tool choice as `tool_plan` takes it,
and SamplingParams. Pure data: no Ray, no libllama, no FastAPI.

The shapes follow the anthropic SDK's types. What this server cannot do is refused with a 400 that names it,
never ignored: content blocks other than text, tool_use, tool_result and thinking (images, documents, search
results, server tools' blocks), server tools (`web_search_...`, `bash_...`), MCP servers, containers. Fields
that never change an answer (`metadata`, `service_tier`, `cache_control`, ...) are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from serving.engine.request import Constraint, SamplingParams
from serving.engine.sampler_defaults import LLAMA_SERVER, SamplerDefaults
from serving.front.errors import APIError
from serving.openai.requests import (INT32_MAX, MAX_STOP_STRINGS, NO_EFFECT_FIELDS, RequestBody, StopString, Text,
                                     unsent)

ANTHROPIC_NO_EFFECT = NO_EFFECT_FIELDS | {  # accepted: they never change what is generated
    "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id", "workspace_id",
    # accepted, not applied: Claude Code sends it with every request (clear old tool results or thinking once
    # the context grows); the whole conversation is rendered, which a slot too small for it refuses with a 400
    "context_management",
}
TOOL_ERROR_PREFIX = "Error: "  # a tool_result with is_error: the model reads that the call failed


class BlockType(str, Enum):
    """The content blocks this server reads; any other type is `unsupported` (refused, named)."""

    text = "text"
    tool_use = "tool_use"
    tool_result = "tool_result"
    thinking = "thinking"
    redacted_thinking = "redacted_thinking"
    unsupported = "unsupported"


def _block_tag(value: Any) -> str:
    """A block's tag for the union below: its type when this server reads it, else `unsupported`."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    known = {b.value for b in BlockType} - {BlockType.unsupported.value}
    return kind if kind in known else BlockType.unsupported.value


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: no effect on an answer


class TextBlock(_Block):
    type: Literal["text"]
    text: Text


class UnsupportedBlock(BaseModel):
    """A block of a type this server does not read (image, document, ...): kept to be refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str = "(no type)"


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolReferenceBlock(_Block):
    """A tool_result's pointer to a deferred tool (Claude Code's tool search): no text for the model, and every
    tool is shown to it anyway (`defer_loading` is not applied)."""

    type: Literal["tool_reference"]
    tool_name: str = ""


def _result_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "tool_reference") else BlockType.unsupported.value


ResultPart = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolReferenceBlock, Tag("tool_reference")]
                       | Annotated[UnsupportedBlock, Tag("unsupported")], Discriminator(_result_tag)]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Text | list[ResultPart] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: Text
    signature: str = ""


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[UnsupportedBlock, Tag("unsupported")],
    Discriminator(_block_tag)]
SystemBlock = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[UnsupportedBlock, Tag("unsupported")],
                        Discriminator(lambda v: "text" if _block_tag(v) == "text" else "unsupported")]


class InputMessage(BaseModel):
    """A turn; `system` is a mid-conversation system message (text only), which recent Claude Code sends."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: Text | list[Block]


class ToolDef(BaseModel):
    """A client tool (`type` absent or `custom`); a server tool (`web_search_...`) is refused by name."""

    model_config = ConfigDict(extra="ignore")  # cache_control, strict, input_examples, defer_loading, ...
    name: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: Text | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceType(str, Enum):
    auto = "auto"
    any = "any"  # some tool must be called: OpenAI's `required`
    tool = "tool"  # the named tool must be called
    none = "none"


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: ToolChoiceType
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> Self:
        if (self.type is ToolChoiceType.tool) != (self.name is not None):
            raise ValueError("tool_choice names a tool (`name`) exactly when its type is `tool`")
        return self


class ThinkingConfig(BaseModel):
    """Extended thinking: the model's `<think>` text comes back as thinking blocks (split off as
    reasoning_content is on the OpenAI routes); `enabled`/`disabled` reach the template as `enable_thinking`.
    `budget_tokens` is accepted, not enforced: max_tokens bounds thinking and answer together."""

    model_config = ConfigDict(extra="ignore")  # display
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(BaseModel):
    """`format`: the answer is JSON valid against the schema; `effort` is accepted (no effect here)."""

    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    format: OutputFormat | None = None


class MessagesBody(RequestBody):
    """What /v1/messages and its count_tokens share: the conversation, its tools and how it is rendered. A JSON
    object whose fields this server does not implement are reported (RequestBody), with Anthropic's own
    do-nothing fields."""

    NO_EFFECT: ClassVar[frozenset[str]] = ANTHROPIC_NO_EFFECT

    model: Text | None = Field(None, description="any name: this server answers with the one model it serves")
    messages: list[InputMessage] = Field(..., min_length=1)
    system: Text | list[SystemBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """`thinking` as the variable Qwen3-style templates read; unset leaves the template's default."""
        if self.thinking is None:
            return {}
        return {"enable_thinking": self.thinking.type != "disabled"}


class CountTokensRequest(MessagesBody):
    """POST /v1/messages/count_tokens: the prompt that /v1/messages would run, counted."""


class MessagesRequest(MessagesBody):
    """POST /v1/messages."""

    max_tokens: int = Field(..., ge=1, description="at most this many tokens; fewer when the slot's context "
                            "ends first (stop_reason model_context_window_exceeded)")
    temperature: float | None = Field(None, ge=0.0, le=1.0, description=unsent("temp", LLAMA_SERVER.temperature))
    top_p: float | None = Field(None, gt=0.0, le=1.0, description=unsent("top_p", LLAMA_SERVER.top_p))
    top_k: int | None = Field(None, ge=0, le=INT32_MAX, description=unsent("top_k", LLAMA_SERVER.top_k))
    stop_sequences: list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False

    def sampling_params(self, max_tokens: int, constraint: Constraint | None,
                        defaults: SamplerDefaults = LLAMA_SERVER) -> SamplingParams:
        """The engine's parameters; `max_tokens` as the route fits it to the slot. Anthropic's samplers are
        temperature, top_p and top_k, the model's defaults where unsent (min-p too, which the API lacks); no
        repeat penalty, as its API has none."""
        return SamplingParams(max_tokens=max_tokens,
                              temperature=defaults.temperature if self.temperature is None else self.temperature,
                              top_p=defaults.top_p if self.top_p is None else self.top_p,
                              top_k=defaults.top_k if self.top_k is None else self.top_k,
                              min_p=defaults.min_p, repeat_penalty=1.0, penalty_last_n=0,
                              stop=tuple(s for s in self.stop_sequences or () if s), constraint=constraint)


# -- translation -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conversation:
    """A request's conversation as the template renders it, and the text of a final assistant turn, which the
    answer continues (Anthropic's prefill: it follows the rendered prompt, and the answer holds only what
    comes after it)."""

    messages: list[dict[str, Any]]
    prefill: str = ""


@dataclass(frozen=True)
class ToolsAsked:
    """The request's tools in OpenAI's function shape and its tool choice as `tool_plan` takes it."""

    tools: list[dict[str, Any]]
    choice: str  # none, auto or required
    named: str | None = None
    parallel: bool = False


def conversation(body: MessagesBody) -> Conversation:
    """The system prompt and messages as chat messages: a user turn's tool_result blocks become `tool` turns
    (in their order, before its text), an assistant turn's tool_use blocks its tool calls and its thinking
    its reasoning_content. Mid-conversation system messages join the system prompt, in order: chat templates
    take one system message, the first (Qwen's refuse any other), so one in place would fail or be dropped.
    Blocks this server does not read are refused with a 400 naming them."""
    out: list[dict[str, Any]] = []
    system = [_system_text(body.system, "system")] + [
        _system_text(m.content, f"messages.{i}.content") for i, m in enumerate(body.messages) if m.role == "system"]
    if any(system):
        out.append({"role": "system", "content": "\n\n".join(text for text in system if text)})
    for i, message in enumerate(body.messages):
        blocks: list[Any] = ([TextBlock(type="text", text=message.content)] if isinstance(message.content, str)
                             else message.content)
        if message.role == "user":
            out += _user_turns(blocks, f"messages.{i}.content")
        elif message.role == "assistant":
            out.append(_assistant_turn(blocks, f"messages.{i}.content"))
    last = body.messages[-1]
    if last.role == "assistant" and not out[-1].get("tool_calls"):
        return Conversation(out[:-1], out[-1]["content"])
    return Conversation(out)


def tools_asked(body: MessagesBody) -> ToolsAsked:
    """Client tools as OpenAI functions; tool_choice `any` is OpenAI's `required`, `tool` a named function.
    A forced answer may hold several calls only when the client says `disable_parallel_tool_use: false`:
    unset is one call, as on the OpenAI routes (serving/openai/routes.py tool_plan says why)."""
    tools = [_function(tool, f"tools.{i}") for i, tool in enumerate(body.tools or [])]
    choice = body.tool_choice
    if choice is None:
        return ToolsAsked(tools, "auto" if tools else "none")
    parallel = choice.disable_parallel_tool_use is False
    if choice.type is ToolChoiceType.tool:
        return ToolsAsked(tools, "required", choice.name, parallel)
    kind = {ToolChoiceType.any: "required", ToolChoiceType.auto: "auto", ToolChoiceType.none: "none"}[choice.type]
    return ToolsAsked(tools, kind, None, parallel)


def unsupported_block(kind: str, param: str) -> APIError:
    return APIError(400, f"content blocks of type '{kind}' are not supported by this server: it reads text, "
                         "tool_use, tool_result and thinking blocks", param=param)


def _system_text(system: str | list[Any] | None, param: str) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for j, block in enumerate(system):
        if isinstance(block, UnsupportedBlock):
            raise unsupported_block(block.type, f"{param}.{j}")
        if not isinstance(block, TextBlock):
            raise APIError(400, f"a system message holds text only, not a {block.type} block", param=f"{param}.{j}")
        texts.append(block.text)
    return "\n\n".join(texts)


def _user_turns(blocks: list[Any], param: str) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id,
                          "content": _result_text(block, f"{param}.{j}.content")})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, UnsupportedBlock):
            raise unsupported_block(block.type, f"{param}.{j}")
        else:
            raise APIError(400, f"a user turn cannot hold a {block.type} block", param=f"{param}.{j}")
    if texts or not turns:
        turns.append({"role": "user", "content": "\n\n".join(texts)})
    return turns


def _result_text(block: ToolResultBlock, param: str) -> str:
    content = block.content
    if not isinstance(content, str):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, UnsupportedBlock):
                raise unsupported_block(part.type, f"{param}.{k}")
            if isinstance(part, TextBlock):
                texts.append(part.text)
        content = "\n\n".join(texts)
    return TOOL_ERROR_PREFIX + content if block.is_error else content


def _assistant_turn(blocks: list[Any], param: str) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, UnsupportedBlock):
            raise unsupported_block(block.type, f"{param}.{j}")
        elif not isinstance(block, RedactedThinkingBlock):  # redacted thinking holds nothing a model can read
            raise APIError(400, f"an assistant turn cannot hold a {block.type} block", param=f"{param}.{j}")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if thinking:
        turn["reasoning_content"] = "".join(thinking)
    return turn


def _function(tool: ToolDef, param: str) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise APIError(400, f"server tools ('{tool.type}') are not supported by this server: send client tools "
                            "(name, description, input_schema)", param=f"{param}.type")
    if tool.input_schema is None:
        raise APIError(400, f"the tool '{tool.name}' has no input_schema", param=f"{param}.input_schema")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}
