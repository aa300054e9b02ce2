"""The scheduler and the output processor without a model: a fake context, milliseconds per test.

The fake keeps its own K/V record per sequence and checks every batch against it (positions contiguous,
no sequence over its cells), so the scheduler's `slot.cache` is checked against what a context would hold.
It keeps llama.cpp's rules for each memory kind too: a recurrent or hybrid state cannot be cut inside its
tokens (`forget` returns False, nothing changed) unless a checkpoint put it back first (a partial state: the
recurrent part alone), and a sliding window drops the cells its last position no longer attends to
(`pos_min`); a batch decoded onto cells that do not hold what it attends to fails the test.
Its "model" is deterministic: the next token after t is (t + 1) % VOCAB, unless a test says otherwise.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from serving.engine.output import OutputProcessor
from serving.engine.prompt_cache import PromptCache, PromptPrices, StateBuffer
from serving.engine.request import FinishReason, GenerationChunk, Request, RequestHandle, SamplingParams
from serving.engine.scheduler import (
    CHECKPOINT_TAIL, CHECKPOINTS, DECODE_FAILED, SAMPLER_FAILED, MemoryKind, RequestOutput, Scheduler,
)

pytestmark = pytest.mark.unit

VOCAB, EOS = 100, 99
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class FakeSampler:
    def __init__(self, ctx: FakeContext, params: SamplingParams) -> None:
        self.ctx, self.params, self.accepted, self.freed = ctx, params, [], False
        self.resamples = 0
        if params.seed == 666:
            raise RuntimeError("this sampler cannot be built")

    def accept(self, tokens: Sequence[int]) -> None:
        self.accepted += list(tokens)

    def sample(self, row: int) -> int:
        if self.params.seed == 13:
            raise RuntimeError("this sampler always fails")
        return self.ctx.greedy(row)

    def free(self) -> None:
        self.freed = True


@dataclass
class FakeContext:
    n_ctx_seq: int = 64
    one_stream_per_slot: bool = True
    batch_capacity: int = 16
    rc: int = 0  # what the next decode returns
    kv: dict[int, list[int]] = field(default_factory=dict)
    rows: list[tuple[int, int, int, bool]] = field(default_factory=list)  # token, pos, seq, logits
    decodes: int = 0
    eos_after: dict[int, int] = field(default_factory=dict)  # seq -> cache length at which EOS comes
    samplers: list[FakeSampler] = field(default_factory=list)
    saves: list[int] = field(default_factory=list)  # slots whose state was saved, in order
    refuse_loads: bool = False
    memory_kind: MemoryKind = MemoryKind.kv
    n_swa: int = 0
    held_from: dict[int, int] = field(default_factory=dict)  # seq -> first position a sliding window still holds
    state_at: dict[int, int] = field(default_factory=dict)  # seq -> tokens its recurrent state holds, where a
    # checkpoint put it behind the cells (until they are cut to it)
    checkpoints: list[int] = field(default_factory=list)  # slots whose partial state was saved, in order

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def clear_batch(self) -> None:
        self.rows = []

    def add_to_batch(self, tokens: Sequence[int], start_pos: int, seq_id: int, want_logits: bool,
                     all_logits: bool = False) -> int:
        assert len(self.rows) + len(tokens) <= self.batch_capacity, "batch overfilled"
        for i, t in enumerate(tokens):
            self.rows.append((t, start_pos + i, seq_id, all_logits or (want_logits and i == len(tokens) - 1)))
        return len(self.rows) - 1

    def decode(self) -> int:
        self.decodes += 1
        if self.rc != 0:
            return self.rc
        for token, pos, seq, _ in self.rows:
            cells = self.kv.setdefault(seq, [])
            assert pos == len(cells), f"seq {seq}: position {pos} after {len(cells)} cached tokens"
            assert pos < self.n_ctx_seq, f"seq {seq} overflows its {self.n_ctx_seq} cells"
            if self.n_swa:  # position pos attends to pos - n_swa + 1 on
                assert max(pos - self.n_swa + 1, 0) >= self.held_from.get(seq, 0), f"seq {seq}: window lost"
            assert seq not in self.state_at, f"seq {seq}: decoded onto a state behind its cells"
            cells.append(token)
        if self.n_swa:  # what llama.cpp may overwrite without swa_full: cells before the last one's window
            for seq, cells in self.kv.items():
                self.held_from[seq] = max(self.held_from.get(seq, 0), len(cells) - self.n_swa)
        return 0

    def greedy(self, row: int) -> int:
        token, _, seq, want = self.rows[row]
        assert want, "sampled a row without logits"
        if self.eos_after.get(seq) == len(self.kv[seq]):
            return EOS
        return (token + 1) % (VOCAB - 1)

    def new_sampler(self, params: SamplingParams, default_seed: int) -> FakeSampler:
        sampler = FakeSampler(self, params)
        self.samplers.append(sampler)
        return sampler

    def forget(self, seq_id: int, from_pos: int = 0) -> bool:
        cells = self.kv.setdefault(seq_id, [])
        if 0 < from_pos < self.state_at.get(seq_id, len(cells)) and not self.memory_kind.cuts:
            return False  # llama_memory_seq_rm of a recurrent state's partial range
        del cells[from_pos:]
        self.state_at.pop(seq_id, None)
        if from_pos == 0 or from_pos <= self.held_from.get(seq_id, 0):
            cells.clear()
            self.held_from[seq_id] = 0
        return True

    def pos_min(self, seq_id: int) -> int:
        cells = self.kv.get(seq_id, [])
        if not cells:
            return -1
        if self.memory_kind.cuts:
            return self.held_from.get(seq_id, 0)
        return min(self.state_at.get(seq_id, len(cells)), len(cells)) - 1

    def copy_seq(self, src: int, dst: int) -> None:
        self.kv[dst] = list(self.kv[src])
        self.held_from[dst] = self.held_from.get(src, 0)

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def greedy_no_eog(self, row: int) -> int:
        """The model's second choice where its first is EOS: the token it says otherwise."""
        return (self.rows[row][0] + 1) % (VOCAB - 1)

    def save_seq(self, seq_id: int, buffer_for: Callable[[int], StateBuffer], partial: bool = False) -> memoryview:
        (self.checkpoints if partial else self.saves).append(seq_id)
        data = json.dumps([self.held_from.get(seq_id, 0), self.kv.get(seq_id, [])]).encode()
        buffer = buffer_for(len(data))
        buffer[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        return memoryview(buffer)[:len(data)]

    def load_seq(self, seq_id: int, state: memoryview, partial: bool = False) -> bool:
        if self.refuse_loads:
            return False
        held_from, tokens = json.loads(bytes(state))
        if partial:  # the recurrent part goes back; the cells are cut to it next
            assert self.kv[seq_id][:len(tokens)] == tokens, "a checkpoint of other tokens"
            self.state_at[seq_id] = len(tokens)
            return True
        assert not self.kv.get(seq_id), "a state is restored into an emptied slot"
        self.held_from[seq_id], self.kv[seq_id] = held_from, tokens
        return True


_ids = iter(range(10**9))


def req(prompt: Sequence[int], params: SamplingParams = GREEDY) -> Request:
    return Request(next(_ids), list(prompt), params)


def make(n_parallel: int = 2, **kw: int) -> tuple[Scheduler, FakeContext]:
    ctx = FakeContext(**kw)
    return Scheduler(ctx, n_parallel, default_seed=1), ctx


def run(s: Scheduler, ctx: FakeContext, steps: int = 100) -> list[RequestOutput]:
    """Step until nothing is left to do; check the cache invariant after every step."""
    outputs: list[RequestOutput] = []
    for _ in range(steps):
        out, decoded = s.step()
        outputs += out
        for slot in s.slots:
            assert slot.cache == ctx.kv.get(slot.seq_id, []), f"slot {slot.seq_id}'s cache drifted"
        if not decoded and not out and not s.waiting:
            return outputs
    raise AssertionError("the scheduler did not settle")


def ends(outputs: list[RequestOutput]) -> dict[int, RequestOutput]:
    return {o.request.id: o for o in outputs if o.finish is not None}


def tokens_of(outputs: list[RequestOutput], request: Request) -> list[int]:
    return [o.token for o in outputs if o.request is request and o.token is not None]


# -- admission and the batch -------------------------------------------------------------------------
def test_requests_beyond_the_slots_wait_and_run_in_arrival_order() -> None:
    s, ctx = make(n_parallel=2)
    rs = [req([1, 2, 3]) for _ in range(5)]
    for r in rs:
        s.add([r])
    out, _ = s.step()
    assert [slot.request for slot in s.slots] == rs[:2] and list(s.waiting) == [[r] for r in rs[2:]]
    out += run(s, ctx)
    done = ends(out)
    assert all(done[r.id].finish == FinishReason.length for r in rs)
    assert all(tokens_of(out, r) == [4, 5, 6, 7] for r in rs)
    assert s.drained and s.counters.requests_finished == 5


def test_one_decode_per_step_carries_every_generating_slot_and_prompt_chunks() -> None:
    s, ctx = make(n_parallel=3, batch_capacity=8)
    s.add([req([1, 2])])
    s.step()  # prompt of the first request
    s.add([req(list(range(10, 30)))])  # 20-token prompt: needs three steps of chunks
    s.step()
    assert ctx.decodes == 2
    gen_rows = [r for r in ctx.rows if r[2] == 0]
    assert len(gen_rows) == 1 and len(ctx.rows) == 8  # one token for the generator, 7 prompt tokens


def test_prefix_reuse_picks_the_slot_sharing_the_longest_prefix() -> None:
    s, ctx = make(n_parallel=2)
    a, b = req([1, 2, 3, 4, 5]), req([7, 8, 9])
    s.add([a])
    s.add([b])
    run(s, ctx)
    slot_of_a = next(slot for slot in s.slots if slot.cache[:5] == [1, 2, 3, 4, 5])
    follow = req([1, 2, 3, 4, 5, 50, 51])
    s.add([follow])
    out = run(s, ctx)
    assert ends(out)[follow.id].usage.cached_tokens == 5
    assert s.slots[slot_of_a.seq_id].cache[:7] == [1, 2, 3, 4, 5, 50, 51]
    same = req([1, 2, 3, 4, 5, 50, 51])  # an identical prompt still decodes its last token for logits
    s.add([same])
    assert ends(run(s, ctx))[same.id].usage.cached_tokens == 6


def test_a_few_shared_tokens_do_not_take_a_slot_holding_a_history_the_prompt_does_not_continue() -> None:
    """As llama-server's --slot-prompt-similarity (0.1): one shared token of 21 is no reason to overwrite a
    20-token history when another slot is free; the history's own next turn then finds it."""
    s, ctx = make(n_parallel=2)
    history = list(range(1, 21))
    s.add([req(history, SamplingParams(max_tokens=1))])
    run(s, ctx)
    holder = next(slot.seq_id for slot in s.slots if slot.cache)
    s.add([req([1] + list(range(50, 70)), SamplingParams(max_tokens=1))])  # shares the token 1 only
    run(s, ctx)
    assert s.slots[holder].cache == history, "the history was overwritten for a 1-token prefix"
    back = req(history + [99], SamplingParams(max_tokens=1))
    s.add([back])
    assert ends(run(s, ctx))[back.id].usage.cached_tokens == 20


def test_busy_slots_stay_consecutive_unless_a_long_prefix_is_worth_a_split() -> None:
    """llama.cpp decodes a step in one micro-batch only over consecutive sequence ids: two streams on slots 0
    and 3 would cost two graph runs a step. Caches everywhere (as after a 4-stream round), the second of two
    requests goes next to the first; a cached prefix of SPLIT_WORTH tokens still wins its slot."""
    from serving.engine.scheduler import SPLIT_WORTH

    s, ctx = make(n_parallel=4, n_ctx_seq=2 * SPLIT_WORTH + 64, batch_capacity=4 * SPLIT_WORTH + 64)
    for i in range(4):  # every slot caches a prompt; slot 3's is the most recently used
        s.add([req([200 + i, 1, 2])])
        run(s, ctx)
    a, b = req([7, 8, 9]), req([7, 8, 10])
    s.add([a])
    s.add([b])
    s.step()
    busy = sorted(slot.seq_id for slot in s.slots if slot.request is not None)
    assert len(busy) == 2 and busy[1] == busy[0] + 1, busy
    run(s, ctx)
    long_prompt = list(range(1000, 1000 + SPLIT_WORTH))
    s.add([req([5, 5, 5])])  # busy again: one slot
    s.step()
    first = next(slot.seq_id for slot in s.slots if slot.request is not None)
    apart = next(slot for slot in s.slots if abs(slot.seq_id - first) > 1)
    apart.cache = list(long_prompt)  # as if that slot had served a long conversation
    ctx.kv[apart.seq_id] = list(long_prompt)
    returning = req([*long_prompt, 1, 2])
    s.add([returning])
    s.step()
    assert returning in [slot.request for slot in s.slots if slot.seq_id == apart.seq_id]
    short = req([*long_prompt[:SPLIT_WORTH - 1], 3])
    run(s, ctx)
    s.add([req([6, 6, 6])])
    s.step()
    anchor = next(slot.seq_id for slot in s.slots if slot.request is not None)
    far = next(slot for slot in s.slots if abs(slot.seq_id - anchor) > 1)
    far.cache, ctx.kv[far.seq_id] = list(long_prompt[:SPLIT_WORTH - 1]), list(long_prompt[:SPLIT_WORTH - 1])
    s.add([short])
    s.step()
    assert short not in [slot.request for slot in s.slots if slot.seq_id == far.seq_id], "a short prefix splits"


@pytest.mark.parametrize(("one_stream_per_slot", "expected"), [(True, 3), (False, 0)])
def test_with_one_kv_stream_for_all_slots_any_slot_joins_the_busy_ones(one_stream_per_slot: bool,
                                                                       expected: int) -> None:
    """kv_unified: llama.cpp decodes a step's rows in one micro-batch whatever their slots, so the slot
    choice no longer keeps busy slots consecutive: the least recently used one is taken, apart or not."""
    s, ctx = make(n_parallel=4, n_ctx_seq=64, batch_capacity=64)
    ctx.one_stream_per_slot = one_stream_per_slot
    for slot, used in zip(s.slots, (1.0, 4.0, 0.0, 3.0), strict=True):  # slot 2, then 0, least recently used
        slot.last_used = used
    s.add([req([7, 8, 9])])
    s.step()
    assert s.slots[2].request is not None
    second = req([7, 8, 10])
    s.add([second])
    s.step()
    assert s.slots[expected].request is second  # per-slot streams: next to slot 2 (3, not 1: less recent)


def test_eos_ends_with_stop_and_is_not_counted() -> None:
    s, ctx = make()
    r = req([1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0))
    ctx.eos_after[0] = 5  # after 3 prompt + 2 generated tokens decoded, the model says EOS
    s.add([r])
    out = run(s, ctx)
    assert tokens_of(out, r) == [4, 5] and ends(out)[r.id].finish == FinishReason.stop
    assert ends(out)[r.id].usage.completion_tokens == 2


def test_ignore_eos_never_samples_eos_and_goes_on_to_max_tokens() -> None:
    """As llama-server's logit bias: the model's EOS is replaced by its best other token, not generated and
    passed over (which a client would see as a token with no text)."""
    s, ctx = make()
    r = req([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ctx.eos_after[0] = 5  # the model says EOS after 2 generated tokens, as above
    s.add([r])
    out = run(s, ctx)
    assert tokens_of(out, r) == [4, 5, 6, 7] and EOS not in tokens_of(out, r)
    assert ends(out)[r.id].finish == FinishReason.length


def test_generation_stops_at_the_slot_end_without_max_tokens() -> None:
    s, ctx = make(n_ctx_seq=16)
    r = req(list(range(10)), SamplingParams(max_tokens=None, temperature=0.0))
    s.add([r])
    done = ends(run(s, ctx))[r.id]
    assert done.finish == FinishReason.length and done.usage.completion_tokens == 6
    assert done.usage.prompt_tokens + done.usage.completion_tokens == 16


# -- failures stay with their requests ---------------------------------------------------------------
def test_a_failed_decode_fails_only_the_requests_in_that_batch() -> None:
    s, ctx = make(n_parallel=3, batch_capacity=4)
    gen, big, queued = req([1, 2]), req(list(range(10, 20))), req([5])
    s.add([gen])
    s.step()  # gen's prompt decoded: it generates from now on
    s.add([big])
    s.step()  # big takes its first chunk of 3 alongside gen's token
    idle_slot = s.slots[2]
    s.add([queued])
    ctx.rc = -3
    out, _ = s.step()
    failed = ends(out)
    assert failed[gen.id].finish == failed[big.id].finish == FinishReason.error
    assert failed[gen.id].error == DECODE_FAILED.format(rc=-3)
    assert s.counters.decode_failures == 1
    assert s.slots[0].cache == [] and s.slots[1].cache == []  # half-written caches are dropped
    ctx.rc = 0
    rest = ends(run(s, ctx))
    assert rest[queued.id].finish == FinishReason.length  # the one not in the failed batch goes on
    assert idle_slot.seq_id == 2


def test_a_failing_sampler_fails_only_its_request() -> None:
    s, ctx = make(n_parallel=3)
    good, bad, greedy = (req([1], SamplingParams(max_tokens=3, temperature=0.8, seed=1)),
                         req([1], SamplingParams(max_tokens=3, temperature=0.8, seed=13)), req([2]))
    for r in (good, bad, greedy):
        s.add([r])
    out = run(s, ctx)
    done = ends(out)
    assert done[bad.id].finish == FinishReason.error and done[bad.id].error == SAMPLER_FAILED
    assert done[good.id].finish == done[greedy.id].finish == FinishReason.length
    assert all(sampler.freed for sampler in ctx.samplers)


def test_a_sampler_that_cannot_be_built_fails_only_its_request() -> None:
    s, ctx = make(n_parallel=1)
    bad, good = req([1], SamplingParams(max_tokens=2, temperature=0.5, seed=666)), req([1])
    s.add([bad])
    s.add([good])
    done = ends(run(s, ctx))
    assert done[bad.id].finish == FinishReason.error and done[good.id].finish == FinishReason.length


def test_penalties_see_the_prompt_tail() -> None:
    s, ctx = make()
    s.add([req(list(range(1, 11)), SamplingParams(max_tokens=1, temperature=0.0, repeat_penalty=1.3,
                                                    penalty_last_n=4))])
    s.step()
    assert ctx.samplers[0].accepted == [7, 8, 9, 10]


# -- cancellation at every point ---------------------------------------------------------------------
def test_cancel_while_waiting() -> None:
    s, ctx = make(n_parallel=1)
    running, waiting = req([1]), req([2])
    s.add([running])
    s.add([waiting])
    s.step()
    waiting.cancelled = True
    out, _ = s.step()
    assert ends(out)[waiting.id].finish == FinishReason.cancelled and not s.waiting


def test_cancel_mid_prefill_keeps_a_valid_prefix() -> None:
    s, ctx = make(n_parallel=1, batch_capacity=4)
    r = req(list(range(10, 22)))
    s.add([r])
    s.step()  # first chunk of 4
    r.cancelled = True
    out, _ = s.step()
    assert ends(out)[r.id].finish == FinishReason.cancelled
    assert s.slots[0].cache == [10, 11, 12, 13] == ctx.kv[0]
    again = req(list(range(10, 22)))
    s.add([again])
    assert ends(run(s, ctx))[again.id].usage.cached_tokens == 4


def test_cancel_while_generating_drops_the_undecoded_token() -> None:
    s, ctx = make(n_parallel=1)
    r = req([1, 2], SamplingParams(max_tokens=50, temperature=0.0))
    s.add([r])
    for _ in range(3):
        s.step()
    r.cancelled = True
    out, _ = s.step()
    assert ends(out)[r.id].finish == FinishReason.cancelled
    assert s.slots[0].next_token is None and s.slots[0].cache == ctx.kv[0]
    assert s.counters.requests_cancelled == 1


def test_cancel_after_the_end_changes_nothing() -> None:
    s, ctx = make(n_parallel=1)
    r = req([1])
    s.add([r])
    run(s, ctx)
    r.cancelled = True
    assert run(s, ctx) == [] and s.counters.requests_cancelled == 0


def test_finish_from_outside_frees_the_slot_at_once() -> None:
    s, ctx = make(n_parallel=1)
    r = req([1], SamplingParams(max_tokens=50, temperature=0.0))
    s.add([r])
    s.step()
    s.finish(r.id, FinishReason.stop)
    assert s.drained and s.slots[0].next_token is None and s.counters.requests_finished == 1


# -- reconfigure -------------------------------------------------------------------------------------
def test_queued_prompt_that_no_longer_fits_after_a_reconfigure_fails_cleanly() -> None:
    s, ctx = make(n_parallel=1, n_ctx_seq=64)
    long_prompt, short = req(list(range(40))), req([1, 2])
    s.admitting = False  # the engine pauses admission while a reconfigure waits
    s.add([long_prompt])
    s.add([short])
    assert s.step() == ([], False) and len(s.waiting) == 2
    s.rebind(FakeContext(n_ctx_seq=32), n_parallel=2, default_seed=1)
    s.admitting = True
    out = ends(run(s, s._ctx))  # noqa: SLF001 (the new fake context)
    assert out[long_prompt.id].finish == FinishReason.error and "no longer fits" in out[long_prompt.id].error
    assert out[short.id].finish == FinishReason.length and len(s.slots) == 2


def test_abort_on_shutdown_ends_running_and_waiting() -> None:
    s, ctx = make(n_parallel=1)
    a, b = req([1], SamplingParams(max_tokens=50, temperature=0.0)), req([2])
    s.add([a])
    s.add([b])
    s.step()
    done = ends(s.abort("bye", waiting_too=True))
    assert done[a.id].error == done[b.id].error == "bye" and s.drained and not s.waiting


# -- the output processor ----------------------------------------------------------------------------
class _Handle(RequestHandle):
    def __init__(self, request: Request, alive: bool = True) -> None:
        import threading

        super().__init__(request, threading.Event())
        self.alive, self.pushed = alive, []

    def push(self, chunk: GenerationChunk) -> bool:
        self.pushed.append(chunk)
        return self.alive


PIECES = {i: f"<{i}>".encode() for i in range(VOCAB)}


def test_stop_strings_end_the_request_and_free_its_slot_before_delivery() -> None:
    s, ctx = make(n_parallel=1)
    outputs = OutputProcessor(PIECES.__getitem__)
    r = req([1], SamplingParams(max_tokens=20, temperature=0.0, stop=("<4>",)))
    handle = _Handle(r)
    s.add([r])
    outputs.add(r, handle)
    seen_busy_at_last_push: list[bool] = []
    for _ in range(10):
        out, _ = s.step()
        deliveries, finished = outputs.process(out)
        for request_id, reason in finished:
            s.finish(request_id, reason)
        if any(d.chunk.finish_reason for d in deliveries):
            seen_busy_at_last_push.append(not s.drained)
        outputs.deliver(deliveries)
        if handle.pushed and handle.pushed[-1].finish_reason:
            break
    text = "".join(c.text for c in handle.pushed)
    assert text == "<2><3>" and handle.pushed[-1].finish_reason == FinishReason.stop
    assert seen_busy_at_last_push == [False]


def test_a_detokeniser_failure_fails_only_its_request() -> None:
    def pieces(token: int) -> bytes:
        if token == 3:
            raise KeyError(token)
        return b"x"

    outputs = OutputProcessor(pieces)
    bad, good = req([2]), req([5])
    hb, hg = _Handle(bad), _Handle(good)
    outputs.add(bad, hb)
    outputs.add(good, hg)
    from serving.engine.request import Usage

    deliveries, finished = outputs.process([RequestOutput(bad, Usage(1), token=3),
                                            RequestOutput(good, Usage(1), token=6)])
    assert finished == [(bad.id, FinishReason.error)]
    assert [d.chunk.finish_reason for d in deliveries] == [FinishReason.error, None]


def test_a_reader_that_is_gone_gets_its_request_cancelled() -> None:
    outputs = OutputProcessor(PIECES.__getitem__)
    r = req([2])
    outputs.add(r, _Handle(r, alive=False))
    from serving.engine.request import Usage

    deliveries, _ = outputs.process([RequestOutput(r, Usage(1), token=3)])
    outputs.deliver(deliveries)
    assert r.cancelled


def test_push_survives_an_event_loop_that_closes_under_it() -> None:
    """The loop can close between any is_closed() check and call_soon_threadsafe: push must not raise."""
    import asyncio
    import threading

    async def make_handle() -> RequestHandle:
        return RequestHandle(req([1]), threading.Event())

    loop = asyncio.new_event_loop()
    handle = loop.run_until_complete(make_handle())
    loop.close()
    assert handle.push(GenerationChunk(text="late")) is False


@pytest.mark.parametrize("stop", [("<9>",), ()])
def test_length_end_releases_held_back_text(stop: tuple[str, ...]) -> None:
    outputs = OutputProcessor(PIECES.__getitem__)
    r = req([1], SamplingParams(max_tokens=1, stop=stop or ("<3>x",)))
    h = _Handle(r)
    outputs.add(r, h)
    from serving.engine.request import Usage

    deliveries, _ = outputs.process([RequestOutput(r, Usage(1, 1), token=3, finish=FinishReason.length)])
    assert deliveries[0].chunk.text == "<3>" and deliveries[0].chunk.finish_reason == FinishReason.length


def test_logprobs_ride_with_their_tokens() -> None:
    from serving.engine.request import TokenLogprob

    class WithLogprobs(FakeContext):
        def logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob:
            return TokenLogprob(token, -0.5, tuple((token + i, -1.0 - i) for i in range(top_n)))

    ctx = WithLogprobs()
    s = Scheduler(ctx, 1, default_seed=1)
    r = req([1], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2))
    s.add([r])
    out = run(s, ctx)
    assert [o.logprob.token for o in out if o.logprob] == tokens_of(out, r) == [2, 3, 4]
    assert all(len(o.logprob.top) == 2 for o in out if o.logprob)


# -- n choices of one prompt -------------------------------------------------------------------------
def test_n_choices_share_one_prefill_and_run_together() -> None:
    s, ctx = make(n_parallel=3, batch_capacity=4)
    prompt = list(range(10, 20))
    choices = [req(prompt, SamplingParams(max_tokens=3, temperature=0.5, seed=i)) for i in range(3)]
    s.add(choices)
    out = run(s, ctx)
    assert s.counters.prompt_tokens_evaluated == len(prompt)  # one prefill, copied twice
    done = ends(out)
    assert all(done[c.id].finish == FinishReason.length for c in choices)
    assert all(tokens_of(out, c) == [20, 21, 22] for c in choices)
    assert all(slot.cache[:10] == prompt for slot in s.slots)


def test_n_choices_wait_for_n_free_slots() -> None:
    s, ctx = make(n_parallel=2)
    first = req([1], SamplingParams(max_tokens=3, temperature=0.0))
    s.add([first])
    pair = [req([5]), req([5])]
    s.add(pair)
    s.step()
    assert len(s.waiting) == 1  # one slot is free, the pair needs two
    out = run(s, ctx)
    assert all(ends(out)[r.id].finish == FinishReason.length for r in pair)


def test_choices_waiting_for_a_cancelled_prefill_end_with_it() -> None:
    s, ctx = make(n_parallel=3, batch_capacity=4)
    choices = [req(list(range(10, 30))) for _ in range(3)]
    s.add(choices)
    s.step()
    choices[0].cancelled = True
    out, _ = s.step()
    assert {o.request.id: o.finish for o in out} == {c.id: FinishReason.cancelled for c in choices}
    assert s.drained


def test_more_choices_than_slots_after_a_reconfigure_fail_cleanly() -> None:
    s, ctx = make(n_parallel=3)
    s.admitting = False
    group = [req([1]) for _ in range(3)]
    s.add(group)
    s.step()
    s.rebind(FakeContext(), n_parallel=2, default_seed=1)
    s.admitting = True
    out = ends(run(s, s._ctx))  # noqa: SLF001
    assert all(out[r.id].finish == FinishReason.error and "choices" in out[r.id].error for r in group)


# -- speculation -------------------------------------------------------------------------------------
class Repeating(FakeContext):
    """A model that repeats its prompt's pattern: after token t comes NEXT[t] (a cycle), so prompt lookup
    guesses right once the cycle has been seen."""

    NEXT = {1: 2, 2: 3, 3: 4, 4: 1}

    def greedy(self, row: int) -> int:
        token, _, seq, want = self.rows[row]
        assert want, "sampled a row without logits"
        return self.NEXT.get(token, 1)


def flat_clock() -> Callable[[], float]:
    """A clock by which every step takes one unit, however many rows it carries: guesses cost nothing, so the
    draft length is what prompt lookup offers (the real clock would price the fake's microseconds)."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


def _spec_run(spec, n_parallel=1, max_tokens=20, **ctx_kw):  # noqa: ANN001, ANN202
    from serving.engine.speculate import SpecSettings

    ctx = Repeating(**ctx_kw)
    s = Scheduler(ctx, n_parallel, default_seed=1, spec=SpecSettings(**spec) if spec is not None else None,
                  clock=flat_clock())
    r = req([1, 2, 3, 4, 1, 2, 3, 4, 1], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    s.add([r])
    out = run(s, ctx)
    return s, ctx, r, out


def test_speculation_gives_the_same_tokens_in_fewer_decodes() -> None:
    plain, plain_ctx, r1, out1 = _spec_run(None)
    fast, fast_ctx, r2, out2 = _spec_run({"draft_max": 4})
    assert tokens_of(out2, r2) == tokens_of(out1, r1) and len(tokens_of(out1, r1)) == 20
    assert fast_ctx.decodes < plain_ctx.decodes / 2
    assert fast.counters.spec_accepted > 0 and fast.counters.spec_accepted <= fast.counters.spec_drafted


def test_rejected_guesses_leave_the_cache_exactly_the_tokens_kept() -> None:
    class Surprising(Repeating):
        NEXT = {1: 2, 2: 3, 3: 7, 7: 4, 4: 1}  # after 3 the model says 7, the prompt said 4

    from serving.engine.speculate import SpecSettings

    ctx = Surprising()
    s = Scheduler(ctx, 1, default_seed=1, spec=SpecSettings(draft_max=4), clock=flat_clock())
    r = req([1, 2, 3, 4, 1, 2, 3, 4, 1], SamplingParams(max_tokens=12, temperature=0.0))
    s.add([r])
    out = run(s, ctx)  # run() checks slot.cache == the fake's K/V after every step
    assert tokens_of(out, r) == [2, 3, 7, 4, 1, 2, 3, 7, 4, 1, 2, 3]
    assert s.counters.spec_drafted > s.counters.spec_accepted > 0


def test_max_tokens_inside_an_accepted_draft_ends_exactly_there() -> None:
    _, ctx, r, out = _spec_run({"draft_max": 8}, max_tokens=5)
    assert tokens_of(out, r) == [2, 3, 4, 1, 2] and ends(out)[r.id].finish == FinishReason.length
    assert ends(out)[r.id].usage.completion_tokens == 5


def test_eos_inside_a_draft_ends_with_stop() -> None:
    class Ending(Repeating):
        NEXT = {1: 2, 2: 3, 3: EOS}

    from serving.engine.speculate import SpecSettings

    ctx = Ending()
    s = Scheduler(ctx, 1, default_seed=1, spec=SpecSettings(draft_max=4), clock=flat_clock())
    r = req([1, 2, 3, 9, 1], SamplingParams(max_tokens=20, temperature=0.0))
    s.add([r])
    out = run(s, ctx)
    assert tokens_of(out, r) == [2, 3] and ends(out)[r.id].finish == FinishReason.stop


def test_no_speculation_when_more_slots_are_busy_than_allowed() -> None:
    from serving.engine.speculate import SpecSettings

    ctx = Repeating()
    s = Scheduler(ctx, 2, default_seed=1, spec=SpecSettings(draft_max=4, max_busy=1), clock=flat_clock())
    for _ in range(2):
        s.add([req([1, 2, 3, 4, 1, 2, 3, 4, 1], SamplingParams(max_tokens=6, temperature=0.0))])
    run(s, ctx)
    assert s.counters.spec_drafted == 0


# -- the host-RAM prompt cache -----------------------------------------------------------------------
def _turns(s: Scheduler, ctx: FakeContext, prompts: list[list[int]]) -> list[RequestOutput]:
    """Each prompt as its own request, one after another (conversations taking turns)."""
    outputs: list[RequestOutput] = []
    for prompt in prompts:
        r = req(prompt, SamplingParams(max_tokens=2))
        s.add([r])
        outputs += [o for o in run(s, ctx) if o.request is r]
    return outputs


def test_a_conversation_that_lost_its_slot_comes_back_warm_from_the_prompt_cache() -> None:
    """Two slots, three conversations taking turns: the third takes a slot from the first, whose state goes
    to host RAM; the first's next turn gets it restored (into the least recently used slot) and prefills
    only what is new. Without the cache it prefills its whole history."""
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=4)
    ctx = FakeContext()
    s = Scheduler(ctx, 2, default_seed=1, prompt_cache=cache)
    a, b, c = [10 + i for i in range(12)], [40 + i for i in range(12)], [70 + i for i in range(12)]
    _turns(s, ctx, [a, b, c])  # c's slot was a's (least recently used): a's 13 cells saved first
    assert ctx.saves == [0] and cache.stats().entries == 1 and cache.stats().tokens == 13
    a2 = a + [22, 23, 90, 91]  # a's history (its prompt, the 2 tokens answered) and a new question
    done = ends(_turns(s, ctx, [a2]))
    (only,) = done.values()
    assert only.usage.cached_tokens == 13 and only.finish == FinishReason.length
    stats = cache.stats()
    assert (stats.hits, stats.hit_tokens, stats.saves) == (1, 13, 2)  # b's slot was saved before the restore
    assert any(slot.cache[:16] == a2 for slot in s.slots)
    cold, cold_ctx = make(n_parallel=2)
    _turns(cold, cold_ctx, [a, b, c])
    (again,) = ends(_turns(cold, cold_ctx, [a2])).values()
    assert again.usage.cached_tokens == 0, "without the cache the returning turn prefills everything"


def test_a_slot_holding_a_longer_prefix_wins_and_short_prompts_are_not_saved() -> None:
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=8)
    ctx = FakeContext()
    s = Scheduler(ctx, 1, default_seed=1, prompt_cache=cache)
    _turns(s, ctx, [[1, 2, 3], [4, 5, 6]])  # 5 cells dropped: under min_tokens, not saved
    assert ctx.saves == [] and cache.stats().entries == 0
    long = list(range(100, 120))
    _turns(s, ctx, [long, long + [121, 122, 123]])  # the slot itself holds it: no save, no restore
    assert ctx.saves == [] and cache.stats().hits == 0


def test_a_state_llama_cpp_refuses_leaves_an_empty_slot_and_is_dropped() -> None:
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=4)
    ctx = FakeContext()
    s = Scheduler(ctx, 1, default_seed=1, prompt_cache=cache)
    a, b = list(range(10, 22)), list(range(40, 52))
    _turns(s, ctx, [a, b])
    ctx.refuse_loads = True
    (back,) = ends(_turns(s, ctx, [a + [22, 23, 7]])).values()
    assert back.finish == FinishReason.length and back.usage.cached_tokens == 0  # prefilled instead
    assert cache.stats().hits == 0 and all(e.tokens[:12] != tuple(a) for e in cache._entries.values())


def test_a_new_context_empties_the_prompt_cache() -> None:
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=4)
    ctx = FakeContext()
    s = Scheduler(ctx, 1, default_seed=1, prompt_cache=cache)
    _turns(s, ctx, [list(range(10, 22)), list(range(40, 52))])
    assert cache.stats().entries == 1
    s.rebind(FakeContext(), 2, default_seed=1)
    assert cache.stats().entries == 0 and cache.stats().saves == 1


def test_finished_slots_are_saved_while_idle_so_a_new_prompt_does_not_wait_for_the_copy() -> None:
    """The engine calls save_idle when a step found nothing to do: finished slots are saved then, least
    recently used first, one a call, all but the most recently used; the prompt that later takes a saved
    slot starts without a copy, and the conversation it displaced still comes back warm."""
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=4)
    ctx = FakeContext()
    s = Scheduler(ctx, 3, default_seed=1, prompt_cache=cache)
    a, b, c, d = ([k + i for i in range(12)] for k in (10, 40, 70, 100))
    _turns(s, ctx, [a, b, c])
    assert ctx.saves == []
    assert s.save_idle() and ctx.saves == [0]  # a's slot, the least recently used
    assert s.save_idle() and ctx.saves == [0, 1]
    assert not s.save_idle() and ctx.saves == [0, 1]  # c's, the most recent, is left to its next turn
    _turns(s, ctx, [d])  # takes a's slot: its state is stored already, no copy before d's prefill
    assert ctx.saves == [0, 1] and cache.stats().saves == 2
    (back,) = ends(_turns(s, ctx, [a + [22, 23, 90, 91]])).values()
    assert back.usage.cached_tokens == 13 and cache.stats().hits == 1
    assert ctx.saves == [0, 1], "restored into b's slot, whose state was stored while idle"


def test_the_slot_a_conversation_comes_back_to_is_not_copied_while_idle() -> None:
    """One conversation (an agent's turns): its slot is always the most recently used, so no idle pass
    copies it; its next turn finds it in the slot. A slot taken again before an idle pass is not saved."""
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=4)
    ctx = FakeContext()
    s = Scheduler(ctx, 2, default_seed=1, prompt_cache=cache)
    a = list(range(10, 22))
    _turns(s, ctx, [a])
    assert not s.save_idle()
    (turn,) = ends(_turns(s, ctx, [a + [22, 23, 5, 6]])).values()
    assert turn.usage.cached_tokens == 13 and not s.save_idle() and ctx.saves == []
    b = list(range(40, 52))
    _turns(s, ctx, [b])  # a's slot is now the older one: saved on the next idle pass, once
    assert s.save_idle() and ctx.saves == [0] and cache.stats().tokens == 17 and not s.save_idle()
    s.reset_slot(0)
    assert not s.save_idle()
    plain, plain_ctx = make(n_parallel=2)
    _turns(plain, plain_ctx, [a, b])
    assert not plain.save_idle() and plain_ctx.saves == []


@pytest.mark.parametrize("broken", ["llama.cpp's copy", "the cache's bookkeeping"])
def test_a_save_that_fails_while_idle_fails_nothing_else(broken: str) -> None:
    """save_idle runs outside a step's guard: a save that raises (llama.cpp's copy, or the cache itself) is
    logged and skipped, and the next prompts run as usual."""
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=4)
    ctx = FakeContext()
    s = Scheduler(ctx, 2, default_seed=1, prompt_cache=cache)

    def boom(*_: object) -> None:
        raise RuntimeError("no memory for the state")

    if broken == "llama.cpp's copy":
        ctx.save_seq = boom  # type: ignore[method-assign]
    else:
        cache.put = boom  # type: ignore[method-assign]
    a, b = list(range(10, 22)), list(range(40, 52))
    _turns(s, ctx, [a, b])
    assert s.save_idle() and not s.save_idle() and cache.stats().entries == 0
    done = ends(_turns(s, ctx, [list(range(70, 82)), a + [22, 23, 5]]))
    assert [o.finish for o in done.values()] == [FinishReason.length, FinishReason.length]


class FixedPrices(PromptPrices):
    """Prices as a machine might have measured them (the fake context's own saves take microseconds)."""

    def __init__(self, save_s_per_token: float, prefill_s_per_token: float) -> None:
        super().__init__()
        self._fixed = (save_s_per_token, prefill_s_per_token)

    @property
    def save_s_per_token(self) -> float:
        return self._fixed[0]

    @property
    def prefill_s_per_token(self) -> float:
        return self._fixed[1]


@pytest.mark.parametrize("copy_is_dear", [True, False])
def test_a_turn_that_adds_little_to_a_stored_state_is_saved_only_where_the_copy_costs_less(
        copy_is_dear: bool) -> None:
    """One slot, two conversations taking turns. a's first state is stored when b takes the slot; a comes
    back, restored, and adds 4 cells. Where the copy of its 17 cells costs more than prefilling those 4 (a
    large model on a GPU), b takes the slot without a copy, and a's next turn restores the older state and
    prefills the rest; where the copy is cheap, it is made and a's next turn restores all of it."""
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=4)
    ctx = FakeContext()
    s = Scheduler(ctx, 1, default_seed=1, prompt_cache=cache)
    a, b = list(range(10, 22)), list(range(40, 52))
    _turns(s, ctx, [a, b])
    assert ctx.saves == [0] and cache.stats().tokens == 13
    cache.prices = FixedPrices(save_s_per_token=0.001 if copy_is_dear else 0.0001, prefill_s_per_token=0.003)
    a2 = a + [22, 23, 90, 91]
    (turn,) = ends(_turns(s, ctx, [a2])).values()
    assert turn.usage.cached_tokens == 13
    _turns(s, ctx, [b + [52, 53, 7]])  # a's 17 cells, 13 stored: 12 ms of prefill against 17 or 1.7 of copy
    assert (len(ctx.saves), cache.stats().skipped) == ((2, 1) if copy_is_dear else (3, 0))
    (back,) = ends(_turns(s, ctx, [a2 + [92, 93, 94]])).values()
    assert back.finish == FinishReason.length
    assert back.usage.cached_tokens == (13 if copy_is_dear else 17)


def test_the_scheduler_prices_its_saves_and_long_prefills_as_it_runs() -> None:
    ticks = itertools.count()
    cache = PromptCache(limit_bytes=1 << 24, min_tokens=4)
    ctx = FakeContext(n_ctx_seq=1024, batch_capacity=512)
    s = Scheduler(ctx, 1, default_seed=1, prompt_cache=cache, clock=lambda: float(next(ticks)))
    _turns(s, ctx, [list(range(10, 22))])
    assert cache.prices.prefill_s_per_token is None, "12 prompt rows: no price of prefill"
    _turns(s, ctx, [list(range(1000, 1300))])  # the short prompt's slot is saved: priced
    assert cache.prices.save_s_per_token is not None and cache.prices.save_s_per_token > 0
    assert cache.prices.prefill_s_per_token is not None and cache.prices.prefill_s_per_token > 0


# -- memory kinds ------------------------------------------------------------------------------------
CANNOT_CUT = [MemoryKind.recurrent, MemoryKind.hybrid]


def _kind(kind: MemoryKind, n_parallel: int = 1, n_swa: int = 0,
          prompt_cache: PromptCache | None = None) -> tuple[Scheduler, FakeContext]:
    ctx = FakeContext(memory_kind=kind, n_swa=n_swa, n_ctx_seq=128)
    return Scheduler(ctx, n_parallel, default_seed=1, prompt_cache=prompt_cache), ctx


def _one(s: Scheduler, ctx: FakeContext, prompt: list[int], max_tokens: int = 3) -> RequestOutput:
    """One request run to its end: its final output (the test fails on an error)."""
    r = req(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    s.add([r])
    out = run(s, ctx)
    end = ends(out)[r.id]
    assert end.error is None and end.finish == FinishReason.length, end
    return end


def _cold(kind: MemoryKind, prompt: list[int], n_swa: int = 0) -> list[int]:
    s, ctx = _kind(kind, n_swa=n_swa)
    r = req(prompt, SamplingParams(max_tokens=3, temperature=0.0))
    s.add([r])
    return tokens_of(run(s, ctx), r)


@pytest.mark.parametrize("kind", CANNOT_CUT)
def test_a_recurrent_state_is_reused_where_the_prompt_extends_it_or_a_checkpoint(kind: MemoryKind) -> None:
    """A follow-up that continues the slot's every token reuses them all; going back (a prompt sharing less
    than the slot holds) behind every checkpoint prefills from the start, since llama.cpp cannot cut the
    state; the same prompt again goes back to the checkpoint CHECKPOINT_TAIL tokens before its end. The fake
    fails any batch decoded onto a state that is not exactly the prompt's prefix, and no cut it cannot make
    is asked of it."""
    s, ctx = _kind(kind)
    history = list(range(1, 21))
    _one(s, ctx, history)
    held = list(s.slots[0].cache)
    assert len(held) == 22  # the prompt and two of its three answer tokens (the last is not decoded)
    assert _one(s, ctx, held + [50, 51]).usage.cached_tokens == 22
    back = history[:15] + [60, 61]
    r = req(back, SamplingParams(max_tokens=3, temperature=0.0))
    s.add([r])
    out = run(s, ctx)
    assert ends(out)[r.id].usage.cached_tokens == 0 and tokens_of(out, r) == _cold(kind, back)
    r = req(back, SamplingParams(max_tokens=3, temperature=0.0))
    s.add([r])
    out = run(s, ctx)
    assert ends(out)[r.id].usage.cached_tokens == len(back) - CHECKPOINT_TAIL
    assert tokens_of(out, r) == _cold(kind, back)
    assert s.counters.checkpoints_restored == 1 and s.counters.prefixes_refused == 0


@pytest.mark.parametrize("kind", CANNOT_CUT)
def test_going_back_takes_another_slot_and_leaves_the_history_where_its_next_turn_finds_it(
        kind: MemoryKind) -> None:
    s, ctx = _kind(kind, n_parallel=2)
    history = list(range(1, 21))
    _one(s, ctx, history)
    holder = next(slot for slot in s.slots if slot.cache)
    kept = list(holder.cache)
    _one(s, ctx, history[:15] + [60, 61])  # shares 15 tokens: no reason to empty the history's slot
    assert holder.cache == kept
    assert _one(s, ctx, kept + [70]).usage.cached_tokens == len(kept)


@pytest.mark.parametrize("kind", CANNOT_CUT)
def test_a_refused_cut_empties_the_slot_and_prefills_from_the_start(kind: MemoryKind) -> None:
    """Where llama.cpp refuses a cut the scheduler did not expect to fail (a slot counted as reusable), the
    slot is emptied and the prompt prefilled whole: never decoded onto the uncut state."""
    s, ctx = _kind(kind)
    _one(s, ctx, list(range(1, 21)))
    slot = s.slots[0]
    prompt = list(slot.cache[:10]) + [70, 71]
    r = req(prompt, SamplingParams(max_tokens=3, temperature=0.0))
    s._assign(slot, r, 10)  # as if the slot had been picked for its 10 shared tokens
    assert slot.cache == [] and ctx.kv[0] == [] and slot.usage.cached_tokens == 0
    assert s.counters.prefixes_refused == 1


def test_a_sliding_window_keeps_a_prefix_only_while_its_window_is_held() -> None:
    """Without full-size window cells llama.cpp overwrites the cells before the last position's window: a
    follow-up extending the slot, or going back one token, still finds what it attends to; going back
    further finds the window's first cells gone and prefills from the start, with the tokens a cold slot
    gives (the fake fails a batch whose window is not held)."""
    s, ctx = _kind(MemoryKind.swa, n_swa=8)
    history = list(range(1, 31))
    _one(s, ctx, history)
    held = list(s.slots[0].cache)
    assert ctx.pos_min(0) == len(held) - 8
    assert _one(s, ctx, held + [40]).usage.cached_tokens == len(held)
    held = list(s.slots[0].cache)
    one_back = held[:-1] + [41, 42]
    assert _one(s, ctx, one_back).usage.cached_tokens == len(held) - 1
    far_back = history[:20] + [43, 44]
    r = req(far_back, SamplingParams(max_tokens=3, temperature=0.0))
    s.add([r])
    out = run(s, ctx)
    assert ends(out)[r.id].usage.cached_tokens == 0 and s.counters.prefixes_refused == 1
    assert tokens_of(out, r) == _cold(MemoryKind.swa, far_back, n_swa=8)


def test_a_sliding_window_that_holds_every_cell_goes_back_anywhere() -> None:
    """With full-size window cells (llama.cpp's swa_full, the context's default) pos_min stays 0: any
    prefix is kept, as for plain attention."""
    s, ctx = _kind(MemoryKind.swa, n_swa=0)
    _one(s, ctx, list(range(1, 31)))
    assert _one(s, ctx, list(range(1, 11)) + [50]).usage.cached_tokens == 10


@pytest.mark.parametrize("kind", CANNOT_CUT)
def test_the_prompt_cache_restores_a_recurrent_state_only_into_a_prompt_that_extends_it(kind: MemoryKind) -> None:
    """A stored state serves a prompt that continues all of it (restored, then only the rest prefilled);
    a prompt going back inside it gets no restore (its state is past that point) and prefills whole."""
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=4)
    s, ctx = _kind(kind, prompt_cache=cache)
    a, b = [10 + i for i in range(12)], [40 + i for i in range(12)]
    _one(s, ctx, a, max_tokens=2)
    a_held = list(s.slots[0].cache)
    _one(s, ctx, b, max_tokens=2)  # takes the only slot: a's state is saved first
    assert cache.stats().entries == 1
    inside = a[:8] + [90]
    assert _one(s, ctx, inside).usage.cached_tokens == 0 and cache.stats().hits == 0
    back = _one(s, ctx, a_held + [91, 92])
    assert back.usage.cached_tokens == len(a_held) and cache.stats().hits == 1


@pytest.mark.parametrize("kind", CANNOT_CUT)
def test_no_guesses_where_the_memory_cannot_drop_the_rejected_ones(kind: MemoryKind,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from serving.engine.speculate import SpecSettings

    ctx = FakeContext(memory_kind=kind)
    with caplog.at_level("WARNING", logger="serving.engine.scheduler"):
        s = Scheduler(ctx, 1, default_seed=1, spec=SpecSettings(draft_max=4))
    assert any("speculation stays off" in r.message for r in caplog.records)
    r = req([1, 2, 3, 4, 1, 2, 3, 4, 1], SamplingParams(max_tokens=6, temperature=0.0))
    s.add([r])
    assert ends(run(s, ctx))[r.id].error is None
    assert s.counters.spec_drafted == 0


@pytest.mark.parametrize("kind", CANNOT_CUT)
def test_choices_of_a_recurrent_model_copy_the_whole_state(kind: MemoryKind) -> None:
    s, ctx = _kind(kind, n_parallel=3)
    rs = [req([5, 6, 7, 8]) for _ in range(3)]
    s.add(rs)
    out = run(s, ctx)
    assert all(ends(out)[r.id].finish == FinishReason.length for r in rs)
    assert len({tuple(tokens_of(out, r)) for r in rs}) == 1


@pytest.mark.parametrize("kind", CANNOT_CUT)
def test_a_checkpoint_before_each_prompts_end_serves_a_regenerated_answer_and_a_changed_history(
        kind: MemoryKind) -> None:
    """The prompt's last CHECKPOINT_TAIL tokens go in a step of their own, after the recurrent part is saved:
    a regenerated answer (the same prompt) and a next turn whose history dropped part of the answer (a chat
    template leaving out the reasoning) go back to it, with the tokens a cold slot gives; a follow-up that
    adds fewer tokens than the tail takes none. A slot keeps its CHECKPOINTS newest, and forgets those past
    where it was cut."""
    s, ctx = _kind(kind)
    history = list(range(1, 21))
    _one(s, ctx, history)
    assert ctx.checkpoints == [0] and [c.n_tokens for c in s.slots[0].checkpoints] == [16]
    for prompt in (history, history + [70, 71, 72]):
        r = req(prompt, SamplingParams(max_tokens=3, temperature=0.0))
        s.add([r])
        out = run(s, ctx)
        assert ends(out)[r.id].usage.cached_tokens == 16 and tokens_of(out, r) == _cold(kind, prompt)
    assert s.counters.checkpoints_restored == 2
    assert [c.n_tokens for c in s.slots[0].checkpoints] == [16, 19]  # the regenerated prompt added no tail
    held = list(s.slots[0].cache)
    _one(s, ctx, held + [80, 81])  # two new tokens: under the tail, no checkpoint
    assert len(ctx.checkpoints) == 2
    for turn in range(CHECKPOINTS + 1):
        _one(s, ctx, list(s.slots[0].cache) + list(range(30 + turn, 30 + turn + 6)))
    marks = [c.n_tokens for c in s.slots[0].checkpoints]
    assert len(marks) == CHECKPOINTS and marks == sorted(marks)
    _one(s, ctx, list(s.slots[0].cache)[:marks[1]] + [90])
    assert [c.n_tokens for c in s.slots[0].checkpoints] == marks[:2]


def test_memories_that_can_be_cut_take_no_checkpoints() -> None:
    s, ctx = _kind(MemoryKind.kv)
    _one(s, ctx, list(range(1, 21)))
    assert ctx.checkpoints == [] and s.slots[0].checkpoints == []
