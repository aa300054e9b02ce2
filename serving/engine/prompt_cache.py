"""Prompt states kept in host RAM, so a conversation that lost its slot comes back warm.

A slot holds one conversation's K/V cells. When more conversations than slots take turns, each new prompt
takes a slot from another one, and that one's next turn would prefill its whole history again. llama-server
keeps such evicted prompts in host memory (`--cache-ram`, 8 GiB by default); so do we: before a slot's cells
are dropped for an unrelated prompt, its state (llama.cpp's per-sequence state, `llama_state_seq_get_data`)
is stored here under its tokens, and a later prompt that extends a stored prefix further than any slot does
gets that state restored into its slot (`llama_state_seq_set_data`) and prefills only the rest.

A save is priced before it is made: a state that adds only a few tokens to one already stored is not copied
when prefilling those tokens on the conversation's return costs less than the copy now (PromptPrices). On an
H100 (27B-class, 2 slots, six ~1,500-token conversations taking turns,
docs/log/2026-12-06-h100-third-fourth-runs.md) a returning turn
whose slot had to be saved first took 188-222 ms to its first token, one whose slot was saved already 70-89
ms: the copy costs more than prefilling the ~65 tokens a chat turn adds. On a CPU with a small model the copy
is cheap and prefill dear, so every state is saved.

States are found through an index of their tokens in blocks (BLOCK tokens, hashed in a chain, so equal
prefixes share index entries): a lookup walks the prompt block by block to the deepest block any stored state
shares, and compares only the states there token by token (at most CANDIDATES, the most recently stored). So a
lookup costs about the prompt's length, not the number of states: a full cache of a small model holds
thousands, and a scan of them all, every admission, held the step thread for milliseconds
(scripts/bench_prompt_cache_lookup.py).

A recurrent or hybrid model's state cannot be cut back to an earlier token (the scheduler's MemoryKind): for
such a context (`cuts` False) a state serves only a prompt that extends it past its end, and a stored state
covers only the tokens it holds, not a shorter history it went through.

Bounded by bytes, least recently used first out. A stored state is valid only for the context that made it
(its layout of streams and cache types): the scheduler empties this cache whenever the context is rebuilt.
Pure bookkeeping: no llama.cpp call here (the scheduler moves the bytes through its ModelContext).
"""

from __future__ import annotations

import collections
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_TOKENS = 64  # a prompt shorter than this prefills faster than its state is saved and restored
HEADROOM = 1.25  # a new state's buffer is this much larger than the state, so a later, longer one can reuse it
MAX_SPARES = 2  # buffers of replaced states kept for the next save (a fresh buffer costs page faults)
PRICE_WINDOW = 8  # prices are the median of this many recent measurements (one slowed by a neighbour is not the price)
PREFILL_PRICE_ROWS = 256  # a step with fewer prompt rows costs about its weight reads, not its tokens: no price
BLOCK = 16  # tokens hashed together in the index (at most min_tokens: a restore needs that many shared)
CANDIDATES = 16  # states compared token by token at the deepest shared block: within a block of the longest
StateBuffer = np.ndarray  # one-dimensional, uint8: what a saved state is written into
Key = tuple[int, ...]  # a stored state's tokens
Node = tuple[int, int]  # (full blocks, chained hash of them): a prefix in the index; (0, 0) is the empty one


@dataclass(frozen=True)
class CachedPrompt:
    """One stored slot state: exactly the tokens its cells held, in order, and llama.cpp's bytes of them."""

    tokens: tuple[int, ...]
    state: memoryview  # llama.cpp's bytes, written and read in place: the head of a (maybe larger) buffer

    @property
    def nbytes(self) -> int:
        """Host RAM the state holds: its whole buffer."""
        return len(self.buffer)

    @property
    def buffer(self) -> StateBuffer:
        buffer = self.state.obj
        assert isinstance(buffer, np.ndarray)
        return buffer


class PromptPrices:
    """What saving a state and prefilling a prompt cost per token, on this machine and context, as the engine
    measured them: the median of the last PRICE_WINDOW saves (seconds over the tokens saved), and of the last
    PRICE_WINDOW steps with at least PREFILL_PRICE_ROWS prompt rows (seconds over the rows).

    Prefill is priced at long prompts' rate, which for the few tokens a skipped save leaves over is an upper
    bound (a short prefill costs hardly more than one decode step): so it leans to saving. Until both are
    measured, every state worth saving is saved."""

    def __init__(self) -> None:
        self._save: collections.deque[float] = collections.deque(maxlen=PRICE_WINDOW)
        self._prefill: collections.deque[float] = collections.deque(maxlen=PRICE_WINDOW)

    def saved(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self._save.append(seconds / tokens)

    def prefilled(self, rows: int, prompt_rows: int, seconds: float) -> None:
        """A decode of `rows` rows, `prompt_rows` of them prompt tokens, took `seconds`."""
        if prompt_rows >= PREFILL_PRICE_ROWS and seconds >= 0:
            self._prefill.append(seconds / rows)

    @property
    def save_s_per_token(self) -> float | None:
        return statistics.median(self._save) if self._save else None

    @property
    def prefill_s_per_token(self) -> float | None:
        return statistics.median(self._prefill) if self._prefill else None

    def skip_pays(self, tokens: int, uncovered: int) -> bool:
        """Whether prefilling `uncovered` tokens later costs less than saving a state of `tokens` tokens now."""
        save, prefill = self.save_s_per_token, self.prefill_s_per_token
        return save is not None and prefill is not None and uncovered * prefill < tokens * save


@dataclass(frozen=True)
class PromptCacheStats:
    """What /slots and /metrics show of the cache."""

    limit_bytes: int
    entries: int
    bytes: int
    tokens: int
    hits: int  # prompts that had a stored state restored into their slot
    hit_tokens: int  # prompt tokens those restores saved from prefill
    saves: int
    skipped: int  # saves priced out (a stored state covered all but what prefills faster than the copy); a
    # slot looked at while idle and again when taken counts twice
    evictions: int  # states dropped to stay under the limit


class PromptCache:
    """Slot states by their tokens, LRU within `limit_bytes`. Used by the scheduler's step thread only."""

    def __init__(self, limit_bytes: int, min_tokens: int = MIN_TOKENS) -> None:
        self.limit_bytes, self.min_tokens = limit_bytes, min_tokens
        self._entries: collections.OrderedDict[Key, CachedPrompt] = collections.OrderedDict()
        self._block = max(1, min(min_tokens, BLOCK))
        self._nodes: dict[Key, list[Node]] = {}  # each state's prefixes in the index, by its key
        self._sharing: dict[Node, dict[Key, None]] = {}  # a prefix -> the states that open with it, in order
        self._ending: dict[Node, dict[Key, None]] = {}  # a prefix -> the states whose last full block it is
        self._bytes = self._tokens = 0
        self._spares: list[StateBuffer] = []
        self.prices = PromptPrices()
        self.hits = self.hit_tokens = self.saves = self.skipped = self.evictions = 0

    def worth_saving(self, tokens: Sequence[int], cuts: bool = True) -> bool:
        """Whether a slot holding `tokens` should be saved before its cells are dropped: long enough, not
        already here (a stored state that extends it covers it too, where the memory `cuts`), and the tokens no
        stored state covers would cost more to prefill again than the copy costs now (PromptPrices)."""
        if self.limit_bytes <= 0 or len(tokens) < self.min_tokens:
            return False
        key = tuple(tokens)
        longest = self._longest(key) if cuts else self._longest_within(key, len(key))
        covered = longest[1] if longest is not None else 0
        if covered == len(key):
            return False
        if self.prices.skip_pays(len(key), len(key) - covered):
            self.skipped += 1
            return False
        return True

    def spare(self, size: int) -> StateBuffer:
        """A buffer of at least `size` bytes for the next save: a replaced state's, when one is large enough
        (writing into fresh memory costs a page fault per page, which on a small VM took longer than
        llama.cpp's copy), else a new one with HEADROOM for the next, longer state of a conversation.

        A new one is left unwritten (`np.empty`): its pages are first touched by llama.cpp's copy, which runs
        without the interpreter lock. A zero-filled `bytearray` would fill them under the lock, stalling the
        event loop that takes requests in and sends first tokens out: a 0.5 ms ticker waited 52 ms through a
        120 MB state's save on the dev CPU, against 0.9 ms for this buffer (scripts/bench_state_buffer.py);
        in a profile of the engine replica on an H100 it was the step thread's largest hold of the lock."""
        fits = [i for i, b in enumerate(self._spares) if len(b) >= size]
        if fits:
            return self._spares.pop(min(fits, key=lambda i: len(self._spares[i])))
        return np.empty(int(size * HEADROOM), dtype=np.uint8)

    def put(self, tokens: Sequence[int], state: memoryview, cuts: bool = True) -> bool:
        """Store a slot's state; stored prefixes of it go (it covers them, where the memory `cuts`; their
        buffers are kept for the next save), then spare buffers and the least recently used states until it
        fits. False when the state alone is over the limit."""
        entry = CachedPrompt(tuple(tokens), state)
        if entry.nbytes > self.limit_bytes or not entry.tokens:
            return False
        nodes = self._path(entry.tokens)
        for key in self._prefixes(entry.tokens, nodes):
            if cuts or key == entry.tokens:
                self._keep_spare(self._drop(key))
        while self._bytes + self._spare_bytes + entry.nbytes > self.limit_bytes:
            if self._spares:
                self._spares.pop(0)
            else:
                self._drop(next(iter(self._entries)))
                self.evictions += 1
        self._entries[entry.tokens] = entry
        self._nodes[entry.tokens] = nodes
        for node in nodes:
            self._sharing.setdefault(node, {})[entry.tokens] = None
        self._ending.setdefault(nodes[-1], {})[entry.tokens] = None
        self._bytes += entry.nbytes
        self._tokens += len(entry.tokens)
        self.saves += 1
        return True

    def best(self, prompt: Sequence[int], cuts: bool = True) -> tuple[CachedPrompt, int] | None:
        """The stored state sharing the longest prefix with `prompt` (to within a block: see `_longest`), and
        that length; None when none shares any. Where the memory does not cut (`cuts` False), the longest
        state `prompt` extends past its end (its last token is decoded again for its logits). Does not count
        a hit: the scheduler decides whether restoring it beats what the slots hold."""
        key = tuple(prompt)
        found = self._longest(key) if cuts else self._longest_within(key, len(key) - 1)
        return (self._entries[found[0]], found[1]) if found is not None else None

    def restored(self, entry: CachedPrompt, used_tokens: int) -> None:
        """Note that `entry` was restored into a slot, saving `used_tokens` of prefill: it is now most recent."""
        if entry.tokens in self._entries:
            self._entries.move_to_end(entry.tokens)
        self.hits += 1
        self.hit_tokens += used_tokens

    def discard(self, entry: CachedPrompt) -> None:
        """Drop a state that could not be restored (it would fail again)."""
        if entry.tokens in self._entries:
            self._drop(entry.tokens)

    def clear(self) -> None:
        """Forget every state (the context they came from is gone), the spare buffers and the prices (a new
        context has its own); the counters stay."""
        self._entries.clear()
        self._nodes.clear()
        self._sharing.clear()
        self._ending.clear()
        self._spares.clear()
        self.prices = PromptPrices()
        self._bytes = self._tokens = 0

    def stats(self) -> PromptCacheStats:
        """Plain counts (any thread may read them: nothing here iterates the entries)."""
        return PromptCacheStats(limit_bytes=self.limit_bytes, entries=len(self._entries),
                                bytes=self._bytes + self._spare_bytes,
                                tokens=self._tokens, hits=self.hits, hit_tokens=self.hit_tokens,
                                saves=self.saves, skipped=self.skipped, evictions=self.evictions)

    @property
    def _spare_bytes(self) -> int:
        return sum(len(b) for b in list(self._spares))  # stats() reads it from other threads

    def _keep_spare(self, buffer: StateBuffer) -> None:
        self._spares.append(buffer)
        del self._spares[:-MAX_SPARES]

    def _drop(self, key: Key) -> StateBuffer:
        entry = self._entries.pop(key)
        nodes = self._nodes.pop(key)
        for node in nodes:
            _unlist(self._sharing, node, key)
        _unlist(self._ending, nodes[-1], key)
        self._bytes -= entry.nbytes
        self._tokens -= len(key)
        return entry.buffer

    def _path(self, tokens: Key) -> list[Node]:
        """The index's prefixes of `tokens`: the empty one, then one per full block, each block's hash chained
        to the ones before it (equal prefixes, equal nodes; a collision is caught by the token comparison that
        follows every lookup)."""
        nodes: list[Node] = [(0, 0)]
        chained, block = 0, self._block
        for depth, start in enumerate(range(0, len(tokens) - block + 1, block), start=1):
            chained = hash((chained, tokens[start:start + block]))
            nodes.append((depth, chained))
        return nodes

    def _longest(self, key: Key) -> tuple[Key, int] | None:
        """The stored state sharing the longest prefix with `key`, and its length: of the states under the
        deepest block any of them shares with `key` (all within a block of each other), the CANDIDATES most
        recently stored, compared token by token."""
        deepest: dict[Key, None] = {}
        for node in self._path(key):
            sharing = self._sharing.get(node)
            if not sharing:
                break
            deepest = sharing
        found: tuple[Key, int] | None = None
        for stored in itertools.islice(reversed(deepest), CANDIDATES):
            shared = common_prefix(stored, key)
            if shared > 0 and (found is None or shared > found[1]):
                found = (stored, shared)
        return found

    def _longest_within(self, key: Key, most: int) -> tuple[Key, int] | None:
        """The longest stored state of at most `most` tokens that `key` begins with, and its length."""
        longest = max((k for k in self._prefixes(key, self._path(key)) if 0 < len(k) <= most), key=len, default=None)
        return (longest, len(longest)) if longest is not None else None

    def _prefixes(self, tokens: Key, nodes: list[Node]) -> list[Key]:
        """The stored states that are prefixes of `tokens` (itself included): each ends past one of its
        nodes, so only the states ending there are compared."""
        return [key for node in nodes for key in self._ending.get(node, ())
                if len(key) <= len(tokens) and tokens[:len(key)] == key]


def _unlist(table: dict[Node, dict[Key, None]], node: Node, key: Key) -> None:
    listed = table[node]
    del listed[key]
    if not listed:
        del table[node]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading tokens `a` and `b` share (both lists, or both tuples). Compares 256 at a time (a C-speed slice
    compare) and then one by one inside the chunk that differs: prompts of thousands of tokens are compared
    at every admission."""
    n = min(len(a), len(b))
    i = 0
    while i < n:
        j = min(i + 256, n)
        if a[i:j] != b[i:j]:
            break
        i = j
    while i < n and a[i] == b[i]:
        i += 1
    return i
