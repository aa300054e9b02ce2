"""Slots, admission, and the step: one llama_decode per step for every busy slot.

Like llama-server's update_slots(): each step first gives every generating slot its one next token, then
fills what is left of the batch (n_batch tokens) with chunks of pending prompts, decodes once, and samples
one token for every slot whose last batch row produced logits. Requests join and leave between steps.

A slot keeps the tokens of its last request in the K/V cache after it finishes; a new request goes to the
free slot whose cache shares the longest prefix with its prompt, and only the rest is prefilled. This is
what makes a follow-up chat turn cheap. With a host-RAM prompt cache (serving/engine/prompt_cache.py, llama-server's
--cache-ram), a finished slot's state is saved while the engine is idle (save_idle), or at the latest before an
unrelated prompt drops its cells (unless a stored state covers all of it but what prefills again faster than
the copy, as measured here), and a prompt that extends a saved state further than any slot's cache gets it
restored into the least recently used slot.

The scheduler never touches text, handles or threads (vLLM v1's split): it reaches llama.cpp only through
the small `ModelContext` protocol, and reports each step as a list of typed `RequestOutput`s that the
output processor (serving/engine/output.py) turns into text for the callers. So everything here runs against a
fake context in milliseconds (tests/test_scheduler.py). The engine's step thread is its only caller.

Not every model's memory can go back. A slot reuses a cached prefix only where llama.cpp keeps it (MemoryKind):
any prefix of attention K/V cells; of a sliding window's cells, a prefix whose window is still held
(`llama_memory_seq_pos_min`); of a recurrent or hybrid model's state, all of it or nothing, since the state
holds no earlier position (`llama_memory_seq_rm` of a partial range returns false), except through a
checkpoint: its recurrent part saved CHECKPOINT_TAIL tokens before the end of each prompt, as llama-server's
context checkpoints, so a next turn or a regenerated answer that shares the prompt goes back to it. Where
llama.cpp refuses anyway, the slot is emptied and the prompt prefilled from its start: never decoded onto
cells that do not hold the prefix it was counted for (docs/design.md, "Memory kinds").
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

from serving.engine.prompt_cache import CachedPrompt, PromptCache, StateBuffer, common_prefix
from serving.engine.request import FinishReason, Request, SamplingParams, TokenLogprob, Usage
from serving.engine.speculate import (
    Acceptance, DraftContext, Drafter, ModelDrafter, PromptLookup, SpecSettings, StepCosts, could_pay, draft_length,
)

log = logging.getLogger(__name__)

# Messages a client may see (details go to the log).
# Cached prompt tokens worth taking a slot apart from the busy ones (each step then decodes in one more
# micro-batch while they run together, _pick_slot): 1024 tokens of a 27B-class prompt prefill in ~0.35 s on
# the H200 (~2,900 tok/s), about what ~35 split decode steps lose.
SPLIT_WORTH = 1024
# A slot's cached prefix counts for the slot choice only when it is more than this share of the prompt (as
# llama-server's --slot-prompt-similarity, 0.1 by default): a few shared tokens ("Conversation", a chat
# template's opening) must not make a new prompt overwrite a long history it does not continue.
SLOT_PROMPT_SIMILARITY = 0.1
DECODE_FAILED = "the model failed to evaluate this request's batch (llama_decode error {rc}); retry it"
SAMPLER_FAILED = "sampling the next token failed for this request"
TOO_MANY_CHOICES = "{n} choices need {n} slots at once, but this server has {slots}: ask for fewer"
# A recurrent or hybrid slot's prompt ends in a step of its own for its last CHECKPOINT_TAIL tokens, and its
# recurrent part is saved before them (llama-server takes one 4 tokens before a prompt's end): a regenerated
# answer sends the same prompt again, which must decode its last token, and a chat template may render the
# turn's opening differently once the answer follows it. CHECKPOINTS of them are kept a slot, newest last.
CHECKPOINT_TAIL = 4
CHECKPOINTS = 4
NO_LONGER_FITS = ("the prompt ({n} tokens) no longer fits a slot ({slot} tokens) after a configuration change: "
                  "shorten it or ask the operator for a larger context")


class TokenSampler(Protocol):
    """One request's sampler (a llama.cpp sampler chain in production)."""

    resamples: int  # tokens a grammar rejected and that were sampled again

    def accept(self, tokens: Sequence[int]) -> None: ...

    def sample(self, row: int) -> int: ...

    def free(self) -> None: ...


class ModelContext(DraftContext, Protocol):
    """What the scheduler needs of a llama.cpp context: one batch, one decode, per-sequence cache trims (a
    draft model's context needs the same, less what sampling and sharing prompts take)."""

    one_stream_per_slot: bool  # kv_unified off: a step's rows split into micro-batches by runs of slots
    memory_kind: MemoryKind
    n_swa: int  # the sliding window in tokens (0: none)

    @property
    def batch_size(self) -> int: ...

    def new_sampler(self, params: SamplingParams, default_seed: int) -> TokenSampler: ...

    def copy_seq(self, src: int, dst: int) -> None: ...

    def pos_min(self, seq_id: int) -> int: ...

    def is_eog(self, token: int) -> bool: ...

    def greedy_no_eog(self, row: int) -> int: ...

    def logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob: ...

    def save_seq(self, seq_id: int, buffer_for: Callable[[int], StateBuffer], partial: bool = False
                 ) -> memoryview: ...

    def load_seq(self, seq_id: int, state: memoryview, partial: bool = False) -> bool: ...


class MemoryKind(str, Enum):
    """What a model's memory keeps of a sequence, which decides the prefixes a slot can go back to (llama.cpp's
    memory modules; serving/engine/llama.py asks the model which it has)."""

    kv = "kv"  # attention K/V cells, one per position: any prefix stays
    swa = "swa"  # sliding-window attention (Gemma 3, gpt-oss): a prefix stays while its window's cells do
    recurrent = "recurrent"  # one state per sequence (Mamba, RWKV): all of it, or nothing
    hybrid = "hybrid"  # attention and recurrent layers (LFM2, Jamba, Nemotron-H, Qwen3.5): as recurrent

    @property
    def cuts(self) -> bool:
        """Whether llama.cpp can drop a sequence's last tokens and keep the rest. A recurrent state (alone, or
        in a hybrid) summarises every token so far and keeps no earlier position: llama_memory_seq_rm of
        [p0, end) with p0 inside its tokens returns false (llama-memory-recurrent.cpp, with the context's
        n_rs_seq snapshots at 0, llama.cpp's default and ours)."""
        return self in (MemoryKind.kv, MemoryKind.swa)


class SlotState(str, Enum):
    idle = "idle"
    prefill = "prefill"
    generate = "generate"


@dataclass(frozen=True)
class RequestOutput:
    """What one step did for one request: a new token, an end, or both (the last token of `length`).

    `usage` is the request's own record (final once `finish` is set).
    """

    request: Request
    usage: Usage
    token: int | None = None
    finish: FinishReason | None = None
    error: str | None = None
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Checkpoint:
    """A slot's recurrent state after its first `n_tokens` tokens (llama.cpp's partial sequence state: a
    hybrid's attention cells are not in it, they are cut back instead)."""

    n_tokens: int
    state: memoryview


@dataclass
class Slot:
    """One sequence of the context. `cache` is exactly the tokens held in its K/V cells, in order."""

    seq_id: int
    cache: list[int] = field(default_factory=list)
    request: Request | None = None
    sampler: TokenSampler | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet decoded
    next_token: int | None = None  # sampled, to be decoded next step
    logits_row: int = -1  # batch row holding this slot's logits after the current decode
    limit: int = 0  # most tokens this request may generate
    usage: Usage = field(default_factory=Usage)
    t_first: float = 0.0
    last_used: float = 0.0
    clones: list[Slot] = field(default_factory=list)  # other choices of this request, waiting for its prompt
    leader: Slot | None = None  # the slot whose prompt this choice will copy
    drafter: Drafter | None = None  # speculation: guesses what follows (prompt lookup, or a draft model)
    acceptance: Acceptance = field(default_factory=Acceptance)  # how its guesses fared (sets the draft length)
    draft: list[int] = field(default_factory=list)  # guesses in the batch being decoded, after next_token
    unsaved: bool = False  # finished since the prompt cache last looked at its cells (save_idle)
    checkpoints: list[Checkpoint] = field(default_factory=list)  # of the tokens in `cache`, oldest first

    @property
    def state(self) -> SlotState:
        if self.request is None:
            return SlotState.idle
        return SlotState.prefill if self.pending or self.leader is not None else SlotState.generate


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
    decode_failures: int = 0
    spec_drafted: int = 0  # tokens guessed and verified
    spec_accepted: int = 0  # of those, kept
    grammar_resamples: int = 0  # tokens a grammar rejected (then sampled again with the grammar first)
    prefixes_refused: int = 0  # cached prefixes llama.cpp could not keep after all: prefilled from the start
    checkpoints_restored: int = 0  # recurrent states put back to a checkpoint (a prompt going back)


@dataclass(frozen=True)
class SlotView:
    """One slot as /slots shows it (llama-server's fields where they exist)."""

    id: int
    state: SlotState
    n_cached: int
    request_id: int | None
    n_prompt: int
    n_generated: int


class Scheduler:
    """Owned by the engine's step thread: nothing here is called from any other thread but `snapshot`."""

    def __init__(self, ctx: ModelContext, n_parallel: int, default_seed: int,
                 spec: SpecSettings | None = None, clock: Callable[[], float] = time.perf_counter,
                 draft: DraftContext | None = None, prompt_cache: PromptCache | None = None) -> None:
        self.prompt_cache = prompt_cache  # None: off
        self.waiting: collections.deque[list[Request]] = collections.deque()  # groups: a request's choices
        self.admitting = True  # the engine pauses admission while a command waits for the slots to drain
        self.counters = Counters()
        self._clock = clock
        self.requests_per_s = 0.0  # recent finish rate (EMA), for Retry-After estimates
        self._last_finish = 0.0
        self._in_batch: set[int] = set()  # seq ids with rows in the batch being decoded
        self.rebind(ctx, n_parallel, default_seed, spec, draft)

    def rebind(self, ctx: ModelContext, n_parallel: int, default_seed: int,
               spec: SpecSettings | None = None, draft: DraftContext | None = None) -> None:
        """Use a (new) context, and the draft model's context when speculation guesses with one; all slots
        start empty, and so does the prompt cache (its states fit only the context that made them). Only called
        while no slot is busy."""
        self._ctx, self._seed, self._spec = ctx, default_seed, spec
        if spec is not None and not ctx.memory_kind.cuts:
            log.warning("speculation stays off: a %s model's memory cannot drop the guesses it rejects",
                        ctx.memory_kind.value)
        if self.prompt_cache is not None:
            self.prompt_cache.clear()
        self.slots = [Slot(seq_id=i) for i in range(n_parallel)]
        self._draft_model = (ModelDrafter(draft, n_parallel, spec.p_min, self._clock) if draft is not None and spec
                             else None)
        self._costs = StepCosts()  # what a step costs by its rows, on this machine and this context

    def add(self, choices: list[Request]) -> None:
        """Queue one request: its `n` choices share one prompt, prefilled once and copied (n slots at once)."""
        self.waiting.append(choices)

    @property
    def n_waiting(self) -> int:
        return sum(len(group) for group in list(self.waiting))

    @property
    def drained(self) -> bool:
        return all(slot.request is None for slot in self.slots)

    # -- the step ------------------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], bool]:
        """One engine step: (what happened to each request, whether a decode ran)."""
        outputs = self._drop_cancelled()
        if self.admitting:
            outputs += self._admit()
        ctx = self._ctx
        ctx.clear_batch()
        generating = [s for s in self.slots if s.next_token is not None]
        self._in_batch = {s.seq_id for s in generating}
        busy = sum(1 for s in self.slots if s.request is not None)
        speculate = self._spec is not None and busy <= self._spec.max_busy
        room = ctx.batch_capacity - len(generating)
        for i, slot in enumerate(generating):  # rows without this slot's guesses: so far + the slots to come
            slot.draft = self._draft(slot, room, ctx.batch_size + len(generating) - i) if speculate else []
            room -= len(slot.draft)
            assert slot.next_token is not None
            last = ctx.add_to_batch([slot.next_token, *slot.draft], len(slot.cache), slot.seq_id, True,
                                    all_logits=bool(slot.draft))
            slot.logits_row = last - len(slot.draft)
        generating_rows = ctx.batch_size
        t0 = self._clock()  # the step's cost, without the guessing (a draft model prices its own)
        due = self._add_prompt_chunks(warm_drafts=speculate)
        if ctx.batch_size == 0:
            return outputs, False
        if self._decode(outputs):
            self._share_prompts()
            self._sample(outputs)
            seconds = self._clock() - t0
            if ctx.batch_size == generating_rows:  # prompt rows cost otherwise: price only generation steps
                self._costs.observe(generating_rows, seconds)
            elif self.prompt_cache is not None:  # what a skipped save's tokens would cost to prefill again
                self.prompt_cache.prices.prefilled(ctx.batch_size, ctx.batch_size - generating_rows, seconds)
            self._checkpoint(due)  # after the step is priced: the copy is no part of a prefill's cost
        return outputs, True

    def _draft(self, slot: Slot, room: int, rows: int) -> list[int]:
        """Guesses to verify after the slot's next token, in a batch of `rows` rows so far: as many as pay on
        this machine (speculate.py), within what the batch, the request's remaining tokens and the slot's
        cells allow (k guesses yield up to k + 1 tokens); the drafter may offer fewer."""
        if slot.drafter is None or self._spec is None or slot.next_token is None:
            return []
        most = max(min(self._spec.draft_max, room, slot.limit - slot.usage.completion_tokens - 1,
                       self._ctx.n_ctx_seq - len(slot.cache) - 2), 0)
        drafter = slot.drafter
        if drafter.costly:  # decide first, then pay for exactly that many guesses
            k = draft_length(slot.acceptance, self._costs, most, rows, True, drafter.guess_seconds)
            return drafter.propose([*slot.cache, slot.next_token], k) if k > 0 else []
        offered = drafter.propose([*slot.cache, slot.next_token], most) if most > 0 else []
        return offered[:draft_length(slot.acceptance, self._costs, len(offered), rows, False, drafter.guess_seconds)]

    def _drafting_may_pay(self, drafter: Drafter) -> bool:
        """Whether the guesser could make a lone stream faster on this machine even if every guess held (not
        where a guess costs about a decode of the model: a draft model nearly as large, or a slow CPU)."""
        guess = drafter.guess_seconds
        return self._spec is None or guess is None or could_pay(self._costs, self._spec.draft_max, 1, guess)

    def _add_prompt_chunks(self, warm_drafts: bool) -> list[Slot]:
        """Prompt chunks into what is left of the batch, oldest request first; the slots to checkpoint once
        it is decoded (their chunk stops CHECKPOINT_TAIL tokens before their prompt's end)."""
        ctx = self._ctx
        prefilling = sorted((s for s in self.slots if s.pending and s.request is not None),
                            key=lambda s: s.request.arrival if s.request is not None else 0.0)
        due: list[Slot] = []
        for slot in prefilling:
            room = ctx.batch_capacity - ctx.batch_size
            if room == 0:
                break
            chunk = slot.pending[:room]
            before_tail = len(slot.pending) - CHECKPOINT_TAIL
            if not ctx.memory_kind.cuts and 0 < before_tail <= len(chunk):
                chunk = chunk[:before_tail]
                due.append(slot)
            last = len(chunk) == len(slot.pending)
            row = ctx.add_to_batch(chunk, len(slot.cache), slot.seq_id, last)
            self._in_batch.add(slot.seq_id)
            slot.logits_row = row if last else -1  # logits only once the whole prompt is in
            slot.cache.extend(chunk)  # positions advance now; cleared by _decode if the decode fails
            del slot.pending[: len(chunk)]
            if last and slot.drafter is not None:
                if slot.drafter.costly and not self._drafting_may_pay(slot.drafter):
                    slot.drafter = None  # a probe would cost it the whole prompt: this request goes without
                elif warm_drafts:  # a draft model takes the prompt in now, not at the first guess (none while
                    slot.drafter.warm(slot.cache)  # too many slots are busy)
            self.counters.prompt_tokens_evaluated += len(chunk)
        return due

    def _checkpoint(self, slots: list[Slot]) -> None:
        """Save each slot's recurrent state as it stands after the decode (CHECKPOINTS a slot, the oldest
        dropped). Like a prompt-cache save it may fail nothing: the slot only loses a way back."""
        for slot in slots:
            try:
                state = self._ctx.save_seq(slot.seq_id, _new_buffer, partial=True)
            except Exception:
                log.exception("checkpointing slot %d at %d tokens failed", slot.seq_id, len(slot.cache))
                continue
            slot.checkpoints = [*slot.checkpoints, Checkpoint(len(slot.cache), state)][-CHECKPOINTS:]

    def _decode(self, outputs: list[RequestOutput]) -> bool:
        """Decode the batch. On failure only the requests with rows in this batch fail.

        Not retried, unlike llama-server's retry of ret == 1 with a smaller batch: there, 1 means the
        unified cache had no room for the batch; here every slot owns n_ctx_seq cells of its own and
        admission keeps prompt + generation inside them, so 1 means our accounting is wrong, and a retry
        would hide that. Negative codes are llama.cpp's fatal errors, 2 an abort (we set no abort
        callback). Ubatches processed before a failure stay in the cache, so those slots' caches are
        dropped entirely: the next request on them prefills from scratch, never from half-written cells.
        """
        for slot in self.slots:
            if slot.next_token is not None:
                slot.cache += [slot.next_token, *slot.draft]
                slot.next_token = None
        rc = self._ctx.decode()
        self.counters.decode_calls += 1
        if rc == 0:
            return True
        self.counters.decode_failures += 1
        log.error("llama_decode returned %d for a batch of %d tokens", rc, self._ctx.batch_size)
        message = DECODE_FAILED.format(rc=rc)
        for slot in self.slots:
            if slot.seq_id in self._in_batch:
                if slot.request is not None:
                    outputs += self._end_with_clones(slot, FinishReason.error, message)
                self._empty(slot)
                slot.draft = []
        return False

    def _share_prompts(self) -> None:
        """A prompt whose last chunk was just decoded: copy its cells to the request's other choices, which
        then sample from the same logits row (one prefill for n choices)."""
        for slot in self.slots:
            if slot.clones and slot.logits_row >= 0:
                for clone in slot.clones:
                    self._ctx.copy_seq(slot.seq_id, clone.seq_id)
                    clone.cache = list(slot.cache)
                    clone.logits_row, clone.leader = slot.logits_row, None
                slot.clones = []

    def _sample(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for slot in self.slots:
            if slot.logits_row >= 0 and slot.request is not None:
                self._sample_slot(slot, outputs, now)

    def _sample_slot(self, slot: Slot, outputs: list[RequestOutput], now: float) -> None:
        """Sample the slot's next token; with guesses in the batch, verify them in order with the request's
        own sampler, keep each guess the sampler drew itself, and roll the cache back past the first miss."""
        row, slot.logits_row = slot.logits_row, -1
        draft, slot.draft = slot.draft, []
        request = slot.request
        assert request is not None
        accepted = 0
        for i in range(len(draft) + 1):
            try:
                token = self._greedy(row + i, request) if slot.sampler is None else slot.sampler.sample(row + i)
                top_n = request.params.logprobs
                logprob = None if top_n is None else self._ctx.logprobs(row + i, token, top_n)
            except Exception:  # one request's sampler: that request fails, its neighbours go on
                log.exception("sampling failed for request %d", request.id)
                outputs.append(self._end(slot, FinishReason.error, SAMPLER_FAILED))
                break
            out = self._on_token(slot, token, now, logprob)
            outputs.append(out)
            if out.finish is not None or i == len(draft) or token != draft[i]:
                break
            accepted += 1  # the guess was right: its cell already holds it, and its row's logits are next
            slot.next_token = None
        if draft:
            self.counters.spec_drafted += len(draft)
            self.counters.spec_accepted += accepted
            slot.acceptance.record(accepted, missed=slot.request is not None and accepted < len(draft))
            kept = len(slot.cache) - len(draft) + accepted  # rejected guesses leave the cache
            if kept < len(slot.cache):
                self._ctx.forget(slot.seq_id, kept)
                del slot.cache[kept:]

    def _greedy(self, row: int, request: Request) -> int:
        """The model's top token; under `ignore_eos` never an end of generation (llama-server bans them with a
        logit bias: the text goes on as the model would continue it, not past a token it shows as nothing)."""
        token = self._ctx.greedy(row)
        if request.params.ignore_eos and self._ctx.is_eog(token):
            return self._ctx.greedy_no_eog(row)
        return token

    def _on_token(self, slot: Slot, token: int, now: float, logprob: TokenLogprob | None) -> RequestOutput:
        request, usage = slot.request, slot.usage
        assert request is not None
        if usage.ttft_s is None:
            slot.t_first = now
            usage.ttft_s = now - request.arrival
        if self._ctx.is_eog(token) and not request.params.ignore_eos:
            return self._end(slot, FinishReason.stop)
        usage.completion_tokens += 1
        usage.decode_s = now - slot.t_first
        self.counters.generated_tokens += 1
        if usage.completion_tokens >= slot.limit:
            return self._end(slot, FinishReason.length, token=token, logprob=logprob)
        slot.next_token = token
        return RequestOutput(request, usage, token=token, logprob=logprob)

    # -- admission -----------------------------------------------------------------------------------
    def _admit(self) -> list[RequestOutput]:
        """Move waiting requests into free slots, first come first served; a request with n choices waits
        until n slots are free at once."""
        outputs: list[RequestOutput] = []
        free = [s for s in self.slots if s.request is None]
        while free and self.waiting:
            group = self.waiting[0]
            problem = self._unfit(group)
            if problem is None and len(group) > len(free):
                return outputs
            self.waiting.popleft()
            if problem is not None:  # queued before a reconfigure shrank the slots
                self.counters.requests_failed += len(group)
                outputs += [RequestOutput(r, Usage(len(r.prompt_tokens)), finish=FinishReason.error, error=problem)
                            for r in group]
                continue
            outputs += self._start(group, free)
        return outputs

    def _unfit(self, group: list[Request]) -> str | None:
        n_prompt = len(group[0].prompt_tokens)
        if n_prompt + 1 > self._ctx.n_ctx_seq:
            return NO_LONGER_FITS.format(n=n_prompt, slot=self._ctx.n_ctx_seq)
        if len(group) > len(self.slots):
            return TOO_MANY_CHOICES.format(n=len(group), slots=len(self.slots))
        return None

    def _start(self, group: list[Request], free: list[Slot]) -> list[RequestOutput]:
        """Assign a request's choices: the first prefills (reusing the best cached prefix), the others copy."""
        leader_request, *others = group
        prompt = leader_request.prompt_tokens
        leader, shared = self._pick_slot(free, prompt)
        saved = self._saved_state(prompt, shared)
        if saved is not None:  # a saved state beats every slot: into the slot nothing better would claim
            leader, _ = self._pick_slot(free, [])
        free.remove(leader)
        if saved is not None:
            shared = self._restore(leader, *saved)
        if not self._try_assign(leader, leader_request, shared):
            self.counters.requests_failed += len(others)
            return [self._end(leader, FinishReason.error, SAMPLER_FAILED)] + [
                RequestOutput(r, Usage(len(r.prompt_tokens)), finish=FinishReason.error, error=SAMPLER_FAILED)
                for r in others]
        outputs: list[RequestOutput] = []
        for request in others:
            clone, _ = self._pick_slot(free, [])  # next to the busy slots (a clone copies the leader's cells)
            free.remove(clone)
            clone.leader = leader
            leader.clones.append(clone)
            if not self._try_assign(clone, request, 0):
                outputs.append(self._end(clone, FinishReason.error, SAMPLER_FAILED))
        return outputs

    def _try_assign(self, slot: Slot, request: Request, shared: int) -> bool:
        try:
            self._assign(slot, request, shared)
            return True
        except Exception:  # e.g. its sampler chain could not be built: only this request fails
            log.exception("could not start request %d", request.id)
            slot.request = request
            return False

    def _pick_slot(self, free: list[Slot], prompt: list[int]) -> tuple[Slot, int]:
        """The free slot for `prompt`, and the cached prefix it shares with it.

        The busy slots are kept in one run of consecutive sequence ids where that costs little: llama.cpp
        (kv_unified off, one K/V stream per slot) puts a step's rows in one micro-batch only for consecutive
        sequence ids, in order (llama_batch_allocr::split_equal, `sequential`), so busy slots 0 and 3 decode
        as two graph runs a step, each costing about a whole step (H200, 27B-class, 4 slots: two streams on
        slots apart gave 0.52x the aggregate of two adjacent ones, scripts/bench_agreement.py). A slot that
        splits the busy ones into more runs is taken only for a cached prefix of SPLIT_WORTH tokens or more
        (with kv_unified on, one K/V stream for all, no slot splits a step). Then: the longest cached prefix
        over SLOT_PROMPT_SIMILARITY of the prompt, then (no prefix worth reusing) the least recently used slot."""
        busy = {s.seq_id for s in self.slots if s.request is not None}
        split = self._ctx.one_stream_per_slot
        runs = {s.seq_id: _runs(busy | {s.seq_id}) if split else 1 for s in free}
        fewest = min(runs.values())
        least = SLOT_PROMPT_SIMILARITY * len(prompt)
        scored = [(shared if shared > least else 0, s) for s in free for shared in [self._reusable(s, prompt)]]
        allowed = [(shared, s) for shared, s in scored if runs[s.seq_id] == fewest or shared >= SPLIT_WORTH]
        shared, best = max(allowed, key=lambda p: (p[0], -runs[p[1].seq_id], -p[1].last_used))
        if shared == 0:
            best = min((s for _, s in allowed if runs[s.seq_id] == fewest), key=lambda s: s.last_used)
        return best, shared

    def _reusable(self, slot: Slot, prompt: list[int]) -> int:
        """The prompt tokens `slot` can keep: the shared prefix, less the prompt's last token (decoded again
        for its logits); where the memory cannot be cut, all the slot holds, or its latest checkpoint within
        the shared prefix, or none."""
        shared = min(common_prefix(slot.cache, prompt), max(len(prompt) - 1, 0))
        if self._ctx.memory_kind.cuts or shared == len(slot.cache):
            return shared
        return max((c.n_tokens for c in slot.checkpoints if c.n_tokens <= shared), default=0)

    def _saved_state(self, prompt: list[int], shared: int) -> tuple[CachedPrompt, int] | None:
        """The prompt cache's state for `prompt` when it shares at least min_tokens more than the best slot's
        `shared` (restoring costs a copy of the state; prefilling fewer tokens than that is cheaper)."""
        cache = self.prompt_cache
        if cache is None:
            return None
        found = cache.best(prompt, cuts=self._ctx.memory_kind.cuts)
        if found is None or found[1] < shared + cache.min_tokens:
            return None
        return found

    def _restore(self, slot: Slot, entry: CachedPrompt, shared: int) -> int:
        """Put a saved state into `slot` (saving what the slot held first, if worth keeping); the prefix it
        now shares with the prompt, 0 when llama.cpp refused the state (the slot is then empty)."""
        cache = self.prompt_cache
        assert cache is not None
        self._save(slot)
        self._empty(slot)
        if not self._ctx.load_seq(slot.seq_id, entry.state):
            log.warning("a saved prompt state (%d tokens) could not be restored into slot %d: dropped",
                        len(entry.tokens), slot.seq_id)
            self._empty(slot)
            cache.discard(entry)
            return 0
        slot.cache = list(entry.tokens)
        cache.restored(entry, shared)
        return shared

    def save_idle(self) -> bool:
        """Save one finished slot's state into the prompt cache (when worth keeping), least recently used
        first, all but the most recently used free slot: the engine calls this only when a step found nothing
        to do, so the copy comes out of idle time. Saved when a new prompt takes the slot instead, the copy
        sits between that prompt and its first token: on an H100 such saves made four new streams' TTFT
        6-11 ms longer with the 135M model (two runs), 31 ms with the 27B-class, and 150-240 ms with
        kv_unified (a unified cache's cells interleave, so llama.cpp copies a state out range by range;
        docs/log/2026-12-06-h100-first-run.md).
        The most recently used slot is left to that: it is the one a conversation's
        next turn most likely comes back to (no copy needed at all), and an agent's next turn can arrive
        within the copy's time. A slot saved here is not copied again when taken (the cache covers it).
        True when a slot was looked at: call again, after checking for new requests."""
        if self.prompt_cache is None:
            return False
        free = sorted((s for s in self.slots if s.request is None), key=lambda s: s.last_used)
        finished = [s for s in free[:-1] if s.unsaved]
        if not finished:
            return False
        slot = finished[0]
        slot.unsaved = False
        self._save(slot)
        return True

    def _save(self, slot: Slot) -> None:
        """Keep a slot's state in the prompt cache before its cells are dropped (when worth it). Nothing here
        may fail a request or the step thread (save_idle runs outside a step's guard): the state is an
        optimisation, and serving goes on without it."""
        cache = self.prompt_cache
        if cache is None:
            return
        try:
            if cache.worth_saving(slot.cache, cuts=self._ctx.memory_kind.cuts):
                t0 = self._clock()
                state = self._ctx.save_seq(slot.seq_id, cache.spare)
                cache.prices.saved(len(slot.cache), self._clock() - t0)
                cache.put(slot.cache, state, cuts=self._ctx.memory_kind.cuts)
        except Exception:
            log.exception("saving slot %d's state (%d tokens) failed", slot.seq_id, len(slot.cache))

    def _assign(self, slot: Slot, request: Request, shared: int) -> None:
        prompt = request.prompt_tokens
        reuse = min(shared, len(prompt) - 1)  # decode >= 1 token so the prompt's last logits exist
        if self.prompt_cache is not None and len(slot.cache) - reuse >= self.prompt_cache.min_tokens:
            self._save(slot)
        reuse = self._cut(slot, reuse)
        params = request.params
        slot.request, slot.unsaved = request, False
        slot.pending = prompt[reuse:] if slot.leader is None else []  # a clone gets the leader's cells
        slot.next_token, slot.logits_row = None, -1
        slot.usage = Usage(prompt_tokens=len(prompt), cached_tokens=reuse if slot.leader is None else 0,
                           queue_s=max(self._clock() - request.arrival, 0.0))
        room = self._ctx.n_ctx_seq - len(prompt)
        slot.limit = min(params.max_tokens, room) if params.max_tokens else room
        slot.sampler = None
        slot.drafter = self._new_drafter(slot)
        slot.acceptance = Acceptance()
        slot.draft = []
        self.counters.prompt_tokens += len(prompt)
        self.counters.prompt_tokens_cached += reuse
        if not params.is_plain_greedy:
            slot.sampler = self._ctx.new_sampler(params, self._seed)
            if params.has_penalties:  # penalties see the prompt's tail, as in llama-server
                last_n = params.penalty_last_n
                slot.sampler.accept(prompt[-last_n:] if last_n > 0 else prompt)

    def _cut(self, slot: Slot, keep: int) -> int:
        """Drop the slot's cells from position `keep` on (a recurrent state goes back to its latest checkpoint
        within `keep` first); the tokens it still holds: `keep` (or the checkpoint's), or 0 where llama.cpp
        refused the cut or the cells left no longer hold what decoding position `keep` attends to (the slot
        is then emptied, and the prompt prefilled from its start, as llama-server does)."""
        ctx, wanted = self._ctx, keep
        if 0 < keep < len(slot.cache) and not ctx.memory_kind.cuts:
            keep = self._back_to_checkpoint(slot, keep)
        if keep > 0 and ctx.forget(slot.seq_id, keep):
            del slot.cache[keep:]
            slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens <= keep]
            if self._holds_window(slot.seq_id, keep):
                return keep
        if wanted > 0:
            self.counters.prefixes_refused += 1
            log.info("slot %d: llama.cpp could not keep %d cached tokens (%s memory); prefilling from the start",
                     slot.seq_id, wanted, ctx.memory_kind.value)
        self._empty(slot)
        return 0

    def _back_to_checkpoint(self, slot: Slot, keep: int) -> int:
        """Put the slot's recurrent part back to its latest checkpoint within `keep` tokens (its attention
        cells, a hybrid's, are cut to it next); the tokens it covers, 0 when there is none or llama.cpp
        refused it."""
        usable = [c for c in slot.checkpoints if c.n_tokens <= keep]
        if not usable or not self._ctx.load_seq(slot.seq_id, usable[-1].state, partial=True):
            return 0
        self.counters.checkpoints_restored += 1
        return usable[-1].n_tokens

    def _empty(self, slot: Slot) -> None:
        """Drop every cell of the slot (never refused), and what was known of them."""
        self._ctx.forget(slot.seq_id)
        slot.cache.clear()
        slot.checkpoints = []

    def _holds_window(self, seq_id: int, keep: int) -> bool:
        """Whether a sequence cut to `keep` tokens still holds what its next position attends to. llama.h
        promises every position from llama_memory_seq_pos_min to the last is held, so the smallest one
        decides. Under a sliding window position `keep` attends to keep - n_swa + 1 on (llama-hparams.cpp's
        is_masked_swa masks p1 - p0 >= n_swa; a chunked window starts later), so pos_min must be at most
        that (llama-server asks one more: pos_min < keep - n_swa); else the window's first cells were
        overwritten. Attention cells hold position 0, and a recurrent or hybrid state sits at its last
        position, keep - 1 after a cut (a hybrid reports the larger of its parts' pos_min, so a hybrid's
        window is not checked here: its attention cells are full-size, the context sets swa_full)."""
        window = self._ctx.n_swa if self._ctx.memory_kind is MemoryKind.swa else 0
        first_needed = max(keep - window + 1, 0) if window else keep - 1
        return 0 <= self._ctx.pos_min(seq_id) <= first_needed

    def _new_drafter(self, slot: Slot) -> Drafter | None:
        """A guesser for the slot's request; none where the memory cannot be cut, since rejected guesses are
        dropped from the cells by a cut (a recurrent model would prefill its whole prompt again instead)."""
        if self._spec is None or not self._ctx.memory_kind.cuts:
            return None
        if self._draft_model is not None:
            return self._draft_model.for_slot(slot.seq_id)
        return PromptLookup(self._spec)

    # -- leaving -------------------------------------------------------------------------------------
    def finish(self, request_id: int, reason: FinishReason) -> None:
        """End a running request from outside the step (a stop string seen by the output processor, or its
        output failed). Frees the slot now: the token it would decode next is dropped."""
        for slot in self.slots:
            if slot.request is not None and slot.request.id == request_id:
                self._end(slot, reason)
                return

    def _end(self, slot: Slot, reason: FinishReason, error: str | None = None,
             token: int | None = None, logprob: TokenLogprob | None = None) -> RequestOutput:
        """Free the slot (its cache stays, a valid prefix for the next request) and say how it ended."""
        request, usage = slot.request, slot.usage
        assert request is not None
        if reason == FinishReason.cancelled:
            self.counters.requests_cancelled += 1
        elif reason == FinishReason.error:
            self.counters.requests_failed += 1
        else:
            self.counters.requests_finished += 1
            self._note_finish()
        if slot.sampler is not None:
            self.counters.grammar_resamples += slot.sampler.resamples
            slot.sampler.free()
        if slot.leader is not None:  # a choice that ends before its prompt was shared with it
            slot.leader.clones.remove(slot)
            slot.leader = None
        slot.request = slot.sampler = None
        slot.pending = []
        slot.next_token, slot.logits_row = None, -1
        slot.last_used = time.perf_counter()
        slot.unsaved = True
        return RequestOutput(request, usage, token=token, finish=reason, error=error, logprob=logprob)

    def _end_with_clones(self, slot: Slot, reason: FinishReason, error: str | None = None) -> list[RequestOutput]:
        """End a slot, and the choices still waiting for its prompt (they have no prompt without it)."""
        clones, slot.clones = slot.clones, []
        outputs = [self._end(slot, reason, error)]
        for clone in clones:
            clone.leader = None
            outputs.append(self._end(clone, reason, error))
        return outputs

    def _note_finish(self) -> None:
        now = time.perf_counter()
        if self._last_finish:
            gap = max(now - self._last_finish, 1e-3)
            self.requests_per_s = 0.8 * self.requests_per_s + 0.2 / gap
        self._last_finish = now

    def _drop_cancelled(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for slot in self.slots:
            if slot.request is not None and slot.request.cancelled:
                outputs += self._end_with_clones(slot, FinishReason.cancelled)
        if any(r.cancelled for group in self.waiting for r in group):
            kept: collections.deque[list[Request]] = collections.deque()
            for group in self.waiting:
                for request in group:
                    if request.cancelled:
                        self.counters.requests_cancelled += 1
                        outputs.append(RequestOutput(request, Usage(len(request.prompt_tokens)),
                                                     finish=FinishReason.cancelled))
                rest = [r for r in group if not r.cancelled]
                if rest:
                    kept.append(rest)
            self.waiting = kept
        return outputs

    def reset_slot(self, seq_id: int) -> None:
        """Empty an idle slot's cache (the engine borrows slot cells for scoring, and restores slot files)."""
        self._empty(self.slots[seq_id])
        self.slots[seq_id].unsaved = False

    def slot_tokens(self, seq_id: int) -> list[int]:
        """The tokens an idle slot's cells hold (what a slot file saves)."""
        return list(self.slots[seq_id].cache)

    def restored_slot(self, seq_id: int, tokens: list[int]) -> None:
        """An idle slot's cells were loaded from a file and now hold `tokens`: the next prompt extending them
        finds them, as any cached prefix."""
        slot = self.slots[seq_id]
        slot.cache = list(tokens)
        slot.last_used = time.perf_counter()
        slot.unsaved = False  # its state is in the file it came from

    def abort(self, message: str, waiting_too: bool) -> list[RequestOutput]:
        """End running requests (and, on shutdown, waiting ones) with an error; reset every slot's cache.

        For the engine's last resort: an error in the step itself, not a single request's trouble.
        """
        outputs = [self._end(s, FinishReason.error, message) for s in self.slots if s.request is not None]
        for slot in self.slots:
            self._empty(slot)
            slot.unsaved = False
        if waiting_too:
            while self.waiting:
                for request in self.waiting.popleft():
                    self.counters.requests_failed += 1
                    outputs.append(RequestOutput(request, Usage(len(request.prompt_tokens)),
                                                 finish=FinishReason.error, error=message))
        return outputs

    # -- observation (any thread) --------------------------------------------------------------------
    def slot_views(self) -> list[SlotView]:
        """Reads each slot's fields once: the step thread may be changing them."""
        views = []
        for slot in list(self.slots):
            request, usage = slot.request, slot.usage
            busy = request is not None
            views.append(SlotView(
                id=slot.seq_id, state=slot.state if busy else SlotState.idle, n_cached=len(slot.cache),
                request_id=request.id if request is not None else None,
                n_prompt=usage.prompt_tokens if busy else 0, n_generated=usage.completion_tokens if busy else 0))
        return views


def _new_buffer(size: int) -> StateBuffer:
    """A checkpoint's own buffer (a recurrent part is small beside a slot's attention cells)."""
    return np.empty(size, dtype=np.uint8)


def _runs(seq_ids: set[int]) -> int:
    """Runs of consecutive ids in `seq_ids`: the micro-batches a step over those slots is decoded in."""
    return sum(1 for i in seq_ids if i - 1 not in seq_ids)

