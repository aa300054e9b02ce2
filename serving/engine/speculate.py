"""Drafting tokens for speculative decoding: guesses the scheduler verifies in one decode.

Decode is bound by reading the weights once per step; verifying k guessed tokens of one sequence in the
same step costs little more than one token (measured on the H200: 16 rows ~ 2.2x one row, for up to 17
tokens), so every accepted guess is a token for nearly free. The scheduler verifies guesses with the
request's own sampler, row by row, and keeps a guess only when the sampler drew exactly that token: what a
request gets is drawn from the same distribution as without speculation (identical when greedy).

Prompt lookup (llama.cpp's "lookup" / vLLM's n-gram): the continuation that followed the most recent
earlier occurrence of the last n tokens, longest n first. No second model; it shines when the output copies
the input (editing code, quoting a document) and proposes nothing otherwise.

How many guesses to verify is decided per step (`draft_length`): from the request's own recent acceptance
and this machine's measured cost of a step by its rows (`StepCosts`), the count that gives the most tokens
per second, or none when guessing would be slower than not.
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecSettings:
    """The engine's speculation settings (from EngineConfig)."""

    draft_max: int = 16  # most tokens guessed per step
    ngram_min: int = 2  # shortest n-gram looked up
    ngram_max: int = 4  # longest n-gram looked up (tried first)
    max_busy: int = 1  # speculate only while at most this many slots generate: guesses cost batch rows
    p_min: float = 0.75  # a draft model stops guessing below this top-token probability


class Drafter(Protocol):
    """One slot's guesser: up to k tokens expected to follow `tokens` (the slot's tokens, then its next).
    `costly`: guessing itself takes time (a draft model decodes), so how many to ask for is decided first;
    a cheap guesser (prompt lookup) is asked for the most and its offer is then cut to what pays.
    `guess_seconds`: what one guess costs its guesser (0 for prompt lookup; None until measured)."""

    @property
    def costly(self) -> bool: ...

    @property
    def guess_seconds(self) -> float | None: ...

    def propose(self, tokens: list[int], k: int) -> list[int]: ...

    def warm(self, prompt: list[int]) -> None:
        """The slot's prompt is in: take it in now, in the prompt's step, rather than at the first guess."""


class PromptLookup:
    """One request's n-gram index over its tokens (prompt + generated), extended as tokens arrive.

    `_last[n][gram]` is the position right after the latest occurrence of `gram` that ends before the
    newest token, so the current suffix never matches itself.
    """

    costly = False
    guess_seconds = 0.0

    def __init__(self, settings: SpecSettings) -> None:
        self._s = settings
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(settings.ngram_min,
                                                                                  settings.ngram_max + 1)}
        self._indexed = 0  # positions < this have been indexed as continuation starts

    def warm(self, prompt: list[int]) -> None:
        """Nothing to do ahead: the index grows as guesses are asked for."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest recent n-gram matching the end of `tokens`."""
        end = len(tokens)
        self._index(tokens, end - 1)
        for n in range(self._s.ngram_max, self._s.ngram_min - 1, -1):
            if end < n:
                continue
            start = self._last[n].get(tuple(tokens[end - n:]))
            if start is not None:
                return tokens[start:start + k]
        return []

    def _index(self, tokens: list[int], upto: int) -> None:
        for i in range(self._indexed + 1, upto + 1):  # continuation starting at i follows tokens[i-n:i]
            for n, table in self._last.items():
                if i >= n:
                    table[tuple(tokens[i - n:i])] = i
        self._indexed = max(self._indexed, upto)


OPTIMISTIC_ROW_COST = 0.1  # a row count not yet measured is priced at 1 + 0.1 per extra row, so it gets tried
COST_WINDOW = 8  # recent step times kept per row count; the price is their median
ACCEPT_DECAY = 0.8  # weight of the past in a request's acceptance counts (recent verifies count most)
PRIOR_ACCEPTED, PRIOR_MISSES = 1.0, 1.0  # a request starts at p = 0.5
PROBE_EVERY = 32  # steps without a draft after which a request probes (guesses) again, at the least ...
PROBE_EVERY_MOST = 1024  # ... and for a draft model doubling after each probe that did not make guessing pay
# again (its probe costs it the catching up with every token since its last guess)
PROBE_P = 0.9  # a probe bets the text turned predictable: as many guesses as would pay best at this acceptance
UNTIMED_PROBE = 3  # guesses of a probe whose guesser was never timed: two one-row decodes, the second priced


class StepCosts:
    """What a decode step costs by the rows it carries, learned as the engine runs: per row count, the median
    of its last COST_WINDOW step times (the decode and the sampling of its rows). Where a row count was never
    measured, its cost is interpolated between measured ones (or extrapolated from the largest), optimistic
    where there is nothing to go by, so a guess gets tried and then priced as it measured.

    Beyond the largest row count measured the price is optimistic too, not the slope of the last two: on a
    GPU two rows can cost 4x one row (one row replays a captured graph) while 17 cost hardly more than two,
    and a line through the first two would price every longer draft out before one was ever tried.

    The first step of each row count is not a price: a batch shape's first decode pays one-time work (on a
    GPU, a new graph and its buffers), and a price that high would never be measured again, since nothing
    guesses at it. The median, not a moving average, so one step slowed by a neighbour on a shared machine does
    not price a row count out for long.

    Why measure rather than assume: on the lent H200, 16 rows of one sequence cost ~2.1x one row (a verify
    is nearly free); on a 2-core CPU, ~8.3x (scripts/bench_verify.py). A draft length that pays on one
    machine loses on the other."""

    def __init__(self) -> None:
        self._recent: dict[int, deque[float]] = {}
        self._seconds: dict[int, float] = {}  # the price of each measured row count
        self._rows: list[int] = []  # the measured row counts, sorted

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or seconds < 0:
            return
        recent = self._recent.get(rows)
        if recent is None:  # the shape's first step: one-time work, not its price
            self._recent[rows] = deque(maxlen=COST_WINDOW)
            return
        recent.append(seconds)
        if rows not in self._seconds:
            bisect.insort(self._rows, rows)
        self._seconds[rows] = statistics.median(recent)

    def measured(self, rows: int) -> bool:
        return rows in self._seconds

    def seconds(self, rows: int) -> float:
        return self._estimate(rows)

    def relative(self, rows: int, base: int, extra_seconds: float = 0.0) -> float:
        """(cost(rows) + extra) / cost(base): how much longer a step of `rows` rows (and `extra_seconds` of
        guessing) takes than one of `base` rows."""
        base_cost = self._estimate(base)
        if base_cost <= 0:
            return 1.0 + OPTIMISTIC_ROW_COST * (rows - base)
        return (self._estimate(rows) + extra_seconds) / base_cost

    def _estimate(self, rows: int) -> float:
        known = self._seconds
        if rows in known:
            return known[rows]
        at = bisect.bisect(self._rows, rows)
        lower = self._rows[at - 1] if at > 0 else None
        upper = self._rows[at] if at < len(self._rows) else None
        if lower is not None and upper is not None:
            share = (rows - lower) / (upper - lower)
            return known[lower] + share * (known[upper] - known[lower])
        anchor = lower if lower is not None else upper
        if anchor is None:
            return 0.0
        return max(known[anchor] * (1.0 + OPTIMISTIC_ROW_COST * (rows - anchor) / anchor), 0.0)


class Acceptance:
    """One request's record of verified guesses, recent ones weighted most: `p`, the chance that a guess is
    right given the ones before it were (accepted / (accepted + misses), each verify ending in a miss or not)."""

    def __init__(self) -> None:
        self.accepted, self.misses = PRIOR_ACCEPTED, PRIOR_MISSES
        self.idle_steps = 0
        self.probe_every = PROBE_EVERY

    @property
    def p(self) -> float:
        return self.accepted / (self.accepted + self.misses)

    def record(self, accepted: int, missed: bool) -> None:
        self.accepted = ACCEPT_DECAY * self.accepted + accepted
        self.misses = ACCEPT_DECAY * self.misses + (1 if missed else 0)
        self.idle_steps = 0


def expected_tokens(p: float, k: int) -> float:
    """Tokens one step yields with k guesses verified in order: the next token, plus each guess kept while
    every one before it was (1 + p + ... + p^k)."""
    return float(k + 1) if p >= 1.0 else (1.0 - p ** (k + 1)) / (1.0 - p)


def draft_length(acceptance: Acceptance, costs: StepCosts, most: int, base: int, probe_backoff: bool,
                 guess_seconds: float | None = 0.0) -> int:
    """How many guesses (at most `most`) to verify in a step that already carries `base` rows: the count
    whose tokens per second beat the step without guesses by the most, or 0 when none does (a guess is a
    batch row, and `guess_seconds` of its guesser's time; a step costs what StepCosts measured).

    A request that stopped guessing probes every PROBE_EVERY steps with guesses on offer, so that text
    turning predictable is noticed: a probe bets that it did (acceptance PROBE_P) and verifies the count that
    would then pay best (where a verify costs about the same for one guess as for many, many: a one-guess
    probe could not show a run worth that price; on a 2-core CPU, one or two). With `probe_backoff` (a draft
    model, whose probe costs it the catching up) the interval doubles while probes find nothing worth it, and
    starts again once guessing pays. No probe where guessing could not pay even if every guess held (a draft
    model as slow as the model). A guesser whose cost is not yet measured (None) is priced as free and probed
    with UNTIMED_PROBE guesses, so that a one-row decode of it is timed after the first (a warm-up, see
    StepCosts)."""
    guess = guess_seconds or 0.0
    best_k = _best_count(acceptance.p, costs, most, base, guess)
    if best_k > 0:
        acceptance.probe_every = PROBE_EVERY
        return best_k
    if most <= 0 or not could_pay(costs, most, base, guess):
        return 0
    acceptance.idle_steps += 1
    if acceptance.idle_steps < acceptance.probe_every:
        return 0
    acceptance.idle_steps = 0
    if probe_backoff:
        acceptance.probe_every = min(2 * acceptance.probe_every, PROBE_EVERY_MOST)
    if guess_seconds is None:
        return min(UNTIMED_PROBE, most)
    return max(_best_count(PROBE_P, costs, most, base, guess), 1)


def _best_count(p: float, costs: StepCosts, most: int, base: int, guess: float) -> int:
    """The count of guesses (0..most) with the most tokens per second at acceptance p; 0 if none beats none."""
    best_k, best_gain = 0, 1.0
    expected, term = 1.0, 1.0  # expected_tokens(p, k), summed as k grows (this runs on every step with guesses)
    for k in range(1, most + 1):
        term *= p
        expected += term
        gain = (base - 1 + expected) / base / costs.relative(base + k, base, k * guess)
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k


def could_pay(costs: StepCosts, most: int, base: int, guess_seconds: float) -> bool:
    """Whether some count of guesses up to `most` would beat a step of `base` rows if every guess held."""
    return any((base + k) / base > costs.relative(base + k, base, k * guess_seconds) for k in range(1, most + 1))


class DraftContext(Protocol):
    """What the draft model's llama.cpp context offers (serving/engine/llama.py's LlamaContext fits)."""

    n_ctx_seq: int

    @property
    def batch_capacity(self) -> int: ...

    def clear_batch(self) -> None: ...

    def add_to_batch(self, tokens: Sequence[int], start_pos: int, seq_id: int, want_logits: bool,
                     all_logits: bool = False) -> int: ...

    def decode(self) -> int: ...

    def greedy(self, row: int) -> int: ...

    def logprobs(self, row: int, token: int, top_n: int) -> Any: ...

    def forget(self, seq_id: int, from_pos: int = 0) -> bool: ...  # False: llama.cpp kept the cells as they were


class ModelDrafter:
    """Guesses from a draft model: a smaller GGUF with the same vocabulary, run greedily ahead of the model
    in a context of its own with one sequence per slot. Before guessing, a slot's draft sequence is brought in
    step with the slot's tokens (its cells trimmed to the common prefix, the missing tokens decoded), so the
    guesses the model rejected last time are dropped here too. Guessing stops at `k`, or when the draft's
    top token is less likely than `p_min` (llama-server's --draft-p-min): an unsure guess costs a verify row
    and is likely wrong. Its decodes are timed by their rows: one guess costs a one-row decode (in step, a
    sequence catches up by the one token the model added), what the draft length weighs against its gain."""

    def __init__(self, ctx: DraftContext, n_seqs: int, p_min: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._ctx, self._p_min, self._clock = ctx, p_min, clock
        self._cells: list[list[int]] = [[] for _ in range(n_seqs)]  # exactly the tokens each sequence holds
        self._decodes = StepCosts()

    @property
    def guess_seconds(self) -> float | None:
        """What a one-row decode of the draft costs (None until one was timed: catching up takes more rows)."""
        return self._decodes.seconds(1) if self._decodes.measured(1) else None

    def for_slot(self, seq_id: int) -> Drafter:
        """The drafter of one slot (a fresh request on it: its sequence is trimmed as the first guess needs)."""
        return _SlotDraft(self, seq_id)

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or not tokens:
            return []
        row = self._catch_up(seq_id, tokens)
        guesses: list[int] = []
        while row >= 0:
            token = self._ctx.greedy(row)
            if math.exp(self._ctx.logprobs(row, token, 0).logprob) < self._p_min:
                break
            guesses.append(token)
            if len(guesses) == k or len(self._cells[seq_id]) + 1 >= self._ctx.n_ctx_seq:
                break
            row = self._feed(seq_id, [token])
        return guesses

    def _catch_up(self, seq_id: int, tokens: list[int]) -> int:
        """Trim the sequence to its common prefix with `tokens` (keeping at least the last token to decode,
        so its logits exist) and decode the rest; the batch row of the last token's logits, or -1."""
        cells = self._cells[seq_id]
        keep = 0
        limit = min(len(cells), len(tokens) - 1)
        while keep < limit and cells[keep] == tokens[keep]:
            keep += 1
        return self._extend(seq_id, tokens, keep)

    def warm(self, seq_id: int, prompt: list[int]) -> None:
        """Decode a new prompt onto the sequence (what it shares with the cells stays)."""
        cells = self._cells[seq_id]
        keep = 0
        while keep < min(len(cells), len(prompt)) and cells[keep] == prompt[keep]:
            keep += 1
        self._extend(seq_id, prompt, keep)

    def _extend(self, seq_id: int, tokens: list[int], keep: int) -> int:
        """Keep the first `keep` cells, decode the rest of `tokens` in batches; the last token's row or -1."""
        cells = self._cells[seq_id]
        if not self._ctx.forget(seq_id, keep):  # a recurrent draft model cannot be cut: it starts over
            self._ctx.forget(seq_id)
            keep = 0
        del cells[keep:]
        if len(tokens) >= self._ctx.n_ctx_seq:
            return -1
        row = -1
        rest = tokens[keep:]
        step = max(self._ctx.batch_capacity, 1)
        for start in range(0, len(rest), step):
            row = self._feed(seq_id, rest[start:start + step])
            if row < 0:
                return -1
        return row

    def _feed(self, seq_id: int, tokens: list[int]) -> int:
        """Decode `tokens` onto the sequence; the row of the last one's logits, or -1 (the sequence is then
        dropped: a draft that cannot run proposes nothing, and the request goes on without guesses)."""
        cells = self._cells[seq_id]
        self._ctx.clear_batch()
        row = self._ctx.add_to_batch(tokens, len(cells), seq_id, True)
        t0 = self._clock()
        rc = self._ctx.decode()
        if rc != 0:
            log.warning("the draft model's decode returned %d; its sequence %d starts over", rc, seq_id)
            self._ctx.forget(seq_id)
            cells.clear()
            return -1
        self._decodes.observe(len(tokens), self._clock() - t0)
        cells.extend(tokens)
        return row


@dataclass(frozen=True)
class _SlotDraft:
    drafter: ModelDrafter
    seq_id: int
    costly: bool = True

    @property
    def guess_seconds(self) -> float | None:
        return self.drafter.guess_seconds

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return self.drafter.propose(self.seq_id, tokens, k)

    def warm(self, prompt: list[int]) -> None:
        self.drafter.warm(self.seq_id, prompt)
