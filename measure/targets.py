"""The targets a workload runs on, each timed on the client's clock the same way (measure/metrics.py):
our Engine in-process (no HTTP), an OpenAI-compatible server over HTTP (our Serve app), and llama-server
started from a binary with the flags that mean the same as our config.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import urllib.parse
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from measure.metrics import StreamRecord
from measure.sse import SSEDecoder, StreamError, interpret_chunk
from measure.workload import Prompt
from serving.engine.config import EngineConfig, SplitMode
from serving.engine.repack import llama_server_args
from serving.engine.request import SamplingParams

if TYPE_CHECKING:  # imported where an engine is built: the HTTP and llama-server helpers need no libllama
    from serving.engine.core import Engine
    from serving.engine.request import GenerationChunk

MAX_CONNECTIONS = 64
LOOPBACK_NAMES = ("localhost",)
REPACK_FLAGS = ("--repack", "--no-repack", "-nr")
Tokenizer = Callable[[str], list[int]]
FORBIDDEN_SERVER_ARGS = ("--host", "--port", "-m", "--model", "-hf", "--hf-repo", "--api-key")


def prompt_tokens(engine: Engine, prompt: Prompt) -> list[int]:
    """A workload prompt as the engine's tokens: a chat prompt through the model's template, as a user turn."""
    text = engine.render_chat([{"role": "user", "content": prompt.text}]) if prompt.chat else prompt.text
    return engine.tokenize_prompt(text)


class EngineTarget:
    """Our Engine called directly: what the HTTP path costs shows against HttpTarget. Tokenising (and, for
    a chat prompt, rendering the template) happens inside the timed span, as a server would do it."""

    def __init__(self, engine: Engine, name: str = "in-process", text_only: bool = False) -> None:
        self.name = name
        self.engine = engine
        self.text_only = text_only  # output is text, as our server's stream shows it (_read)

    async def run_stream(self, prompt: Prompt, max_tokens: int, ignore_eos: bool) -> StreamRecord:
        record = StreamRecord(t_start=time.perf_counter())
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        return await self._read(self.engine.submit(prompt_tokens(self.engine, prompt), params), record)

    def tokenize(self, text: str) -> list[int]:
        """Text as tokens without BOS (pieces of a replayed prompt: measure/replay.py)."""
        return self.engine.tokenize(text, add_special=False, parse_special=False)

    async def run_tokens(self, tokens: list[int], max_tokens: int, temperature: float, n: int) -> StreamRecord:
        """A replayed request: `n` choices of `max_tokens` each, EOS ignored; the record times the first
        choice and counts every choice's tokens (OpenAI's usage)."""
        record = StreamRecord(t_start=time.perf_counter())
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                seed=1 if temperature > 0 else None)
        first, *others = self.engine.submit_choices(tokens, params, n)
        try:
            await self._read(first, record)
            for handle in others:
                other = await self._read(handle, StreamRecord(t_start=record.t_start))
                record.completion_tokens = (record.completion_tokens or 0) + (other.completion_tokens or 0)
        except BaseException:
            for handle in others:
                handle.cancel()
            raise
        return record

    async def _read(self, handle: AsyncIterable[GenerationChunk], record: StreamRecord) -> StreamRecord:
        """Time the chunks: every token is output (the engine's view, as llama-server's completions stream
        shows it), or with `text_only` only text, as our server's stream shows it: a token that renders as
        nothing (a special token, half a UTF-8 character)
        gets no SSE event there, so a client first sees it with the next text. A comparison with our HTTP
        path needs the latter, or the in-process TTFT comes a decode step early for such streams (found with
        `bench_http_path.py --trace`: one stream of four on CPU, ~30 ms). Tokens still unseen at the end
        are output at the end."""
        unseen = 0  # tokens that came without text, shown with the next text
        async for chunk in handle:
            t = time.perf_counter()
            if chunk.error:
                raise StreamError(f"in-process engine error: {chunk.error}")
            unseen += len(chunk.token_ids)
            if chunk.text or (unseen and (not self.text_only or chunk.finish_reason is not None)):
                record.add_output(t, unseen or None, chunk.text)
                unseen = 0
            if chunk.finish_reason is not None:
                record.finish_reason = chunk.finish_reason.value
                if chunk.usage is not None:
                    record.completion_tokens = chunk.usage.completion_tokens
                    record.prompt_tokens = chunk.usage.prompt_tokens
                    record.cached_tokens = chunk.usage.cached_tokens
                    if chunk.usage.ttft_s is not None:
                        record.engine_ttft_ms = chunk.usage.ttft_s * 1e3
        record.t_end = time.perf_counter()
        return record

    def describe(self) -> dict[str, Any]:
        return {"kind": "in-process", "engine_config": self.engine.config.to_yaml_dict()}


@contextlib.contextmanager
def loaded_engine(config: EngineConfig, name: str = "in-process", text_only: bool = False) -> Any:
    """An EngineTarget on a freshly loaded engine, closed afterwards."""
    from serving.engine.core import Engine

    engine = Engine(config)
    try:
        yield EngineTarget(engine, name, text_only)
    finally:
        engine.close()


@contextlib.contextmanager
def vocabulary(model: Path) -> Iterator[Tokenizer]:
    """The model's vocabulary read alone (no weights), as a tokenizer for HttpTarget: one for every target of a
    benchmark, giving what EngineTarget.tokenize gives (no BOS, specials as text)."""
    from serving.engine.llama import Vocabulary

    vocab = Vocabulary(model)
    try:
        yield vocab.tokenize
    finally:
        vocab.free()


def check_loopback_url(url: str) -> str:
    """The URL without a trailing slash; anything but a loopback http(s) URL is refused."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"the URL must look like http://127.0.0.1:8000/v1, got {url!r}")
    host = parsed.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() in LOOPBACK_NAMES
    if not loopback:
        raise ValueError(f"only loopback addresses are benchmarked, got host {host!r}")
    return url.rstrip("/")


class HttpTarget:
    """An OpenAI-compatible server over HTTP (our Serve app, or llama-server): a plain prompt goes to
    /completions (tokenised like the in-process target), a chat prompt to /chat/completions. Make it inside
    the event loop that uses it (its connection pool belongs to that loop)."""

    def __init__(self, name: str, base_url: str, request_timeout_s: float = 300.0,
                 tokenizer: Tokenizer | None = None) -> None:
        import httpx

        self.name = name
        self.base_url = check_loopback_url(base_url)
        self.model_name = "default"
        self.fingerprint: str | None = None
        self.extra: dict[str, Any] = {}
        self.tokenizer = tokenizer  # token-id prompts (run_tokens) are built with it: `vocabulary`
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=5.0), trust_env=False,
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS))

    async def preflight(self) -> None:
        """Fail early and clearly if nothing answers; learn the served model's name from /models."""
        import httpx

        try:
            resp = await self._client.get(f"{self.base_url}/models", timeout=10.0)
        except httpx.TransportError as exc:
            raise StreamError(f"cannot reach {self.base_url} ({type(exc).__name__}: {exc}): is the server "
                              "running, and is the URL the API root (e.g. http://127.0.0.1:8000/v1)?") from exc
        data = resp.json().get("data") if resp.status_code == 200 else None
        if data and isinstance(data[0], dict) and data[0].get("id"):
            self.model_name = str(data[0]["id"])

    def _body(self, prompt: Prompt, max_tokens: int, ignore_eos: bool) -> tuple[str, dict[str, Any]]:
        common = {"model": self.model_name, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos,
                  "stream": True, "stream_options": {"include_usage": True}}
        if prompt.chat:
            return "/chat/completions", {"messages": [{"role": "user", "content": prompt.text}], **common}
        return "/completions", {"prompt": prompt.text, **common}

    async def run_stream(self, prompt: Prompt, max_tokens: int, ignore_eos: bool) -> StreamRecord:
        """POST one streaming request and timestamp every SSE event as it arrives."""
        path, body = self._body(prompt, max_tokens, ignore_eos)
        return await self._post(path, body, prompt.chat)

    def tokenize(self, text: str) -> list[int]:
        """Text as the model's token ids, no BOS (pieces of a replayed prompt: measure/replay.py), read from the
        model's vocabulary here rather than asked of the server, so every server gets the same ids."""
        if self.tokenizer is None:
            raise ValueError(f"{self.name}: token-id prompts need the model's vocabulary (measure/targets.py "
                             "`vocabulary`)")
        return self.tokenizer(text)

    async def run_tokens(self, tokens: list[int], max_tokens: int, temperature: float, n: int) -> StreamRecord:
        """A replayed request (measure/replay.py's TokenTarget): the token ids as /completions' prompt (our
        server and llama-server both take them), `max_tokens` with EOS ignored (a replay asks the recorded
        output length). One choice only: llama-server's /completions takes no `n`, and Mooncake traces have none."""
        if n != 1:
            raise ValueError(f"{self.name}: a replay over HTTP sends one choice a request, not n={n}")
        body: dict[str, Any] = {"model": self.model_name, "prompt": tokens, "max_tokens": max_tokens,
                                "temperature": temperature, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}
        if temperature > 0:
            body["seed"] = 1  # as EngineTarget.run_tokens: the same draw on every target
        return await self._post("/completions", body, chat=False)

    async def _post(self, path: str, body: dict[str, Any], chat: bool) -> StreamRecord:
        rid = uuid.uuid4().hex  # the server's logs and stamps (serving/front/http.py) name the request by it
        record = StreamRecord(t_start=time.perf_counter(), request_id=rid)

        async def sent(event: str, _: dict[str, Any]) -> None:  # httpcore's trace of this request
            if event.endswith("send_request_body.complete"):
                record.t_sent = time.perf_counter()

        async with self._client.stream("POST", self.base_url + path, json=body, extensions={"trace": sent},
                                       headers={"X-Request-ID": rid}) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                raise StreamError(f"{self.name}: HTTP {resp.status_code} from {path}: {detail}")
            decoder = SSEDecoder()
            async for line in resp.aiter_lines():
                data = decoder.feed(line)
                if data is not None and not self._absorb(data, chat, record):
                    break
            tail = decoder.flush()
            if tail is not None:
                self._absorb(tail, chat, record)
        record.t_end = time.perf_counter()
        self.fingerprint = record.fingerprint or self.fingerprint
        return record

    @staticmethod
    def _absorb(data: str, chat: bool, record: StreamRecord) -> bool:
        """Fold one event into the record; False at `[DONE]`."""
        t = time.perf_counter()
        if data.strip() == "[DONE]":
            return False
        record.absorb(interpret_chunk(data, chat), t)
        return True

    def describe(self) -> dict[str, Any]:
        return {"kind": "http", "url": self.base_url, "model": self.model_name, "fingerprint": self.fingerprint,
                **self.extra}

    async def aclose(self) -> None:
        await self._client.aclose()


# -- llama-server -------------------------------------------------------------------------------------------

def repack_server_args(config: EngineConfig, server_args: Sequence[str]) -> list[str]:
    """`--no-repack` for llama-server wherever our engine would load without the CPU weight repack
    (`cpu_repack`; `auto` = serving/engine/repack.py's per-machine probe), so both peers run the same kernels and
    neither crashes on a CPU whose repack path faults. A repack flag of the caller's own wins."""
    if any(a.split("=")[0] in REPACK_FLAGS for a in server_args):
        return []
    return llama_server_args(config)


def llama_server_flags(config: EngineConfig) -> list[str]:
    """llama-server's flags with the meaning of `config`'s llama.cpp settings (the model and the address
    are the benchmark's own; `--no-repack` where our engine would not repack)."""
    flags = ["-ngl", "999" if config.n_gpu_layers < 0 else str(config.n_gpu_layers), "-c", str(config.n_ctx),
             "-np", str(config.n_parallel), "-b", str(config.n_batch), "-ub", str(config.n_ubatch),
             "-ctk", config.type_k.value, "-ctv", config.type_v.value, "-fa", config.flash_attn.value]
    for override in config.override_tensor:
        flags += ["-ot", override]
    if config.n_cpu_moe and not config.cpu_moe_start:
        flags += ["--n-cpu-moe", str(config.n_cpu_moe)]
    elif config.n_cpu_moe:  # layers from another start: --n-cpu-moe's own patterns, given as -ot (after the others)
        flags += ["-ot", ",".join(str(o) for o in config.expert_overrides())]
    if not config.kv_offload:
        flags += ["-nkvo"]
    if config.kv_unified:
        flags += ["-kvu"]
    if config.split_mode != SplitMode.layer:
        flags += ["-sm", config.split_mode.value]
    if config.main_gpu:
        flags += ["-mg", str(config.main_gpu)]
    if config.tensor_split:
        flags += ["-ts", ",".join(f"{share:g}" for share in config.tensor_split)]
    if config.n_threads is not None:
        flags += ["-t", str(config.n_threads)]
    if config.n_threads_batch is not None:
        flags += ["-tb", str(config.n_threads_batch)]
    return flags + repack_server_args(config, flags)


def check_server_args(args: Sequence[str]) -> None:
    """The benchmark owns the address and the model: a conflicting flag would measure something else."""
    bad = [a for a in args if a.split("=")[0] in FORBIDDEN_SERVER_ARGS]
    if bad:
        raise ValueError(f"llama-server flags must not set {bad}: the benchmark picks the model and the port")


def free_loopback_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llama_server_version(binary: str) -> str | None:
    """`llama-server --version` (e.g. 'version: 1 (0c1e570)'), or None when it cannot be run."""
    try:
        proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return " | ".join(ln for ln in lines if ln.startswith(("version", "built"))) or None


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
                raise RuntimeError(f"llama-server exited with {proc.returncode}; log tail:\n{_log_tail(log)}")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(f"{base}/health")).status_code == 200:
                    return
            await asyncio.sleep(0.25)
    raise TimeoutError(f"llama-server not healthy after {timeout_s:.0f} s; log tail:\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextlib.asynccontextmanager
async def llama_server(binary: str, model: Path, server_args: Sequence[str], start_timeout_s: float = 180.0,
                       request_timeout_s: float = 300.0, tokenizer: Tokenizer | None = None
                       ) -> AsyncIterator[HttpTarget]:
    """llama-server on a free loopback port: wait for /health, yield an HttpTarget (with `tokenizer` for
    token-id prompts), always stop it."""
    check_server_args(server_args)
    port = free_loopback_port()
    cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *server_args]
    log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    print(f"starting: {shlex.join(cmd)}  (log: {log})", file=sys.stderr)
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    target = None
    try:
        base = f"http://127.0.0.1:{port}"
        await _wait_healthy(proc, base, start_timeout_s, log)
        target = HttpTarget("llama-server", f"{base}/v1", request_timeout_s, tokenizer)
        await target.preflight()
        target.extra = {"binary": str(Path(binary).resolve()), "server_args": list(server_args),
                        "command": shlex.join(cmd), "log": str(log), "version": llama_server_version(binary),
                        "pid": proc.pid}
        yield target
    finally:
        if target is not None:
            await target.aclose()
        _stop(proc)
