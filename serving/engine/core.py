"""The engine: one llama.cpp model and one context per process, driven by one step thread.

This is the only module that crosses threads. Callers (HTTP routes, benchmarks, the tuner) submit from any
thread; requests and commands reach the step thread through its queues, and chunks come back through each
request's handle. The step thread alone owns the llama.cpp objects, the scheduler (serving/engine/scheduler.py)
and the output processor (serving/engine/output.py), and it alone frees them, so no caller can free memory that
llama.cpp is still using.

Each engine records the shapes of the client requests it serves (serving/engine/traffic.py): the step thread
completes a shape as a request's last choice ends and adds it to the TrafficRecord; /traffic and the metrics
read the record from the event loop. One lock (`_traffic_lock`) guards the record: the step thread holds it
for an O(1) add per request, a reader for one copy of the record (under a millisecond at 4096 shapes), so
neither ever waits long and no reader sees a half-added shape.

Weights (LlamaModel) and context (LlamaContext) have separate lifetimes on purpose: the tuner, and a live
config change, rebuild only the context (K/V cache, batch sizes, slots) and keep the weights loaded.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# first: loads ray, then libllama (see serving/engine/llama.py)
from serving.engine.llama import (LlamaContext, LlamaModel, Placement, builtin_chat_templates,
                                  check_draft_vocabulary, format_builtin_chat, gpu_offload_supported)

import numpy as np  # noqa: E402

from serving.engine.chat_template import PromptTemplate, SpecialTokens, chat_template_for  # noqa: E402
from serving.engine import devices  # noqa: E402
from serving.engine.config import EngineConfig, default_threads  # noqa: E402
from serving.engine.fit import budget_for, fit  # noqa: E402
from serving.engine.memory import ModelShape  # noqa: E402
from serving.engine.errors import EngineError, EngineStoppedError, PromptTooLongError, QueueFullError  # noqa: E402
from serving.engine.output import OutputProcessor  # noqa: E402
from serving.engine.prompt_cache import PromptCache  # noqa: E402
from serving.engine.repack import use_extra_bufts  # noqa: E402
from serving.engine.request import Constraint, Request, RequestHandle, SamplingParams  # noqa: E402
from serving.engine.sampler_defaults import SamplerDefaults  # noqa: E402
from serving.engine.scheduler import RequestOutput, Scheduler  # noqa: E402
from serving.engine.stats import EngineStats  # noqa: E402
from serving.engine.traffic import (DEFAULT_LIMIT, RequestShape, ShapeInProgress, TrafficRecord,  # noqa: E402
                             TrafficSummary, TrafficTag)

log = logging.getLogger(__name__)

STEP_FAILED = "internal engine error; the request was not completed"
SHUTTING_DOWN = "the engine is shutting down"
JOIN_TIMEOUT_S = 30.0


@dataclass
class _Command:
    """Work for the step thread once `ready` says so (default: every slot idle: a reconfigure, a scoring
    pass; a slot file waits for its slot alone)."""

    run: Callable[[], Any]
    future: concurrent.futures.Future[Any]
    ready: Callable[[], bool] | None = None


@dataclass(frozen=True)
class SlotFile:
    """What a slot save or restore moved (llama-server's /slots/{id}?action=... answer)."""

    slot_id: int
    filename: str
    n_tokens: int
    n_bytes: int
    ms: float


class Engine:
    """A continuous-batching llama.cpp engine: submit prompts from any thread, read chunks back.

    One step thread owns the llama.cpp context; every step is one llama_decode for all busy slots. The
    same class serves HTTP (serving/replica/server.py), runs the benchmarks, and is what the tuner measures.
    `max_queued` bounds the requests waiting for a slot (None: unbounded); beyond it `submit` raises
    QueueFullError at once, which is the server's admission control. `traffic_limit` is how many finished
    client requests' shapes the traffic record keeps.
    """

    def __init__(self, config: EngineConfig, *, max_queued: int | None = None,
                 traffic_limit: int = DEFAULT_LIMIT) -> None:
        self.requested = config  # as the caller wrote it, `auto` settings and all; `config` is what runs
        self._found: tuple[tuple[devices.DeviceMemory, ...], int] | None = None  # GPUs and host memory, read once
        config = self._sized(config)
        self.config = config
        self.fingerprint = config.fingerprint()  # each answer names its config: computed once a config, not per request
        self.max_queued = max_queued
        self.weight_loads = 0
        self.weight_load_s = 0.0
        self._model_lock = threading.Lock()  # guards self._model against a swap while a caller tokenises
        self._model: LlamaModel | None = self._load_model(config)
        self.sampler_defaults = SamplerDefaults.of_model(config.model_path.name, self._model.metadata)
        try:
            self._template = self._chat_template(self._model, config)
        except EngineError:
            self._model.free()
            raise
        self._ctx = LlamaContext(self._model, config, default_threads())
        self._draft_model: LlamaModel | None = None  # spec_mode draft: the draft model's weights ...
        self._draft_loaded: EngineConfig | None = None  # ... loaded for this draft config
        self._draft_ctx: LlamaContext | None = None
        try:
            self._draft_ctx = self._draft_context(config, self._model)
        except EngineError:
            self._ctx.free()
            self._model.free()
            raise
        self._scheduler = Scheduler(self._ctx, config.n_parallel, config.seed, config.speculation,
                                    draft=self._draft_ctx, prompt_cache=prompt_cache_for(config, None))
        self._traffic = TrafficRecord(traffic_limit)
        self._traffic_lock = threading.Lock()  # the step thread adds, routes read (see the module docstring)
        self._outputs = OutputProcessor(self._model.token_bytes, on_shape=self._record_shape)
        self._n_ctx_slot = self._ctx.n_ctx_seq
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple[list[tuple[Request, RequestHandle]], ShapeInProgress | None]] = \
            queue.SimpleQueue()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._pending: list[_Command] = []  # step thread only
        self._intake = threading.Lock()  # submit's check-and-put vs the step thread's last drain
        self._stopping = False  # set by close()
        self._stopped = False  # set by the step thread as it leaves, under _intake
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()
        log.info("engine ready: %s in %.1fs, %d slots x %d tokens", config.model_path.name,
                 self.weight_load_s, config.n_parallel, self._n_ctx_slot)

    # -- what callers use ----------------------------------------------------------------------------
    @property
    def n_ctx_slot(self) -> int:
        return self._n_ctx_slot

    @property
    def n_vocab(self) -> int:
        return self._with_model(lambda m: m.n_vocab)

    @property
    def n_ctx_train(self) -> int:
        return self._with_model(lambda m: m.n_ctx_train)

    @property
    def alive(self) -> bool:
        """False once the step thread has stopped (closed, or died): the replica should be replaced."""
        return self._thread.is_alive() and not self._stopped

    def tokenize_prompt(self, text: str) -> list[int]:
        """Tokenise a prompt as llama-server does (specials parsed, BOS when the vocabulary adds one)."""
        return self._with_model(lambda m: m.tokenize(text))

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self._with_model(lambda m: m.tokenize(text, add_special, parse_special))

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """Render chat messages with the model's template (the `chat_template` setting's, else the GGUF's own)."""
        return self._template.render(messages, tools=tools, template_kwargs=template_kwargs)

    @property
    def chat_template(self) -> PromptTemplate:
        return self._template

    def detokenize(self, tokens: list[int]) -> str:
        """Text of token ids as generation would show it (control tokens render as nothing)."""
        self._check_ids(tokens)
        return self._with_model(lambda m: b"".join(m.token_bytes(t) for t in tokens)).decode("utf-8", "replace")

    def token_piece(self, token: int) -> bytes:
        """One token's raw bytes (can be part of a UTF-8 character)."""
        self._check_ids([token])
        return self._with_model(lambda m: m.token_bytes(token))

    def submit(self, prompt_tokens: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request; iterate the returned handle for its output. Thread-safe.

        Raises ValueError (empty prompt, token ids outside the vocabulary, a grammar that does not parse),
        PromptTooLongError (prompt and max_tokens do not fit one slot), QueueFullError (max_queued requests
        already wait), and EngineStoppedError (closed, or the step thread has died).
        """
        return self.submit_choices(prompt_tokens, params, 1)[0]

    def submit_choices(self, prompt_tokens: list[int], params: SamplingParams, n: int,
                       traffic: TrafficTag | None = None) -> list[RequestHandle]:
        """Queue `n` independent completions of one prompt (OpenAI's `n`): the prompt is prefilled once and
        its K/V cells copied to the other slots (llama_memory_seq_cp), so n choices cost one prefill.
        They run at once, so n may not exceed n_parallel. With a seed, choice i samples with seed + i.
        With `traffic` (client requests) the request's shape is recorded when it ends, arrival time now."""
        if not 1 <= n <= self.config.n_parallel:
            raise ValueError(f"n={n} choices need n slots at once; this server has {self.config.n_parallel}")
        tokens = self._checked_tokens(prompt_tokens, params)
        group = []
        for i in range(n):
            choice = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
            request = Request(next(self._ids), tokens, choice)
            group.append((request, RequestHandle(request, self._wake)))
        shape = None if traffic is None else ShapeInProgress.start(len(tokens), params, n, traffic, time.time())
        with self._intake:
            if self._stopping or self._stopped:
                raise EngineStoppedError("the engine is not running: " + SHUTTING_DOWN)
            self._check_queue(n)
            self._inbox.put((group, shape))
        self._wake.set()
        return [handle for _, handle in group]

    def stats(self) -> dict[str, Any]:
        """Slots, queue and counters (for /slots, metrics, tests) as plain values."""
        return self.snapshot().as_dict()

    def snapshot(self) -> EngineStats:
        views = self._scheduler.slot_views()
        counters = replace(self._scheduler.counters)
        drafted = counters.spec_drafted
        cache = self._scheduler.prompt_cache
        return EngineStats(
            config=self.config, n_ctx_slot=self._n_ctx_slot, weight_loads=self.weight_loads,
            slots=views, slots_busy=sum(1 for v in views if v.request_id is not None),
            queue_depth=self.queue_depth, counters=counters,
            spec_acceptance=counters.spec_accepted / drafted if drafted else None,
            prompt_cache=cache.stats() if cache is not None else None)

    def traffic_summary(self, replica: str = "") -> TrafficSummary:
        """The client traffic this engine has served, as a value (any thread)."""
        with self._traffic_lock:
            return self._traffic.summary(replica)

    def traffic_since(self, seen: int) -> tuple[list[RequestShape], int]:
        """Shapes recorded after the first `seen`, and the count to pass next time (TrafficRecord.since)."""
        with self._traffic_lock:
            return self._traffic.since(seen)

    def _record_shape(self, shape: RequestShape) -> None:
        """The step thread's side: a finished client request's shape into the record."""
        with self._traffic_lock:
            self._traffic.add(shape)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot (an estimate while the step thread is moving them)."""
        return self._scheduler.n_waiting + self._inbox.qsize()

    def reconfigure(self, config: EngineConfig, timeout: float | None = None) -> None:
        """Switch to a new config: drain running requests, rebuild the context (weights kept when the model
        and n_gpu_layers are unchanged), resume. Waiting requests wait through the switch; none fails.
        Blocks until done; raises EngineError (and keeps the old config running) if the new one fails.
        Settings left `auto` are sized again, within the memory the engine found when it first sized one.
        """
        # sized on the step thread once drained: sizing reads the GGUF header (a second on a loaded CPU), and a
        # prompt queued for the old slots must not take one meanwhile that the new config cannot hold
        self._when_drained(lambda: self._rebuild(self._sized(config)), timeout)
        self.requested = config

    def score(self, tokens: list[int], timeout: float | None = None) -> float:
        """Mean negative log-likelihood (nats/token) of `tokens` under the running config.

        The tuner's quality probe: a quantised K/V cache changes what attention reads back, and this
        measures by how much. Runs between requests on slot 0 (drained first), then frees that slot.
        """
        return self._when_drained(lambda: self._nll(tokens), timeout)

    def save_slot(self, slot_id: int, path: Path, timeout: float | None = None) -> SlotFile:
        """Slot `slot_id`'s cells and tokens to `path` (llama.cpp's sequence state file), once that slot is
        idle; the other slots go on. ValueError for a slot id out of range; EngineError when the file could
        not be written."""
        return self._when_slot_idle(slot_id, lambda: self._save_slot(slot_id, path), timeout)

    def restore_slot(self, slot_id: int, path: Path, timeout: float | None = None) -> SlotFile:
        """A file `save_slot` wrote, into slot `slot_id` once it is idle: a prompt extending its tokens then
        prefills only the rest. ValueError for a slot id out of range or a file this model and context
        cannot load (the slot is then empty)."""
        return self._when_slot_idle(slot_id, lambda: self._restore_slot(slot_id, path), timeout)

    def erase_slot(self, slot_id: int, timeout: float | None = None) -> int:
        """Empty slot `slot_id`'s cells once it is idle; how many tokens it held."""
        return self._when_slot_idle(slot_id, lambda: self._erase_slot(slot_id), timeout)

    def close(self) -> None:
        """Stop the step thread; it fails what is still queued or running and frees llama.cpp's memory.

        If the thread does not leave in time (stuck inside llama_decode), nothing is freed here: freeing a
        context llama.cpp is still using would crash the process; the thread frees it when it leaves.
        """
        self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.error("the engine's step thread did not stop within %.0f s; it frees llama.cpp's memory "
                          "when it leaves", JOIN_TIMEOUT_S)

    def check_constraint(self, constraint: Constraint) -> None:
        """ValueError unless this model can enforce `constraint`; a guide is compiled for the vocabulary here
        (and cached), so the request that brings it, not the step thread, pays the compile."""
        self._with_model(lambda m: m.check_constraint(constraint))

    # -- helpers for callers -------------------------------------------------------------------------
    def _with_model(self, use: Callable[[LlamaModel], Any]) -> Any:
        with self._model_lock:
            if self._model is None:
                raise EngineStoppedError("the model is being reloaded or the engine has stopped; retry shortly")
            return use(self._model)

    def _checked_tokens(self, prompt_tokens: list[int], params: SamplingParams) -> list[int]:
        if not prompt_tokens:
            raise ValueError("the prompt is empty: send at least one token of text")
        self._check_ids(prompt_tokens)
        if any(not 0 <= t < self.n_vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.n_vocab})")
        if params.constraint is not None:
            self.check_constraint(params.constraint)
        n_requested = params.max_tokens or 0
        if len(prompt_tokens) + max(n_requested, 1) > self._n_ctx_slot:
            raise PromptTooLongError(len(prompt_tokens), n_requested, self._n_ctx_slot)
        return [int(t) for t in prompt_tokens]

    def _check_ids(self, tokens: list[int]) -> None:
        """Token ids reach llama.cpp's vocabulary tables unchecked: an id outside them is a crash."""
        if not tokens:
            return
        ids = np.asarray(tokens)
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.n_vocab:
            raise ValueError(f"token ids must be integers in [0, {self.n_vocab})")

    def _check_queue(self, n: int) -> None:
        if self.max_queued is None:
            return
        free = sum(1 for v in self._scheduler.slot_views() if v.request_id is None)
        queued = self.queue_depth
        if queued + n - free > self.max_queued:
            rate = self._scheduler.requests_per_s
            wait = (queued + 1) / rate if rate > 0 else 1.0
            raise QueueFullError(queued, self.max_queued, max(1, min(60, math.ceil(wait))))

    def _when_slot_idle(self, slot_id: int, run: Callable[[], Any], timeout: float | None) -> Any:
        n_slots = self.config.n_parallel
        if not 0 <= slot_id < n_slots:
            raise ValueError(f"slot id {slot_id} is out of range: this server has slots 0 to {n_slots - 1}")

        def idle() -> bool:  # out of range after a reconfigure: ready, and the command says so
            slots = self._scheduler.slots
            return slot_id >= len(slots) or slots[slot_id].request is None

        return self._when_drained(run, timeout, ready=idle)

    def _when_drained(self, run: Callable[[], Any], timeout: float | None,
                      ready: Callable[[], bool] | None = None) -> Any:
        """Run `run` on the step thread once no slot is busy, or once `ready` says so (admission pauses
        meanwhile); wait for it.

        On timeout a command that has not started is withdrawn (nothing changed; TimeoutError); one that
        has started is waited for, since a half-done rebuild cannot be walked away from.
        """
        if self._stopping or self._stopped:
            raise EngineStoppedError(SHUTTING_DOWN)
        command = _Command(run, concurrent.futures.Future(), ready)
        self._commands.put(command)
        self._wake.set()
        try:
            return command.future.result(timeout)
        except concurrent.futures.TimeoutError:
            if command.future.cancel():
                raise TimeoutError(f"the engine did not drain within {timeout} s; nothing was changed") from None
            return command.future.result()

    # -- the step thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._take_inbox()
                self._run_commands()
                if self._stopping:  # a command may stop the engine (a config that cannot be restored)
                    break
                if not self._step() and not self._scheduler.save_idle():
                    self._wake.wait(0.5 if self._pending else None)
                    self._wake.clear()
        except BaseException:  # a bug we did not foresee: leave cleanly so the replica is replaced
            log.exception("the engine's step thread failed")
            raise
        finally:
            self._shut_down()

    def _step(self) -> bool:
        """One scheduler step and its outputs. A request's own failures are handled inside the scheduler
        and the output processor; anything reaching here is a bug in the step itself, so the requests in
        flight end with an error (their slots reset) and the engine goes on serving."""
        try:
            outputs, decoded = self._scheduler.step()
        except Exception:
            log.exception("engine step failed")
            self._emit(self._scheduler.abort(STEP_FAILED, waiting_too=False))
            return False
        self._emit(outputs)
        return decoded or bool(outputs)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        deliveries, ends = self._outputs.process(outputs)
        for request_id, reason in ends:
            self._scheduler.finish(request_id, reason)
        self._outputs.deliver(deliveries)  # after the slots are released: see serving/engine/output.py

    def _take_inbox(self) -> None:
        while True:
            try:
                group, shape = self._inbox.get_nowait()
            except queue.Empty:
                return
            for request, handle in group:
                self._outputs.add(request, handle, shape)
            self._scheduler.add([request for request, _ in group])

    def _run_commands(self) -> None:
        """Pause admission while a command waits; run commands once the slots are idle; then resume."""
        while True:
            try:
                self._pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        self._pending = [c for c in self._pending if not c.future.cancelled()]
        self._scheduler.admitting = not self._pending
        if not self._pending:
            return
        drained = self._scheduler.drained
        runnable = [c for c in self._pending if (c.ready() if c.ready is not None else drained)]
        for command in runnable:
            if command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.run())
                except Exception as exc:
                    command.future.set_exception(exc)
        self._pending = [c for c in self._pending if c not in runnable]
        self._scheduler.admitting = not self._pending

    def _shut_down(self) -> None:
        """The step thread's last act: fail everything still here, then free llama.cpp's memory."""
        with self._intake:
            self._stopped = True
        self._take_inbox()
        self._emit(self._scheduler.abort(SHUTTING_DOWN, waiting_too=True))
        for command in self._pending + _drain(self._commands):
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineStoppedError(SHUTTING_DOWN))
        self._ctx.free()
        self._free_draft(keep_weights=False)
        with self._model_lock:
            model, self._model = self._model, None
        if model is not None:
            model.free()

    # -- commands (run on the step thread, slots idle) -----------------------------------------------
    def _slot_in_range(self, slot_id: int) -> None:
        if slot_id >= len(self._scheduler.slots):
            raise ValueError(f"slot id {slot_id} is out of range after a reconfigure: this server has slots 0 "
                             f"to {len(self._scheduler.slots) - 1}")

    def _save_slot(self, slot_id: int, path: Path) -> SlotFile:
        self._slot_in_range(slot_id)
        t0 = time.perf_counter()
        tokens = self._scheduler.slot_tokens(slot_id)
        written = self._ctx.save_seq_file(slot_id, path, tokens)
        if written == 0:
            raise EngineError(f"llama.cpp could not write slot {slot_id}'s state to {path.name}")
        return SlotFile(slot_id, path.name, len(tokens), written, (time.perf_counter() - t0) * 1000)

    def _restore_slot(self, slot_id: int, path: Path) -> SlotFile:
        self._slot_in_range(slot_id)
        t0 = time.perf_counter()
        self._scheduler.reset_slot(slot_id)
        tokens = self._ctx.load_seq_file(slot_id, path)
        if tokens is None:
            raise ValueError(f"{path.name} is not a slot state this model and config can load (another model, "
                             "other cache types or slot count, or not a slot file)")
        self._scheduler.restored_slot(slot_id, tokens)
        return SlotFile(slot_id, path.name, len(tokens), path.stat().st_size, (time.perf_counter() - t0) * 1000)

    def _erase_slot(self, slot_id: int) -> int:
        self._slot_in_range(slot_id)
        n = len(self._scheduler.slot_tokens(slot_id))
        self._scheduler.reset_slot(slot_id)
        return n

    def _nll(self, tokens: list[int], chunk: int = 256) -> float:
        ctx, seq = self._ctx, 0
        tokens = tokens[: self._n_ctx_slot]
        if len(tokens) < 2:
            raise ValueError("scoring needs at least two tokens")
        self._scheduler.reset_slot(seq)
        total, pos = 0.0, 0
        chunk = min(chunk, ctx.batch_capacity)
        try:
            while pos < len(tokens) - 1:
                part = tokens[pos : pos + chunk]
                ctx.batch.clear()
                ctx.batch.add(part, pos, seq, logits_for_last=True, logits_for_all=True)
                if ctx.decode() != 0:
                    raise EngineError("llama_decode failed while scoring")
                logits = ctx.all_logits(len(part)).astype(np.float64)
                targets = tokens[pos + 1 : pos + 1 + len(part)]
                rows = logits[: len(targets)]
                top = rows.max(axis=1, keepdims=True)
                log_z = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
                total += float((log_z - rows[np.arange(len(targets)), targets]).sum())
                pos += len(part)
        finally:
            self._scheduler.reset_slot(seq)
        return total / (len(tokens) - 1)

    def _sized(self, config: EngineConfig) -> EngineConfig:
        """`config` with its `auto` settings sized from the GGUF header and the memory found here (serving/engine/
        fit.py), logged in one line; a config with none comes back as it is. The GPUs and host memory are read
        the first time only: later the engine's own allocations would count against it."""
        if config.sized:
            return config
        if self._found is None:
            self._found = (devices.visible_gpus() if gpu_offload_supported() else (), devices.available_memory())
        shape = ModelShape.from_gguf(config.model_path)
        fitted = fit(shape, config, budget_for(config, *self._found))
        log.info("%s", fitted.describe(shape))
        return fitted.config

    def _load_model(self, config: EngineConfig) -> LlamaModel:
        t0 = time.perf_counter()
        model = LlamaModel(config.model_path, config.n_gpu_layers, extra_bufts=use_extra_bufts(config),
                           placement=Placement.of(config))
        self.weight_loads += 1
        self.weight_load_s += time.perf_counter() - t0
        return model

    @staticmethod
    def _chat_template(model: LlamaModel, config: EngineConfig) -> PromptTemplate:
        """The prompt format `config` asks for on `model`; EngineError for a setting that names none."""
        tokens = SpecialTokens(model.bos_text, model.eos_text, model.adds_bos)
        template = chat_template_for(model.path.name, config.chat_template, model.metadata("tokenizer.chat_template"),
                                     tokens, builtin_chat_templates(), format_builtin_chat)
        log.info("chat template of %s: %s %s", model.path.name, template.origin.value, config.chat_template or "")
        return template

    def _rebuild(self, config: EngineConfig) -> None:
        """Swap in a context (and, if the model changes, weights) for `config`; on failure put the old
        config back. Old memory is freed before new is taken: on a GPU both rarely fit at once. If even
        the old config cannot be restored, the engine stops (its replica is then replaced)."""
        old = self.config
        reload = not config.same_weights(old)
        self._ctx.free()
        self._free_draft(keep_weights=config.same_draft_weights(old))
        if reload:
            self._drop_model()
        try:
            self._install(config, reload)
        except EngineError:
            log.error("reconfigure to %s failed; restoring the previous config", config)
            try:
                self._install(old, reload)
            except EngineError:
                log.exception("restoring the previous config failed too; the engine stops")
                self._stopping = True
                raise
            raise
        log.info("engine reconfigured (%s): %s", "weights reloaded" if reload else "context only", config)

    def _install(self, config: EngineConfig, load_weights: bool) -> None:
        """Build what `config` needs and bind everything to it; leaves nothing allocated if it fails."""
        model = self._load_model(config) if load_weights else self._model
        assert model is not None
        try:
            template = (self._chat_template(model, config)
                        if load_weights or config.chat_template != self.config.chat_template else self._template)
            ctx = LlamaContext(model, config, default_threads())
        except EngineError:
            if load_weights:
                model.free()
            raise
        try:
            draft_ctx = self._draft_context(config, model)
        except EngineError:
            ctx.free()
            if load_weights:
                model.free()
            raise
        if load_weights:
            with self._model_lock:
                self._model = model
            self._outputs.rebind(model.token_bytes)
            self.sampler_defaults = SamplerDefaults.of_model(config.model_path.name, model.metadata)
        self._template = template
        self._ctx, self.config, self._n_ctx_slot = ctx, config, ctx.n_ctx_seq
        self.fingerprint = config.fingerprint()
        self._draft_ctx = draft_ctx
        self._scheduler.prompt_cache = prompt_cache_for(config, self._scheduler.prompt_cache)
        self._scheduler.rebind(ctx, config.n_parallel, config.seed, config.speculation, draft=draft_ctx)

    def _draft_context(self, config: EngineConfig, model: LlamaModel) -> LlamaContext | None:
        """The draft model's context for `config` (spec_mode draft), its weights loaded unless the loaded
        ones serve, and checked to share `model`'s vocabulary; None without a draft model."""
        draft = config.draft
        if draft is None:
            return None
        if self._draft_model is None or self._draft_loaded is None or not draft.same_weights(self._draft_loaded):
            self._free_draft(keep_weights=False)
            loaded = LlamaModel(draft.model_path, draft.n_gpu_layers, extra_bufts=use_extra_bufts(draft))
            try:
                check_draft_vocabulary(model, loaded)
            except EngineError:
                loaded.free()
                raise
            self._draft_model, self._draft_loaded = loaded, draft
        return LlamaContext(self._draft_model, draft, default_threads())

    def _free_draft(self, keep_weights: bool) -> None:
        """Free the draft model's context (and its weights unless the next config keeps them)."""
        ctx, self._draft_ctx = self._draft_ctx, None
        if ctx is not None:
            ctx.free()
        if not keep_weights and self._draft_model is not None:
            self._draft_model.free()
            self._draft_model, self._draft_loaded = None, None

    def _drop_model(self) -> None:
        with self._model_lock:
            model, self._model = self._model, None
        if model is not None:
            model.free()


def _drain(commands: queue.SimpleQueue[_Command]) -> list[_Command]:
    out = []
    while True:
        try:
            out.append(commands.get_nowait())
        except queue.Empty:
            return out


__all__ = ["Engine", "EngineError", "EngineStats", "PromptTooLongError"]


def prompt_cache_for(config: EngineConfig, current: PromptCache | None) -> PromptCache | None:
    """The prompt cache `config` asks for (None: cache_ram_mib 0); the current one is kept, with its counters,
    at the new size (the scheduler empties it with the context it came from)."""
    if config.cache_ram_mib == 0:
        return None
    limit = config.cache_ram_mib * 2**20
    if current is None:
        return PromptCache(limit)
    current.limit_bytes = limit
    return current
