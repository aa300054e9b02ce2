"""OpenAI request/response shapes. Pure data: no Ray, no libllama, no FastAPI.

Requests are parsed into typed models; values out of range get a 400 naming the parameter. Nothing is
silently ignored: a field this server does not implement gets a 400 naming it (`unsupported_fields`),
except fields that never change an answer (`user`, `metadata`, ...) and unimplemented ones sent with
their do-nothing value (null, false). Every bound here
exists so that no request body can reach the engine with a value it cannot take (a number llama.cpp
stores in 32 bits, a float that is not finite, text that is not valid Unicode): bad input is the client's
400, never the server's 500. Responses are built as plain dicts: one is made per streamed token, and
dicts are the cheapest thing to serialise.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from serving.engine.request import Constraint, SamplingParams
from serving.engine.sampler_defaults import LLAMA_SERVER, SamplerDefaults
from serving.openai.reasoning import ReasoningFormat

T = TypeVar("T")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # stop strings are matched against the text on every token: keep each one short
INT32_MAX = 2**31 - 1  # llama.cpp's top_k and penalty_last_n are int32
UINT32_MAX = 2**32 - 1  # llama.cpp's seeds are uint32
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat; completions allow 5
NO_EFFECT_FIELDS = frozenset({  # accepted: they never change what is generated
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "cache_prompt",
})


def _encodable(text: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); they are not text and cannot be tokenised."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text is not valid Unicode (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(_encodable)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, usage comes once at the end


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON that validates against a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama-server's spelling for json_object


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def as_template_dict(self) -> dict[str, Any]:
        """Hugging Face templates read `arguments` as a mapping (OpenAI sends JSON text)."""
        args: Any = self.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # a template renders the text as it came
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class RequestBody(BaseModel):
    """A request body: a JSON object; fields this server does not implement are reported, never ignored."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    NO_EFFECT: ClassVar[frozenset[str]] = NO_EFFECT_FIELDS
    IDLE: ClassVar[tuple[Any, ...]] = (None, False, 0, [], {})  # values that ask for nothing

    @model_validator(mode="before")
    @classmethod
    def _body_is_an_object(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError("the request body must be a JSON object")
        return data

    def unsupported_fields(self) -> list[str]:
        """Fields sent that this server does not implement (and that would change the answer)."""
        extra = self.model_extra or {}
        return sorted(k for k, v in extra.items() if k not in self.NO_EFFECT and v not in self.IDLE)


def unsent(key: str, value: float) -> str:
    """A sampler field's description: what an unsent value samples as."""
    return f"default: the model's general.sampling.{key}, else llama-server's {value}"


def _sent(value: T | None, default: T) -> T:
    return default if value is None else value


class _SamplingFields(RequestBody):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's plus llama-server's extensions)."""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1, description="default: until the slot's context is full")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description=unsent("temp", LLAMA_SERVER.temperature))
    top_p: float | None = Field(None, gt=0.0, le=1.0, description=unsent("top_p", LLAMA_SERVER.top_p))
    top_k: int | None = Field(None, ge=0, le=INT32_MAX, description="0 = off; " + unsent("top_k", LLAMA_SERVER.top_k))
    min_p: float | None = Field(None, ge=0.0, le=1.0, description=unsent("min_p", LLAMA_SERVER.min_p))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repeat_penalty: float | None = Field(None, gt=0.0, description=unsent("penalty_repeat",
                                                                          LLAMA_SERVER.repeat_penalty))
    repeat_last_n: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 = the whole slot; " + unsent(
        "penalty_last_n", LLAMA_SERVER.repeat_last_n))
    seed: int | None = Field(None, ge=-1, le=UINT32_MAX, description="llama.cpp seeds are 32-bit; -1 = random")
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=256, description="choices, at most the server's slots (they run at once)")
    ignore_eos: bool = False
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id -> bias added to its logit; -100 bans it, 100 forces it")
    grammar: Text | None = Field(None, description="llama-server's raw GBNF grammar (root rule 'root')")
    json_schema: dict[str, Any] | None = Field(None, description="llama-server's: constrain to this JSON schema")
    response_format: ResponseFormat | None = None
    n_predict: int | None = Field(None, ge=-1, le=INT32_MAX, description="llama-server's name for max_tokens; "
                                  "-1 = until the slot's context is full")

    @model_validator(mode="after")
    def _llama_server_max_tokens_name(self) -> Self:
        """`n_predict` (llama-server's name) sets max_tokens; both at once would leave one of them ignored."""
        if self.n_predict is not None:
            if self.n_predict == 0:
                raise ValueError("n_predict must be -1 (until the slot's context is full) or at least 1")
            if self.max_tokens is not None:
                raise ValueError("send one of max_tokens and n_predict, not both")
            self.max_tokens = None if self.n_predict < 0 else self.n_predict
        return self

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias); OpenAI's -100 means "never": -inf, so it really never appears."""
        out = []
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys are token ids; {key!r} is not one") from None
            out.append((token, -math.inf if value <= -100 else value))
        return tuple(out)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; k >= 0: the chosen token's and the k most likely (per endpoint's fields)."""
        return None

    def sampling_params(self, n_ctx_slot: int | None = None, constraint: Constraint | None = None,
                        defaults: SamplerDefaults = LLAMA_SERVER) -> SamplingParams:
        """The engine's parameters, `defaults` (the model's) where a setting is unsent; `repeat_last_n` is
        capped at the slot (a penalty window longer than what a slot holds means the same, and llama.cpp
        allocates the window up front)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        last_n = _sent(self.repeat_last_n, defaults.repeat_last_n)
        if n_ctx_slot is not None:
            last_n = n_ctx_slot if last_n < 0 else min(last_n, n_ctx_slot)
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=_sent(self.temperature, defaults.temperature),
            top_p=_sent(self.top_p, defaults.top_p), top_k=_sent(self.top_k, defaults.top_k),
            min_p=_sent(self.min_p, defaults.min_p),
            repeat_penalty=_sent(self.repeat_penalty, defaults.repeat_penalty), presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, penalty_last_n=max(last_n, 0),
            seed=None if self.seed is None or self.seed < 0 else self.seed,
            stop=tuple(s for s in stops if s), ignore_eos=self.ignore_eos, logit_bias=self.bias(),
            constraint=constraint, logprobs=self.top_logprobs_asked(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "input_text", "output_text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: Text | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """Templates expect plain string content (text parts are joined), tool calls with mapping arguments."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.as_template_dict() for c in self.tool_calls]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="with tool_choice required: true allows several "
                                             "calls; unset or false, one (serving/openai/routes.py plan_tools)")
    reasoning_format: ReasoningFormat = Field(ReasoningFormat.auto, description="llama-server's: none leaves "
                                              "<think> text in the content; auto/deepseek move it to "
                                              "reasoning_content")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat "
                                                        "template, e.g. {\"enable_thinking\": false}")

    @model_validator(mode="after")
    def _newer_max_tokens_name(self) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def function_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]


class CompletionRequest(_SamplingFields):
    prompt: Text | list[int] | list[Text] | list[list[int]] = Field(..., description="one prompt, or a list "
                                                                    "of prompts (text or token ids)")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: str | list[int] | list[str] | list[list[int]]) -> Any:
        if not value or (isinstance(value, list) and any(isinstance(p, (str, list)) and not p for p in value)):
            raise ValueError("the prompt is empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: OpenAI takes one or many, as text or token ids."""
        p: Any = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [[int(t) for t in p]]
        return [x if isinstance(x, str) else [int(t) for t in x] for x in p]

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class ResponsesInputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponsesTextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = "text"


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: ResponsesTextFormat | None = None


class ResponsesRequest(RequestBody):
    """OpenAI's /v1/responses for plain text in and out: `input` as text or messages, `instructions`."""

    NO_EFFECT: ClassVar[frozenset[str]] = NO_EFFECT_FIELDS | {"reasoning", "tool_choice", "tools", "include"}
    IDLE: ClassVar[tuple[Any, ...]] = (None, False, 0, [], {}, "none", "auto")

    model: Text | None = None
    input: Text | list[ResponsesInputMessage] = Field(..., min_length=1)
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description=unsent("temp", LLAMA_SERVER.temperature))
    top_p: float | None = Field(None, gt=0.0, le=1.0, description=unsent("top_p", LLAMA_SERVER.top_p))
    stream: bool = False
    text: ResponsesText | None = None
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None

    def messages(self) -> list[dict[str, Any]]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        return [*out, *({"role": m.role, "content": m.text()} for m in self.input)]

    def sampling_params(self, defaults: SamplerDefaults = LLAMA_SERVER) -> SamplingParams:
        """The engine's parameters; the API has temperature and top_p: the other cuts are the model's defaults
        (and no repeat penalty: OpenAI's APIs have none)."""
        return SamplingParams(max_tokens=self.max_output_tokens, temperature=_sent(self.temperature,
                              defaults.temperature), top_p=_sent(self.top_p, defaults.top_p),
                              top_k=defaults.top_k, min_p=defaults.min_p)


class TokenizeRequest(BaseModel):
    """llama-server's /tokenize."""

    model_config = ConfigDict(extra="forbid")
    content: Text
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    """llama-server's /detokenize."""

    model_config = ConfigDict(extra="forbid")
    tokens: list[int]
