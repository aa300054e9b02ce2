#!/usr/bin/env python3
"""A client streaming chat completions back to back until stopped (SIGINT/SIGTERM, or --duration), counting
what came back: the load an in-place study runs beside, and the proof that it failed no client request.

A request counts as ok only when its stream ended properly (a finish reason, then `data: [DONE]`); an error
status, an error event, a cut stream or a transport error is a failure, with its first 300 characters kept.

    python scripts/stream_client.py --url http://127.0.0.1:8000/v1 --out results/client.json &
    ...; kill -INT %1     # writes the summary and exits
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from measure.sse import StreamError, interpret_chunk, iter_sse_data  # noqa: E402


def one_stream(http: httpx.Client, url: str, n: int, max_tokens: int) -> int:
    """One streamed chat completion; the completion tokens it reported. Raises on anything but a whole stream."""
    body = {"messages": [{"role": "user", "content": f"Client request {n}: tell me about lighthouses."}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", f"{url}/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise StreamError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}")
        finished, done, tokens = False, False, 0
        for data in iter_sse_data(resp.iter_lines()):
            if data.strip() == "[DONE]":
                done = True
                break
            info = interpret_chunk(data, chat=True)
            finished = finished or info.finish_reason is not None
            if info.usage is not None and info.usage.completion_tokens is not None:
                tokens = info.usage.completion_tokens
    if not (finished and done):
        raise StreamError(f"the stream was cut (finish reason seen: {finished}, [DONE] seen: {done})")
    return tokens


def run(url: str, max_tokens: int, stop: threading.Event) -> dict[str, Any]:
    ok, tokens, failures, started = 0, 0, Counter[str](), time.time()
    with httpx.Client(timeout=httpx.Timeout(600, connect=10), trust_env=False) as http:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                tokens += one_stream(http, url, n, max_tokens)
                ok += 1
            except (StreamError, httpx.HTTPError, ValueError) as exc:
                failures[f"{type(exc).__name__}: {exc}"[:300]] += 1
                stop.wait(0.5)
    return {"url": url, "started": started, "seconds": round(time.time() - started, 1), "ok": ok,
            "failed": sum(failures.values()), "tokens": tokens, "failures": dict(failures)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--duration", type=float, help="stop after this many seconds (default: until a signal)")
    parser.add_argument("--out", type=Path, help="write the summary as JSON here too")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.duration:
        threading.Timer(args.duration, stop.set).start()
    summary = run(args.url, args.max_tokens, stop)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
