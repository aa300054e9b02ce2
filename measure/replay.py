"""Traffic workloads and their replay: what a study measures when it tunes for the traffic a service gets.

A `TrafficWorkload` is a list of request shapes (prompt tokens, how many of them are a prefix shared with
other requests, output tokens, choices, greedy or sampled, arrival time), never text: from the serving app's
own record (`GET /traffic`, serving/engine/traffic.py), from a JSONL file (ours, or a Mooncake trace as vLLM's
`bench serve`, GuideLLM and AIPerf replay: serving/engine/mooncake.py), or built in (`chat`, `rag`, `agent`).

Replaying one builds each prompt as token ids of the recorded length: a shared prefix (the same tokens for
every request of its prefix group, so a slot's prefix cache finds it as the service's did) then tokens of its
own (starting with the request's number, so nothing else is shared by accident). A Mooncake request's prompt
is its blocks instead: each hash id's block the same tokens wherever it appears, so lines that begin with the
same ids begin with the same tokens, as the trace says their prompts did; it asks for the recorded
output length with EOS ignored, so every config generates the same tokens' worth of work. Every run gets a
salt of its own in those numbers, so one run never finds another's prefixes cached.

Two ways to send them, as vLLM's benchmark does:
- open loop: each request at its recorded arrival time (or a Poisson process at `--rate`), divided by
  `rate_scale` (2: twice as fast); a slow config piles up a queue, which is what the TTFT target sees;
- closed loop: `concurrency` clients, each sending its next request when its last one ended.

The figures (measure/slo.py): per request its TTFT, ITL and E2E from the client's clock (arrival = when it
was due), goodput and the SLO outcome. Pure but for the target it runs on (measure/targets.py's EngineTarget).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from measure.metrics import StreamRecord, completion_tokens_of, percentile, stream_figures
from measure.slo import Latency, RequestLatency, Slo, SloOutcome, Spread, evaluate, samples, spread
from serving.engine.mooncake import BLOCK_TOKENS, TraceLine, is_trace_line
from serving.engine.traffic import RequestKind, RequestShape

DEFAULT_CONCURRENCY = 4  # the mission's 4 concurrent streams
DEFAULT_REQUESTS = 64
SAMPLED_TEMPERATURE = 0.8
REPLAY_TIMEOUT_S = 1800.0
BLOCK_KEYS = 1 << 24  # a block's key stream starts here, past any prefix group's


class Arrivals(str, Enum):
    """How requests are sent."""

    open = "open"  # at their arrival times (recorded, or Poisson at a rate), whatever the server's pace
    closed = "closed"  # `concurrency` clients, each waiting for its last answer


def replayed_kind(kind: RequestKind) -> RequestKind:
    """How a recorded kind replays: a constrained request as sampled (its grammar is not recorded)."""
    return RequestKind.sampled if kind is RequestKind.constrained else kind


@dataclass(frozen=True)
class ReplayRequest:
    """One request to replay, as counts. Its prompt is `prefix_tokens` tokens of prefix group `group`'s
    shared stream, then `prompt_tokens - prefix_tokens` tokens of its own; or, where it has `blocks` (a
    Mooncake line's hash_ids), those blocks of `block_tokens` each (cut to the prompt's length), then tokens of
    its own if they fall short. `prefix_tokens` is then what its leading blocks share with earlier requests."""

    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int = 0
    group: int = 0
    arrival_s: float = 0.0  # from the workload's first arrival
    kind: RequestKind = RequestKind.greedy
    n: int = 1
    blocks: tuple[int, ...] = ()
    block_tokens: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.n < 1 or self.block_tokens < 1:
            raise ValueError(f"a replayed request needs a prompt, an output, a choice and blocks of a token: {self}")
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError(f"prefix_tokens {self.prefix_tokens} outside 0..prompt_tokens {self.prompt_tokens}")

    @property
    def context_tokens(self) -> int:
        """What one of its choices occupies in a slot at its end."""
        return self.prompt_tokens + math.ceil(self.output_tokens / self.n)

    @classmethod
    def of_shape(cls, shape: RequestShape, first_arrival: float) -> ReplayRequest:
        """A recorded shape: the tokens it found cached are the part shared with earlier requests (one group:
        the service's prefixes are unknown, only how much of each prompt was found). Constrained requests
        replay as sampled (their grammar is not recorded); a request that produced nothing asks for one token."""
        kind = replayed_kind(shape.kind)
        return cls(prompt_tokens=max(shape.prompt_tokens, 1), output_tokens=max(shape.output_tokens, shape.n),
                   prefix_tokens=min(shape.cached_tokens, max(shape.prompt_tokens - 1, 0)),
                   arrival_s=max(shape.arrival - first_arrival, 0.0), kind=kind, n=shape.n)

    @classmethod
    def of_trace(cls, line: TraceLine) -> ReplayRequest:
        """A Mooncake line (greedy, one choice: the format has neither); its shared prefix is known only beside
        the lines before it (`shared_blocks`). A line that asked for no output asks for one token."""
        return cls(prompt_tokens=line.input_length, output_tokens=max(line.output_length, 1), blocks=line.hash_ids)


@dataclass(frozen=True)
class TrafficWorkload:
    """Requests to replay and how: `arrivals` open (at `arrival_s / rate_scale`) or closed (`concurrency`
    clients). `source` says where the shapes came from."""

    name: str
    source: str
    requests: tuple[ReplayRequest, ...]
    arrivals: Arrivals = Arrivals.closed
    concurrency: int = DEFAULT_CONCURRENCY
    rate_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"workload {self.name!r} holds no request")
        if self.concurrency < 1 or not self.rate_scale > 0:
            raise ValueError("a workload needs concurrency >= 1 and rate_scale > 0")

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate_per_s(self) -> float | None:
        """Its arrivals per second as recorded (before rate_scale); None when they all arrive at once."""
        return (len(self.requests) - 1) / self.span_s if self.span_s > 0 else None

    @property
    def max_context(self) -> int:
        """The most tokens one request's choice holds in a slot: a config with less context per slot fails it."""
        return max(r.context_tokens for r in self.requests)

    @property
    def max_choices(self) -> int:
        return max(r.n for r in self.requests)

    def lengths_scaled(self, factor: float) -> TrafficWorkload:
        """Every prompt, shared prefix and output `factor` times as long (at least one token each): the same
        mix of shapes at a size a small machine replays in minutes. The name says so (`rag@0.25`)."""
        if factor == 1.0:
            return self
        if not factor > 0:
            raise ValueError(f"a length scale must be above 0, not {factor}")

        def scaled(r: ReplayRequest) -> ReplayRequest:
            prompt = max(1, round(r.prompt_tokens * factor))
            return replace(r, prompt_tokens=prompt, prefix_tokens=min(round(r.prefix_tokens * factor), prompt),
                           output_tokens=max(r.n, round(r.output_tokens * factor)),
                           block_tokens=max(1, round(r.block_tokens * factor)))

        return replace(self, name=f"{self.name}@{factor:g}", source=f"{self.source}; lengths x{factor:g}",
                       requests=tuple(scaled(r) for r in self.requests))

    def taking(self, count: int) -> TrafficWorkload:
        """Its first `count` requests (all of them when it holds fewer)."""
        return replace(self, requests=self.requests[:count])

    def paced(self, arrivals: Arrivals, concurrency: int | None = None, rate_scale: float | None = None,
              rate_per_s: float | None = None, seed: int = 0) -> TrafficWorkload:
        """Sent another way. `rate_per_s` (open loop) re-draws the arrival times as a Poisson process at that
        rate; otherwise open loop keeps the recorded times."""
        requests = self.requests
        if rate_per_s is not None:
            rng, t, timed = random.Random(seed), 0.0, []
            for r in requests:
                timed.append(replace(r, arrival_s=t))
                t += rng.expovariate(rate_per_s)
            requests = tuple(timed)
        return replace(self, requests=requests, arrivals=arrivals,
                       concurrency=self.concurrency if concurrency is None else concurrency,
                       rate_scale=self.rate_scale if rate_scale is None else rate_scale)

    def describe(self) -> str:
        how = (f"open loop at {self._rate_text()}" if self.arrivals is Arrivals.open
               else f"closed loop, {self.concurrency} clients")
        prompts = [r.prompt_tokens for r in self.requests]
        outputs = [r.output_tokens for r in self.requests]
        shared = sum(r.prefix_tokens for r in self.requests) / max(sum(prompts), 1)
        return (f"{self.name} ({self.source}): {len(self.requests)} requests, {how}; prompt tokens p50 "
                f"{percentile(prompts, 50):.0f} / max {max(prompts)}, output p50 {percentile(outputs, 50):.0f} / max "
                f"{max(outputs)}, {100 * shared:.0f}% of prompt tokens shared")

    def _rate_text(self) -> str:
        rate = self.rate_per_s
        if rate is None:
            return "once (all at the start)"
        scale = f" (recorded x{self.rate_scale:g})" if self.rate_scale != 1.0 else ""
        return f"{rate * self.rate_scale:.2f} requests/s{scale}"


# -- where workloads come from ------------------------------------------------------------------------------

class Builtin(str, Enum):
    """The built-in workloads: three services that want different settings."""

    chat = "chat"  # short prompts, long answers: slots (concurrent decode) matter
    rag = "rag"  # 2-6k-token prompts of retrieved text, short answers: prefill (batch sizes), context per slot
    agent = "agent"  # sessions of many turns over one long shared prefix (system prompt, tools): prefix reuse


def builtin(which: Builtin, count: int = DEFAULT_REQUESTS, seed: int = 0) -> TrafficWorkload:
    """`count` requests of a built-in workload, drawn with a seed (the same seed, the same requests).
    Closed loop at DEFAULT_CONCURRENCY unless paced otherwise."""
    rng = random.Random(f"{which.value}-{seed}")
    if which is Builtin.chat:
        requests = [ReplayRequest(prompt_tokens=32 + _lognormal(rng, 120, 0.6, 600), prefix_tokens=32,
                                  output_tokens=_lognormal(rng, 250, 0.4, 600), kind=RequestKind.sampled)
                    for _ in range(count)]
        source = "built in: 32-token system prompt + ~120-token question, ~250-token answer"
    elif which is Builtin.rag:
        requests = [ReplayRequest(prompt_tokens=rng.randint(2000, 6000), prefix_tokens=200,
                                  output_tokens=rng.randint(32, 128)) for _ in range(count)]
        source = "built in: 200-token instructions + 2-6k tokens of retrieved text, 32-128-token answer"
    else:
        requests = _agent_sessions(rng, count)
        source = "built in: sessions of 4-8 turns over a 1500-token shared prefix, +150-400 tokens a turn"
    return TrafficWorkload(which.value, source, tuple(requests))


def _lognormal(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _agent_sessions(rng: random.Random, count: int) -> list[ReplayRequest]:
    """Sessions interleaved as their turns would arrive: turn t of a session holds the session's whole text
    so far (its prefix group's stream), so each turn finds the last one's prompt cached."""
    sessions: list[list[ReplayRequest]] = []
    made = 0
    while made < count:
        group, length, turns = len(sessions) + 1, 1500, []
        for _ in range(min(rng.randint(4, 8), count - made)):
            length += rng.randint(150, 400)
            turns.append(ReplayRequest(prompt_tokens=length, prefix_tokens=length, group=group,
                                       output_tokens=rng.randint(40, 160)))
        sessions.append(turns)
        made += len(turns)
    order: list[ReplayRequest] = []
    while any(sessions):  # round robin: clients take turns, as concurrent sessions do
        for turns in sessions:
            if turns:
                order.append(turns.pop(0))
    return order


def from_shapes(shapes: Sequence[RequestShape], name: str, source: str) -> TrafficWorkload:
    """A recorded traffic (GET /traffic's `recent`, in arrival order) as an open-loop workload."""
    if not shapes:
        raise ValueError(f"{source}: no request recorded yet")
    ordered = sorted(shapes, key=lambda s: s.arrival)
    first = ordered[0].arrival
    return TrafficWorkload(name, source, tuple(ReplayRequest.of_shape(s, first) for s in ordered),
                           arrivals=Arrivals.open)


def load_file(path: Path) -> TrafficWorkload:
    """A JSONL file of request shapes: per line `prompt_tokens`, `output_tokens` and optionally `arrival`
    (seconds, any origin), `cached_tokens` (or `prefix_tokens` with a `group`), `n`, `kind` (greedy,
    sampled, constrained). GET /traffic's `recent.requests` entries are such lines. Or a Mooncake trace
    (`timestamp` in ms, `input_length`, `output_length`, `hash_ids`; GET /traffic?format=mooncake writes one).
    Open loop when every line has an arrival, else closed loop."""
    requests: list[ReplayRequest] = []
    arrivals: list[float | None] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"workload file {path}: {exc.strerror or exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request, arrival = _line_of(json.loads(line))
            requests.append(request)
            arrivals.append(arrival)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"workload file {path}, line {number}: {exc}") from exc
    if not requests:
        raise ValueError(f"workload file {path}: no request in it")
    times = [a for a in arrivals if a is not None]
    timed = len(times) == len(requests)
    if timed:
        first = min(times)
        order = sorted(range(len(requests)), key=lambda i: times[i])
        requests = [replace(requests[i], arrival_s=times[i] - first) for i in order]
    return TrafficWorkload(path.stem, f"file {path}", tuple(shared_blocks(requests)),
                           arrivals=Arrivals.open if timed else Arrivals.closed)


def shared_blocks(requests: Sequence[ReplayRequest]) -> list[ReplayRequest]:
    """Requests in the order they are sent, each block request's `prefix_tokens` set to its leading blocks an
    earlier one had (a hash id names its block and all before it, so a seen id is a seen prefix): what a
    prefix cache large enough could find. Requests without blocks are as they were."""
    seen: set[int] = set()
    out = []
    for r in requests:
        if not r.blocks:
            out.append(r)
            continue
        shared = next((i for i, block in enumerate(r.blocks) if block not in seen), len(r.blocks))
        seen.update(r.blocks)
        out.append(replace(r, prefix_tokens=min(shared * r.block_tokens, r.prompt_tokens)))
    return out


def _line_of(line: Any) -> tuple[ReplayRequest, float | None]:
    """A file's line as a request and its arrival in seconds (None: the line has none)."""
    if not isinstance(line, dict):
        raise ValueError("each line is a JSON object")
    if is_trace_line(line):
        trace = TraceLine.parse(line)
        return ReplayRequest.of_trace(trace), None if trace.timestamp_ms is None else trace.timestamp_ms / 1000.0
    arrival = line.get("arrival")
    return _request_of(line), None if arrival is None else float(arrival)


def _request_of(line: dict[str, Any]) -> ReplayRequest:
    missing = [k for k in ("prompt_tokens", "output_tokens") if k not in line]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (each line is a request's shape, not its text)")
    prompt, n = int(line["prompt_tokens"]), int(line.get("n") or 1)
    prefix = int(line.get("prefix_tokens") or line.get("cached_tokens") or 0)
    kind = RequestKind(line.get("kind", RequestKind.greedy.value))
    return ReplayRequest(prompt_tokens=prompt, output_tokens=max(int(line["output_tokens"]), n),
                         prefix_tokens=min(prefix, max(prompt - 1, 0)), group=int(line.get("group", 0)),
                         kind=replayed_kind(kind), n=n)


# -- running one --------------------------------------------------------------------------------------------

class TokenTarget(Protocol):
    """What a replay runs on: token prompts, timed on the client's clock (measure/targets.py's EngineTarget)."""

    name: str

    def tokenize(self, text: str) -> list[int]: ...

    async def run_tokens(self, tokens: list[int], max_tokens: int, temperature: float, n: int) -> StreamRecord: ...


class PromptBuilder:
    """Token prompts of exact lengths from a filler text's tokens: group g's shared stream and request i's
    own tokens. Each stream starts with two key tokens of its own (from the salt, the number or group, and
    which of the two it is), so streams part at their first token (at the latest their second) and nothing
    else is shared by accident."""

    def __init__(self, target: TokenTarget, filler: str, salt: int) -> None:
        self._salt = salt
        self._filler = target.tokenize(filler) or [1]
        self._keys = sorted(set(self._filler))  # the key tokens: ids the model's vocabulary surely has
        self._groups: dict[int, list[int]] = {}

    def prompt(self, request: ReplayRequest, number: int) -> list[int]:
        if request.blocks:
            shared = self._blocks(request.blocks, request.block_tokens, request.prompt_tokens)
        else:
            shared = self._group(request.group, request.prefix_tokens)[:request.prefix_tokens]
        own = self._stream(2 * number, number * 131, request.prompt_tokens - len(shared))
        return shared + own

    def _blocks(self, blocks: Sequence[int], block_tokens: int, length: int) -> list[int]:
        """The blocks' tokens up to `length`: block id b is the same `block_tokens` tokens in every request
        (a stream keyed by b, as a group's is by its number)."""
        tokens: list[int] = []
        for block in blocks[:-(-length // block_tokens)]:
            tokens += self._stream(2 * (BLOCK_KEYS + block) + 1, block * 997, block_tokens)
        return tokens[:length]

    def _group(self, group: int, length: int) -> list[int]:
        stream = self._groups.get(group, [])
        if len(stream) < length:
            stream = self._groups[group] = self._stream(2 * group + 1, group * 997, length)
        return stream

    def _stream(self, key: int, offset: int, length: int) -> list[int]:
        """`length` tokens: the key's two tokens (distinct pairs for distinct keys of one salt while there are
        fewer than len(keys)**2 / 2 requests; the first differs unless the keys are len(keys) apart), then
        the filler from `offset`."""
        n = len(self._keys)
        high, low = divmod((self._salt * 1_000_003 + key) % (n * n), n)
        tokens = [self._keys[low], self._keys[high]][:length]  # low first: consecutive keys part at once
        body = self._filler
        while len(tokens) < length:
            start = (offset + len(tokens)) % len(body)
            tokens += body[start:start + length - len(tokens)]
        return tokens


@dataclass(frozen=True)
class Outcome:
    """One replayed request: its latencies, or why it failed."""

    request: ReplayRequest
    latency: RequestLatency
    error: str = ""


@dataclass(frozen=True)
class ReplayFigures:
    """A replay's figures: throughput, goodput under the SLO, latency percentiles with their spread."""

    workload: str
    requests: int
    failed: int
    wall_s: float
    throughput_rps: float
    output_tok_s: float
    goodput_rps: float
    goodput_tok_s: float
    median_stream_tok_s: float  # the median request's decode tok/s: what one client sees
    slo: SloOutcome
    percentiles: dict[str, Spread] = field(default_factory=dict)  # "ttft_p95" -> its spread
    errors: tuple[str, ...] = ()  # the first few distinct errors

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplayFigures:
        """Back from `dataclasses.asdict` (a saved report), so tables can be drawn again from what was measured."""
        fields = dict(data)
        fields["slo"] = SloOutcome.from_dict(data["slo"])
        fields["percentiles"] = {k: Spread(**v) for k, v in data.get("percentiles", {}).items()}
        fields["errors"] = tuple(data.get("errors", ()))
        return cls(**fields)

    @classmethod
    def of(cls, workload: str, outcomes: Sequence[Outcome], wall_s: float, slo: Slo) -> ReplayFigures:
        latencies = [o.latency for o in outcomes]
        good = [lat for lat in latencies if lat.good(slo)]
        decode = [(lat.output_tokens - 1) / (lat.e2e_s - lat.ttft_s) for lat in latencies
                  if lat.ok and lat.output_tokens > 1 and lat.e2e_s > lat.ttft_s]
        per = 1 / wall_s if wall_s > 0 else 0.0
        return cls(
            workload=workload, requests=len(outcomes), failed=sum(1 for lat in latencies if not lat.ok),
            wall_s=wall_s, throughput_rps=sum(1 for lat in latencies if lat.ok) * per,
            output_tok_s=sum(lat.output_tokens for lat in latencies if lat.ok) * per,
            goodput_rps=len(good) * per, goodput_tok_s=sum(lat.output_tokens for lat in good) * per,
            median_stream_tok_s=percentile(decode, 50) if decode else 0.0, slo=evaluate(latencies, slo),
            percentiles={f"{m.value}_p{p}": spread(samples(latencies, m), p) for m in Latency for p in (50, 95, 99)},
            errors=tuple(dict.fromkeys(o.error for o in outcomes if o.error))[:3])


class Replayer:
    """Replays a workload on a target; `salt` keeps one run's prompts apart from every other's."""

    def __init__(self, workload: TrafficWorkload, slo: Slo, filler: str, salt: int = 0,
                 timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        self.workload, self.slo, self.filler, self.salt, self.timeout_s = workload, slo, filler, salt, timeout_s

    async def run(self, target: TokenTarget) -> ReplayFigures:
        builder = PromptBuilder(target, self.filler, self.salt)
        prompts = [builder.prompt(r, i) for i, r in enumerate(self.workload.requests)]
        t0 = time.perf_counter()
        send = self._open if self.workload.arrivals is Arrivals.open else self._closed
        outcomes = await asyncio.wait_for(send(target, prompts, t0), self.timeout_s)
        return ReplayFigures.of(self.workload.name, outcomes, time.perf_counter() - t0, self.slo)

    async def _open(self, target: TokenTarget, prompts: list[list[int]], t0: float) -> list[Outcome]:
        scale = self.workload.rate_scale

        async def due(request: ReplayRequest, prompt: list[int]) -> Outcome:
            t_due = t0 + request.arrival_s / scale
            await asyncio.sleep(max(0.0, t_due - time.perf_counter()))
            return await one(target, request, prompt, t_due)

        return list(await asyncio.gather(*(due(r, p) for r, p in zip(self.workload.requests, prompts, strict=True))))

    async def _closed(self, target: TokenTarget, prompts: list[list[int]], t0: float) -> list[Outcome]:
        queue = list(zip(self.workload.requests, prompts, strict=True))
        queue.reverse()
        outcomes: list[Outcome] = []

        async def client() -> None:
            while queue:
                request, prompt = queue.pop()
                outcomes.append(await one(target, request, prompt))

        await asyncio.gather(*(client() for _ in range(self.workload.concurrency)))
        return outcomes


async def one(target: TokenTarget, request: ReplayRequest, prompt: list[int], t_due: float | None = None
              ) -> Outcome:
    """One request, timed from the moment it was due (`t_due`; closed loop: now), so a request sent late,
    its client's event loop being busy, counts its lateness; an error is its outcome, never the run's."""
    t_due = time.perf_counter() if t_due is None else t_due
    temperature = SAMPLED_TEMPERATURE if request.kind is RequestKind.sampled else 0.0
    try:
        record = await target.run_tokens(prompt, request.output_tokens // request.n or 1, temperature, request.n)
        figures = stream_figures(record)
    except Exception as exc:  # noqa: BLE001 (the request failed: counted, the replay goes on)
        elapsed = time.perf_counter() - t_due
        return Outcome(request, RequestLatency(False, elapsed, elapsed, (), 0), f"{type(exc).__name__}: {exc}")
    ttft = record.output_times[0] - t_due if record.output_times else record.t_end - t_due
    latency = RequestLatency(ok=True, ttft_s=ttft, e2e_s=record.t_end - t_due, itl_s=figures.itl_s,
                             output_tokens=completion_tokens_of(record))
    return Outcome(request, latency)
