"""Slots, admission, and the step loop: one llama_decode per step for every busy slot.

Like llama-server's update_slots(): each step first gives every generating slot its one next token, then
fills what is left of the batch (n_batch tokens) with chunks of pending prompts, decodes once, and samples
one token for every slot whose last batch row produced logits. Requests join and leave between steps.

A slot keeps the tokens of its last request in the K/V cache after it finishes; a new request goes to the
free slot whose cache shares the longest prefix with its prompt, and only the rest is prefilled. This is
what makes a follow-up chat turn cheap.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serving.detok import IncrementalDetokenizer
from serving.request import (
    FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, GenerationChunk, Request, RequestHandle, Usage,
)
from serving.sampling import SamplerChain

if TYPE_CHECKING:
    from serving.config import EngineConfig
    from serving.engine import LlamaContext, LlamaModel

log = logging.getLogger(__name__)


@dataclass
class Slot:
    """One sequence of the context. `cache` is exactly the tokens held in its K/V cells, in order."""

    seq_id: int
    cache: list[int] = field(default_factory=list)
    request: Request | None = None
    handle: RequestHandle | None = None
    sampler: SamplerChain | None = None
    detok: IncrementalDetokenizer | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet decoded
    next_token: int | None = None  # sampled, to be decoded next step
    logits_row: int = -1  # batch row holding this slot's logits after the current decode
    limit: int = 0  # most tokens this request may generate
    usage: Usage = field(default_factory=Usage)
    t_first: float = 0.0
    last_used: float = 0.0

    @property
    def busy(self) -> bool:
        return self.request is not None

    @property
    def state(self) -> str:
        if not self.busy:
            return "idle"
        return "prefill" if self.pending else "generate"


@dataclass
class Counters:
    """Totals since start; read by /slots, the metrics and the tests."""

    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    prompt_tokens_evaluated: int = 0
    prompt_tokens_cached: int = 0
    generated_tokens: int = 0
    decode_calls: int = 0


class Scheduler:
    """Owned by the engine's step thread; `enqueue` and `snapshot` are the only calls from other threads."""

    def __init__(self, model: LlamaModel, ctx: LlamaContext, config: EngineConfig) -> None:
        self._waiting: collections.deque[tuple[Request, RequestHandle]] = collections.deque()
        self._lock = threading.Lock()  # guards _waiting against enqueue from other threads
        self._admitting = True
        self.counters = Counters()
        self.rebind(model, ctx, config)

    # -- control -------------------------------------------------------------------------------------
    def rebind(self, model: LlamaModel, ctx: LlamaContext, config: EngineConfig) -> None:
        """Use a (new) model/context; all slots start empty. Only called while no slot is busy."""
        self._model, self._ctx, self._config = model, ctx, config
        self.slots = [Slot(seq_id=i) for i in range(config.n_parallel)]
        self._is_eog = model.is_eog

    def enqueue(self, request: Request, handle: RequestHandle) -> None:
        with self._lock:
            self._waiting.append((request, handle))

    def pause_admission(self) -> None:
        self._admitting = False

    def resume_admission(self) -> None:
        self._admitting = True

    @property
    def drained(self) -> bool:
        return not any(slot.busy for slot in self.slots)

    # -- the step ------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step. Returns False when there was nothing to decode."""
        self._drop_cancelled()
        if self._admitting:
            self._admit()
        batch = self._ctx.batch
        batch.clear()
        for slot in self.slots:
            if slot.next_token is not None:
                slot.logits_row = batch.add([slot.next_token], len(slot.cache), slot.seq_id, True)
        self._add_prompt_chunks()
        if batch.n == 0:
            return False
        self._decode()
        self._sample()
        return True

    def _add_prompt_chunks(self) -> None:
        batch = self._ctx.batch
        for slot in sorted((s for s in self.slots if s.pending), key=lambda s: s.request.arrival):
            if batch.free == 0:
                return
            chunk = slot.pending[: batch.free]
            last = len(chunk) == len(slot.pending)
            row = batch.add(chunk, len(slot.cache), slot.seq_id, last)
            slot.logits_row = row if last else -1  # logits only once the whole prompt is in
            slot.cache.extend(chunk)  # positions advance now; cleared by _decode if the decode fails
            del slot.pending[: len(chunk)]
            self.counters.prompt_tokens_evaluated += len(chunk)

    def _decode(self) -> None:
        for slot in self.slots:
            if slot.next_token is not None:
                slot.cache.append(slot.next_token)
                slot.next_token = None
        rc = self._ctx.decode()
        self.counters.decode_calls += 1
        if rc != 0:
            in_batch = {int(s) for s in self._ctx.batch.seq_id[: self._ctx.batch.n]}
            for slot in self.slots:
                if slot.seq_id in in_batch and slot.busy:
                    self._finish(slot, FINISH_ERROR, error=f"llama_decode failed (code {rc})")
                    self._ctx.forget(slot.seq_id)
                    slot.cache.clear()

    def _sample(self) -> None:
        now = time.perf_counter()
        for slot in self.slots:
            if slot.logits_row < 0 or not slot.busy:
                continue
            row, slot.logits_row = slot.logits_row, -1
            if slot.sampler is None:
                token = int(self._ctx.logits(row).argmax())
            else:
                token = slot.sampler.sample(self._ctx.ptr, row)
            self._on_token(slot, token, now)

    def _on_token(self, slot: Slot, token: int, now: float) -> None:
        usage = slot.usage
        if usage.completion_tokens == 0:
            slot.t_first = now
            usage.ttft_s = now - slot.request.arrival
        if self._is_eog(token) and not slot.request.params.ignore_eos:
            self._finish(slot, FINISH_STOP)
            return
        usage.completion_tokens += 1
        usage.decode_s = now - slot.t_first
        self.counters.generated_tokens += 1
        text, hit_stop = slot.detok.add(token)
        if hit_stop:
            self._finish(slot, FINISH_STOP, text=text, token=token)
        elif usage.completion_tokens >= slot.limit:
            self._finish(slot, FINISH_LENGTH, text=text + slot.detok.finish(), token=token)
        else:
            slot.handle.push(GenerationChunk(text=text, token_ids=[token]))
            slot.next_token = token

    # -- admission -----------------------------------------------------------------------------------
    def _admit(self) -> None:
        while True:
            free = [s for s in self.slots if not s.busy]
            if not free:
                return
            with self._lock:
                if not self._waiting:
                    return
                request, handle = self._waiting.popleft()
            if len(request.prompt_tokens) >= self._ctx.n_ctx_seq:  # queued before a reconfigure shrank slots
                handle.push(GenerationChunk(
                    finish_reason=FINISH_ERROR, usage=Usage(len(request.prompt_tokens)),
                    error=f"the prompt ({len(request.prompt_tokens)} tokens) no longer fits a slot "
                          f"({self._ctx.n_ctx_seq} tokens) after a configuration change"))
                self.counters.requests_failed += 1
                continue
            self._assign(self._pick_slot(free, request.prompt_tokens), request, handle)

    def _pick_slot(self, free: list[Slot], prompt: list[int]) -> Slot:
        """The free slot sharing the longest cached prefix with `prompt`; else the least recently used."""
        shared, best = max(((_common_prefix(s.cache, prompt), s) for s in free), key=lambda p: (p[0], -p[1].last_used))
        return best if shared > 0 else min(free, key=lambda s: s.last_used)

    def _assign(self, slot: Slot, request: Request, handle: RequestHandle) -> None:
        prompt = request.prompt_tokens
        reuse = min(_common_prefix(slot.cache, prompt), len(prompt) - 1)  # decode >= 1 token for logits
        self._ctx.forget(slot.seq_id, reuse)
        del slot.cache[reuse:]
        params = request.params
        slot.request, slot.handle = request, handle
        slot.pending = prompt[reuse:]
        slot.next_token = None
        slot.usage = Usage(prompt_tokens=len(prompt), cached_tokens=reuse)
        room = self._ctx.n_ctx_seq - len(prompt)
        slot.limit = min(params.max_tokens, room) if params.max_tokens else room
        slot.detok = IncrementalDetokenizer(self._model.token_bytes, params.stop)
        slot.sampler = None
        if not params.is_plain_greedy:
            slot.sampler = SamplerChain(params, self._config.seed)
            if params.has_penalties:
                slot.sampler.accept_prompt(prompt, params.penalty_last_n)
        self.counters.prompt_tokens += len(prompt)
        self.counters.prompt_tokens_cached += reuse

    # -- leaving -------------------------------------------------------------------------------------
    def _finish(self, slot: Slot, reason: str, text: str = "", token: int | None = None,
                error: str | None = None) -> None:
        """Send the last chunk and free the slot (its cache stays for prefix reuse)."""
        if reason == FINISH_STOP and token is None and slot.detok is not None:
            text += slot.detok.finish()
        slot.handle.push(GenerationChunk(
            text=text, token_ids=[token] if token is not None else [], finish_reason=reason,
            usage=slot.usage, error=error,
        ))
        if reason == FINISH_CANCELLED:
            self.counters.requests_cancelled += 1
        elif reason == FINISH_ERROR:
            self.counters.requests_failed += 1
        else:
            self.counters.requests_finished += 1
        slot.pending = []  # an unfinished prefill leaves a partial prompt cached: still a valid prefix
        if slot.sampler is not None:
            slot.sampler.free()
        slot.request = slot.handle = slot.sampler = slot.detok = None
        slot.next_token = None
        slot.logits_row = -1
        slot.last_used = time.perf_counter()

    def _drop_cancelled(self) -> None:
        for slot in self.slots:
            if slot.busy and slot.request.cancelled:
                self._finish(slot, FINISH_CANCELLED)
        with self._lock:
            gone = [(r, h) for r, h in self._waiting if r.cancelled]
            for item in gone:
                self._waiting.remove(item)
        for request, handle in gone:
            handle.push(GenerationChunk(finish_reason=FINISH_CANCELLED, usage=Usage(len(request.prompt_tokens))))
            self.counters.requests_cancelled += 1

    def reset_slot(self, seq_id: int) -> None:
        """Empty an idle slot's cache (the engine borrows slot cells for scoring)."""
        self._ctx.forget(seq_id)
        self.slots[seq_id].cache.clear()

    def fail_active(self, message: str) -> None:
        """After an unexpected error: end every running request with an error and reset the slots' caches."""
        for slot in self.slots:
            if slot.busy:
                self._finish(slot, FINISH_ERROR, error=message)
            self._ctx.forget(slot.seq_id)
            slot.cache.clear()

    def fail_all(self, message: str) -> None:
        """On shutdown: end running and waiting requests with an error, so no caller waits forever."""
        self.fail_active(message)
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for request, handle in waiting:
            handle.push(GenerationChunk(finish_reason=FINISH_ERROR, error=message,
                                        usage=Usage(len(request.prompt_tokens))))

    # -- observation ---------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        slots = [_slot_view(s) for s in list(self.slots)]
        return {
            "slots": slots,
            "slots_busy": sum(1 for s in slots if s["state"] != "idle"),
            "queue_depth": len(self._waiting),
            "counters": vars(self.counters).copy(),
        }


def _slot_view(slot: Slot) -> dict[str, Any]:
    """One slot as llama-server's /slots shows it; reads each field once (another thread is stepping)."""
    request, usage = slot.request, slot.usage
    return {
        "id": slot.seq_id, "state": slot.state if request else "idle", "n_cached": len(slot.cache),
        "request_id": request.id if request else None,
        "n_prompt": usage.prompt_tokens if request else 0,
        "n_generated": usage.completion_tokens if request else 0,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
