"""What every figure means, computed the same way for every target (our engine in-process, our server
over HTTP, llama-server), from the client's own clock:

- TTFT: from just before the client hands the request over (in-process: before tokenising it; HTTP: before
  the POST) to the first chunk that carries output; queueing included;
- decode tok/s of a stream: (completion tokens - 1) / (time of its last output chunk - its first), i.e.
  tokens after the first over the time they took (llama-server's timings.predicted_per_second, but measured
  by the client);
- prefill tok/s: prompt tokens evaluated (not served from a slot's cache) / TTFT;
- aggregate tok/s of a round: all completion tokens of the streams started together / wall time from the
  round's start to its last stream's end;
- send time (HTTP targets): from the same start to the moment the request's last byte left the client, its
  own share of TTFT; a round's figure is the latest of its streams (requests started together leave one
  after another);
- inter-token latency: the gap between consecutive output chunks divided by the tokens in the later chunk
  (exact when chunks say how many tokens they carry, else the stream's average);
- a repeated figure is the median over rounds.

Pure (no I/O): unit-tested on constructed records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from measure.sse import ChunkInfo, StreamError


@dataclass
class StreamRecord:
    """Raw timings of one streamed request; times are time.perf_counter() seconds."""

    t_start: float
    t_end: float = math.nan
    t_sent: float = math.nan  # the request's last byte left the client (HTTP targets)
    output_times: list[float] = field(default_factory=list)
    output_tokens: list[int | None] = field(default_factory=list)
    completion_tokens: int | None = None  # the server's usage figure, when it sent one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    fingerprint: str | None = None
    engine_ttft_ms: float | None = None  # the engine's own time to first token, when it reported one
    request_id: str | None = None  # the X-Request-ID it was sent with (HTTP targets), as a server logs it
    parts: list[str] = field(default_factory=list)  # the text, as it came

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add_output(self, t: float, n_tokens: int | None, text: str) -> None:
        """Record an output chunk received at time t (carrying `n_tokens` when known)."""
        self.output_times.append(t)
        self.output_tokens.append(n_tokens)
        self.parts.append(text)

    def absorb(self, info: ChunkInfo, t: float) -> None:
        """Fold one parsed HTTP chunk into the record."""
        if info.has_output:
            self.add_output(t, info.n_tokens, info.text)
        if info.finish_reason:
            self.finish_reason = info.finish_reason
        if info.usage:
            self.completion_tokens = info.usage.completion_tokens
            self.prompt_tokens = info.usage.prompt_tokens
            self.cached_tokens = info.usage.cached_tokens
        if info.fingerprint:
            self.fingerprint = info.fingerprint
        if info.engine_ttft_ms is not None:
            self.engine_ttft_ms = info.engine_ttft_ms


@dataclass(frozen=True)
class StreamFigures:
    """One request's figures (see the module docstring)."""

    ttft_s: float
    decode_tok_s: float | None
    completion_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    itl_s: tuple[float, ...]
    send_s: float | None = None  # from the start until the request had left the client; None in process
    engine_ttft_s: float | None = None  # the engine's own account of ttft_s (StreamRecord.engine_ttft_ms)

    @property
    def prefill_tok_s(self) -> float | None:
        if self.prompt_tokens is None or self.ttft_s <= 0:
            return None
        return (self.prompt_tokens - (self.cached_tokens or 0)) / self.ttft_s


def completion_tokens_of(record: StreamRecord) -> int:
    """The usage figure when the server sent one; else the sum of explicit per-chunk counts; else one per
    output chunk."""
    if record.completion_tokens is not None:
        return record.completion_tokens
    if record.output_tokens and all(n is not None for n in record.output_tokens):
        return sum(n for n in record.output_tokens if n is not None)
    return len(record.output_times)


def chunk_token_weights(record: StreamRecord, completion_tokens: int) -> list[float]:
    """Tokens per output chunk: exact when every chunk states it, else the stream's average (usage / chunks).

    llama-server sends one chunk per token except when a token ends inside a UTF-8 character (its text is
    held back and sent with the next token); our server groups a stream's tokens under load: chunks can be
    fewer than tokens.
    """
    counts = record.output_tokens
    if counts and all(n for n in counts):
        return [float(n) for n in counts if n]
    average = completion_tokens / len(counts) if counts else 1.0
    return [max(average, 1.0)] * len(counts)


def stream_figures(record: StreamRecord) -> StreamFigures:
    """One request's raw timings -> TTFT, decode rate and inter-token latencies. A stream that ended
    properly without a token (EOS first, where EOS counts) took its whole time to say so."""
    if not record.output_times:
        if record.finish_reason is None or record.completion_tokens:
            raise StreamError("the stream produced no output")
        return StreamFigures(record.t_end - record.t_start, None, 0, record.prompt_tokens, record.cached_tokens, (),
                             _send_s(record), _engine_ttft_s(record))
    n = completion_tokens_of(record)
    times = record.output_times
    weights = chunk_token_weights(record, n)
    itl = tuple((times[i] - times[i - 1]) / weights[i] for i in range(1, len(times)))
    span = times[-1] - times[0]
    return StreamFigures(
        ttft_s=times[0] - record.t_start,
        decode_tok_s=(n - 1) / span if n > 1 and span > 0 else None,
        completion_tokens=n,
        prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens,
        itl_s=itl,
        send_s=_send_s(record),
        engine_ttft_s=_engine_ttft_s(record),
    )


def _send_s(record: StreamRecord) -> float | None:
    return None if math.isnan(record.t_sent) else record.t_sent - record.t_start


def _engine_ttft_s(record: StreamRecord) -> float | None:
    return None if record.engine_ttft_ms is None else record.engine_ttft_ms / 1e3


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


@dataclass(frozen=True)
class RoundFigures:
    """One round: `streams` requests started together. `short_streams` counts those that ended before the
    requested length (EOS where it was not ignored)."""

    streams: int
    wall_s: float
    completion_tokens: int
    short_streams: int
    aggregate_tok_s: float
    decode_tok_s: float | None  # the mean over the round's streams
    slowest_decode_tok_s: float | None
    ttft_ms: float  # the mean over the round's streams
    ttft_ms_max: float
    prefill_tok_s: float | None
    itl_ms_p50: float | None
    itl_ms_p95: float | None
    send_ms_max: float | None = None  # the latest its streams' requests left the client (HTTP targets)
    engine_ttft_ms: float | None = None  # the mean of the engine's own TTFTs (None unless every stream had one)

    @classmethod
    def of(cls, streams: Sequence[StreamFigures], wall_s: float, requested_tokens: int) -> RoundFigures:
        total = sum(s.completion_tokens for s in streams)
        itl = [x for s in streams for x in s.itl_s]
        ttft = [s.ttft_s for s in streams]
        decodes = [s.decode_tok_s for s in streams if s.decode_tok_s is not None]
        return cls(
            streams=len(streams), wall_s=wall_s, completion_tokens=total,
            short_streams=sum(1 for s in streams if s.completion_tokens < requested_tokens),
            aggregate_tok_s=total / wall_s if wall_s > 0 else 0.0,
            decode_tok_s=_mean(decodes), slowest_decode_tok_s=min(decodes, default=None),
            ttft_ms=1e3 * statistics.fmean(ttft), ttft_ms_max=1e3 * max(ttft),
            prefill_tok_s=_mean(s.prefill_tok_s for s in streams),
            itl_ms_p50=1e3 * percentile(itl, 50) if itl else None,
            itl_ms_p95=1e3 * percentile(itl, 95) if itl else None,
            send_ms_max=None if any(s.send_s is None for s in streams) else 1e3 * max(s.send_s or 0.0 for s in streams),
            engine_ttft_ms=None if any(s.engine_ttft_s is None for s in streams)
            else 1e3 * statistics.fmean(s.engine_ttft_s or 0.0 for s in streams),
        )

    @classmethod
    def median(cls, rounds: Sequence[RoundFigures]) -> RoundFigures:
        """Every figure's median over rounds (a figure missing in any round stays missing)."""
        if not rounds:
            raise ValueError("no rounds to take the median of")
        values: dict[str, Any] = {}
        for f in fields(cls):
            column = [getattr(r, f.name) for r in rounds]
            values[f.name] = None if any(v is None for v in column) else statistics.median(column)
        return cls(**values)

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)
