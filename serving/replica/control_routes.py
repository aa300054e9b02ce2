"""The control routes of an engine replica: /health, llama-server's /slots (and slot files), /props, Prometheus
/metrics and /traffic. They read state only (the slot-file action excepted, which waits for its slot), never
take a slot or wait behind completions, and answer for every replica of the app where that means asking the
others (Serve's broadcast, through the server's own handle)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response

from serving.engine import mooncake
from serving.engine.errors import EngineError
from serving.engine.request import SamplingParams
from serving.engine.traffic import TrafficSummary, merge_summaries
from serving.front.errors import APIError
from serving.front.ingress import HealthReport
from serving.openai.routes import ERROR_RESPONSES
from serving.openai.slot_files import (SlotAction, SlotFileBody, erased_answer, restored_answer, saved_answer,
                                       slot_file)
from serving.replica.metrics import CONTENT_TYPE, merge_expositions

if TYPE_CHECKING:
    from pathlib import Path

    from serving.engine.core import Engine
    from serving.replica.host import EngineHost

log = logging.getLogger("serving")

TRAFFIC_DEADLINE_S = 5.0  # /traffic, /slots and /metrics wait this long for every replica's answer
SLOT_WAIT_S = 60.0  # a slot file action waits this long for its slot to be idle
MISSING_HEADER = "X-Replicas-Missing"  # /traffic?format=mooncake: what the JSON's replicas_missing says


class TrafficFormat(str, Enum):
    """What /traffic answers in: our summary (JSON), or the recent requests as a Mooncake trace (JSONL) that
    vLLM's `bench serve`, GuideLLM and AIPerf replay (serving/engine/mooncake.py says what its hash_ids can
    tell of shared prefixes)."""

    json = "json"
    mooncake = "mooncake"


class ControlHost(Protocol):
    """What the control routes need of the replica (serving/replica/server.py's LlamaServer)."""

    host: EngineHost
    slot_save_path: Path | None
    build_info: str

    def ready_engine(self) -> Engine: ...
    def engine_turn(self) -> contextlib.AbstractAsyncContextManager[Engine]: ...
    def health_report(self) -> HealthReport: ...
    def place(self) -> dict[str, Any]: ...
    def replica_summary(self) -> dict[str, Any]: ...
    def peers(self) -> Any: ...
    async def metrics_text(self) -> str: ...
    async def all_traffic(self) -> tuple[TrafficSummary, int | None]: ...


async def gather_replicas(peers: Any, own: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
    """Every engine replica's summary (`own` stands in for this one if the broadcast missed it), and how many did
    not answer in time; None for that count where every replica could not be asked."""
    try:
        answers = await peers.broadcast("replica_summary").results_async(timeout_s=TRAFFIC_DEADLINE_S,
                                                                         return_exceptions=True)
    except Exception as exc:  # no handle (outside a Serve app), or no replica listed yet
        log.info("/slots could not ask every replica (%s)", type(exc).__name__)
        return [own], None
    summaries = {a["replica"]: a for a in answers if isinstance(a, dict)}
    summaries.setdefault(own["replica"], own)
    return sorted(summaries.values(), key=lambda a: a["replica"]), len(answers) - sum(isinstance(a, dict)
                                                                                       for a in answers)


async def gather_traffic(peers: Any, own: TrafficSummary) -> tuple[TrafficSummary, int | None]:
    """Every engine replica's traffic summary merged (`own` stands in for this replica if the broadcast
    missed it), and how many replicas did not answer in time. Where every replica cannot be asked (a Ray
    without DeploymentHandle.broadcast, or the broadcast itself failed), `own` alone and None: the
    answer then says which replica it is for, and that the others are unknown."""
    broadcast = getattr(peers, "broadcast", None)
    if broadcast is None:
        return own, None
    try:
        answers = await broadcast("traffic_summary").results_async(timeout_s=TRAFFIC_DEADLINE_S,
                                                                   return_exceptions=True)
    except Exception as exc:  # no replica listed yet, or one that never answered within the deadline
        log.warning("/traffic could not ask every replica (%s: %s); answering for this one", type(exc).__name__, exc)
        return own, None
    summaries = {s.replicas: s for s in answers if isinstance(s, TrafficSummary)}
    summaries.setdefault(own.replicas, own)
    return merge_summaries(summaries.values()), len(answers) - sum(isinstance(s, TrafficSummary) for s in answers)


class ControlRoutes:
    """The control routes over one replica (`router()` binds them)."""

    def __init__(self, server: ControlHost) -> None:
        self._server = server

    def router(self) -> APIRouter:
        """These routes, bound to this replica, for serving/openai/routes.py's build_api."""
        router = APIRouter()
        router.add_api_route("/health", self.health, methods=["GET"], responses={
            503: {"description": "loading, the model failed to load, or no replica is up"}})
        router.add_api_route("/slots", self.slots, methods=["GET"], responses=ERROR_RESPONSES)
        router.add_api_route("/slots/{slot_id}", self.slot_action, methods=["POST"], responses=ERROR_RESPONSES)
        router.add_api_route("/props", self.props, methods=["GET"], responses=ERROR_RESPONSES)
        router.add_api_route("/metrics", self.prometheus, methods=["GET"], response_class=Response,
                             responses={200: {"content": {CONTENT_TYPE: {}}}})
        router.add_api_route("/traffic", self.traffic, methods=["GET"], response_model=None, responses={
            **ERROR_RESPONSES, 200: {"content": {"application/json": {}, mooncake.MEDIA_TYPE: {}},
                                     "description": "the summary (JSON), or a Mooncake trace (JSONL)"}})
        return router

    async def health(self) -> JSONResponse:
        """200 once the engine serves; 503 while loading, after a failed load, or if the engine stopped.
        (The app's ingress answers /health from health_report; this route answers with ingress=engine.)"""
        return self._server.health_report().response()

    async def slots(self) -> dict[str, Any]:
        """Slots, queue, counters and the running config, like llama-server's /slots plus /props; where this
        replica runs (`node`), and every replica of the app (`replicas`: node, devices, health, config)."""
        server = self._server
        replicas, missing = await gather_replicas(server.peers(), server.replica_summary())
        return {"replica": server.host.replica, **server.ready_engine().stats(), "tuning": server.host.trials.state(),
                "node": server.place(), "replicas": replicas, "replicas_missing": missing}

    async def slot_action(self, slot_id: int, action: SlotAction, body: SlotFileBody | None = None
                          ) -> dict[str, Any]:
        """llama-server's slot files: `save` a slot's cells and tokens to a file of the slot directory,
        `restore` one into a slot, `erase` a slot. Waits for that slot to be idle (new requests wait
        meanwhile; running ones go on), and for an in-place trial to give the engine back."""
        path = slot_file(self._server.slot_save_path, body, action)
        try:
            async with self._server.engine_turn() as engine:
                if path is None:
                    return erased_answer(slot_id, await asyncio.to_thread(engine.erase_slot, slot_id, SLOT_WAIT_S))
                if action is SlotAction.save:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    done = await asyncio.to_thread(engine.save_slot, slot_id, path, SLOT_WAIT_S)
                    return saved_answer(done.slot_id, done.filename, done.n_tokens, done.n_bytes, done.ms)
                done = await asyncio.to_thread(engine.restore_slot, slot_id, path, SLOT_WAIT_S)
                return restored_answer(done.slot_id, done.filename, done.n_tokens, done.n_bytes, done.ms)
        except ValueError as exc:
            raise APIError(400, str(exc), param="slot_id" if "slot id" in str(exc) else "filename") from None
        except TimeoutError:
            raise APIError(503, f"slot {slot_id} stayed busy for {SLOT_WAIT_S:.0f} s: retry later",
                           type_="server_error", code="slot_busy", headers={"Retry-After": "5"}) from None
        except (EngineError, OSError) as exc:
            raise APIError(500, f"the slot file could not be written or read: {exc}", type_="server_error") from None

    async def props(self) -> dict[str, Any]:
        """llama-server's /props: the generation defaults, slots, model and chat template."""
        engine = self._server.ready_engine()
        config = engine.config
        unsent = engine.sampler_defaults  # what a request that sends no sampler settings samples as
        params = SamplingParams(temperature=unsent.temperature, top_p=unsent.top_p, top_k=unsent.top_k,
                                min_p=unsent.min_p, repeat_penalty=unsent.repeat_penalty,
                                penalty_last_n=unsent.repeat_last_n)
        return {
            "default_generation_settings": {"n_ctx": engine.n_ctx_slot, "params": {
                **asdict(params), "repeat_last_n": unsent.repeat_last_n, "seed": config.seed}},
            "total_slots": config.n_parallel, "model_path": str(config.model_path), "model_alias": config.served_name,
            "chat_template": engine.chat_template.source, "n_vocab": engine.n_vocab, "n_ctx_train": engine.n_ctx_train,
            "config": config.to_yaml_dict(), "build_info": self._server.build_info,
        }

    async def prometheus(self) -> Response:
        """Prometheus text exposition of every replica's metrics (each labelled with its replica; queue and slot
        gauges read now); a replica that does not answer in time is left out, this one never."""
        peers, answers = self._server.peers(), []
        if peers is not None:
            try:
                answers = await peers.broadcast("metrics_text").results_async(timeout_s=TRAFFIC_DEADLINE_S,
                                                                              return_exceptions=True)
            except Exception:  # no replica listed yet: this one's alone
                answers = []
        texts = [a for a in answers if isinstance(a, str)]
        if not any(f'replica="{self._server.host.replica}"' in text for text in texts):
            texts.append(await self._server.metrics_text())
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE)

    async def traffic(self, recent: Annotated[int | None, Query(ge=0, description="list only the latest this "
                                                                "many request shapes (0: none)")] = None,
                      answer_in: Annotated[TrafficFormat, Query(alias="format", description=(
                          "json: the summary; mooncake: the recent requests as a Mooncake trace"))] = TrafficFormat.json
                      ) -> Response:
        """The shape of the client traffic served (token counts, kinds, arrival times; never text), merged
        over every engine replica: totals, histograms and the recent arrivals, for the tuner to replay; or
        those arrivals as a Mooncake trace, one request a line, for other tools to (the replicas that did not
        answer are counted in the X-Replicas-Missing header, "unknown" where they could not be asked)."""
        summary, missing = await self._server.all_traffic()
        if answer_in is TrafficFormat.json:
            return JSONResponse({**summary.as_dict(recent), "replicas_missing": missing})
        shapes = summary.recent if recent is None else summary.recent[len(summary.recent) - recent:] if recent else ()
        return Response(mooncake.jsonl(mooncake.trace_of(shapes)), media_type=mooncake.MEDIA_TYPE,
                        headers={MISSING_HEADER: "unknown" if missing is None else str(missing)})
