"""OpenAI request/response shapes and OpenAI's error JSON. Pure data: no Ray, no libllama, no FastAPI.

Requests are parsed into typed models (unknown fields are ignored, as vLLM does, so clients that send
extra OpenAI options keep working); values out of range get a 400 naming the parameter. Every bound here
exists so that no request body can reach the engine with a value it cannot take (a number llama.cpp
stores in 32 bits, a float that is not finite, text that is not valid Unicode): bad input is the client's
400, never the server's 500. Responses are built as plain dicts: one is made per streamed token, and
dicts are the cheapest thing to serialise.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from serving.request import FinishReason, GenerationChunk, SamplingParams, Usage

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # stop strings are matched against the text on every token: keep each one short
INT32_MAX = 2**31 - 1  # llama.cpp's top_k and penalty_last_n are int32
UINT32_MAX = 2**32 - 1  # llama.cpp's seeds are uint32


class APIError(Exception):
    """An error to send back as OpenAI's error JSON with this HTTP status (and these headers)."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error JSON, for the OpenAPI schema (what every 4xx/5xx of this server carries)."""

    error: ErrorDetail


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
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's plus llama-server's extensions)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1, description="default: until the slot's context is full")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=INT32_MAX, description="0 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repeat_penalty: float = Field(1.0, gt=0.0)
    repeat_last_n: int = Field(64, ge=-1, le=INT32_MAX, description="-1 = the whole slot")
    seed: int | None = Field(None, ge=-1, le=UINT32_MAX, description="llama.cpp seeds are 32-bit; -1 = random")
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported; send separate requests for more choices")
        return value

    def sampling_params(self, n_ctx_slot: int | None = None) -> SamplingParams:
        """The engine's parameters; `repeat_last_n` is capped at the slot (a penalty window longer than
        what a slot holds means the same, and llama.cpp allocates the window up front)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        last_n = self.repeat_last_n
        if n_ctx_slot is not None:
            last_n = n_ctx_slot if last_n < 0 else min(last_n, n_ctx_slot)
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repeat_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, penalty_last_n=max(last_n, 0), seed=self.seed,
            stop=tuple(s for s in stops if s), ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """Templates expect plain string content; text parts are joined."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _newer_max_tokens_name(self) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_SamplingFields):
    prompt: Text | list[int] | list[Text] = Field(...)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("send one prompt per request (a list of several prompts is not supported)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one OpenAI-style 400 naming one bad parameter.

    For a union (`prompt` is text, token ids or a list of text) pydantic reports every member; the one
    that got deepest into the value is the one that matched the client's intent.
    """
    if not errors:
        return APIError(400, "invalid request")
    if errors[0].get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    located = [(_param_path(err.get("loc", ())), err) for err in errors]
    loc, first = max(located, key=lambda pair: (len(pair[0]), not str(pair[1].get("type", "")).endswith("_type")))
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request"))
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type", "missing"):
        msg = "the request body must be a JSON object"
    return APIError(400, f"invalid value for '{param}': {msg}" if param else msg, param=param)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_path(loc: tuple[Any, ...] | list[Any]) -> list[str]:
    """`('body', 'prompt', 'list[str]', 0, 'function-after[...]')` -> `['prompt', '0']`."""
    return [str(part) for part in loc
            if isinstance(part, int) or (part != "body" and str(part).isidentifier() and part not in _UNION_TAGS)]


def internal_error(request_id: str) -> APIError:
    """What a client sees of a server bug: no exception text, only the id the log line carries."""
    return APIError(500, f"internal server error (request id {request_id}); the details are in the server log",
                    type_="server_error", code="internal_error")


# -- responses ---------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_dict(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage()
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(chunk: GenerationChunk) -> str | None:
    """OpenAI knows 'stop' and 'length'; a cancelled or failed request never reaches a client as such."""
    reason = chunk.finish_reason
    if reason in (FinishReason.stop, FinishReason.length):
        return FinishReason(reason).value
    return None


class ResponseBuilder:
    """Builds the JSON bodies of one response (chat or text completion), streamed or whole."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def stream_chunk(self, text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_dict(usage)}

    def whole(self, text: str, reason: str | None, usage: Usage | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        usage = usage or Usage()
        body = self._envelope(self.object, [choice])
        body["usage"] = usage_dict(usage)
        body["timings"] = {"ttft_ms": None if usage.ttft_s is None else usage.ttft_s * 1e3,
                           "predicted_per_second": usage.decode_tok_s}
        return body

