"""The OpenAI-compatible HTTP surface: the app factory (build_api: error handling, the guard middleware), SSE,
and the /v1 routes (OpenAIRoutes, bound to a host). Shapes live in serving/openai/requests.py; the Serve
deployment that composes these routes with its control routes (/health, /slots, /metrics) in
serving/replica/server.py.

What a client can get wrong is a 4xx with OpenAI's error JSON; a full server is a 503 with Retry-After;
anything else is a 500 whose body holds only a request id, the one the log line carries (and Serve's
X-Request-ID response header). One request's failure stays its own: the routes catch what a request can
raise, and a stream that an engine error cuts ends with an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from serving.front.errors import APIError, ErrorBody, internal_error, validation_error
from serving.openai.requests import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, NamedToolChoice, ResponsesRequest, TokenizeRequest,
)
from serving.engine.chat_template import ChatTemplateError
from serving.engine.errors import EngineStoppedError, EngineUnavailableError, PromptTooLongError, QueueFullError
from serving.openai.errors import engine_unavailable, prompt_too_long, queue_full, unavailable
from serving.openai.reasoning import START as THINK_START
from serving.openai.reasoning import ReasoningFormat
from serving.engine.request import (Constraint, FinishReason, GenerationChunk, RequestHandle, SamplingParams, Usage,
                                    paced, unpaced)
from serving.openai.responses import ChatResponse, ChoiceState, CompletionResponse, ResponsesAnswer, total_usage
from serving.front.http import (DONE, GuardMiddleware, error_response, mark_submitted, request_id, responses_error,
                                route_path)
from serving.openai.structured import GrammarError, constraint_of, tool_call_guide
from serving.openai.tools import CallMode, messages_for_plain_template
from serving.engine.traffic import TrafficTag

if TYPE_CHECKING:
    from serving.engine.core import Engine

log = logging.getLogger("serving")
T = TypeVar("T")
# A request body up to this size is templated and tokenised on the event loop (serving/openai/routes.py's _prepare):
# ~0.8 ms of tokenising on a slow 2-core machine, a few hundred microseconds on a server's.
INLINE_BODY_BYTES = 4096


class _App(FastAPI):
    def openapi(self) -> dict[str, Any]:
        """The schema says what the server answers: 400 with OpenAI's error JSON, not FastAPI's 422."""
        if self.openapi_schema is None:
            schema = super().openapi()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
            self.openapi_schema = schema
        return self.openapi_schema


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc, route_path(request.scope))


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(list(exc.errors())), route_path(request.scope))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(APIError(exc.status_code, str(exc.detail), code=_HTTP_CODES.get(exc.status_code),
                                   headers=dict(exc.headers) if exc.headers else None), route_path(request.scope))


async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineUnavailableError)
    return error_response(unavailable(exc), route_path(request.scope))


def build_api(*routers: APIRouter) -> FastAPI:
    """The app factory: one FastAPI app per replica with OpenAI's error JSON for every error (the client's
    400s, FastAPI's 404/405, the host's 503s; Anthropic's shape under /v1/messages) and the catch-all and
    body limit (GuardMiddleware) around `routers`. The API key and CORS are the ingress's
    (serving/front/ingress.py), bound when the app is built: this app is reached only through it, or through
    the same rules with `ingress=engine`."""
    app = _App(title="llama-serve-tune", description="OpenAI-compatible llama.cpp serving")
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineUnavailableError, _unavailable)
    app.add_middleware(GuardMiddleware)
    for router in routers:
        app.include_router(router)
    return app


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text} for code, text in (
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model or route"),
        (413, "request body too large"), (500, "internal error (the message holds a request id)"),
        (503, "model loading, or the server is full (Retry-After says when to retry)"),
    )
}


# -- SSE ---------------------------------------------------------------------------------------------
class RequestRecorder(Protocol):
    def record_request(self, usage: Usage | None, reason: FinishReason | str) -> None: ...
    def record_rejected(self, cause: str) -> None: ...


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _events(frames: Iterable[dict[str, Any]]) -> str:
    return "".join(_event(frame) for frame in frames)


GENERATION_FAILED = "generation failed"


def _generation_failed(chunk: GenerationChunk) -> APIError:
    return APIError(500, chunk.error or GENERATION_FAILED, type_="server_error", code="generation_failed")


async def merged(handles: list[RequestHandle], spacing: Callable[[], float] | None = unpaced
                 ) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """(choice index, chunk) from several handles as they come, each handle `paced` by `spacing`; one
    handle is read directly."""
    if len(handles) == 1:
        async for chunk in paced(handles[0], spacing):
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerationChunk] | None] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for chunk in paced(handle, spacing):
            await queue.put((index, chunk))
        await queue.put(None)

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        open_ = len(tasks)
        while open_:
            item = await queue.get()
            if item is None:
                open_ -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class Job:
    """One answer in the making: the choices' handles and states, and how to shape them."""

    handles: list[RequestHandle]
    states: list[ChoiceState]
    response: ChatResponse | CompletionResponse
    prompts: int = 1
    echoes: list[str] = field(default_factory=list)

    def usage(self) -> Usage:
        return total_usage(self.states, self.prompts)

    def openings(self) -> list[dict[str, Any]]:
        if isinstance(self.response, ChatResponse):
            return [self.response.opening(s.index) for s in self.states]
        frames = [self.response.opening(s.index, e) for s, e in zip(self.states, self.echoes, strict=True)]
        return [f for f in frames if f is not None]

    def whole(self) -> dict[str, Any]:
        if isinstance(self.response, ChatResponse):
            return self.response.whole(self.states, self.usage())
        return self.response.whole(self.states, self.usage(), self.echoes)


async def sse_events(job: Job, include_usage: bool, metrics: RequestRecorder, rid: str,
                     spacing: Callable[[], float] | None = unpaced) -> AsyncIterator[str]:
    """Server-sent events for one answer; always ends with `[DONE]` unless the client went away. After a
    choice's first chunk, what it generates over `spacing()` seconds goes as one event; `None`: an event
    per token (`paced`).

    The openings (a chat choice's role) go out with the first chunk that has something to say, in one write,
    as llama-server sends them: a write each would be one more trip through the HTTP stack while other
    requests wait for their first token. Each chunk's events go as one write.

    An error chunk (the engine failed a choice) sends OpenAI's error JSON as an event, then `[DONE]`.
    Anything raised here (a bug) becomes the same error event with a generic message, since the 200 status
    and headers are already out.
    """
    try:
        pending = _events(job.openings())
        async for index, chunk in merged(job.handles, spacing):
            state = job.states[index]
            if chunk.finish_reason == FinishReason.error:  # what came before the error (merged in) goes first
                pending += _events(job.response.stream(state, state.feed(replace(chunk, finish_reason=None,
                                                                                   usage=None))))
                metrics.record_request(chunk.usage, FinishReason.error)
                pending += _event(_generation_failed(chunk).body())
                break
            pending += _events(job.response.stream(state, state.feed(chunk)))
            if chunk.finish_reason is not None:
                metrics.record_request(chunk.usage, chunk.finish_reason)
            if pending:
                yield pending
                pending = ""
        else:
            if include_usage:
                pending += _event(job.response.usage_chunk(job.usage()))
        yield pending + DONE
    except Exception:
        log.exception("streaming failed (request id %s)", rid)
        yield _event(internal_error(rid).body())
        yield DONE


# -- the /v1 routes ----------------------------------------------------------------------------------
class RouteHost(Protocol):
    """What the routes need of the replica that serves them (serving/replica/server.py's LlamaServer)."""

    @property
    def metrics(self) -> RequestRecorder: ...

    def ready_engine(self) -> Engine:
        """The engine, or EngineUnavailableError (a 503) while there is none."""
        ...

    def engine_turn(self) -> contextlib.AbstractAsyncContextManager[Engine]:
        """The engine, for checking, preparing and submitting one request. A host that lends its engine to
        other work (in-place tuning trials, serving/replica/trials.py) makes a request wait its turn here."""
        ...

    def stream_spacing(self) -> float:
        """Seconds between a stream's events after its first token (what comes between travels in one
        event); 0: an event per token. A stream whose client asked for logprobs always gets one per token."""
        ...


class OpenAIRoutes:
    """The OpenAI routes over one host's engine: /v1/chat/completions, /v1/completions, /v1/responses,
    /v1/models and llama-server's /tokenize and /detokenize (`router()` binds them). They use the engine's
    public API only."""

    def __init__(self, host: RouteHost) -> None:
        self._host = host

    @property
    def metrics(self) -> RequestRecorder:
        return self._host.metrics

    def router(self) -> APIRouter:
        """These routes, bound to this host, for build_api."""
        router = APIRouter()
        post, get = ["POST"], ["GET"]
        for path, endpoint, methods, public in (
                ("/v1/chat/completions", self.chat_completions, post, True),
                ("/chat/completions", self.chat_completions, post, False),  # llama-server's alias
                ("/v1/completions", self.completions, post, True),
                ("/v1/responses", self.responses, post, True),
                ("/tokenize", self.tokenize, post, True),
                ("/detokenize", self.detokenize, post, True),
                ("/v1/models", self.models, get, True),
                ("/models", self.models, get, False)):  # llama-server's alias
            router.add_api_route(path, endpoint, methods=methods, responses=ERROR_RESPONSES, include_in_schema=public)
        return router

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        async with self._host.engine_turn() as engine:
            job = await self._chat_job(engine, body, request)
        return await self._answer(job, body, request)

    async def _chat_job(self, engine: Engine, body: ChatCompletionRequest, request: Request) -> Job:
        _check_request(engine, body)
        plan = plan_tools(body)
        messages = [m.as_template_dict() for m in body.messages]
        kwargs = body.chat_template_kwargs or {}
        prompt, tokens = await prepare(request, lambda: rendered(engine, messages, plan.tools, kwargs, request))
        params = _params(body, engine, _constraint(body, plan.constraint))
        handles = self._submit(engine, tokens, params, body.n, param="messages", streamed=body.stream,
                               scope=request.scope)
        reasoning = body.reasoning_format != ReasoningFormat.none
        thinking_open = reasoning and prompt.rstrip().endswith(THINK_START)
        states = [ChoiceState(i, reasoning=reasoning, thinking_open=thinking_open, tools=plan.calls)
                  for i in range(len(handles))]
        config = engine.config
        response = ChatResponse(config.served_name, engine.token_piece, body.logprobs, engine.fingerprint)
        return Job(handles, states, response)

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        async with self._host.engine_turn() as engine:
            job = await self._completion_job(engine, body, request)
        return await self._answer(job, body, request)

    async def _completion_job(self, engine: Engine, body: CompletionRequest, request: Request) -> Job:
        _check_request(engine, body)
        prompts = body.prompts()
        tokenized = await prepare(request, lambda: [p if isinstance(p, list) else engine.tokenize_prompt(p)
                                                    for p in prompts])
        params = _params(body, engine, _constraint(body, None))
        handles: list[RequestHandle] = []
        try:
            for tokens in tokenized:
                handles += self._submit(engine, tokens, params, body.n, param="prompt", streamed=body.stream,
                                        scope=request.scope)
        except BaseException:
            for handle in handles:  # a later prompt was refused: the earlier ones must not run for nobody
                handle.cancel()
            raise
        echoes = [""] * len(handles)
        if body.echo:
            texts = [p if isinstance(p, str) else engine.detokenize(p) for p in prompts]
            echoes = [texts[i // body.n] for i in range(len(handles))]
        response = CompletionResponse(engine.config.served_name, engine.token_piece, body.logprobs is not None,
                                      engine.fingerprint)
        return Job(handles, [ChoiceState(i) for i in range(len(handles))], response, len(prompts), echoes)

    async def responses(self, body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API for text in, text out (streamed as its typed events, or whole)."""
        async with self._host.engine_turn() as engine:
            _check_request(engine, body)
            messages = body.messages()
            _, tokens = await prepare(request, lambda: rendered(engine, messages, None, {}, request))
            params = body.sampling_params(engine.sampler_defaults)
            handle = self._submit(engine, tokens, params, 1, param="input", streamed=body.stream,
                                  scope=request.scope)[0]
        # the response names the temperature and top_p it sampled with, sent or not
        answer = ResponsesAnswer(engine.config.served_name, {**body.model_dump(mode="json"),
                                                             "temperature": params.temperature, "top_p": params.top_p})
        state = ChoiceState(0)
        if body.stream:
            return StreamingResponse(self._responses_stream(handle, answer, state, request_id(request.headers)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await self._gather([handle], [state])
        status = "incomplete" if state.finish == "length" else "completed"
        return answer.body(status, state.content, state.usage, state.finish)

    async def _responses_stream(self, handle: RequestHandle, answer: ResponsesAnswer, state: ChoiceState,
                                rid: str) -> AsyncIterator[str]:
        def typed(event: dict[str, Any]) -> str:
            return f"event: {event['type']}\n" + _event(event)

        async with cancel_unless_finished([handle], self.metrics):
            try:
                for event in answer.opening():
                    yield typed(event)
                async for chunk in paced(handle, self._host.stream_spacing):
                    if chunk.finish_reason == FinishReason.error:
                        self.metrics.record_request(chunk.usage, FinishReason.error)
                        yield typed(answer.event("error", **responses_error(_generation_failed(chunk))))
                        return
                    delta = state.feed(chunk)
                    if delta.content:
                        yield typed(answer.delta(delta.content))
                    if chunk.finish_reason is not None:
                        self.metrics.record_request(chunk.usage, chunk.finish_reason)
                for event in answer.closing(state.content, state.usage, state.finish):
                    yield typed(event)
            except Exception:
                log.exception("streaming failed (request id %s)", rid)
                yield typed(answer.event("error", **responses_error(internal_error(rid))))

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """llama-server's /tokenize: token ids, or {id, piece} with `with_pieces` (a piece that is not whole
        UTF-8 comes as its bytes)."""
        engine = self._host.ready_engine()
        tokens = await _off_loop(lambda: engine.tokenize(body.content, body.add_special, body.parse_special))
        if not body.with_pieces:
            return {"tokens": tokens}
        out = []
        for token in tokens:
            raw = engine.token_piece(token)
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            out.append({"id": token, "piece": piece})
        return {"tokens": out}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        engine = self._host.ready_engine()
        try:
            return {"content": engine.detokenize(body.tokens)}
        except ValueError as exc:
            raise APIError(400, str(exc), param="tokens") from exc
  # llama-server's alias
    async def models(self) -> dict[str, Any]:
        engine = self._host.ready_engine()
        return {"object": "list", "data": [{
            "id": engine.config.served_name, "object": "model", "created": 0, "owned_by": "llama-serve-tune",
            "meta": {"n_ctx_slot": engine.n_ctx_slot, "n_parallel": engine.config.n_parallel,
                     "n_vocab": engine.n_vocab, "n_ctx_train": engine.n_ctx_train},
        }]}

    # -- helpers -------------------------------------------------------------------------------------
    async def _answer(self, job: Job, body: Any, request: Request) -> Any:
        rid = request_id(request.headers)
        if body.stream:
            return StreamingResponse(self._stream(job, body.include_usage, rid),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await self._gather(job.handles, job.states)
        return job.whole()

    async def _gather(self, handles: list[RequestHandle], states: list[ChoiceState]) -> None:
        """Read every choice to its end into its state (a whole answer); a failed choice is a 500."""
        async with cancel_unless_finished(handles, self.metrics):
            async for index, chunk in merged(handles):
                if chunk.finish_reason == FinishReason.error:
                    self.metrics.record_request(chunk.usage, FinishReason.error)
                    raise _generation_failed(chunk)
                states[index].feed(chunk)
                if chunk.finish_reason is not None:
                    self.metrics.record_request(chunk.usage, chunk.finish_reason)

    async def _stream(self, job: Job, include_usage: bool, rid: str) -> AsyncIterator[str]:
        spacing = None if job.response.want_logprobs else self._host.stream_spacing  # logprobs: per token
        async with cancel_unless_finished(job.handles, self.metrics):
            async for event in sse_events(job, include_usage, self.metrics, rid, spacing):
                yield event

    def _submit(self, engine: Engine, tokens: list[int], params: SamplingParams, n: int,
                param: str, streamed: bool, scope: Scope) -> list[RequestHandle]:
        """Hand one prompt's choices to the engine, tagged as client traffic (its shape is recorded); a traced
        request is stamped (serving/front/http.py)."""
        try:
            handles = engine.submit_choices(tokens, params, n, traffic=TrafficTag(streamed=streamed))
            mark_submitted(scope)
            return handles
        except PromptTooLongError as exc:
            raise prompt_too_long(exc, param) from exc
        except QueueFullError as exc:
            self.metrics.record_rejected("queue_full")
            raise queue_full(exc) from exc
        except EngineStoppedError as exc:
            self.metrics.record_rejected("engine_stopped")
            raise engine_unavailable() from exc
        except ValueError as exc:  # the engine's own checks (an empty prompt, n, ids): its message is for the client
            raise APIError(400, str(exc), param="n" if "choices" in str(exc) else param) from exc


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for rendering (tools shown), decoding (a grammar) and reading (how calls
    are read back; None: not at all)."""

    tools: list[dict[str, Any]] | None = None
    constraint: Constraint | None = None
    calls: CallMode | None = None


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """OpenAI's tool_choice as a ToolPlan (see `tool_plan`): unset is `auto` with tools, `none` without."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return tool_plan([t.model_dump(exclude_none=True) for t in body.tools or []],
                     "required" if named is not None else str(choice), named, body.parallel_tool_calls is True)


def tool_plan(tools: list[dict[str, Any]], choice: str, named: str | None = None, parallel: bool = False
              ) -> ToolPlan:
    """`tools` in OpenAI's shape under a tool choice (`none`, `auto` or `required`; `named`: the one function
    that must be called): `none` hides the tools; `auto` shows them and reads calls back; `required` and a
    named function also constrain decoding with a grammar, so the call is well formed and its arguments fit.

    A forced answer is one call unless `parallel` (then up to MAX_PARALLEL_CALLS; never for a named
    function). OpenAI's route asks for parallel calls only on `parallel_tool_calls: true`: unset is one call, as
    llama-server long defaulted, though OpenAI's default is true: a grammar that lets a small model go on
    calling lets it repeat the same call until max_tokens cuts it, and the client that forced a call gets a
    cut answer. One call, the grammar ends after its `</tool_call>` and so does the answer
    (`finish_reason: "tool_calls"`)."""
    if not tools:
        if choice not in ("none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    if choice == "none":
        return ToolPlan()
    functions = [(t["function"]["name"], t["function"].get("parameters") or {"type": "object"}) for t in tools]
    if named is not None:
        functions = [f for f in functions if f[0] == named]
        if not functions:
            raise APIError(400, f"tool_choice names '{named}', which is not among the tools", param="tool_choice")
    constraint = None
    if choice != "auto":
        try:
            constraint = tool_call_guide(functions, parallel=parallel and named is None)
        except GrammarError as exc:
            raise APIError(400, f"a tool's parameters: {exc}", param="tools") from exc
    return ToolPlan(tools, constraint, CallMode.auto if constraint is None else CallMode.forced)


def _check_request(engine: Engine, body: Any) -> None:
    name = engine.config.served_name
    if body.model and body.model != name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{name}'",
                       param="model", code="model_not_found")
    unsupported = body.unsupported_fields()
    if unsupported:
        raise APIError(400, f"unsupported parameter '{unsupported[0]}': this server does not implement it",
                       param=unsupported[0], code="unsupported_parameter")
    if getattr(body, "n", 1) > engine.config.n_parallel:
        raise APIError(400, f"n={body.n} choices run at once, one per slot; this server has "
                            f"{engine.config.n_parallel} slots", param="n")


def _constraint(body: Any, tool_call: Constraint | None) -> Constraint | None:
    try:
        constraint = constraint_of(body)
    except (GrammarError, ValueError) as exc:
        param = "response_format" if body.response_format is not None else (
            "json_schema" if body.json_schema is not None else "grammar")
        raise APIError(400, str(exc), param=param) from exc
    if constraint is not None and tool_call is not None:
        raise APIError(400, "a forced tool call (tool_choice) and response_format/grammar cannot both constrain "
                            "one answer", param="tool_choice")
    return constraint or tool_call


def _params(body: Any, engine: Engine, constraint: Constraint | None) -> SamplingParams:
    try:
        return body.sampling_params(engine.n_ctx_slot, constraint, engine.sampler_defaults)
    except ValueError as exc:
        raise APIError(400, str(exc), param="logit_bias") from exc


@contextlib.asynccontextmanager
async def cancel_unless_finished(handles: list[RequestHandle], metrics: RequestRecorder) -> AsyncIterator[None]:
    """Whatever ends the reading early (the client went away: CancelledError or GeneratorExit; an error in
    one choice; a bug) cancels every unfinished choice, so their slots are free at the next step."""
    try:
        yield
    finally:
        for handle in handles:
            if not handle.finished:
                handle.cancel()
                metrics.record_request(None, FinishReason.cancelled)


def _render(engine: Engine, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            kwargs: dict[str, Any], request: Request) -> str:
    """The model's own template; tools go to it when it renders them, else into a system message."""
    tool_turns = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    try:
        if tool_turns and not engine.chat_template.knows_tools:
            return engine.render_chat(messages_for_plain_template(messages, tools), template_kwargs=kwargs)
        return engine.render_chat(messages, tools=tools, template_kwargs=kwargs)
    except ChatTemplateError as exc:  # the template's own message (roles out of order, ...)
        raise APIError(400, str(exc), param="messages") from exc
    except EngineStoppedError:
        raise
    except Exception as exc:  # a template that trips over these messages some other way
        log.warning("the chat template failed (request id %s)", request_id(request.headers), exc_info=True)
        raise APIError(400, "the model's chat template could not render these messages", param="messages") from exc


def rendered(engine: Engine, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              kwargs: dict[str, Any], request: Request) -> tuple[str, list[int]]:
    """The prompt text and its tokens: one piece of work, so it crosses to a worker thread at most once."""
    prompt = _render(engine, messages, tools, kwargs, request)
    return prompt, engine.tokenize_prompt(prompt)


async def prepare(request: Request, work: Callable[[], T]) -> T:
    """Template and tokenising for a request: on the event loop for a small body (tens to hundreds of
    microseconds: less than a hop to a worker thread and back, which took milliseconds on the 2-core CPU while
    the model's threads held the cores), in a worker thread otherwise, so a long prompt never stalls the loop."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) <= INLINE_BODY_BYTES:
        try:
            return work()
        except EngineStoppedError as exc:
            raise engine_unavailable() from exc
    return await _off_loop(work)


async def _off_loop(work: Callable[[], T]) -> T:
    """Template rendering and tokenising run in a worker thread: a long prompt never stalls the event
    loop that answers /health and streams every other request's tokens."""
    try:
        return await asyncio.to_thread(work)
    except EngineStoppedError as exc:
        raise engine_unavailable() from exc
