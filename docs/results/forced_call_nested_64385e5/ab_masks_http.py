#!/usr/bin/env python3
"""Streamed through the OpenAI routes (the app as the replica composes it, uvicorn in this process, one engine):
forced place_order call vs the same request with the tool offered and nothing forced (ignore_eos, as many
tokens), and json_schema (ORDER) vs the same question unconstrained; each with the guide's mask on a worker
thread (old: 9c47bf4's guided.py) and on the step thread after the decode launch (new), in one process,
rotated each round. Decode rate: the stream's own timings.predicted_per_second (the engine's clock).

    git show 9c47bf4:serving/engine/guided.py > /tmp/old_guided.py
    python docs/results/forced_call_nested_64385e5/ab_masks_http.py /tmp/old_guided.py --rounds 20 --out ab_http.json
"""

from __future__ import annotations
import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE))
from serving.engine import llama  # noqa
from serving.engine import guided  # noqa
import httpx
import uvicorn
from measure.constrained import ORDER, PLACE_ORDER
from measure.design import median_interval, rotated
from measure.provenance import provenance
from serving.engine.config import THREADS_ENV, EngineConfig
from serving.engine.core import Engine
from ab_masks import load_old, use


class Host:
    def __init__(self, engine):
        from serving.openai.routes import OpenAIRoutes, build_api
        from serving.replica.metrics import ReplicaMetrics

        self.engine = engine
        self.metrics = ReplicaMetrics("ab", "ab")
        self.api = build_api(OpenAIRoutes(self).router())

    def ready_engine(self):
        return self.engine

    @contextlib.asynccontextmanager
    async def engine_turn(self):
        yield self.engine

    def stream_spacing(self):
        return 0.0


QUESTION = "Order two red A1 widgets and one B7 gadget for Alice."

MODEL = {"id": "m"}


def body(mode, n, twin_tokens=None, temperature=0.0):
    b = {
        "model": MODEL["id"],
        "messages": [{"role": "user", "content": f"(request {n}) {QUESTION}"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 160,
        "temperature": temperature,
        "seed": n,
    }
    if mode == "tool_call_nested":
        b["tools"] = [PLACE_ORDER]
        if twin_tokens is None:
            b["tool_choice"] = {"type": "function", "function": {"name": "place_order"}}
    elif twin_tokens is None:
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
    if twin_tokens is not None:
        b["max_tokens"], b["ignore_eos"] = twin_tokens, True
    return b


def stream(client, url, b):
    timings = usage = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=b) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event)
            if event.get("usage"):
                usage, timings = event["usage"], event.get("timings")
    return {"decode_tok_s": timings["predicted_per_second"], "tokens": usage["completion_tokens"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    old, OldMasks = load_old(a.old)
    engine = Engine(EngineConfig(n_parallel=1, n_ctx=2048, seed=1, cache_ram_mib=0))
    ctx, old_masks = engine._ctx, OldMasks()
    host = Host(engine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(host.api, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    arms = [(m, w) for m in ("json_schema_nested", "tool_call_nested") for w in ("old", "new")]
    rows = {arm: [] for arm in arms}
    with httpx.Client(timeout=600, trust_env=False) as client:
        MODEL["id"] = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        for m, w in arms:
            use(ctx, w, old, old_masks)
            stream(client, url, body(m, 0))
        for r in range(a.rounds):
            for m, w in rotated(arms, r):
                use(ctx, w, old, old_masks)
                engine.erase_slot(0)
                c = stream(client, url, body(m, r + 1, temperature=a.temperature))
                engine.erase_slot(0)
                t = stream(client, url, body(m, r + 1, c["tokens"], a.temperature))
                rows[(m, w)].append({"constrained": c, "twin": t})
            print(
                f"round {r + 1}: "
                + ", ".join(
                    f"{m}/{w} {rows[(m, w)][-1]['constrained']['decode_tok_s']:.1f}/"
                    f"{rows[(m, w)][-1]['twin']['decode_tok_s']:.1f}"
                    for m, w in arms
                ),
                flush=True,
            )
    server.should_exit = True
    use(ctx, "new", old, old_masks)
    out = {
        "provenance": provenance(),
        "rounds": a.rounds,
        "temperature": a.temperature,
        "threads_env": os.environ.get(THREADS_ENV),
        "modes": {},
    }
    for m in ("json_schema_nested", "tool_call_nested"):
        res = {}
        for w in ("old", "new"):
            each = sorted(x["constrained"]["decode_tok_s"] / x["twin"]["decode_tok_s"] for x in rows[(m, w)])
            res[w] = {"median": statistics.median(each), "ci95": median_interval(each), "each": each}
        each = sorted(
            y["constrained"]["decode_tok_s"] / x["constrained"]["decode_tok_s"]
            for x, y in zip(rows[(m, "old")], rows[(m, "new")], strict=False)
        )
        res["new_over_old"] = {"median": statistics.median(each), "ci95": median_interval(each)}
        res["runs"] = {w: rows[(m, w)] for w in ("old", "new")}
        out["modes"][m] = res
        print(m, {k: (round(v["median"], 3), v["ci95"]) for k, v in res.items() if k != "runs"})
    a.out.write_text(json.dumps(out, indent=1, default=str))
    engine.close()


if __name__ == "__main__":
    main()
