"""serving/engine/prompt_cache.py: the host-RAM store of slot states, bounded, LRU, by tokens (no model needed)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from serving.engine.prompt_cache import PromptCache, StateBuffer, common_prefix

pytestmark = pytest.mark.unit


def buffer(data: bytes) -> StateBuffer:
    """A state's buffer as the cache makes them (PromptCache.spare): uint8, one dimension."""
    return np.frombuffer(bytearray(data), dtype=np.uint8)


def state(data: bytes) -> memoryview:
    return memoryview(buffer(data))


def test_states_stay_within_the_limit_least_recently_used_first_out() -> None:
    cache = PromptCache(limit_bytes=100, min_tokens=2)
    assert cache.put([1, 2, 3], state(b"a" * 40))
    assert cache.put([4, 5, 6], state(b"b" * 40))
    entry, shared = cache.best([1, 2, 3, 9]) or (None, 0)
    assert entry is not None and shared == 3
    cache.restored(entry, shared)  # [1, 2, 3] is now the most recent: [4, 5, 6] goes first
    assert cache.put([7, 8, 9], state(b"c" * 40))
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.tokens, stats.evictions, stats.hits, stats.hit_tokens) == \
        (2, 80, 6, 1, 1, 3)
    assert cache.best([4, 5, 6]) is None and cache.best([7, 8]) is not None
    assert not cache.put([1], state(b"x" * 101)), "a state over the whole limit is not stored"


def test_a_longer_state_covers_its_prefixes() -> None:
    cache = PromptCache(limit_bytes=1000, min_tokens=3)
    replaced = buffer(b"a" * 10)
    cache.put([1, 2, 3, 4], memoryview(replaced))
    assert not cache.worth_saving([1, 2, 3]), "a stored state extends it"
    assert not cache.worth_saving([5, 6]), "shorter than min_tokens"
    assert cache.worth_saving([1, 2, 3, 4, 5])
    cache.put([1, 2, 3, 4, 5], state(b"b" * 12))  # replaces its prefix [1, 2, 3, 4]
    assert cache.stats().entries == 1 and cache.stats().bytes == 12 + 10, "its buffer is kept as a spare"
    assert cache.spare(11) is not replaced and len(cache.spare(11)) == int(11 * 1.25), "too small: a new one"
    assert cache.spare(8) is replaced and cache.stats().bytes == 12, "the next save writes into it"
    assert PromptCache(limit_bytes=0).worth_saving(list(range(100))) is False  # off


def test_the_smallest_spare_that_fits_is_taken_and_a_new_buffer_is_left_unwritten() -> None:
    """Spares alike in content are told apart by identity; a new buffer is np.empty, not zero-filled, so its
    pages are first touched by llama.cpp's copy, outside the interpreter lock."""
    cache = PromptCache(limit_bytes=1000, min_tokens=1)
    small, large = buffer(b"\0" * 20), buffer(b"\0" * 30)
    cache.put([1], memoryview(large))
    cache.put([1, 2], state(b"x"))  # covers [1]: its buffer becomes a spare
    cache.put([3], memoryview(small))
    cache.put([3, 4], state(b"y"))
    assert cache.spare(15) is small and cache.spare(15) is large
    fresh = cache.spare(15)
    assert isinstance(fresh, np.ndarray) and fresh.dtype == np.uint8 and len(fresh) == int(15 * 1.25)


def test_the_best_state_is_the_longest_shared_prefix_and_discard_and_clear_forget() -> None:
    cache = PromptCache(limit_bytes=1000, min_tokens=1)
    cache.put([1, 2, 3, 4], state(b"a"))
    cache.put([1, 2, 9, 9, 9], state(b"b"))
    found = cache.best([1, 2, 9, 9, 0])
    assert found is not None and found[0].tokens == (1, 2, 9, 9, 9) and found[1] == 4
    cache.discard(found[0])
    assert cache.best([1, 2, 9]) is not None and cache.best([1, 2, 9])[1] == 2  # type: ignore[index]
    cache.clear()
    assert cache.best([1, 2, 3]) is None and cache.stats().bytes == 0 and cache.stats().saves == 2


def test_common_prefix_agrees_with_a_token_by_token_count_across_chunk_boundaries() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(0, 900)
        a = [rng.randint(0, 3) for _ in range(n)]
        cut = rng.randint(0, n)
        b = a[:cut] + [rng.randint(0, 3) for _ in range(rng.randint(0, 600))]
        naive = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == naive and common_prefix(tuple(a), tuple(b)) == naive


def test_a_save_is_skipped_only_where_prefilling_what_it_adds_costs_less_than_the_copy() -> None:
    """Priced on the machine: with no prices yet every state worth saving is saved; once measured, a state
    that adds a few tokens to a stored one is skipped where those tokens prefill faster than the copy (a large
    model on a GPU), and saved where the copy is cheap (a small model on a CPU). Prefill is priced only from
    long prompts."""
    cache = PromptCache(limit_bytes=10_000, min_tokens=4)
    cache.put(list(range(100)), state(b"a" * 100))
    grown = list(range(110))  # 10 tokens past the stored state
    assert cache.worth_saving(grown), "nothing measured yet: saved"
    cache.prices.prefilled(rows=64, prompt_rows=64, seconds=1.0)
    assert cache.prices.prefill_s_per_token is None, "a short prompt's step is no price of prefill"
    cache.prices.prefilled(rows=300, prompt_rows=298, seconds=0.3)  # 1 ms a token
    cache.prices.saved(tokens=1000, seconds=0.05)  # 0.05 ms a token: 5.5 ms for these 110
    assert cache.worth_saving(grown) and cache.stats().skipped == 0, "10 ms of prefill > 5.5 ms of copy: saved"
    for _ in range(8):
        cache.prices.saved(tokens=1000, seconds=0.2)  # the copy got dearer: 22 ms > 10 ms of prefill
    assert not cache.worth_saving(grown) and cache.stats().skipped == 1
    assert cache.worth_saving(list(range(100)) + list(range(500, 530))), "30 uncovered tokens: 30 ms > 26 ms"
    assert cache.worth_saving(list(range(1000, 1110))), "nothing stored covers it: 110 ms of prefill"
    cache.clear()
    assert cache.prices.save_s_per_token is None, "a new context is priced anew"


def test_the_index_finds_what_a_scan_of_every_state_would_through_puts_drops_and_evictions() -> None:
    """Random conversations (shared openings, turns that extend earlier states), a limit that evicts, restores
    and discards: after every operation the index's answer is a scan's (fewer states than CANDIDATES, so
    exact), and it lists exactly the states held, so a dropped state is never offered."""
    from serving.engine.prompt_cache import CANDIDATES

    rng = random.Random(11)
    cache = PromptCache(limit_bytes=12 * 40, min_tokens=4)  # blocks of 4 tokens; 12 states of 40 bytes
    opening = [1, 2, 3, 4, 5, 6]
    histories: list[list[int]] = []
    for step in range(400):
        action = rng.random()
        if action < 0.5 or not histories:
            tail = [rng.randrange(7, 12) for _ in range(rng.randrange(1, 9))]
            tokens = opening[:rng.randrange(len(opening) + 1)] + tail
            histories.append(tokens)
        else:
            tokens = rng.choice(histories)
            tokens += [rng.randrange(7, 12) for _ in range(rng.randrange(1, 6))]  # the next turn
        cache.put(tokens, state(b"s" * 40))
        prompt = rng.choice(histories)[:rng.randrange(1, 40)] + [99]
        scan = max((common_prefix(k, tuple(prompt)) for k in cache._entries), default=0)
        found = cache.best(prompt)
        assert (found[1] if found else 0) == scan, f"step {step}"
        assert found is None or found[0].tokens in cache._entries
        if found is not None and rng.random() < 0.2:
            (cache.discard if rng.random() < 0.3 else lambda e: cache.restored(e, 1))(found[0])
        listed = {k for keys in cache._sharing.values() for k in keys}
        assert listed == set(cache._entries) and len(cache._entries) < CANDIDATES
    assert cache.stats().evictions > 0
    cache.clear()
    assert cache.best([1, 2, 3, 4, 5]) is None and not cache._sharing and not cache._ending


def test_a_lookup_among_many_states_with_one_opening_compares_only_the_deepest() -> None:
    """Hundreds of states opening with the same long system prompt: a returning prompt gets its own state
    (the deepest shared block), a new one a state sharing the opening, and a state a stored one extends is
    not saved again."""
    cache = PromptCache(limit_bytes=1 << 20, min_tokens=64)
    system = list(range(100, 300))  # 200 tokens every prompt opens with
    rng = random.Random(5)
    states = [system + [rng.randrange(1000, 9000) for _ in range(60)] for _ in range(300)]
    for tokens in states:
        cache.put(tokens, state(b"s"))
    found = cache.best(states[42] + [5, 6, 7])
    assert found is not None and found[0].tokens == tuple(states[42]) and found[1] == 260
    other = cache.best(system + [1, 2, 3])
    assert other is not None and other[1] == 200
    assert not cache.worth_saving(states[7][:230]), "a stored state extends it"


def test_where_the_memory_cannot_be_cut_only_a_state_the_prompt_extends_serves() -> None:
    """A recurrent state is at its last token: it serves a prompt that continues all of it (the longest such
    one, and never one the prompt ends inside, whose last token must be decoded again for its logits), and
    a longer stored state does not make a shorter history already saved."""
    cache = PromptCache(limit_bytes=1000, min_tokens=2)
    long_one = list(range(1, 41))
    assert cache.put(long_one, state(b"l" * 10))
    going_back = long_one[:20] + [99]
    entry, shared = cache.best(going_back) or (None, 0)
    assert entry is not None and shared == 20  # cut back, as attention cells can be
    assert cache.best(going_back, cuts=False) is None
    assert cache.best(long_one, cuts=False) is None  # the same prompt: its last token is decoded again
    assert cache.put([7, 8, 9], state(b"s" * 10)) and cache.put(list(range(1, 17)), state(b"m" * 10))
    entry, shared = cache.best(long_one + [5], cuts=False) or (None, 0)
    assert entry is not None and entry.tokens == tuple(long_one) and shared == 40
    entry, shared = cache.best(long_one[:30], cuts=False) or (None, 0)
    assert entry is not None and entry.tokens == tuple(range(1, 17)) and shared == 16
    assert not cache.worth_saving(long_one[:25]) and cache.worth_saving(long_one[:25], cuts=False)
    assert not cache.worth_saving(long_one, cuts=False)  # the same tokens are stored
    assert cache.put(long_one + [41, 42], state(b"x" * 10), cuts=False)  # a longer state keeps its prefixes
    assert cache.stats().entries == 4
    assert cache.put(long_one + [41, 42], state(b"y" * 10), cuts=False) and cache.stats().entries == 4
    assert cache.put(long_one + [41, 42, 43], state(b"z" * 10)) and cache.stats().entries == 2
