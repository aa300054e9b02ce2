"""Our engine in a child process, measured with the shared workload: for the device benchmark.

A child, so that (1) its memory is read like llama-server's (the whole process: CUDA context included, and
nothing left behind in the parent for the next phase to count), and (2) a crash in the bindings fails one
phase only. The parent reads memory while the child waits, loaded and idle, before and after the workload.

Protocol: the child prints tagged JSON lines on stdout (`loaded`, `done`, `error`) and waits for a line on
stdin (`go`, then `exit`) between them. `loaded` carries the buffers llama.cpp said it allocated
(serving/engine/buffers.py), beside which the memory model's terms can be checked one by one.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

TAG = "@@measure.isolated@@ "


class Child:
    """The parent's side of one child engine."""

    def __init__(self, proc: asyncio.subprocess.Process, load_timeout_s: float) -> None:
        self.proc = proc
        self.load_timeout_s = load_timeout_s

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def loaded(self) -> dict[str, Any]:
        """The child's engine facts, once it has loaded."""
        return (await self._message(self.load_timeout_s, "loaded"))["engine"]

    async def run(self, timeout_s: float) -> dict[str, Any]:
        """Tell the loaded child to run the workload; its results (per level: median and rounds)."""
        await self.tell("go")
        return (await self._message(timeout_s, "done"))["results"]

    async def tell(self, word: str) -> None:
        """One line to the child's stdin ('go', 'exit')."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{word}\n".encode())
        await self.proc.stdin.drain()

    async def _message(self, timeout_s: float, waiting_for: str) -> dict[str, Any]:
        """The child's next tagged line (other stdout lines pass through); a dead child is an error."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), max(deadline - time.monotonic(), 0.01))
            except TimeoutError:
                raise TimeoutError(f"engine child: no '{waiting_for}' within {timeout_s:.0f} s") from None
            if not line:
                code = await self.proc.wait()
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                raise RuntimeError(f"engine child died ({how}) while waiting for '{waiting_for}'")
            text = line.decode("utf-8", "replace")
            if not text.startswith(TAG):
                sys.stderr.write(text)
                continue
            message: dict[str, Any] = json.loads(text[len(TAG):])
            if message.get("event") == "error":
                raise RuntimeError(f"engine child: {message.get('error')}")
            return message


@asynccontextmanager
async def child_engine(engine_fields: dict[str, Any], workload_fields: dict[str, Any],
                       load_timeout_s: float) -> AsyncIterator[Child]:
    """Start `python -m measure.isolated` with an engine config and a workload; always end it."""
    spec = json.dumps({"engine": engine_fields, "workload": workload_fields})
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "measure.isolated", spec,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                limit=16 << 20)
    child = Child(proc, load_timeout_s)
    try:
        yield child
        await child.tell("exit")
        await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _emit(message: dict[str, Any]) -> None:
    print(TAG + json.dumps(message, default=str), flush=True)


async def _child(spec: dict[str, Any]) -> int:
    """Load the engine, say so, wait for 'go', run the workload, report, wait for 'exit'."""
    from serving.engine import llama as _llama  # noqa: F401  (first: the library load order, see serving/engine/llama.py)
    from measure.targets import EngineTarget
    from measure.workload import PromptSet, Runner, Workload
    from serving.engine.buffers import llama_buffers
    from serving.engine.config import EngineConfig
    from serving.engine.core import Engine

    try:
        config = EngineConfig(**spec["engine"])
        with llama_buffers() as buffers:
            engine = Engine(config)
    except Exception as exc:
        _emit({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    try:
        _emit({"event": "loaded", "engine": {"config": config.to_yaml_dict(), "n_ctx_slot": engine.n_ctx_slot,
                                             "weight_load_s": round(engine.weight_load_s, 2),
                                             "buffers_mib": buffers}})
        await asyncio.to_thread(sys.stdin.readline)
        w = spec["workload"]
        workload = Workload(**{**w, "levels": tuple(w["levels"]), "prompt_set": PromptSet(w["prompt_set"])})
        levels = await Runner(workload).levels([EngineTarget(engine)])
        results = {str(n): level.as_dict() for n, level in next(iter(levels.values())).items()}
        _emit({"event": "done", "results": results})
        await asyncio.to_thread(sys.stdin.readline)
    except Exception as exc:
        _emit({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_child(json.loads(sys.argv[1]))))
