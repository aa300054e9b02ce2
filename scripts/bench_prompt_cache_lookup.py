#!/usr/bin/env python3
"""What the prompt cache's bookkeeping costs the step thread as it fills: the time of one lookup (`best`, at
every admission), one save decision (`worth_saving`, before a slot's cells are dropped) and one store (`put`)
with N stored states, all opening with the same chat template as real prompts do. These run on the engine's
step thread holding the interpreter lock, so their time is every request's TTFT and the event loop's stall.

A full cache of a small model holds thousands of states: 8 GiB of 200-token SmolLM2-135M states (~23 KB a
token with an f16 cache) is ~1,800 of them.

    python scripts/bench_prompt_cache_lookup.py --entries 100,1000,2000 --json-out lookup.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.provenance import provenance, write_report  # noqa: E402
from serving.engine.prompt_cache import PromptCache  # noqa: E402

TEMPLATE_TOKENS = 30  # a chat template's opening, shared by every prompt (SmolLM2's system turn is ~30 tokens)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    head = list(range(TEMPLATE_TOKENS))
    return [head + [rng.randrange(1000, 49_000) for _ in range(length - TEMPLATE_TOKENS)] for _ in range(count)]


def timed_ms(call: Callable[[list[int]], object], prompt: list[int], repeats: int) -> float:
    """The median of `repeats` calls, ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call(prompt)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def measure(entries: int, length: int, repeats: int) -> dict[str, float | int]:
    cache = PromptCache(limit_bytes=1 << 50)
    state = np.empty(16, dtype=np.uint8).data
    stored = prompts(entries, length, seed=entries)
    for tokens in stored:
        cache.put(tokens, state)
    new = prompts(1, length, seed=-1)[0]  # a prompt nothing stored continues
    back = [*stored[0], 7, 8, 9]  # one that continues a stored state: a conversation's next turn
    figures: dict[str, float | int] = {
        "entries": entries, "best_new_ms": timed_ms(cache.best, new, repeats),
        "best_returning_ms": timed_ms(cache.best, back, repeats),
        "worth_saving_ms": timed_ms(cache.worth_saving, new, repeats)}
    more = iter(prompts(repeats, length, seed=-2))  # a new state each time (the cache grows by `repeats`)
    figures["put_ms"] = timed_ms(lambda _: cache.put(next(more), state), new, repeats)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=lambda t: [int(x) for x in t.split(",")], default=[100, 1000, 2000])
    p.add_argument("--length", type=int, default=200, help="tokens a stored state holds (default 200)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    rows = [measure(n, args.length, args.repeats) for n in args.entries]
    print("| stored states | best, new prompt ms | best, returning prompt ms | worth_saving ms | put ms |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['entries']} | {r['best_new_ms']:.3f} | {r['best_returning_ms']:.3f} | "
              f"{r['worth_saving_ms']:.3f} | {r['put_ms']:.3f} |")
    if args.json_out:
        write_report(args.json_out, {"provenance": provenance(), "command": " ".join(sys.argv),
                                     "length": args.length, "repeats": args.repeats, "rows": rows})
    else:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
