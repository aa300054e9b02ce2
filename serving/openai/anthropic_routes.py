"""Anthropic's Messages API over one host's engine: POST /v1/messages (whole or streamed) and
/v1/messages/count_tokens, for Claude Code and other clients of the anthropic SDK.

A request is translated (serving/openai/anthropic_requests.py), rendered through the model's chat template
with its tools as the chat route renders them, constrained as the chat route constrains forced calls
(`tool_plan`), and its answer read back by the same ChoiceState; serving/openai/anthropic_responses.py shapes
the events and the message. Errors on these paths are Anthropic's JSON (the app's handlers choose it by path,
serving/front/errors.py); a full queue is 529 `overloaded_error` with Retry-After, as Anthropic's API answers
when it is overloaded and its clients retry. The model name is not checked: this server serves one model,
and Claude Code asks for its own model names (the answer's `model` says which one answered).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from serving.engine.errors import EngineStoppedError, PromptTooLongError, QueueFullError
from serving.engine.request import FinishReason, GenerationChunk, RequestHandle, paced
from serving.engine.traffic import TrafficTag
from serving.front.errors import AnthropicErrorBody, APIError, anthropic_error_type, internal_error
from serving.front.http import mark_submitted, request_id
from serving.openai.anthropic_requests import (
    CountTokensRequest, MessagesBody, MessagesRequest, conversation, tools_asked,
)
from serving.openai.anthropic_responses import MessageAnswer, matched_stop, sse
from serving.openai.errors import engine_unavailable, queue_full
from serving.openai.reasoning import START as THINK_START
from serving.openai.responses import ChoiceState
from serving.openai.routes import RouteHost, ToolPlan, cancel_unless_finished, prepare, rendered, tool_plan
from serving.openai.structured import GrammarError, json_schema_guide

if TYPE_CHECKING:
    from serving.engine.core import Engine

log = logging.getLogger("serving")
OVERLOADED = 529  # Anthropic's status for "overloaded": its SDK and Claude Code retry it after Retry-After
GENERATION_FAILED = "generation failed"
_ERRORS = ((400, "invalid request, or blocks or fields this server does not read"), (401, "missing or wrong API key"),
           (404, "unknown route"), (413, "request body too large"),
           (500, "internal error (the message holds a request id)"),
           (503, "model loading (Retry-After says when to retry)"),
           (OVERLOADED, "the engine's queue is full (Retry-After says when to retry)"))
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {  # what the OpenAPI schema says these routes answer
    code: {"model": AnthropicErrorBody, "description": f"{anthropic_error_type(code)}: {text}"}
    for code, text in _ERRORS}


@dataclass(frozen=True)
class Turn:
    """A request made ready for the engine: the rendered prompt, its tokens and its tool plan."""

    prompt: str
    tokens: list[int]
    plan: ToolPlan


class MessagesRoutes:
    """/v1/messages and /v1/messages/count_tokens on one host (`router()` binds them), through the engine's
    public API only."""

    def __init__(self, host: RouteHost) -> None:
        self._host = host

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/messages", self.messages, methods=["POST"], responses=ERROR_RESPONSES)
        router.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"],
                             responses=ERROR_RESPONSES)
        return router

    async def messages(self, body: MessagesRequest, request: Request) -> Any:
        async with self._host.engine_turn() as engine:
            turn = await self._turn(engine, body, request)
            answer, handle = self._start(engine, body, turn, request)
        stops = tuple(s for s in body.stop_sequences or () if s)
        if body.stream:
            return StreamingResponse(self._stream(engine, handle, answer, stops, request_id(request.headers)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await self._gather(handle, answer)
        return answer.message(self._stop_sequence(engine, answer, stops))

    async def count_tokens(self, body: CountTokensRequest, request: Request) -> dict[str, int]:
        """The tokens of the prompt /v1/messages would run for this body (tools and system included)."""
        engine = self._host.ready_engine()
        turn = await self._turn(engine, body, request)
        return {"input_tokens": len(turn.tokens)}

    # -- the request ---------------------------------------------------------------------------------
    async def _turn(self, engine: Engine, body: MessagesBody, request: Request) -> Turn:
        unsupported = body.unsupported_fields()
        if unsupported:
            raise APIError(400, f"unsupported parameter '{unsupported[0]}': this server does not implement it",
                           param=unsupported[0])
        chat = conversation(body)
        asked = tools_asked(body)
        plan = tool_plan(asked.tools, asked.choice, asked.named, asked.parallel)
        kwargs = body.template_kwargs()
        prompt, tokens = await prepare(request, lambda: rendered(engine, chat.messages, plan.tools, kwargs, request))
        if chat.prefill:
            prompt += chat.prefill
            tokens = await prepare(request, lambda: engine.tokenize_prompt(prompt))
        return Turn(prompt, tokens, plan)

    def _start(self, engine: Engine, body: MessagesRequest, turn: Turn, request: Request
               ) -> tuple[MessageAnswer, RequestHandle]:
        """Hand the prompt to the engine with max_tokens fitted to the slot (Anthropic's clients ask for what
        their model could write, often more than a slot holds: the answer then ends with the context, and
        says so); the answer that will read it."""
        constraint = turn.plan.constraint
        fmt = body.output_config.format if body.output_config is not None else None
        if fmt is not None:
            if constraint is not None:
                raise APIError(400, "a forced tool call (tool_choice) and output_config.format cannot both "
                                    "constrain one answer", param="tool_choice")
            try:
                constraint = json_schema_guide(fmt.schema_)
            except (GrammarError, ValueError) as exc:
                raise APIError(400, str(exc), param="output_config.format.schema") from exc
        max_tokens = max(1, min(body.max_tokens, engine.n_ctx_slot - len(turn.tokens)))
        params = body.sampling_params(max_tokens, constraint, engine.sampler_defaults)
        handle = self._submit(engine, turn.tokens, params, body.stream, request)
        thinking_open = turn.prompt.rstrip().endswith(THINK_START)
        state = ChoiceState(0, reasoning=True, thinking_open=thinking_open, tools=turn.plan.calls)
        return MessageAnswer(engine.config.served_name, len(turn.tokens), body.max_tokens, state), handle

    def _submit(self, engine: Engine, tokens: list[int], params: Any, streamed: bool,
                request: Request) -> RequestHandle:
        metrics = self._host.metrics
        try:
            handle = engine.submit_choices(tokens, params, 1, traffic=TrafficTag(streamed=streamed))[0]
        except PromptTooLongError as exc:
            raise APIError(400, f"prompt is too long: {exc.n_prompt} tokens > {exc.n_ctx_slot - 1} maximum "
                                "(a slot's context; serve with a larger n_ctx or fewer n_parallel slots)",
                           param="messages") from exc
        except QueueFullError as exc:
            metrics.record_rejected("queue_full")
            full = queue_full(exc)
            raise APIError(OVERLOADED, full.message, type_="overloaded_error", headers=full.headers) from exc
        except EngineStoppedError as exc:
            metrics.record_rejected("engine_stopped")
            raise engine_unavailable() from exc
        except ValueError as exc:  # the engine's own checks: its message is for the client
            raise APIError(400, str(exc), param="messages") from exc
        mark_submitted(request.scope)
        return handle

    # -- the answer ----------------------------------------------------------------------------------
    async def _gather(self, handle: RequestHandle, answer: MessageAnswer) -> None:
        """Read the generation to its end into `answer`; a failed generation is a 500."""
        metrics = self._host.metrics
        async with cancel_unless_finished([handle], metrics):
            async for chunk in handle:
                if chunk.finish_reason == FinishReason.error:
                    metrics.record_request(chunk.usage, FinishReason.error)
                    raise _generation_failed(chunk)
                answer.feed(chunk)
                if chunk.finish_reason is not None:
                    metrics.record_request(chunk.usage, chunk.finish_reason)
                    answer.closing(None)

    async def _stream(self, engine: Engine, handle: RequestHandle, answer: MessageAnswer, stops: tuple[str, ...],
                      rid: str) -> AsyncIterator[str]:
        """Anthropic's event stream for one answer. An engine error (or a bug here) after the 200 went out
        ends it with an `error` event: what came before it still reaches the client."""
        metrics = self._host.metrics
        async with cancel_unless_finished([handle], metrics):
            try:
                yield "".join(map(sse, answer.opening()))
                async for chunk in paced(handle, self._host.stream_spacing):
                    if chunk.finish_reason == FinishReason.error:
                        metrics.record_request(chunk.usage, FinishReason.error)
                        before = answer.feed(GenerationChunk(chunk.text, chunk.token_ids))
                        yield "".join(map(sse, before)) + sse(_generation_failed(chunk).anthropic_body())
                        return
                    events = answer.feed(chunk)
                    if chunk.finish_reason is not None:
                        metrics.record_request(chunk.usage, chunk.finish_reason)
                        events += answer.closing(self._stop_sequence(engine, answer, stops))
                    if events:
                        yield "".join(map(sse, events))
            except Exception:
                log.exception("streaming failed (request id %s)", rid)
                yield sse(internal_error(rid).anthropic_body())

    @staticmethod
    def _stop_sequence(engine: Engine, answer: MessageAnswer, stops: tuple[str, ...]) -> str | None:
        """The stop sequence that ended the answer, if one did: only then is the generated text detokenised
        again (the engine releases the text before a stop sequence, not the sequence)."""
        if not stops or answer.state.finish != FinishReason.stop.value:
            return None
        try:
            generated = engine.detokenize(answer.token_ids)
        except EngineStoppedError:  # the model went away after the answer: it ended, whatever ended it
            return None
        return matched_stop(stops, answer.text, generated)


def _generation_failed(chunk: GenerationChunk) -> APIError:
    return APIError(500, chunk.error or GENERATION_FAILED, type_="api_error")
