"""The engine: one llama.cpp model and one context per process, driven by a step thread.

Weights (LlamaModel) and context (LlamaContext) have separate lifetimes on purpose: the tuner, and a
live config change, rebuild only the context (K/V cache, batch sizes, slots) and keep the weights loaded.
The step loop itself lives in serving/scheduler.py; this module owns the llama.cpp objects, the thread,
and the public API that the HTTP routes, the benchmarks and the tuner all call.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from serving.llama import llama_cpp as ll  # first: loads libllama before numpy
from serving.llama import numpy_was_first

import numpy as np  # noqa: E402  (after libllama, see serving/llama.py)

from serving.chat_template import ChatTemplate  # noqa: E402
from serving.config import CacheType, EngineConfig, FlashAttn  # noqa: E402
from serving.errors import EngineError, PromptTooLongError  # noqa: E402,F401
from serving.request import Request, RequestHandle  # noqa: E402
from serving.request import SamplingParams  # noqa: E402
from serving.scheduler import Scheduler  # noqa: E402

log = logging.getLogger(__name__)

_GGML_TYPES = {
    CacheType.f32: 0, CacheType.f16: 1, CacheType.bf16: 30, CacheType.q8_0: 8, CacheType.q4_0: 2,
    CacheType.q4_1: 3, CacheType.q5_0: 6, CacheType.q5_1: 7, CacheType.iq4_nl: 20,
}
_FLASH_ATTN = {
    FlashAttn.auto: ll.LLAMA_FLASH_ATTN_TYPE_AUTO,
    FlashAttn.on: ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    FlashAttn.off: ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


def default_threads() -> int:
    """CPUs this process may run on (llama.cpp's own default of 4 oversubscribes small machines)."""
    return max(1, len(os.sched_getaffinity(0)))


class LlamaModel:
    """Weights and vocabulary of one GGUF file, loaded once; thread-safe to tokenise from any thread."""

    def __init__(self, path: Path, n_gpu_layers: int) -> None:
        if not path.is_file():
            raise EngineError(f"model file {path} does not exist: set `model:` to a GGUF file")
        params = ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        self.path = path
        self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            hint = " (numpy was imported before libllama: see serving/llama.py)" if numpy_was_first else ""
            raise EngineError(f"llama.cpp could not load {path}: is it a GGUF file this llama.cpp reads?{hint}")
        self.vocab = ll.llama_model_get_vocab(self.ptr)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = ll.llama_model_n_ctx_train(self.ptr)
        self.size_bytes = ll.llama_model_size(self.ptr)
        self._pieces: dict[int, bytes] = {}
        self.chat_template = ChatTemplate(
            self.metadata("tokenizer.chat_template"),
            bos_token=self.token_text(ll.llama_vocab_bos(self.vocab)),
            eos_token=self.token_text(ll.llama_vocab_eos(self.vocab)),
        )

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):  # long value (chat templates can be): ask again with room for all of it
            buf = ctypes.create_string_buffer(n + 1)
            ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Tokenise as llama-server does for a prompt (BOS where the vocabulary wants one, specials parsed)."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """A token's raw bytes (may be part of a UTF-8 character); control tokens render as nothing."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._piece(token, special=False)
            self._pieces[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        return self._piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    def _piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.vocab, token))

    def free(self) -> None:
        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None


class Batch:
    """A llama_batch whose arrays are numpy buffers, so filling a prompt chunk is a slice copy, not a loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq_id = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        base = self.seq_id.ctypes.data
        i32p = ctypes.POINTER(ctypes.c_int32)
        self._seq_ptrs = (i32p * capacity)(*(ctypes.cast(base + 4 * i, i32p) for i in range(capacity)))
        self.struct = ll.llama_batch(
            n_tokens=0,
            token=self.tokens.ctypes.data_as(i32p),
            embd=None,
            pos=self.pos.ctypes.data_as(i32p),
            n_seq_id=self.n_seq_id.ctypes.data_as(i32p),
            seq_id=self._seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self.n = 0

    @property
    def free(self) -> int:
        return self.capacity - self.n

    def clear(self) -> None:
        self.n = 0

    def add(self, tokens: Sequence[int], start_pos: int, seq_id: int, logits_for_last: bool,
            logits_for_all: bool = False) -> int:
        """Append tokens of one sequence; return the batch row of the last one (where its logits land)."""
        i, k = self.n, len(tokens)
        self.tokens[i : i + k] = tokens
        self.pos[i : i + k] = np.arange(start_pos, start_pos + k, dtype=np.int32)
        self.seq_id[i : i + k] = seq_id
        self.logits[i : i + k] = 1 if logits_for_all else 0
        self.logits[i + k - 1] = 1 if logits_for_last or logits_for_all else 0
        self.n += k
        return i + k - 1


class LlamaContext:
    """One llama.cpp context: the K/V cache for `n_parallel` sequences and the compute buffers."""

    def __init__(self, model: LlamaModel, config: EngineConfig) -> None:
        params = ll.llama_context_default_params()
        params.n_ctx = config.n_ctx
        params.n_batch = config.n_batch
        params.n_ubatch = config.n_ubatch
        params.n_seq_max = config.n_parallel
        params.n_threads = config.n_threads or default_threads()
        params.n_threads_batch = config.n_threads_batch or params.n_threads
        params.type_k = _GGML_TYPES[config.type_k]
        params.type_v = _GGML_TYPES[config.type_v]
        params.flash_attn_type = _FLASH_ATTN[config.flash_attn]
        params.kv_unified = False  # each slot owns n_ctx / n_parallel cells and attends over only those
        params.no_perf = True
        self.model = model
        self.ptr = ll.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise EngineError(
                f"llama.cpp could not create a context with n_ctx={config.n_ctx}, n_parallel={config.n_parallel}, "
                f"n_batch={config.n_batch}, n_ubatch={config.n_ubatch}, type_k={config.type_k.value}, "
                f"type_v={config.type_v.value}, flash_attn={config.flash_attn.value}: lower n_ctx or n_batch "
                "(out of memory?), or use an f16 V cache if flash attention is unavailable here"
            )
        self.memory = ll.llama_get_memory(self.ptr)
        self.n_ctx_seq = ll.llama_n_ctx_seq(self.ptr)
        self.batch = Batch(config.n_batch)
        self._n_vocab = model.n_vocab

    def decode(self) -> int:
        """Run the current batch through the model (releases the GIL while llama.cpp works)."""
        self.batch.struct.n_tokens = self.batch.n
        return ll.llama_decode(self.ptr, self.batch.struct)

    def logits(self, row: int) -> np.ndarray:
        """The logits of batch row `row` as a numpy view (no copy)."""
        ptr = ll.llama_get_logits_ith(self.ptr, row)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def all_logits(self, n_rows: int) -> np.ndarray:
        """Logits of the last decode's first `n_rows` output rows, as an (n_rows, n_vocab) view."""
        ptr = ll.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self._n_vocab))

    def forget(self, seq_id: int, from_pos: int = 0) -> None:
        """Drop a slot's cached tokens from position `from_pos` on."""
        ll.llama_memory_seq_rm(self.memory, seq_id, from_pos, -1)

    def free(self) -> None:
        if self.ptr:
            ll.llama_free(self.ptr)
            self.ptr = None


class Engine:
    """A continuous-batching llama.cpp engine: submit prompts from any thread, read chunks back.

    One step thread owns the llama.cpp context; every step is one llama_decode for all busy slots. The
    same class serves HTTP (serving/app.py), runs the benchmarks, and is what the tuner measures.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.perf_counter()
        self._model = LlamaModel(config.model_path, config.n_gpu_layers)
        self.weight_loads = 1
        self.weight_load_s = time.perf_counter() - t0
        self._ctx = LlamaContext(self._model, config)
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._scheduler = Scheduler(self._model, self._ctx, config)
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()
        log.info("engine ready: %s in %.1fs, %d slots x %d tokens", self._model.path.name,
                 self.weight_load_s, config.n_parallel, self.n_ctx_slot)

    # -- what callers use ----------------------------------------------------------------------------
    @property
    def n_ctx_slot(self) -> int:
        return self._ctx.n_ctx_seq

    @property
    def alive(self) -> bool:
        """False once the step thread has stopped (closed, or died): the replica should be replaced."""
        return self._thread.is_alive()

    @property
    def model(self) -> LlamaModel:
        return self._model

    def tokenize_prompt(self, text: str) -> list[int]:
        """Tokenise a prompt as llama-server does (specials parsed, BOS when the vocabulary adds one)."""
        return self._model.tokenize(text)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """Render chat messages with the model's own template (from the GGUF metadata)."""
        return self._model.chat_template.render(messages)

    def submit(self, prompt_tokens: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request; iterate the returned handle for its output. Thread-safe.

        Raises PromptTooLongError when the prompt and max_tokens do not fit one slot.
        """
        if not prompt_tokens:
            raise ValueError("the prompt is empty: send at least one token of text")
        n_requested = params.max_tokens or 0
        if len(prompt_tokens) + max(n_requested, 1) > self.n_ctx_slot:
            raise PromptTooLongError(len(prompt_tokens), n_requested, self.n_ctx_slot)
        request = Request(next(self._ids), list(prompt_tokens), params)
        handle = RequestHandle(request, self._wake)
        self._scheduler.enqueue(request, handle)
        self._wake.set()
        return handle

    def stats(self) -> dict[str, Any]:
        """Slots, queue and counters (for /slots, metrics, tests). A snapshot; cheap; never blocks."""
        return {"config": self.config.to_yaml_dict(), "n_ctx_slot": self.n_ctx_slot,
                "weight_loads": self.weight_loads, **self._scheduler.snapshot()}

    def reconfigure(self, config: EngineConfig, timeout: float | None = None) -> None:
        """Switch to a new config: drain running requests, rebuild the context (weights kept when the model
        and n_gpu_layers are unchanged), resume. Waiting requests wait through the switch; none fails.
        Blocks until done; raises EngineError (and keeps the old config running) if the new one fails.
        """
        self._when_drained(lambda: self._rebuild(config), timeout)

    def score(self, tokens: list[int], timeout: float | None = None) -> float:
        """Mean negative log-likelihood (nats/token) of `tokens` under the running config.

        The tuner's quality probe: a quantised K/V cache changes what attention reads back, and this
        measures by how much. Runs between requests on slot 0 (drained first), then frees that slot.
        """
        return self._when_drained(lambda: self._nll(tokens), timeout)

    def _when_drained(self, command: Callable[[], Any], timeout: float | None) -> Any:
        """Run `command` on the step thread once no slot is busy; block until it has run."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((command, future))
        self._scheduler.pause_admission()
        self._wake.set()
        return future.result(timeout)

    def close(self) -> None:
        """Stop the step thread, fail what is still queued, and free llama.cpp's memory."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._scheduler.fail_all("the engine is shutting down")
        self._ctx.free()
        self._model.free()

    # -- the step thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closing:
            if self._scheduler.drained:
                self._run_commands()
            try:
                worked = self._scheduler.step()
            except Exception as exc:  # keep serving: fail the requests in flight, not the process
                log.exception("engine step failed")
                self._scheduler.fail_active(f"engine error: {exc}")
                worked = False
            if not worked:
                self._wake.wait()
                self._wake.clear()

    def _run_commands(self) -> None:
        while True:
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(command())
            except Exception as exc:
                future.set_exception(exc)
            finally:
                self._scheduler.resume_admission()

    def _nll(self, tokens: list[int], chunk: int = 256) -> float:
        ctx, seq = self._ctx, 0
        tokens = tokens[: self.n_ctx_slot]
        if len(tokens) < 2:
            raise ValueError("scoring needs at least two tokens")
        self._scheduler.reset_slot(seq)
        total, pos = 0.0, 0
        chunk = min(chunk, ctx.batch.capacity)
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
        self._scheduler.reset_slot(seq)
        return total / (len(tokens) - 1)

    def _rebuild(self, config: EngineConfig) -> None:
        old_config = self.config
        reload = not config.same_weights(old_config)
        self._ctx.free()
        try:
            if reload:
                self._model.free()
                t0 = time.perf_counter()
                self._model = LlamaModel(config.model_path, config.n_gpu_layers)
                self.weight_loads += 1
                self.weight_load_s += time.perf_counter() - t0
            self._ctx = LlamaContext(self._model, config)
        except EngineError:
            log.error("reconfigure failed; restoring the previous config")
            if reload:
                self._model = LlamaModel(old_config.model_path, old_config.n_gpu_layers)
                self.weight_loads += 1
            self._ctx = LlamaContext(self._model, old_config)
            self._scheduler.rebind(self._model, self._ctx, old_config)
            raise
        self.config = config
        self._scheduler.rebind(self._model, self._ctx, config)
        log.info("engine reconfigured (%s): %s", "weights reloaded" if reload else "context only", config)
