"""Prefix affinity's parts (serving/replica/affinity.py): a request body's conversation text, the block-hashed
prefix memory per replica (matching, LRU eviction that leaves no hole, replicas forgotten), and the choice
between the replica holding a prompt and the least loaded. Pure: no Ray, no model."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest

from serving.replica.affinity import (BLOCK_CHARS, MATCH_RATE, PrefixIndex, RoutedBy, block_hashes, choose,
                                      prompt_text)

pytestmark = pytest.mark.unit


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_a_returning_chat_turn_starts_with_the_text_of_the_turn_before() -> None:
    """System, then each message as role and text: the next turn (the answer and a new question appended)
    extends the earlier text, so its prefix is what the replica that served the earlier turn holds."""
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me of rivers."}]
    second = [*first, {"role": "assistant", "content": "Rivers flow."},
              {"role": "user", "content": [{"type": "text", "text": "And lakes?"}]}]
    a, b = prompt_text("/v1/chat/completions", body(messages=first)), prompt_text("/v1/chat/completions",
                                                                                    body(messages=second))
    assert a and b and b.startswith(a) and "And lakes?" in b and len(b) > len(a)
    as_user = prompt_text("/v1/chat/completions", body(messages=[{"role": "user", "content": "You are terse."}]))
    assert as_user and not a.startswith(as_user)  # roles are part of it


def test_tools_open_the_text_as_they_open_the_rendered_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    text = prompt_text("/v1/chat/completions", body(tools=tools, messages=[{"role": "user", "content": "hi"}]))
    assert text and text.index('"name":"f"') < text.index("hi")


def test_completion_prompts_text_or_token_ids() -> None:
    assert prompt_text("/v1/completions", body(prompt="Once upon a time")) == "Once upon a time"
    assert prompt_text("/v1/completions", body(prompt=["Once"])) == "Once"
    assert prompt_text("/v1/completions", body(prompt=[1, 2, 3])) == "1,2,3"
    assert prompt_text("/v1/completions", body(prompt=["a", "b"])) is None  # a batch has no one prefix


def test_anthropic_messages_system_blocks_tool_use_and_results() -> None:
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    first = [{"role": "user", "content": "List files."}]
    second = [*first, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "ls",
                                                          "input": {"path": "/"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                            "content": [{"type": "text", "text": "etc usr"}]}]}]
    a = prompt_text("/v1/messages", body(system=system, messages=first))
    b = prompt_text("/v1/messages", body(system=system, messages=second))
    assert a and b and a.startswith("Be brief.") and b.startswith(a)
    assert '"path":"/"' in b and "etc usr" in b


def test_responses_input_plain_or_items() -> None:
    assert prompt_text("/v1/responses", body(instructions="Be kind.", input="hi")).startswith("Be kind.")
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
             {"type": "function_call", "name": "f", "arguments": '{"x":1}'}]
    text = prompt_text("/v1/responses", body(input=items))
    assert text and "q" in text and '{"x":1}' in text


def test_anything_but_a_generation_body_has_no_prompt() -> None:
    assert prompt_text("/slots", b"") is None
    assert prompt_text("/v1/models", b"") is None
    assert prompt_text("/v1/chat/completions", b"not json") is None
    assert prompt_text("/v1/chat/completions", b"[1, 2]") is None
    assert prompt_text("/v1/chat/completions", body(messages="nope")) is None
    assert prompt_text("/v1/chat/completions", b"\xff\xfe") is None


def test_block_keys_name_whole_prefixes() -> None:
    text = "x" * (3 * BLOCK_CHARS + 5)
    keys = block_hashes(text)
    assert len(keys) == 3 and len(set(keys)) == 3  # same block text, different prefixes: different keys
    assert block_hashes(text[:2 * BLOCK_CHARS]) == keys[:2]
    assert block_hashes("y" + text[1:])[0] != keys[0]
    assert block_hashes("short") == []


def test_the_longest_held_prefix_is_found() -> None:
    index = PrefixIndex()
    history = "".join(f"line {i} of the shared history\n" for i in range(200))
    index.insert("a", block_hashes(history))
    index.insert("b", block_hashes(history[:len(history) // 4]))
    longer = history + "a question that came later" * 20
    keys = block_hashes(longer)
    assert index.matched("a", keys) == len(history) // BLOCK_CHARS
    assert index.matched("b", keys) == len(history) // 4 // BLOCK_CHARS
    assert index.matched("c", keys) == 0
    assert index.matched("a", block_hashes("something else entirely" * 40)) == 0


def test_eviction_keeps_the_bound_drops_the_oldest_and_leaves_no_hole() -> None:
    index = PrefixIndex(blocks_per_replica=10)
    old, new = "o" * (6 * BLOCK_CHARS), "n" * (6 * BLOCK_CHARS)
    index.insert("a", block_hashes(old))
    index.insert("a", block_hashes(new))
    assert index.blocks("a") == 10
    assert index.matched("a", block_hashes(new)) == 6
    assert index.matched("a", block_hashes(old)) == 4  # the old prompt's deepest two went first: its start stays
    shared = "s" * (4 * BLOCK_CHARS)
    for i in range(5):  # prompts sharing a start: the start, touched by each, outlives their tails
        index.insert("a", block_hashes(shared + str(i) * (3 * BLOCK_CHARS)))
    assert index.matched("a", block_hashes(shared)) == 4 and index.blocks("a") == 10


def test_a_replica_that_left_is_forgotten() -> None:
    index = PrefixIndex()
    keys = block_hashes("z" * 4 * BLOCK_CHARS)
    index.insert("a", keys)
    index.insert("b", keys)
    index.keep_only(["b", "c"])
    assert index.matched("a", keys) == 0 and index.blocks("a") == 0 and index.matched("b", keys) == 4


@dataclass(frozen=True)
class Fake:
    name: str
    ongoing: int = 0


def pick(index: PrefixIndex, text: str, replicas: list[Fake], max_imbalance: int = 4) -> tuple[str, RoutedBy]:
    choice = choose(block_hashes(text), len(text), replicas, lambda r: r.name, lambda r: r.ongoing, index,
                    max_imbalance)
    assert choice is not None
    return choice.replica, choice.by


def test_the_holder_wins_within_the_imbalance_bound() -> None:
    index = PrefixIndex()
    history = "h" * (20 * BLOCK_CHARS)
    index.insert("b", block_hashes(history))
    turn = history + "next question " * 10
    assert pick(index, turn, [Fake("a"), Fake("b", 4)]) == ("b", RoutedBy.affinity)
    assert pick(index, turn, [Fake("a", 1), Fake("b", 6)]) == ("a", RoutedBy.imbalance)
    assert pick(index, turn, [Fake("a", 0), Fake("b", 1)], max_imbalance=0) == ("a", RoutedBy.imbalance)


def test_a_prompt_nobody_holds_enough_of_goes_by_load_spreading_new_conversations() -> None:
    index = PrefixIndex()
    index.insert("a", block_hashes("a" * 40 * BLOCK_CHARS))
    assert pick(index, "new " * 100, [Fake("a"), Fake("b")]) == ("b", RoutedBy.load)  # b holds less
    assert pick(index, "new " * 100, [Fake("a"), Fake("b", 1)]) == ("a", RoutedBy.load)  # b is busier
    shared = "s" * BLOCK_CHARS
    index.insert("a", block_hashes(shared))
    text = shared + "t" * int(BLOCK_CHARS / MATCH_RATE)  # a shared start, under MATCH_RATE of the prompt
    assert pick(index, text, [Fake("a"), Fake("b")])[1] is RoutedBy.load
    assert pick(index, "tiny", [Fake("a"), Fake("b")])[1] is RoutedBy.load  # under a block: nothing to match
    assert choose([], 0, [], str, len, index, 4) is None


def test_the_routers_cost_per_request() -> None:
    """Not a timed assert: what the router's work costs per request on this CPU (printed; run with -s), for
    the size of a long agent conversation, 64 kB of JSON and 8 replicas of full memory."""
    index = PrefixIndex()
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i} " + "w" * 1000} for i in range(64)]
    raw = body(messages=messages)
    for r in range(8):
        for c in range(BLOCKS_PER_TEST // 500):
            index.insert(f"r{r}", block_hashes(f"{r}.{c}" + "q" * 500 * BLOCK_CHARS))
    index.insert("r3", block_hashes(prompt_text("/v1/chat/completions", raw) or ""))
    replicas = [Fake(f"r{r}", r % 3) for r in range(8)]
    rounds = 50
    start = time.perf_counter()
    for _ in range(rounds):
        text = prompt_text("/v1/chat/completions", raw) or ""
        chosen = choose(block_hashes(text), len(text), replicas, lambda r: r.name, lambda r: r.ongoing, index, 4)
    each = (time.perf_counter() - start) / rounds
    assert chosen is not None and chosen.replica == "r3"
    print(f"\nrouter cost: {each * 1e6:.0f} us per request ({len(raw)} bytes of JSON, {len(text)} characters, "
          f"8 replicas of {index.blocks('r0')} blocks)")


BLOCKS_PER_TEST = 20_000
