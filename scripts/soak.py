#!/usr/bin/env python3
"""Bounded loopback soak of the Serve app: overload, dropped streams, a live config switch, a penalised
request among greedy ones, and a SIGKILLed replica, with /health polled throughout.

The script starts the app itself (measure/loopback.py: a private Ray cluster, the HTTP proxy on
127.0.0.1 and a free port, the app as `serve run serving.app:main` builds it, on the embedded CPU model by
default), runs the phases in order, and writes `summary.json` and `summary.md` to --out. Every request has a
timeout, every loop a count and a deadline; the script stops by itself and exits 1 when a phase fails.

Phases (see docs/robustness.md for what each one proves):

* overload    --overload-clients (96) concurrent clients on 4 slots: every answer is 200 or a 503 with OpenAI
                error JSON; streamed 200s end with [DONE] and carry no error event.
* disconnects --drop-streams (200) streams read for a few events and closed, in waves; then every slot and
                the queue drain (no slot leaked) and requests_cancelled rose.
* switch      4 clients stream while the config is switched live on the ConfigChannel (n_parallel 4 -> 2,
                n_batch, back): 0 failed requests and /slots shows each new config.
* penalised   one request with repeat/frequency/presence penalties among greedy ones: all 200, text, no error.
* kill        the replica's process SIGKILLed under 8-way load: clients see OpenAI error JSON or an error
                event + [DONE] in a cut stream (no hang, no plain-text 500), and
                /health + a probe completion recover within --recovery-bound-s. Recovery time: from the kill
                to the first successful completion of a request sent after it (a client's or the probe's).

* node-loss   (not in the default run: it starts a cluster of its own) a Ray cluster of two nodes on this
                machine (measure/cluster.py: a head and a second raylet, one GPU each by declaration), the app
                on it by `serve run` of configs/serve.yaml with num_replicas=auto (a replica on each node);
                the second node's raylet SIGKILLed under --kill-clients load: the same criteria as kill (clean
                errors, no hang), /health of that app `degraded` while the node is gone, the node started again,
                and both replicas serving again within --recovery-bound-s with the config the other serves.
* study-node-loss (opt-in too) the same cluster and app; an in-place study (python -m tuning.search --in-place,
                --study-trials trials) runs over both replicas under 2-way client load, and the second node's
                raylet is SIGKILLed after its first trial: the tuner exits 0 within --study-bound-s with the pick
                applied to the surviving replica (a trial lost with the node fails, the study goes on), clients
                see only clean errors (no hang), the survivor serves, and the node back, both replicas serve one
                config.

/health is polled every --health-interval-s by a thread: each answer must be 200 (a 500/503 is tolerated only
while the replica is down in the kill phase) in under 1 s.

    python scripts/soak.py                                  # all phases, results/soak/
    python scripts/soak.py --phases overload,kill --out /tmp/soak n_parallel=4 n_ctx=4096
    python scripts/soak.py model=/models/x.gguf n_parallel=8 --overload-clients 192

Trailing KEY=VALUE words are passed to serving.app:main like `serve run` does (defaults: config=
configs/default.yaml n_parallel=4 n_ctx=4096).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import yaml  # noqa: E402

from measure.cluster import ClusterApp, LocalCluster, all_serving  # noqa: E402
from measure.loopback import APP_NAME, REPO_ROOT, LoopbackApp, parse_overrides  # noqa: E402
from measure.provenance import git_commit, machine_info  # noqa: E402
from measure.soak import (  # noqa: E402
    HEALTH_BOUND_S, HealthPoller, Outcome, describe, judge_all_ok, judge_health, judge_kill, judge_overload,
    request_body, rounded, send, summarize,
)

PHASES = ("overload", "disconnects", "switch", "penalised", "kill")  # the default run
OPT_IN_PHASES = ("node-loss", "study-node-loss")
STUDY_SPACE = {"n_parallel": [1, 2], "n_batch": [128, 256], "n_ubatch": [128, 256], "ctx_per_slot": [512],
               "type_k": ["f16"], "type_v": ["f16"], "flash_attn": ["on"]}  # small: a CPU trial is seconds
FIRST_TRIAL = "the first trial held its replica"  # the tuner's line after its first measured trial
LOST_TRIAL = "the replica running this trial was lost"  # tuning/inplace.py's words for it
PROMPTS = [
    "Write one sentence about the sea.",
    "Name three colours.",
    "What is a river?",
    "Tell me a fact about the moon.",
    "Describe a cat in a few words.",
    "Why is the sky blue?",
    "Give me a short greeting.",
    "What do bees make?",
]


def publish_config(engine: dict[str, Any], timeout_s: float) -> Any:
    """Publish an engine config live on the loopback app, as the tuner's write-back does, and wait for every
    replica's ack (the switch phase runs the tuner's own path, not a copy of it)."""
    from serving.engine.config import EngineConfig
    from tuning.writeback import apply_to_serve

    return apply_to_serve(EngineConfig(**engine), app_name=APP_NAME, timeout_s=timeout_s)


# -- the soak -------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PhaseResult:
    name: str
    criterion: str
    passed: bool = False
    duration_s: float = 0.0
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    health: dict[str, Any] = dataclasses.field(default_factory=dict)
    t0: float = 0.0
    t1: float = 0.0
    down: tuple[float, float] | None = None


class Soak:
    def __init__(self, app: LoopbackApp, args: argparse.Namespace) -> None:
        self.app, self.args, self.base = app, args, app.url
        self.rng = random.Random(args.seed)
        self.poller: HealthPoller | None = None
        self.log_lines: list[str] = []

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log_lines.append(line)

    def client(self, read_s: float = 60.0, connections: int = 256) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=httpx.Timeout(read_s, connect=10.0),
                                 limits=httpx.Limits(max_connections=connections, max_keepalive_connections=32))

    async def slots(self, http: httpx.AsyncClient) -> dict[str, Any] | None:
        try:
            r = await asyncio.wait_for(http.get(f"{self.base}/slots"), 10)
            return r.json() if r.status_code == 200 else None
        except (TimeoutError, httpx.HTTPError, ValueError):
            return None

    async def wait_drained(self, http: httpx.AsyncClient, deadline_s: float) -> tuple[bool, dict[str, Any] | None, float]:
        """Poll /slots until no slot is busy and nothing is queued; (drained, last snapshot, seconds waited)."""
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < deadline_s:
            snap = await self.slots(http)
            if snap is not None:
                last = snap
                if snap["slots_busy"] == 0 and snap["queue_depth"] == 0:
                    return True, snap, time.monotonic() - t0
            await asyncio.sleep(0.25)
        return False, last, time.monotonic() - t0

    def pick(self, i: int) -> tuple[str, bool, str]:
        kind = "chat" if i % 2 == 0 else "completion"
        stream = (i // 2) % 2 == 0
        return kind, stream, f"[{i}] {PROMPTS[i % len(PROMPTS)]}"

    async def load_loop(self, http: httpx.AsyncClient, i: int, stop: asyncio.Event, out: list[Outcome],
                        max_requests: int, max_tokens: int = 24, total_s: float = 60.0,
                        pause_on_error_s: float = 0.2, only_stream: bool = False, base: str | None = None) -> None:
        """One client: requests back to back until `stop` (bounded by `max_requests`), to `base` (the app)."""
        for n in range(max_requests):
            if stop.is_set():
                return
            kind, stream, prompt = self.pick(i + n)
            stream = True if only_stream else stream
            o = await send(http, base or self.base, kind,
                           request_body(kind, prompt, max_tokens, stream, temperature=0.7), total_s=total_s)
            out.append(o)
            if not o.ok:
                await asyncio.sleep(pause_on_error_s)

    # -- phases ------------------------------------------------------------------------------------------
    async def overload(self, res: PhaseResult) -> None:
        a = self.args
        outcomes: list[Outcome] = []
        async with self.client(read_s=a.request_timeout_s, connections=a.overload_clients + 16) as http:
            async def client(i: int) -> None:
                for n in range(a.overload_requests):
                    kind, stream, prompt = self.pick(i + n * a.overload_clients)
                    body = request_body(kind, prompt, self.rng.randint(16, 32), stream, temperature=0.7)
                    outcomes.append(await send(http, self.base, kind, body, total_s=a.request_timeout_s))

            await asyncio.gather(*(client(i) for i in range(a.overload_clients)))
            drained, snap, waited = await self.wait_drained(http, 60)
        res.stats = summarize(outcomes)
        res.stats["retry_after_on_503"] = sorted({str(o.retry_after) for o in outcomes if o.status == 503})
        starts = [o.t_start for o in outcomes]
        res.stats["client_start_spread_s"] = rounded(max(starts) - min(starts), 2) if starts else None
        res.stats["drained_after_s"] = rounded(waited, 1) if drained else None
        res.failures, res.warnings = judge_overload(outcomes)
        if not drained:
            res.failures.append(f"slots/queue not drained 60 s after the burst: {_slot_brief(snap)}")
        examples_503 = [o.body for o in outcomes if o.status == 503][:1]
        if examples_503:
            res.stats["example_503_body"] = examples_503[0]

    async def disconnects(self, res: PhaseResult) -> None:
        a = self.args
        outcomes: list[Outcome] = []
        async with self.client(read_s=a.request_timeout_s) as http:
            before = await self.slots(http)
            sent = 0
            wave = 0
            while sent < a.drop_streams:
                n = min(a.drop_wave, a.drop_streams - sent)
                tasks = []
                for j in range(n):
                    kind = "chat" if (sent + j) % 2 == 0 else "completion"
                    body = request_body(kind, f"[{sent + j}] Write a long story about a lighthouse keeper.",
                                        256, True, temperature=0.8, ignore_eos=True)
                    tasks.append(send(http, self.base, kind, body, total_s=a.request_timeout_s,
                                      drop_after=self.rng.randint(1, 4)))
                outcomes += await asyncio.gather(*tasks)
                sent += n
                wave += 1
                if wave % 5 == 0:
                    self.log(f"  disconnects: {sent}/{a.drop_streams} streams dropped")
            drained, after, waited = await self.wait_drained(http, a.drain_deadline_s)
            # every slot still usable: n_parallel requests at once, all complete
            n_par = len((after or before or {}).get("slots", [])) or 4
            probes = await asyncio.gather(*(send(http, self.base, "completion",
                                                 request_body("completion", f"[{k}] Count to five:", 8, False),
                                                 total_s=a.request_timeout_s) for k in range(n_par)))
        dropped = sum(o.dropped for o in outcomes)
        cancelled = None
        if before and after:
            cancelled = after["counters"]["requests_cancelled"] - before["counters"]["requests_cancelled"]
        res.stats = {**summarize(outcomes), "dropped_by_client": dropped, "requests_cancelled_delta": cancelled,
                     "drained": drained, "drained_after_s": rounded(waited, 1), "slots_after": _slot_brief(after),
                     "probe_requests_ok": f"{sum(o.ok for o in probes)}/{len(probes)}"}
        # a dropped stream's status was 200 and it had events; anything else (a 503, an error) is listed
        res.failures += [describe(o) for o in outcomes if not o.dropped and not o.ok]
        if not drained:
            res.failures.append(f"slot leak: {_slot_brief(after)} {a.drain_deadline_s:.0f} s after the last drop")
        if cancelled is None:
            res.failures.append("could not read /slots counters before/after")
        elif cancelled < 1:
            res.failures.append(f"requests_cancelled did not rise ({cancelled}) after {dropped} dropped streams")
        elif cancelled < dropped:
            res.warnings.append(f"requests_cancelled rose by {cancelled}, fewer than the {dropped} dropped streams "
                                "(some may have finished first)")
        res.failures += [f"probe after drops: {describe(o)}" for o in probes if not o.ok]

    async def switch(self, res: PhaseResult) -> None:
        a = self.args
        outcomes: list[Outcome] = []
        switches: list[dict[str, Any]] = []
        async with self.client(read_s=a.request_timeout_s) as http:
            snap = await self.slots(http)
            if snap is None:
                res.failures.append("/slots unreadable before the switch")
                return
            base_cfg = dict(snap["config"])
            n_par = base_cfg["n_parallel"]
            plan = [{"n_parallel": max(1, n_par // 2)}, {"n_batch": 512, "n_ubatch": 256},
                    {"n_parallel": n_par, "n_batch": base_cfg["n_batch"], "n_ubatch": base_cfg["n_ubatch"]}]
            stop = asyncio.Event()
            clients = [asyncio.create_task(self.load_loop(http, i, stop, outcomes, max_requests=400,
                                                          total_s=a.request_timeout_s))
                       for i in range(a.switch_clients)]
            try:
                await asyncio.sleep(a.switch_settle_s)
                cfg = base_cfg
                for change in plan:
                    cfg = {**cfg, **change}
                    done_before = len(outcomes)
                    t0 = time.monotonic()
                    try:
                        result = await asyncio.wait_for(
                            asyncio.to_thread(publish_config, cfg, a.switch_timeout_s), a.switch_timeout_s + 30)
                        applied, message = result.applied, result.message
                    except Exception as exc:  # noqa: BLE001  (recorded as a failure)
                        applied, message = False, f"{type(exc).__name__}: {exc}"
                    took = time.monotonic() - t0
                    now = await self.slots(http)
                    shown = {k: (now or {}).get("config", {}).get(k) for k in change}
                    n_slots = len((now or {}).get("slots", []))
                    ok = applied and shown == change and n_slots == cfg["n_parallel"]
                    switches.append({"change": change, "applied": applied, "message": message,
                                     "seconds": rounded(took, 2), "slots_config": shown, "slots": n_slots,
                                     "requests_meanwhile": len(outcomes) - done_before, "ok": ok})
                    self.log(f"  switch {change}: applied={applied} in {took:.1f} s; /slots shows {shown}, "
                             f"{n_slots} slots ({message})")
                    if not ok:
                        res.failures.append(f"switch {change} not in effect: applied={applied} ({message}); "
                                            f"/slots shows {shown} with {n_slots} slots")
                    await asyncio.sleep(a.switch_settle_s)
            finally:
                stop.set()
                await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), a.request_timeout_s + 10)
        res.stats = {**summarize(outcomes), "switches": switches}
        res.failures += judge_all_ok(outcomes)

    async def penalised(self, res: PhaseResult) -> None:
        a = self.args
        outcomes: list[Outcome] = []
        penal = {"temperature": 0, "repeat_penalty": 1.3, "frequency_penalty": 0.8, "presence_penalty": 0.6,
                 "repeat_last_n": 64}
        async with self.client(read_s=a.request_timeout_s) as http:
            baseline = await send(http, self.base, "chat",
                                  request_body("chat", PROMPTS[0], 32, False, temperature=0), total_s=a.request_timeout_s)
            same = 0
            for stream in (False, True):
                tasks = []
                for i in range(a.penalised_greedy):
                    prompt = PROMPTS[0] if i == 0 else PROMPTS[i % len(PROMPTS)]
                    tasks.append(send(http, self.base, "chat", request_body("chat", prompt, 32, stream, temperature=0),
                                      total_s=a.request_timeout_s))
                tasks.insert(a.penalised_greedy // 2,
                             send(http, self.base, "chat", request_body("chat", PROMPTS[1], 48, stream, **penal),
                                  total_s=a.request_timeout_s))
                got = await asyncio.gather(*tasks)
                outcomes += got
                same += int(got[0].ok and baseline.ok and got[0].text == baseline.text)
        res.stats = {**summarize(outcomes),
                     "greedy_repeat_identical_to_solo": f"{same}/2 (information: batched greedy vs the same request alone)"}
        res.failures += judge_all_ok([baseline] + outcomes, need_text=True)

    async def kill(self, res: PhaseResult) -> None:
        a = self.args
        outcomes: list[Outcome] = []
        async with self.client(read_s=a.kill_request_timeout_s) as http:
            stop = asyncio.Event()
            clients = [asyncio.create_task(self.load_loop(http, i, stop, outcomes, max_requests=2000,
                                                          total_s=a.kill_request_timeout_s, pause_on_error_s=0.25))
                       for i in range(a.kill_clients)]
            t_kill = t_health = t_recovered = None
            old_pids = new_pids = []
            try:
                await asyncio.sleep(a.kill_warmup_s)
                warm_deadline = time.monotonic() + 60  # kill a replica that is serving, not one still warming up
                while sum(o.ok for o in outcomes) < a.kill_clients and time.monotonic() < warm_deadline:
                    await asyncio.sleep(0.25)
                old_pids = self.app.replica_pids()
                pid = self.app.kill_replica()
                t_kill = time.monotonic()
                self.log(f"  SIGKILL replica pid {pid} under {a.kill_clients}-way load "
                         f"({sum(o.ok for o in outcomes)} requests done before)")
                async with self.client(read_s=10) as probe:
                    while time.monotonic() - t_kill < a.recovery_bound_s:
                        try:
                            h = await asyncio.wait_for(probe.get(f"{self.base}/health"), 5)
                            healthy = h.status_code == 200
                        except (TimeoutError, httpx.HTTPError):
                            healthy = False
                        if healthy and t_health is None:
                            t_health = time.monotonic()
                        if healthy:
                            o = await send(probe, self.base, "completion",
                                           request_body("completion", "Recovery check:", 4, False), total_s=20)
                            if o.ok:
                                t_recovered = time.monotonic()
                                break
                        await asyncio.sleep(0.25)
                new_pids = self.app.replica_pids()
                if t_recovered is not None:
                    assert t_health is not None  # a probe completion is only sent once /health said 200
                    self.log(f"  probe completion ok {t_recovered - t_kill:.1f} s after the kill (/health 200 after "
                             f"{t_health - t_kill:.1f} s); replica pids {old_pids} -> {new_pids}")
                    await asyncio.sleep(a.kill_after_s)
            finally:
                stop.set()
                await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True),
                                       a.kill_request_timeout_s + 10)
        res.down = (t_kill, t_recovered if t_recovered is not None else time.monotonic()) if t_kill else None
        failures, seen = judge_kill(outcomes, t_kill or 0.0)
        errors = Counter(describe(o) for o in outcomes if not o.ok)
        # service restored: the first request started after the kill that succeeded (a client's or the probe's)
        firsts = [o.t_start + o.latency_s for o in outcomes if t_kill and o.t_start >= t_kill and o.ok]
        if t_recovered is not None:
            firsts.append(t_recovered)
        t_served = min(firsts) if firsts and t_kill else None
        res.stats = {**summarize(outcomes), **seen,
                     "recovery_s": rounded(t_served - t_kill, 1) if t_served else None,
                     "probe_ok_after_s": rounded(t_recovered - t_kill, 1) if t_recovered and t_kill else None,
                     "health_200_after_s": rounded(t_health - t_kill, 1) if t_health and t_kill else None,
                     "replica_pids_before": old_pids, "replica_pids_after": new_pids,
                     "failed_after_recovery": (sum(not o.ok for o in outcomes if o.t_start >= t_recovered)
                                               if t_recovered else None),
                     "errors_seen": [f"{n}x {e}" for e, n in errors.most_common(10)]}
        res.failures += failures
        if t_recovered and res.stats["failed_after_recovery"]:
            res.failures.append(f"{res.stats['failed_after_recovery']} request(s) started after the recovery failed")
        if t_kill is None:
            res.failures.append("the replica could not be killed")
        elif t_recovered is None:
            res.failures.append(f"no recovery within {a.recovery_bound_s:.0f} s (/health 200 and a completion)")

    async def node_loss(self, res: PhaseResult) -> None:
        a = self.args
        cluster = await asyncio.to_thread(LocalCluster.start, 1, 2, 1)
        work = Path(tempfile.mkdtemp(prefix="soak-cluster-"))
        app = ClusterApp(cluster, work, {**self.app.app_args, "num_replicas": "auto", "cpus_per_replica": 0.5})
        outcomes: list[Outcome] = []
        try:
            await asyncio.to_thread(app.wait, all_serving(2), "two replicas serving", a.recovery_bound_s + 180)
            before = {json.dumps(r["config"], sort_keys=True) for r in (await asyncio.to_thread(app.slots))["replicas"]}
            self.log(f"  app on {cluster.address}: a replica on each of {cluster.nodes}")
            async with self.client(read_s=a.kill_request_timeout_s) as http:
                stop = asyncio.Event()
                clients = [asyncio.create_task(self.load_loop(http, i, stop, outcomes, max_requests=2000,
                                                              total_s=a.kill_request_timeout_s,
                                                              pause_on_error_s=0.25, base=app.url))
                           for i in range(a.kill_clients)]
                try:
                    await asyncio.sleep(a.kill_warmup_s)
                    lost = cluster.nodes[-1]
                    cluster.kill_node(lost)
                    t_kill = time.monotonic()
                    self.log(f"  SIGKILL the raylet of {lost} under {a.kill_clients}-way load "
                             f"({sum(o.ok for o in outcomes)} requests done before)")
                    await asyncio.to_thread(app.wait, lambda h: h.get("status") == "degraded", "degraded", 60)
                    t_degraded = time.monotonic()
                    await asyncio.sleep(a.kill_after_s)  # served by the survivor meanwhile
                    await asyncio.to_thread(cluster.add_node, 1, 2)
                    t_rejoined = time.monotonic()
                    await asyncio.to_thread(app.wait, all_serving(2), "both replicas back", a.recovery_bound_s)
                    t_back = time.monotonic()
                    await asyncio.sleep(a.kill_after_s)
                finally:
                    stop.set()
                    await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True),
                                           a.kill_request_timeout_s + 10)
            after = {json.dumps(r["config"], sort_keys=True) for r in (await asyncio.to_thread(app.slots))["replicas"]}
        finally:
            app.stop()
            await asyncio.to_thread(cluster.stop)
            shutil.rmtree(work, ignore_errors=True)
        failures, seen = judge_kill(outcomes, t_kill)
        errors = Counter(describe(o) for o in outcomes if not o.ok)
        res.stats = {**summarize(outcomes), **seen, "degraded_after_s": rounded(t_degraded - t_kill, 1),
                     "node_down_s": rounded(t_rejoined - t_kill, 1), "back_after_rejoin_s": rounded(t_back - t_rejoined, 1),
                     "failed_while_node_lost": sum(not o.ok for o in outcomes if t_kill <= o.t_start < t_back),
                     "errors_seen": [f"{n}x {e}" for e, n in errors.most_common(10)]}
        res.failures += failures
        if after != before:
            res.failures.append(f"the replica that came back serves another config: {after} vs {before}")

    async def study_node_loss(self, res: PhaseResult) -> None:
        a = self.args
        cluster = await asyncio.to_thread(LocalCluster.start, 1, 2, 1)
        work = Path(tempfile.mkdtemp(prefix="soak-study-"))
        app = ClusterApp(cluster, work, {**self.app.app_args, "num_replicas": "auto", "cpus_per_replica": 0.5})
        outcomes: list[Outcome] = []
        try:
            await asyncio.to_thread(app.wait, all_serving(2), "two replicas serving", a.recovery_bound_s + 180)
            async with self.client(read_s=a.request_timeout_s) as http:
                stop = asyncio.Event()
                clients = [asyncio.create_task(self.load_loop(http, i, stop, outcomes, max_requests=2000,
                                                              total_s=a.request_timeout_s, pause_on_error_s=1.0,
                                                              base=app.url)) for i in range(2)]
                try:
                    t_kill, code, output, tuner_s = await self._study_losing_a_node(cluster, work)
                    probe = await send(http, app.url, "completion", request_body("completion", "Count: 1 2 3", 8,
                                                                                 False), total_s=60)
                    await asyncio.to_thread(cluster.add_node, 1, 2)
                    await asyncio.to_thread(app.wait, all_serving(2), "both replicas back", a.recovery_bound_s)
                finally:
                    stop.set()
                    await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True),
                                           a.request_timeout_s + 10)
            configs = {json.dumps(r["config"], sort_keys=True) for r in (await asyncio.to_thread(app.slots))["replicas"]}
        finally:
            app.stop()
            await asyncio.to_thread(cluster.stop)
        report = work / "lost" / "report.md"
        lost = report.read_text().count(LOST_TRIAL) if report.exists() else 0
        shutil.rmtree(work, ignore_errors=True)
        failures, seen = judge_kill(outcomes, t_kill)
        res.stats = {**summarize(outcomes), **seen, "tuner_exit": code, "tuner_s": rounded(tuner_s, 1),
                     "report_rows_lost_with_the_node": lost, "survivor_probe": probe.label}
        res.failures += failures
        if code != 0 or "live apply: applied to" not in output:
            res.failures.append(f"the study did not end cleanly (exit {code}): {output[-1500:]}")
        if not probe.ok:
            res.failures.append(f"the surviving replica did not serve: {describe(probe)}")
        if len(configs) != 1:
            res.failures.append(f"the replicas serve different configs after the study: {configs}")

    async def _study_losing_a_node(self, cluster: LocalCluster, work: Path) -> tuple[float, int | None, str, float]:
        """The in-place study on the cluster's app, the second node's raylet killed after its first trial: the kill's
        time, the tuner's exit code (None: it did not end within --study-bound-s, then killed), its output, and its
        run time."""
        a = self.args
        (work / "space.yaml").write_text(yaml.safe_dump(STUDY_SPACE))
        log = work / "tuner.log"
        command = [sys.executable, "-m", "tuning.search", "--in-place", "--trials", str(a.study_trials), "--app-name",
                   APP_NAME, "--space", str(work / "space.yaml"), "--gen-tokens", "16", "--repeats", "1",
                   "--min-ctx-per-slot", "512", "--confirm-rounds", "0", "--results-dir", str(work), "--out",
                   str(work / "tuned.yaml"), "--study-name", "lost", "--workload", "benchmark"]
        t0 = time.monotonic()
        with log.open("wb") as out:
            tuner = subprocess.Popen(command, cwd=REPO_ROOT, env=cluster.env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while FIRST_TRIAL not in log.read_text() and tuner.poll() is None and time.monotonic() - t0 < a.study_bound_s:
                await asyncio.sleep(1)
            cluster.kill_node(cluster.nodes[-1])
            t_kill = time.monotonic()
            self.log("  SIGKILL the raylet of the second node after the study's first trial")
            code: int | None = await asyncio.to_thread(tuner.wait, max(a.study_bound_s - (t_kill - t0), 1))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if tuner.poll() is None:
                tuner.kill()
        return t_kill, code, log.read_text(), time.monotonic() - t0

    # -- driver --------------------------------------------------------------------------------------------
    async def run_phase(self, name: str, fn: Callable[[PhaseResult], Awaitable[None]], criterion: str,
                        bound_s: float) -> PhaseResult:
        res = PhaseResult(name, criterion)
        self.log(f"phase {name}: {criterion}")
        assert self.poller is not None
        self.poller.phase = name
        res.t0 = time.monotonic()
        try:
            await asyncio.wait_for(fn(res), bound_s)
        except TimeoutError:
            res.failures.append(f"phase did not finish within its bound of {bound_s:.0f} s")
        except Exception as exc:  # noqa: BLE001  (a crash of the phase is a failed phase, the soak goes on)
            res.failures.append(f"phase crashed: {type(exc).__name__}: {exc}")
        res.t1 = time.monotonic()
        self.poller.phase = f"after-{name}"
        res.duration_s = round(res.t1 - res.t0, 1)
        samples = [s for s in self.poller.samples if res.t0 <= s.t <= res.t1]
        res.health = judge_health(samples, down=res.down)
        if not res.health["passed"]:
            res.failures.append(f"/health: {res.health['violations']} of {res.health['polls']} polls bad, e.g. "
                                f"{res.health['examples'][:3]}")
        res.passed = not res.failures
        self.log(f"phase {name}: {'PASS' if res.passed else 'FAIL'} in {res.duration_s} s; "
                 f"{json.dumps(_brief_stats(res.stats))}; /health p50 {res.health['p50_s']} s "
                 f"p99 {res.health['p99_s']} s max {res.health['max_s']} s")
        for f in res.failures[:12]:
            self.log(f"    failure: {f}")
        for w in res.warnings[:5]:
            self.log(f"    warning: {w}")
        return res

    async def run(self, phases: list[str]) -> list[PhaseResult]:
        a = self.args
        spec = {
            "overload": (self.overload, f"{a.overload_clients} clients x {a.overload_requests} requests on the "
                         "slots: every answer 200 or a 503 with OpenAI error JSON; streams end with [DONE]", 600),
            "disconnects": (self.disconnects, f"{a.drop_streams} streams dropped mid-way in waves of {a.drop_wave}: "
                            "no slot leaked, requests_cancelled rose", 600),
            "switch": (self.switch, f"{a.switch_clients} clients streaming through live config switches: "
                       "0 failed requests, /slots shows each new config", 600),
            "penalised": (self.penalised, "one penalised request among greedy ones, streamed and not: all 200 "
                          "with text", 300),
            "kill": (self.kill, f"replica SIGKILLed under {a.kill_clients}-way load: clean HTTP errors, no hang, "
                     f"recovery within {a.recovery_bound_s:.0f} s", a.recovery_bound_s + 300),
            "node-loss": (self.node_loss, f"a node of two SIGKILLed under {a.kill_clients}-way load: clean HTTP "
                          "errors, no hang, /health degraded, both replicas back with the same config within "
                          f"{a.recovery_bound_s:.0f} s of the node's return", 2 * a.recovery_bound_s + 600),
            "study-node-loss": (self.study_node_loss, "a node of two SIGKILLed during an in-place study under 2-way "
                                "load: the tuner exits 0 with the pick applied to the survivor, clean HTTP errors, "
                                "no hang, one config on both replicas once the node is back",
                                a.study_bound_s + 2 * a.recovery_bound_s + 600),
        }
        results = []
        for name in phases:
            fn, criterion, bound = spec[name]
            results.append(await self.run_phase(name, fn, criterion, bound))
        return results


def _slot_brief(snap: dict[str, Any] | None) -> str:
    if not snap:
        return "unknown (/slots unreadable)"
    states = Counter(s["state"] for s in snap.get("slots", []))
    return f"slots_busy={snap.get('slots_busy')} queue_depth={snap.get('queue_depth')} states={dict(states)}"


def _brief_stats(stats: dict[str, Any]) -> dict[str, Any]:
    keep = ("requests", "ok", "statuses", "recovery_s", "requests_cancelled_delta", "drained")
    return {k: stats[k] for k in keep if k in stats}


# -- reporting ------------------------------------------------------------------------------------------
def write_summary(out_dir: Path, meta: dict[str, Any], results: list[PhaseResult], health_all: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {**meta, "passed": bool(results) and all(r.passed for r in results) and "error" not in meta,
           "health_all": health_all,
           "phases": [{k: v for k, v in dataclasses.asdict(r).items() if k not in ("t0", "t1", "down")}
                      for r in results]}
    (out_dir / "summary.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out_dir / "summary.md").write_text(markdown(doc))


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"Soak run {doc['date']} on commit {doc['commit']}, {doc['machine']['cpu']} "
             f"({doc['machine']['cpus']} CPUs); `{doc['command']}`; app {doc['app_args']}; "
             f"total {doc['total_s']} s. Overall: **{'PASS' if doc['passed'] else 'FAIL'}**.", "",
             "| phase | result | requests | statuses | /health p50 / p99 / max (s) | notes |",
             "| --- | --- | --- | --- | --- | --- |"]
    for p in doc["phases"]:
        s, h = p["stats"], p["health"]
        notes = []
        for key in ("recovery_s", "health_200_after_s", "probe_ok_after_s", "failed_after_recovery",
                    "degraded_after_s", "node_down_s", "back_after_rejoin_s", "failed_while_node_lost",
                    "requests_cancelled_delta", "dropped_by_client",
                    "drained_after_s", "retry_after_on_503", "greedy_repeat_identical_to_solo"):
            if key in s:
                notes.append(f"{key}={s[key]}")
        if "switches" in s:
            notes += [f"switch {w['change']}: {'ok' if w['ok'] else 'FAILED'} in {w['seconds']} s" for w in s["switches"]]
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(s.get("statuses", {}).items()))
        lines.append(f"| {p['name']} | {'PASS' if p['passed'] else 'FAIL'} | {s.get('requests', '')} | {statuses} | "
                     f"{h.get('p50_s')} / {h.get('p99_s')} / {h.get('max_s')} | {'; '.join(notes)} |")
    h = doc["health_all"]
    lines += ["", f"/health over the whole run: {h['polls']} polls, statuses {h['statuses']}, p50 {h['p50_s']} s, "
              f"p99 {h['p99_s']} s, max {h['max_s']} s, {h['over_bound']} at or over {HEALTH_BOUND_S:.0f} s."]
    if doc.get("error"):
        lines += ["", f"The run stopped early: `{doc['error']}`"]
    for p in doc["phases"]:
        if p["stats"].get("errors_seen"):
            lines += ["", f"What the {p['name']} phase's clients saw (other than success):"]
            lines += [f"- `{e}`" for e in p["stats"]["errors_seen"]]
        if p["failures"] or p["warnings"]:
            lines += ["", f"**{p['name']}** ({p['criterion']}):"]
            lines += [f"- failure: `{f}`" for f in _dedupe(p["failures"])[:15]]
            lines += [f"- warning: {w}" for w in p["warnings"][:5]]
    return "\n".join(lines) + "\n"


def _dedupe(items: Iterable[str]) -> list[str]:
    counts = Counter(items)
    return [f"{n}x {item}" if n > 1 else item for item, n in counts.items()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="passed to serving.app:main, as serve run does")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, run in this order: {','.join(PHASES)}")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "soak")
    p.add_argument("--port", type=int, default=None, help="HTTP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-timeout-s", type=float, default=180.0, help="hard deadline of each request")
    p.add_argument("--health-interval-s", type=float, default=0.5)
    p.add_argument("--overload-clients", type=int, default=96)
    p.add_argument("--overload-requests", type=int, default=1, help="requests each overload client sends in turn")
    p.add_argument("--drop-streams", type=int, default=200)
    p.add_argument("--drop-wave", type=int, default=8, help="streams opened (and dropped) together")
    p.add_argument("--drain-deadline-s", type=float, default=30.0)
    p.add_argument("--switch-clients", type=int, default=4)
    p.add_argument("--switch-settle-s", type=float, default=4.0, help="load before, between and after switches")
    p.add_argument("--switch-timeout-s", type=float, default=180.0)
    p.add_argument("--penalised-greedy", type=int, default=7, help="greedy requests around the penalised one")
    p.add_argument("--kill-clients", type=int, default=8)
    p.add_argument("--kill-warmup-s", type=float, default=5.0,
                   help="load before the kill (then until --kill-clients requests have succeeded, at most 60 s more)")
    p.add_argument("--kill-after-s", type=float, default=5.0, help="load kept on after recovery")
    p.add_argument("--kill-request-timeout-s", type=float, default=60.0)
    p.add_argument("--recovery-bound-s", type=float, default=120.0)
    p.add_argument("--study-trials", type=int, default=6, help="study-node-loss: the in-place study's trials")
    p.add_argument("--study-bound-s", type=float, default=900.0, help="study-node-loss: the study's bound")
    p.add_argument("--max-total-s", type=float, default=3600.0, help="the whole run's bound; then it exits")
    args = p.parse_args(argv)
    args.phase_list = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = set(args.phase_list) - set(PHASES) - set(OPT_IN_PHASES)
    if unknown:
        p.error(f"unknown phase(s) {sorted(unknown)}; phases are {', '.join(PHASES)}")
    try:
        args.app_args = parse_overrides(args.overrides)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _watchdog(seconds: float) -> None:
    """Exit the process if the run outlives its bound (a stuck driver must not hold the machine)."""
    def fire() -> None:
        print(f"soak: the run exceeded --max-total-s={seconds:.0f}; exiting", flush=True)
        os._exit(3)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _watchdog(args.max_total_s)
    args.out.mkdir(parents=True, exist_ok=True)
    app = LoopbackApp(args.app_args, port=args.port, log_copy_dir=args.out)
    meta: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
            "machine": machine_info(), "command": " ".join(["python", "scripts/soak.py", *(argv or sys.argv[1:])]),
            "app_args": app.app_args}
    t0 = time.monotonic()
    results: list[PhaseResult] = []
    poller = None
    try:
        startup = app.start()
        print(f"app up on {app.url} after {startup:.1f} s (replica pids {app.replica_pids()})", flush=True)
        meta["startup_s"] = round(startup, 1)
        poller = HealthPoller(app.url, args.health_interval_s, args.max_total_s)
        poller.start()
        soak = Soak(app, args)
        soak.poller = poller
        results = asyncio.run(soak.run(args.phase_list))
    except Exception as exc:  # noqa: BLE001  (reported in the summary, exit code 1)
        meta["error"] = f"{type(exc).__name__}: {exc}"
        print(f"soak: {meta['error']}", flush=True)
    finally:
        if poller is not None:
            poller.stop()
        try:
            app.stop()
        except Exception as exc:  # noqa: BLE001
            print(f"soak: stopping the app failed: {exc!r}", flush=True)
    meta["total_s"] = round(time.monotonic() - t0, 1)
    downs = [r.down for r in results if r.down]
    health_all = judge_health(poller.samples if poller else [], down=downs[0] if downs else None)
    write_summary(args.out, meta, results, health_all)
    passed = bool(results) and all(r.passed for r in results) and "error" not in meta
    print(f"soak {'PASSED' if passed else 'FAILED'} in {meta['total_s']} s: "
          + ", ".join(f"{r.name} {'pass' if r.passed else 'FAIL'}" for r in results)
          + f"; summary in {args.out}/summary.md", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
