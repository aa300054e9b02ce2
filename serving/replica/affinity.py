"""Prefix affinity: which engine replica already holds the start of a request's prompt, judged in the router's
process from what it routed before (serving/replica/routing.py wires this into Serve's router).

Why text, not tokens: the router runs in the ingress (or Serve's proxy), which holds no model and must not
tokenise; asking replicas for prefix hashes of their caches would add a round trip or a large routing-stats
report per replica. So the router remembers, per replica, the conversation text it sent there: a returning
turn whose earlier turns went to replica A finds them in A's entries. A replica's caches are what it served
(its slots, then its host-RAM prompt cache), so what the router sent there approximates what it holds.

The memory is a block-hashed prefix tree: the text is cut into BLOCK_CHARS blocks, block i keyed by a hash
chained over blocks 0..i (the key names the whole prefix up to there, as vLLM keys its K/V blocks); a
replica's entries are those keys in LRU order, at most BLOCKS_PER_REPLICA (about 4 M characters, 1 M tokens:
more than a replica's slots and host-RAM cache hold of most models; beyond it the oldest prefixes go first).
An insert touches a text's blocks from the last to the first, so a prefix is always at least as recent as
what extends it: eviction never leaves a hole, and the longest held prefix is found by bisection.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

BLOCK_CHARS = 128  # about 30-40 tokens: matches are counted in whole blocks
BLOCKS_PER_REPLICA = 1 << 15  # 4 M characters of prefixes per replica (a few MiB of the router's memory)
MATCH_RATE = 0.1  # below this share of the prompt held anywhere, route by load (Ray's match_rate_threshold)
GENERATION_PATHS = ("/chat/completions", "/completions", "/messages", "/responses")  # under /v1, or not
ROLE_MARK, TEXT_MARK = "\x1e", "\x1f"  # between messages: no message text holds these

R = TypeVar("R")


class RoutedBy(str, Enum):
    """Why a request went where it went (the `by` label of llm_requests_routed)."""

    affinity = "affinity"  # to the replica holding the longest prefix of its prompt
    load = "load"  # no replica held enough of it (a new conversation, a short prompt): the least loaded
    imbalance = "imbalance"  # a replica held it, but had too many more requests than the least loaded
    overflow = "overflow"  # the router's pick could not take it (full, gone): Serve sent it to another


@dataclass(frozen=True)
class RouteNote:
    """What the router decided, carried to the replica with the request (the replica counts it)."""

    by: RoutedBy
    replica: str  # the replica the router picked (its unique id); another that got the request counts overflow


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """The chained hash of every whole block of `text`: entry i names text[:(i + 1) * block_chars]. Python's
    str hash is salted per process, and these keys never leave it."""
    keys, key = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        key = hash((key, text[start:start + block_chars]))
        keys.append(key)
    return keys


class PrefixIndex:
    """Per replica, the prefixes (as block keys) of the prompts routed there, LRU-bounded."""

    def __init__(self, blocks_per_replica: int = BLOCKS_PER_REPLICA) -> None:
        self._limit = blocks_per_replica
        self._held: dict[str, OrderedDict[int, None]] = {}

    def insert(self, replica: str, keys: Sequence[int]) -> None:
        """`replica` was sent a prompt with these block keys: they become its most recent."""
        held = self._held.setdefault(replica, OrderedDict())
        for key in reversed(keys):  # the first block last: the most recent, the last to go
            held[key] = None
            held.move_to_end(key)
        while len(held) > self._limit:
            held.popitem(last=False)

    def matched(self, replica: str, keys: Sequence[int]) -> int:
        """How many leading blocks of `keys` `replica` holds (entries are prefix-closed: bisect)."""
        held = self._held.get(replica)
        if not held or not keys or keys[0] not in held:
            return 0
        low, high = 1, len(keys)  # keys[:low] held; find the largest such low
        while low < high:
            mid = (low + high + 1) // 2
            if keys[mid - 1] in held:
                low = mid
            else:
                high = mid - 1
        return low

    def blocks(self, replica: str) -> int:
        return len(self._held.get(replica, ()))

    def keep_only(self, replicas: Iterable[str]) -> None:
        """Forget every replica not listed (gone, or replaced: a restarted replica has a new id, empty caches)."""
        keep = set(replicas)
        for replica in [r for r in self._held if r not in keep]:
            del self._held[replica]


@dataclass(frozen=True)
class Choice:
    """The replica the router prefers for a request, and why."""

    replica: str
    by: RoutedBy


def choose(keys: Sequence[int], text_chars: int, candidates: Sequence[R], name: Callable[[R], str],
           ongoing: Callable[[R], int], index: PrefixIndex, max_imbalance: int) -> Choice | None:
    """The replica for a prompt of `text_chars` characters with these block keys, among `candidates`.

    The one holding the longest prefix, if that is at least MATCH_RATE of the prompt and that replica has at
    most `max_imbalance` more requests in flight than the least loaded; else the least loaded, ties going to
    the replica that holds the least (new conversations spread over the replicas instead of piling onto
    the first). None without candidates."""
    if not candidates:
        return None
    loads = {name(r): ongoing(r) for r in candidates}
    lightest = min(loads.values())
    matches = {n: index.matched(n, keys) for n in loads}
    best = max(matches.values(), default=0)
    if best and best * BLOCK_CHARS >= MATCH_RATE * text_chars:
        holder = min((n for n, m in matches.items() if m == best), key=loads.__getitem__)
        if loads[holder] - lightest <= max_imbalance:
            return Choice(holder, RoutedBy.affinity)
        return Choice(_least_loaded(loads, index), RoutedBy.imbalance)
    return Choice(_least_loaded(loads, index), RoutedBy.load)


def _least_loaded(loads: dict[str, int], index: PrefixIndex) -> str:
    return min(loads, key=lambda n: (loads[n], index.blocks(n), random.random()))


# -- the conversation's text, from a relayed request's body -----------------------------------------------
def prompt_text(path: str, body: bytes) -> str | None:
    """The text a request's prompt starts with, in prompt order, such that a conversation's next turn starts
    with this turn's text: tools and system first, then every message as role and text. None for anything
    but a generation route, or a body that is not a JSON object (the replica's route answers it)."""
    kind = next((p for p in GENERATION_PATHS if path.endswith(p)), None)
    if kind is None:
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    if kind == "/completions":
        return _completion_prompt(request.get("prompt"))
    head = _tools(request.get("tools")) + _text(request.get("system")) + _text(request.get("instructions"))
    turns = request.get("input") if kind == "/responses" else request.get("messages")
    if isinstance(turns, str) and kind == "/responses":  # the Responses API's plain input
        return head + _message("user", turns)
    if not isinstance(turns, list):
        return None
    return head + "".join(_message(m.get("role") or m.get("type", ""), m) if isinstance(m, dict) else "" for m in turns)


def _completion_prompt(prompt: Any) -> str | None:
    """One prompt: text, or token ids as text; several prompts (a batch) have no single prefix."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt))
    if isinstance(prompt, list) and len(prompt) == 1:
        return _completion_prompt(prompt[0])
    return None


def _message(role: Any, message: Any) -> str:
    """A message (or a Responses input item) as its role (or type) and its text."""
    return f"{ROLE_MARK}{role}{TEXT_MARK}{_text(message)}"


def _tools(tools: Any) -> str:
    """Tool definitions, as they open the rendered prompt (chat templates put them with the system prompt)."""
    return json.dumps(tools, separators=(",", ":"), sort_keys=True) if tools else ""


def _text(value: Any) -> str:
    """The text of a content value: a string, content parts (text, tool calls and results, nested), or none."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(part) for part in value)
    if isinstance(value, dict):
        if isinstance(value.get("text"), str):
            return value["text"]
        if "content" in value:
            return _text(value["content"])
        if "input" in value:  # an Anthropic tool_use block: its arguments
            return json.dumps(value["input"], separators=(",", ":"), sort_keys=True)
        if isinstance(value.get("arguments"), str):  # a Responses function_call item
            return value["arguments"]
    return ""
