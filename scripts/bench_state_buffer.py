#!/usr/bin/env python3
"""What a prompt-cache save's new buffer costs the event loop of the process it runs in.

The step thread saves a slot's state into a buffer from `PromptCache.spare`, then llama.cpp copies the state
into it (`llama_state_seq_get_data`, through ctypes: without the interpreter lock). While the step thread holds
the lock, nothing else in the process runs Python: in a replica, that is the event loop taking requests in and
sending first tokens out. This times a save's two parts for a few state sizes, the buffer as the cache makes it
and as a zero-filled `bytearray` (what it made before), with a ticker thread that wakes every 0.5 ms: its
longest gap is how long the loop would have waited. The copy is `ctypes.memset` over the buffer, a stand-in for
llama.cpp's (both run without the lock and touch every page). No model needed.

    python scripts/bench_state_buffer.py [--sizes-mb 3,30,120] [--repeats 5] [--out results.json]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from measure.provenance import provenance, write_report  # noqa: E402
from serving.engine.prompt_cache import PromptCache  # noqa: E402

TICK_S = 0.0005


@dataclass(frozen=True)
class Row:
    size_mb: float
    buffer: str
    save_ms: float  # the buffer made and written, median over the repeats
    longest_gap_ms: float  # the ticker's longest wait in that time, median over the repeats


def _ticker(stop: threading.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        time.sleep(TICK_S)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def one_save(make: Callable[[int], Any], size: int) -> tuple[float, float]:
    """(ms the save took, the ticker's longest gap in ms) for one buffer of `size` bytes made and written."""
    stop, gaps = threading.Event(), list[float]()
    ticker = threading.Thread(target=_ticker, args=(stop, gaps))
    ticker.start()
    time.sleep(0.05)
    gaps.clear()
    start = time.perf_counter()
    buffer = make(size)
    ctypes.memset((ctypes.c_uint8 * size).from_buffer(buffer), 1, size)
    took = time.perf_counter() - start
    time.sleep(0.01)
    stop.set()
    ticker.join()
    return took * 1e3, max(gaps) * 1e3


def measure(sizes_mb: list[float], repeats: int) -> list[Row]:
    makes: dict[str, Callable[[int], Any]] = {
        "PromptCache.spare (np.empty)": lambda n: PromptCache(limit_bytes=n * 2).spare(n),
        "bytearray (zero-filled)": bytearray,
    }
    rows = []
    for size_mb in sizes_mb:
        size = int(size_mb * 1e6)
        for name, make in makes.items():
            runs = [one_save(make, size) for _ in range(repeats)]
            rows.append(Row(size_mb, name, statistics.median(r[0] for r in runs),
                            statistics.median(r[1] for r in runs)))
            print(f"  {size_mb:g} MB, {name}: {rows[-1].save_ms:.1f} ms, longest gap {rows[-1].longest_gap_ms:.1f} ms",
                  file=sys.stderr)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| state MB | buffer | save ms (made + written) | longest wait of a 0.5 ms ticker, ms |",
             "| ---: | --- | ---: | ---: |"]
    lines += [f"| {r.size_mb:g} | {r.buffer} | {r.save_ms:.1f} | {r.longest_gap_ms:.1f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="3,30,120", help="state sizes, comma-separated (default 3,30,120)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, help="JSON report")
    args = p.parse_args()
    sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    if not sizes or any(s <= 0 for s in sizes) or args.repeats < 1:
        p.error("--sizes-mb takes positive sizes and --repeats at least 1")
    rows = measure(sizes, args.repeats)
    print(table(rows))
    if args.out:
        write_report(args.out, {"provenance": provenance(), "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
