"""Streams from client processes of their own: N streams at once as N independent clients.

One Python client that runs several streams in one event loop sends their requests one after another and reads
their events in turn, so its own time lands in every stream's TTFT: on an H100 the last of four requests left
such a client 9-15 ms after the first (`scripts/bench_http_path.py`'s "last request sent", 2026-12-06), time
that counts as the server path's though no server spent it. The clients a server meets are separate programs;
so are these: a process per concurrent stream, each with its own event loop and connection pool, timing its
stream itself (`time.perf_counter` is the system's monotonic clock, one clock for every process on Linux, so
the records compare with the in-process target's and with each other).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from multiprocessing.connection import Connection
from typing import Any

from measure.metrics import StreamRecord
from measure.sse import StreamError
from measure.targets import HttpTarget
from measure.workload import Prompt

READY_TIMEOUT_S = 120.0  # a spawned client imports this package afresh: seconds on a slow machine


class ProcessClients:
    """An HTTP target whose streams each run in a client process of their own (`workers` of them, one per
    stream of the largest round). Start it with `start()` inside the event loop that uses it."""

    def __init__(self, name: str, base_url: str, workers: int) -> None:
        if workers < 1:
            raise ValueError("ProcessClients needs at least one worker")
        self.name, self.base_url, self.workers = name, base_url, workers
        self.model_name = "default"
        self.fingerprint: str | None = None
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._idle: asyncio.Queue[Connection] = asyncio.Queue()

    async def start(self) -> None:
        """Spawn the clients; each checks the server answers (HttpTarget.preflight) before it counts as ready."""
        spawn = multiprocessing.get_context("spawn")  # not fork: the parent runs threads (Ray, an engine)
        conns = []
        for i in range(self.workers):
            ours, theirs = spawn.Pipe()
            process = spawn.Process(target=client_process, args=(theirs, self.name, self.base_url),
                                    name=f"{self.name}-client-{i}", daemon=True)
            process.start()
            theirs.close()
            self._processes.append(process)
            conns.append(ours)
        for conn in conns:
            if not await asyncio.to_thread(conn.poll, READY_TIMEOUT_S):
                raise StreamError(f"{self.name}: a client process did not start in {READY_TIMEOUT_S:.0f} s")
            reply = await asyncio.to_thread(conn.recv)
            if isinstance(reply, BaseException):
                raise reply
            self.model_name = str(reply)
            self._idle.put_nowait(conn)

    async def run_stream(self, prompt: Prompt, max_tokens: int, ignore_eos: bool) -> StreamRecord:
        """One stream, run and timed by an idle client process."""
        conn = await self._idle.get()
        try:
            conn.send((prompt, max_tokens, ignore_eos))
            result = await asyncio.to_thread(conn.recv)
        except (EOFError, OSError) as exc:  # the client process died: it takes no more streams
            raise StreamError(f"{self.name}: a client process exited mid-stream ({type(exc).__name__})") from exc
        else:
            self._idle.put_nowait(conn)
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, StreamRecord)
        self.fingerprint = result.fingerprint or self.fingerprint
        return result

    def describe(self) -> dict[str, Any]:
        return {"kind": "http", "url": self.base_url, "model": self.model_name, "fingerprint": self.fingerprint,
                "clients": f"{self.workers} processes"}

    async def aclose(self) -> None:
        while not self._idle.empty():
            with contextlib.suppress(OSError):
                self._idle.get_nowait().send(None)
        for process in self._processes:
            await asyncio.to_thread(process.join, 10.0)
            if process.is_alive():
                process.kill()


def client_process(conn: Connection, name: str, base_url: str) -> None:
    """A client process's life: answer ready (the served model's name) or the reason it is not, then run one
    stream per job until told to stop (None)."""
    asyncio.run(_serve_jobs(conn, name, base_url))


async def _serve_jobs(conn: Connection, name: str, base_url: str) -> None:
    target = HttpTarget(name, base_url)
    try:
        try:
            await target.preflight()
        except StreamError as exc:
            conn.send(exc)
            return
        conn.send(target.model_name)
        while (job := conn.recv()) is not None:  # blocking: this loop has nothing else to do between streams
            prompt, max_tokens, ignore_eos = job
            try:
                conn.send(await target.run_stream(prompt, max_tokens, ignore_eos))
            except Exception as exc:  # noqa: BLE001 - the parent raises it in the round that asked
                conn.send(StreamError(f"{name}: {type(exc).__name__}: {exc}"))
    finally:
        await target.aclose()
