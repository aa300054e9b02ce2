"""The soak's client side (scripts/soak.py): one request and what the client saw of it, /health polled on a
thread, and the verdicts on a phase's outcomes. Apart from the phases that drive the app, so the judging is
unit-tested on constructed outcomes (tests/test_soak_script.py) without a server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections import Counter
from typing import Any

import httpx

HEALTH_BOUND_S = 1.0  # seconds: a /health answer this slow or slower counts as a violation


# -- one request, and what the client saw ------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    """What one client request ended with."""

    kind: str                      # chat | completion
    stream: bool
    status: int | None = None      # HTTP status; None when none arrived
    error: str | None = None       # transport error / timeout (repr), if any
    latency_s: float = 0.0
    text: str = ""
    events: int = 0                # SSE data events read (streams)
    done: bool = False             # streams: saw data: [DONE]
    error_event: str | None = None  # streams: an {"error": ...} event's message
    openai_error: bool = False     # a non-200 body was OpenAI error JSON
    retry_after: str | None = None
    body: str = ""                 # a non-200 body (truncated)
    dropped: bool = False          # the client closed the stream on purpose
    t_start: float = 0.0           # monotonic
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        """A complete, successful answer."""
        if self.status != 200 or self.error or self.error_event:
            return False
        return self.done if self.stream else True

    @property
    def label(self) -> str:
        """A short class for histograms: the status, or what went wrong instead."""
        if self.status is None:
            return f"no-status:{(self.error or '?').split('(')[0]}"
        if self.status == 200 and self.stream and not self.dropped:
            if self.error_event:
                return "200-error-event"
            if not self.done:
                return "200-truncated"
        return str(self.status)


def is_openai_error(body: Any) -> bool:
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("message"), str))


def parse_sse_data(line: str) -> tuple[str, Any] | None:
    """One SSE line -> ("done", None) | ("error", message) | ("chunk", obj) | ("bad", line); None if not data."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return ("done", None)
    try:
        obj = json.loads(payload)
    except ValueError:
        return ("bad", payload[:200])
    if isinstance(obj, dict) and "error" in obj:
        err = obj["error"]
        return ("error", err.get("message", str(err)) if isinstance(err, dict) else str(err))
    return ("chunk", obj)


def chunk_text(obj: Any) -> tuple[str, str | None]:
    """Text and finish_reason of one streamed chunk (chat delta or text completion)."""
    text, reason = "", None
    for choice in (obj.get("choices") or []) if isinstance(obj, dict) else []:
        delta = choice.get("delta")
        text += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
        reason = choice.get("finish_reason") or reason
    return text, reason


def request_body(kind: str, prompt: str, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream, **extra}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def send(http: httpx.AsyncClient, base: str, kind: str, body: dict[str, Any], *, total_s: float,
               drop_after: int | None = None) -> Outcome:
    """One request with a hard deadline; streams are read event by event (closed early after `drop_after`)."""
    out = Outcome(kind=kind, stream=bool(body.get("stream")), t_start=time.monotonic())
    url = f"{base}/v1/chat/completions" if kind == "chat" else f"{base}/v1/completions"

    async def run() -> None:
        if not out.stream:
            r = await http.post(url, json=body)
            out.status = r.status_code
            _read_whole(out, r)
            return
        async with http.stream("POST", url, json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                _read_whole(out, r)
                return
            async for line in r.aiter_lines():
                parsed = parse_sse_data(line)
                if parsed is None:
                    continue
                what, value = parsed
                if what == "done":
                    out.done = True
                    break
                if what in ("error", "bad"):
                    out.error_event = value
                    continue
                out.events += 1
                text, reason = chunk_text(value)
                out.text += text
                out.finish_reason = reason or out.finish_reason
                if drop_after is not None and out.events >= drop_after:
                    out.dropped = True
                    break  # leaving the block closes the connection: the server sees the client go

    try:
        await asyncio.wait_for(run(), timeout=total_s)
    except TimeoutError:
        out.error = f"Timeout(no end within {total_s:.0f} s)"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}({str(exc)[:200]})"
    out.latency_s = time.monotonic() - out.t_start
    return out


def _read_whole(out: Outcome, r: httpx.Response) -> None:
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code == 200:
        if isinstance(body, dict) and body.get("choices"):
            choice = body["choices"][0]
            out.text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
            out.finish_reason = choice.get("finish_reason")
        else:
            out.error = f"BadBody({r.text[:200]})"
        return
    out.openai_error = is_openai_error(body)
    out.retry_after = r.headers.get("retry-after")
    out.body = r.text[:300]


# -- /health, polled by a thread throughout -----------------------------------------------------------
@dataclasses.dataclass
class HealthSample:
    t: float        # monotonic
    phase: str
    status: int | None
    latency_s: float
    error: str | None = None
    body: str = ""  # a non-200 answer's body (truncated)


class HealthPoller(threading.Thread):
    """GET /health every `interval_s` (timeout 5 s, so a slow answer is measured, not waited on forever)."""

    def __init__(self, url: str, interval_s: float, max_s: float) -> None:
        super().__init__(daemon=True, name="health-poller")
        self.url, self.interval_s, self.max_s = url, interval_s, max_s
        self.samples: list[HealthSample] = []
        self.phase = "startup"
        self._halt = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.max_s
        with httpx.Client(timeout=5.0) as http:
            while not self._halt.is_set() and time.monotonic() < deadline:
                t0 = time.monotonic()
                status, error, body = None, None, ""
                try:
                    r = http.get(f"{self.url}/health")
                    status, body = r.status_code, ("" if r.status_code == 200 else r.text[:200])
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}({str(exc)[:120]})"
                self.samples.append(HealthSample(t0, self.phase, status, time.monotonic() - t0, error, body))
                self._halt.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def judge_health(samples: list[HealthSample], down: tuple[float, float] | None = None,
                 bound_s: float = HEALTH_BOUND_S) -> dict[str, Any]:
    """Every /health answered within `bound_s`: 200, or 500/503 only inside the `down` window (kill phase)."""
    bad: list[str] = []
    for s in samples:
        in_down = down is not None and down[0] <= s.t <= down[1]
        if s.status is None:
            bad.append(f"no answer after {s.latency_s:.2f} s: {s.error}")
        elif s.status != 200 and not (in_down and s.status in (500, 503)):
            bad.append(f"status {s.status} after {s.latency_s:.2f} s: {s.body}")
        elif s.latency_s >= bound_s:
            bad.append(f"status {s.status} after {s.latency_s:.2f} s (over {bound_s:.0f} s)")
    lat = [s.latency_s for s in samples if s.status is not None]
    return {
        "polls": len(samples),
        "statuses": dict(Counter(str(s.status) if s.status is not None else "none" for s in samples)),
        "p50_s": rounded(percentile(lat, 50)), "p99_s": rounded(percentile(lat, 99)),
        "max_s": rounded(max(lat) if lat else None),
        "over_bound": sum(1 for s in samples if s.latency_s >= bound_s),
        "non_200_bodies": dict(Counter(f"{s.status} {s.body}" for s in samples if s.status not in (None, 200))),
        "violations": len(bad), "examples": bad[:8], "passed": not bad and bool(samples),
    }


def rounded(x: float | None, nd: int = 3) -> float | None:
    """A figure for the summary's JSON: `nd` decimals are all the timing resolution means; None stays."""
    return None if x is None else round(x, nd)


# -- judging each phase's outcomes (pure; unit-tested in tests/test_soak_script.py) ---------------------
def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    lat = [o.latency_s for o in outcomes if o.ok]
    return {
        "requests": len(outcomes),
        "ok": sum(o.ok for o in outcomes),
        "statuses": dict(Counter(o.label for o in outcomes)),
        "latency_p50_s": rounded(percentile(lat, 50)), "latency_p99_s": rounded(percentile(lat, 99)),
    }


def describe(o: Outcome) -> str:
    what = f"{o.kind}{' stream' if o.stream else ''}: {o.label}"
    detail = o.error or o.error_event or o.body or (f"{o.events} events, no [DONE]" if o.stream and not o.done else "")
    return f"{what} {detail}".strip()[:400]


def judge_overload(outcomes: list[Outcome]) -> tuple[list[str], list[str]]:
    """Every answer 200 (complete) or a 503 with OpenAI error JSON. Returns (failures, warnings)."""
    failures, warnings = [], []
    for o in outcomes:
        if o.status == 503:
            if not o.openai_error:
                failures.append(f"503 without OpenAI error JSON: {describe(o)}")
            elif o.retry_after is None:
                warnings.append("503 without Retry-After")
        elif not o.ok:
            failures.append(describe(o))
    if not any(o.ok for o in outcomes):
        failures.append("no request succeeded")
    return failures, sorted(set(warnings))


def judge_all_ok(outcomes: list[Outcome], need_text: bool = False) -> list[str]:
    failures = [describe(o) for o in outcomes if not o.ok]
    if need_text:
        failures += [f"empty text: {o.kind}{' stream' if o.stream else ''}" for o in outcomes if o.ok and not o.text]
    if not outcomes:
        failures.append("no requests were made")
    return failures


def judge_kill(outcomes: list[Outcome], t_kill: float) -> tuple[list[str], dict[str, Any]]:
    """Around a killed replica: no hang, no request without an HTTP status (the ingress stays up), every error
    a 5xx with OpenAI's error JSON, and every stream the dead replica cut ended by an error event and [DONE]."""
    failures: list[str] = []
    seen: Counter[str] = Counter()
    for o in outcomes:
        if o.ok:
            seen["ok"] += 1
            continue
        if o.error and o.error.startswith("Timeout"):
            failures.append(f"hung: {describe(o)}")
            seen["hang"] += 1
        elif o.status is None:
            failures.append(f"no HTTP status: {describe(o)}")
            seen["no-status"] += 1
        elif o.status == 200 and o.error_event and o.done:
            seen["stream-cut(error-event, [DONE])"] += 1
        elif o.status == 200:
            failures.append(f"stream cut without an error event and [DONE]: {describe(o)}")
            seen["stream-cut(connection closed)"] += 1
        elif o.status >= 500 and o.openai_error:
            seen[f"{o.status} json"] += 1
        else:
            failures.append(f"not OpenAI's error JSON: {describe(o)}")
            seen[f"{o.label} text" if o.status >= 500 else o.label] += 1
    after = [o for o in outcomes if o.t_start >= t_kill]
    return failures, {"outcomes": dict(seen), "requests_after_kill": len(after),
                      "ok_after_kill": sum(o.ok for o in after)}
