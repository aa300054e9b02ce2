#!/usr/bin/env python3
"""Device benchmark: bandwidth roofline, llama-server vs our engine (in-process and over Ray Serve), memory.

Why this exists: a figure on a lent GPU is only worth the device time when it can be judged, so ONE run on ONE
device measures everything a claim needs side by side:

1. the device's copy bandwidth (bytes read + written), hence the single-stream decode roofline
   (bandwidth / bytes read per token, from the GGUF header: tuning.memory.ModelShape);
2. llama-server with the flags that mean the same as our EngineConfig (the seed article's config by default);
3. our Engine in-process (no HTTP; in a child process, see bench_in_process), same config and workload;
4. our Engine behind Ray Serve over HTTP, same config and workload;
5. device memory measured (GPU: NVML 'used' minus the idle baseline at start) next to tuning.memory's prediction.

The workload is scripts/bench_serving.py's (fixed --max-tokens, ignore_eos, greedy, nonce-tagged prompts,
warm-up then the median of --repeats rounds) at concurrency 1 and 4, so every target is measured the same way.
Only one engine holds the model at a time (llama-server, then in-process, then Serve, per config), so memory
readings are clean and a 15 GB model never sits on the device twice. Every phase has a timeout; a failed phase
is recorded and the run goes on (device time is scarce), and the JSON report is rewritten after every phase so
a run cut short still leaves its figures.

Examples::

    # CPU smoke test (embedded SmolLM2-135M; about a minute on 2 cores)
    python scripts/bench_device.py --llama-server .llama-build/bin/llama-server \\
        --configs article --max-tokens 16 --repeats 1 --json-out results/bench_device_cpu.json
    # GPU: the 27B-class synthetic model, both configs, defaults otherwise (about 4-5 minutes on an H200)
    PYTHONUNBUFFERED=1 python3 scripts/bench_device.py --model /tmp/qwen27b.gguf \\
        --llama-server build/bin/llama-server --commit SHA --json-out $OUT/bench_device.json

Progress goes to stderr, the table to stdout. SIGTERM stops the run cleanly and still prints the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

try:  # FIRST: loads libllama before numpy/torch (a large-vocab model crashed otherwise: serving/llama.py)
    import serving  # noqa: F401
    SERVING_IMPORT_ERROR: str | None = None
except Exception as _exc:  # llama-server and the bandwidth phase need no bindings: keep going, record why
    SERVING_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import datetime as dt  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable, Sequence  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

from measure.provenance import COMMIT_ENV  # noqa: E402

GiB = 1 << 30
SINGLE, MULTI = 1, 4  # concurrency levels: a lone stream, and four at once
TARGETS = ("llama-server", "ours in-process", "ours HTTP")
APP_NAME = "llama"
PROTOCOL_TAG = "@@bench_device@@ "  # marks the in-process worker's messages on its stdout
BANDWIDTH_TIMEOUT_S = 300.0  # child process: torch import + CUDA init + ~25 copies of a 4 GiB buffer
ENV_KEYS = ("LLAMA_CPP_LIB_PATH", "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "LLAMA_ATTN_ROT_DISABLE",
            "GGML_CUDA_DISABLE_GRAPHS", "OMP_NUM_THREADS")
_T0 = time.monotonic()


def load_bench_serving() -> ModuleType:
    """scripts/bench_serving.py as a module: its workload, metrics and targets are the ones every figure uses."""
    spec = importlib.util.spec_from_file_location("bench_serving", REPO_ROOT / "scripts" / "bench_serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


bs = load_bench_serving()


def say(message: str) -> None:
    """A progress line with the run's elapsed time, on stderr like bench_serving's (stdout: table, protocol)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Configs: one description, rendered as llama-server flags and as EngineConfig fields
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One engine setting, expressed once so llama-server and our engine get the same meaning."""

    name: str
    n_ctx: int
    n_parallel: int
    n_batch: int = 512
    n_ubatch: int = 512
    type_k: str = "q8_0"
    type_v: str = "q8_0"
    flash_attn: str = "on"

    def server_args(self, threads: int | None = None) -> list[str]:
        """llama-server flags (all layers on the GPU: -ngl 99 = our n_gpu_layers -1)."""
        args = ["-ngl", "99", "-c", str(self.n_ctx), "-fa", self.flash_attn, "-ctk", self.type_k,
                "-ctv", self.type_v, "-np", str(self.n_parallel), "-b", str(self.n_batch), "-ub", str(self.n_ubatch)]
        return args + (["-t", str(threads)] if threads else [])

    def engine_fields(self, model: Path, threads: int | None = None) -> dict[str, Any]:
        """EngineConfig fields with the same meaning as server_args()."""
        fields: dict[str, Any] = {
            "model": str(model), "n_ctx": self.n_ctx, "n_parallel": self.n_parallel, "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch, "type_k": self.type_k, "type_v": self.type_v,
            "flash_attn": self.flash_attn, "n_gpu_layers": -1,
        }
        if threads:
            fields["n_threads"] = threads
        return fields


CONFIGS: dict[str, BenchConfig] = {
    # the seed article's final llama-server line: -ngl 99 -c 4096 -fa on -ctk q8_0 -ctv q8_0 -np 2 -b 512
    "article": BenchConfig("article", n_ctx=4096, n_parallel=2),
    # four slots of the same size
    "np4": BenchConfig("np4", n_ctx=8192, n_parallel=4),
}


def parse_configs(text: str) -> list[BenchConfig]:
    """'article,np4' -> the named configs, in order; unknown names are an error that lists the known ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    return [CONFIGS[n] for n in names]


# ---------------------------------------------------------------------------------------------------------------
# Roofline and bandwidth arithmetic (pure; unit-tested)
# ---------------------------------------------------------------------------------------------------------------

def bandwidth_summary(buffer_bytes: int, seconds: Sequence[float]) -> dict[str, Any]:
    """Copy bandwidth from timed copies of one buffer: each copy reads AND writes `buffer_bytes`."""
    times = [t for t in seconds if t > 0]
    if not times:
        raise ValueError("no positive copy time to compute a bandwidth from")
    moved = 2 * buffer_bytes
    median = statistics.median(times)
    return {"buffer_bytes": buffer_bytes, "bytes_moved_per_copy": moved, "copies": len(times),
            "median_s": median, "bytes_per_s": moved / median, "best_bytes_per_s": moved / min(times),
            "worst_bytes_per_s": moved / max(times)}


def roofline_tok_s(bytes_per_s: float | None, bytes_per_token: int | None) -> float | None:
    """Single-stream decode ceiling: every weight byte read once per token at the measured bandwidth."""
    if not bytes_per_s or not bytes_per_token or bytes_per_token <= 0:
        return None
    return bytes_per_s / bytes_per_token


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, or None when either is missing or the reference is zero."""
    if not isinstance(value, (int, float)) or not isinstance(reference, (int, float)) or not reference:
        return None
    return value / reference


# ---------------------------------------------------------------------------------------------------------------
# Bandwidth: measured in a child process, so this process holds no torch CUDA context or cached allocations that
# would then count as the in-process engine's memory (and a hung copy is killed by a plain timeout)
# ---------------------------------------------------------------------------------------------------------------

def copy_times_cuda(n_bytes: int, repeats: int, warmup: int = 3) -> tuple[list[float], str]:
    """Device-to-device copies timed with CUDA events; returns seconds per copy and the GPU's name."""
    import torch

    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times, f"torch {torch.__version__} d2d copy on {torch.cuda.get_device_name()}"


def copy_times_host(n_bytes: int, repeats: int, warmup: int = 2) -> tuple[list[float], str]:
    """numpy copies of a host buffer timed with perf_counter (warm-up also faults in the destination pages)."""
    import numpy as np

    src = np.ones(n_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    for _ in range(warmup):
        np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return times, f"numpy {np.__version__} host copy"


def bandwidth_worker(device: str, gib: float, repeats: int) -> int:
    """Child-process entry: measure, print one JSON line."""
    n_bytes = int(gib * GiB)
    times, method = copy_times_cuda(n_bytes, repeats) if device == "cuda" else copy_times_host(n_bytes, repeats)
    print(json.dumps({**bandwidth_summary(n_bytes, times), "method": method, "device": device}), flush=True)
    return 0


def measure_bandwidth(device: str, gib: float, repeats: int, timeout_s: float) -> dict[str, Any]:
    """Run bandwidth_worker in a child Python; raise with its stderr tail when it fails."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--bandwidth-worker", device,
           "--bw-gib", str(gib), "--bw-repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"bandwidth worker exited {proc.returncode}: {tail}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------------------------
# Device facts and memory readings
# ---------------------------------------------------------------------------------------------------------------

class GpuMemory:
    """Device memory in use on the benchmarked GPU: NVML when pynvml imports, else nvidia-smi."""

    def __init__(self) -> None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        self.index = int(visible) if visible.isdigit() else 0
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception:
            self._nvml = None
        self.info = self._describe()

    @property
    def present(self) -> bool:
        return bool(self.info.get("name"))

    def _describe(self) -> dict[str, Any]:
        if self._nvml is not None:
            nv = self._nvml
            name = nv.nvmlDeviceGetName(self._handle)
            driver = nv.nvmlSystemGetDriverVersion()
            return {"name": name.decode() if isinstance(name, bytes) else name,
                    "driver": driver.decode() if isinstance(driver, bytes) else driver,
                    "memory_total_bytes": int(nv.nvmlDeviceGetMemoryInfo(self._handle).total),
                    "count": int(nv.nvmlDeviceGetCount()), "index": self.index, "via": "nvml"}
        row = self._smi("name,driver_version,memory.total")
        if row is None:
            return {}
        return {"name": row[0], "driver": row[1], "memory_total_bytes": int(float(row[2])) << 20,
                "index": self.index, "via": "nvidia-smi"}

    def _smi(self, fields: str) -> list[str] | None:
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                  "-i", str(self.index)], capture_output=True, text=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode != 0 or not out.stdout.strip():
            return None
        return [x.strip() for x in out.stdout.strip().splitlines()[0].split(",")]

    def used(self) -> int | None:
        """Bytes in use on the device (every process), or None when it cannot be read."""
        if self._nvml is not None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        row = self._smi("memory.used")
        return int(float(row[0])) << 20 if row else None

    def process_count(self) -> int | None:
        """Compute processes on the device (another tenant makes every figure suspect)."""
        if self._nvml is None:
            return None
        return len(self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle))


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (CPU runs: what 'memory measured' means there)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def child_pid(comm_prefix: str) -> int | None:
    """A direct child of this process whose name starts with `comm_prefix` (the llama-server we started)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == me and comm.startswith(comm_prefix[:15]):
            return int(entry)
    return None


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (CPU runs report it instead of a GPU name)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def llama_cpp_commit(version: str | None) -> str | None:
    """The commit hash in `llama-server --version` output ('... (build 1, commit 0c1e570)')."""
    match = re.search(r"commit ([0-9a-f]{7,40})", version or "")
    return match.group(1) if match else None


def repo_commit(override: str | None) -> str:
    """`git rev-parse HEAD`, or the --commit override (the GPU machine gets a copy of the tree without .git)."""
    if override or os.environ.get(COMMIT_ENV):
        return override or os.environ[COMMIT_ENV]
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


# ---------------------------------------------------------------------------------------------------------------
# The run's shared state
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """Everything the phases share: arguments, device probe, model facts, the report being built."""

    args: argparse.Namespace
    gpu: GpuMemory
    report: dict[str, Any]
    shape: Any = None
    baseline: int | None = None
    serve_port: int | None = None
    serve_error: str | None = None

    @property
    def on_gpu(self) -> bool:
        return self.gpu.present

    @property
    def schedule(self) -> Any:
        return bs.Schedule([SINGLE, MULTI], self.args.repeats, self.args.max_tokens, self.args.round_timeout)

    def save(self) -> None:
        """Rewrite the JSON report (after every phase, so a run cut short keeps what it measured)."""
        path = Path(self.args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.report, indent=2, default=str) + "\n", encoding="utf-8")

    def engine_memory(self, pid: int | None) -> int | None:
        """Memory the engine holds now. GPU: device used minus the idle baseline; CPU: its process's RSS."""
        if self.on_gpu:
            used = self.gpu.used()
            return None if used is None or self.baseline is None else used - self.baseline
        return rss_bytes(pid) if pid is not None else None

    async def settle(self, limit_s: float = 90.0, slack: int = 512 << 20) -> int | None:
        """Wait until the previous engine's device memory is given back; return what is still held over baseline."""
        if not self.on_gpu or self.baseline is None:
            return None
        deadline = time.monotonic() + limit_s
        while True:
            held = (self.gpu.used() or 0) - self.baseline
            if held < slack or time.monotonic() > deadline:
                if held >= slack:
                    say(f"  warning: {held / GiB:.2f} GiB still held over the baseline before loading")
                return held
            await asyncio.sleep(1.0)


def describe_error(exc: BaseException, timeout_s: float) -> str:
    """One line for the report; a bare timeout says which limit it hit."""
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) and not str(exc):
        return f"TimeoutError: phase exceeded {timeout_s:.0f} s"
    return f"{type(exc).__name__}: {exc}"[:2000]


async def run_phase(run: Run, label: str, timeout_s: float,
                    body: Callable[[dict[str, Any]], Awaitable[None]]) -> dict[str, Any]:
    """Run one phase under a timeout; record its error instead of stopping the run. `body` fills `out` as it
    goes, so figures measured before a failure are kept."""
    out: dict[str, Any] = {"error": None}
    t0 = time.monotonic()
    say(f"{label}: start")
    try:
        await asyncio.wait_for(body(out), timeout_s)
    except (Exception, SystemExit) as exc:  # SystemExit: bench_serving's way of saying a server did not start
        out["error"] = describe_error(exc, timeout_s)
        run.report["errors"].append(f"{label}: {out['error']}")
        say(f"{label}: FAILED: {out['error']}")
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    if out["error"] is None:
        say(f"{label}: done in {out['elapsed_s']:.0f} s")
    run.save()
    return out


async def workload(schedule: Any, target: Any) -> dict[str, Any]:
    """The shared workload on one target: per concurrency level, the median and the rounds."""
    results, _fingerprints = await bs.benchmark([target], schedule)
    per_level = results[target.name]
    for level, data in per_level.items():
        short = data["median"].get("short_streams")
        if short:
            say(f"  warning: {target.name} c={level}: {short} stream(s) stopped before max_tokens")
    return per_level


async def sample_memory(run: Run, out: dict[str, Any], key: str, pid: int | None) -> None:
    """Record the engine's memory under `key` (a short pause first, so allocations have landed)."""
    await asyncio.sleep(1.0)
    out.setdefault("memory", {})[key] = run.engine_memory(pid)


# ---------------------------------------------------------------------------------------------------------------
# The three targets
# ---------------------------------------------------------------------------------------------------------------

async def bench_llama_server(run: Run, cfg: BenchConfig, out: dict[str, Any]) -> None:
    """llama-server on a free loopback port with the config's flags: memory when idle, then the workload."""
    out["memory"] = {"before_load": await run.settle()}
    a = run.args
    # the engine's CPU weight repack decision (serving/repack.py) applied to llama-server too: same kernels
    repack = [] if SERVING_IMPORT_ERROR else bs.repack_server_args({}, [])
    async with bs.llama_server(a.llama_server, str(a.model), cfg.server_args(a.threads) + repack, "completions",
                               a.load_timeout, a.request_timeout) as target:
        out["server"] = target.describe()
        pid = None if run.on_gpu else child_pid(Path(a.llama_server).name)
        await sample_memory(run, out, "loaded_idle", pid)
        out["results"] = await workload(run.schedule, target)
        await sample_memory(run, out, "after_workload", pid)


def emit(message: dict[str, Any]) -> None:
    """Worker side of the in-process protocol: one tagged JSON line on stdout (progress goes to stderr)."""
    print(PROTOCOL_TAG + json.dumps(message, default=str), flush=True)


async def read_message(proc: asyncio.subprocess.Process, timeout_s: float, waiting_for: str) -> dict[str, Any]:
    """Parent side: the worker's next tagged line (other stdout lines pass through); a dead worker is an error."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), max(remaining, 0.01))
        except TimeoutError:
            raise TimeoutError(f"in-process worker: no '{waiting_for}' within {timeout_s:.0f} s") from None
        if not line:
            code = await proc.wait()
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise RuntimeError(f"in-process worker died ({how}) while waiting for '{waiting_for}'")
        text = line.decode("utf-8", "replace")
        if not text.startswith(PROTOCOL_TAG):
            sys.stderr.write(text)
            continue
        message = json.loads(text[len(PROTOCOL_TAG):])
        if message.get("event") == "error":
            raise RuntimeError(f"in-process worker: {message.get('error')}")
        return message


async def tell(proc: asyncio.subprocess.Process, word: str) -> None:
    """Parent -> worker: one line on its stdin ('go', 'exit')."""
    assert proc.stdin is not None
    proc.stdin.write(f"{word}\n".encode())
    await proc.stdin.drain()


async def bench_in_process(run: Run, cfg: BenchConfig, out: dict[str, Any]) -> None:
    """Our Engine called directly (bench_serving's InProcessTarget, no HTTP), in a child process.

    A child, so that (1) its memory is read like llama-server's (the whole process: CUDA context included, and
    nothing left behind in this process for the next phase to count), and (2) a crash in the bindings (one is
    known on the GPU machine: serving/llama.py) fails this phase only. The parent reads memory while the
    child waits, loaded and idle, before and after the workload.
    """
    out["memory"] = {"before_load": await run.settle()}
    a = run.args
    spec = {"engine_fields": cfg.engine_fields(a.model, a.threads), "max_tokens": a.max_tokens,
            "repeats": a.repeats, "round_timeout": a.round_timeout}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).resolve()), "--in-process-worker", json.dumps(spec),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=16 << 20)
    try:
        out["engine"] = (await read_message(proc, a.load_timeout, "loaded"))["engine"]
        await sample_memory(run, out, "loaded_idle", proc.pid)
        await tell(proc, "go")
        out["results"] = (await read_message(proc, a.phase_timeout, "done"))["results"]
        await sample_memory(run, out, "after_workload", proc.pid)
        await tell(proc, "exit")
        await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def in_process_worker(spec: dict[str, Any]) -> int:
    """Child entry: load the engine, report, wait for 'go', run the workload, report, wait for 'exit'."""
    try:
        if SERVING_IMPORT_ERROR:
            raise RuntimeError(f"cannot import serving: {SERVING_IMPORT_ERROR}")
        from serving.config import EngineConfig
        from serving.engine import Engine

        config = EngineConfig(**spec["engine_fields"])
        engine = Engine(config)
    except Exception as exc:
        emit({"event": "error", "error": describe_error(exc, 0)})
        return 1
    try:
        emit({"event": "loaded", "engine": {"config": config.to_yaml_dict(), "n_ctx_slot": engine.n_ctx_slot,
                                            "weight_load_s": round(engine.weight_load_s, 2)}})
        await asyncio.to_thread(sys.stdin.readline)
        target = bs.InProcessTarget(engine, {"resolved": config.model_dump(mode="json")})
        sched = bs.Schedule([SINGLE, MULTI], spec["repeats"], spec["max_tokens"], spec["round_timeout"])
        emit({"event": "done", "results": await workload(sched, target)})
        await asyncio.to_thread(sys.stdin.readline)
    except Exception as exc:
        emit({"event": "error", "error": describe_error(exc, 0)})
        return 1
    finally:
        engine.close()
    return 0


def libllama_path() -> str | None:
    """The libllama.so this process loaded (through serving.llama), for --serve-preload-libllama."""
    lib = getattr(sys.modules.get("llama_cpp.llama_cpp"), "_lib", None)
    return getattr(lib, "_name", None)


def start_serve(num_gpus: int, preload: str | None) -> int:
    """Start Ray (GPUs as NVML counted them) and Serve's HTTP proxy on a free loopback port; return the port.

    Replicas are Ray worker processes: they inherit this environment, so the repo goes on PYTHONPATH for them
    (the GPU machine's copy is not pip-installed). `preload` puts libllama.so in the workers' LD_PRELOAD: a Ray
    worker imports numpy before our code runs, the order that crashed a large-vocab load on the GPU machine.
    """
    import ray
    from ray import serve

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    runtime_env = {"env_vars": {"LD_PRELOAD": preload}} if preload else None
    ray.init(num_gpus=num_gpus, num_cpus=max(os.cpu_count() or 1, 4), include_dashboard=False,
             logging_level="ERROR", log_to_driver=False, runtime_env=runtime_env)
    port = bs.free_loopback_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def serve_app_problem(name: str) -> str | None:
    """Serve's word when the app is DEPLOY_FAILED or UNHEALTHY (e.g. a replica that crashed loading), else None."""
    from ray import serve

    app = serve.status().applications.get(name)
    status = str(getattr(app.status, "value", app.status)) if app is not None else ""
    if status not in ("DEPLOY_FAILED", "UNHEALTHY"):
        return None
    details = [app.message] + [d.message for d in app.deployments.values() if d.message]
    return f"{status}: " + " | ".join(m for m in details if m)[:1500]


async def wait_serve_healthy(base: str, timeout_s: float) -> None:
    """Poll GET /health (never takes a slot) until 200. A failed model load (503 with an error) or an app that Serve
    calls failed or unhealthy (a replica crashed) fails at once instead of waiting out the timeout."""
    import httpx

    deadline = time.monotonic() + timeout_s
    next_note = time.monotonic() + 30
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            problem = await asyncio.to_thread(serve_app_problem, APP_NAME)
            if problem:
                raise RuntimeError(f"Serve app {problem}")
            try:
                resp = await client.get(f"{base}/health")
                if resp.status_code == 200:
                    return
                body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
                if body.get("status") == "error":
                    raise RuntimeError(f"the replica failed to load the model: {body.get('error')}")
            except httpx.TransportError:
                pass
            if time.monotonic() > next_note:
                say("  Serve replica still loading the model ...")
                next_note += 30
            await asyncio.sleep(1.0)
    raise TimeoutError(f"Serve app not healthy after {timeout_s:.0f} s")


async def served_config(base: str) -> dict[str, Any] | None:
    """The config the replica actually runs (GET /slots), to prove it matches the other targets'."""
    import httpx

    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        resp = await client.get(f"{base}/slots")
    return resp.json().get("config") if resp.status_code == 200 else None


async def bench_http(run: Run, cfg: BenchConfig, out: dict[str, Any]) -> None:
    """Our app through Ray Serve over HTTP: deploy, wait for /health, the workload, delete the app."""
    if run.serve_error:
        raise RuntimeError(f"Ray Serve did not start: {run.serve_error}")
    from ray import serve

    from serving.app import main as build_app

    out["memory"] = {"before_load": await run.settle()}
    fields = {"config": str(REPO_ROOT / "configs" / "default.yaml"),  # every field below overrides it
              **cfg.engine_fields(run.args.model, run.args.threads)}
    base = f"http://127.0.0.1:{run.serve_port}"
    try:
        await asyncio.to_thread(serve.run, build_app(fields), name=APP_NAME, route_prefix="/")
        await wait_serve_healthy(base, run.args.load_timeout)
        out["engine"] = {"config": await served_config(base)}
        await sample_memory(run, out, "loaded_idle", None)
        target = bs.HttpTarget("ours-http", f"{base}/v1", "completions", run.args.request_timeout)
        try:
            await target.preflight()
            out["results"] = await workload(run.schedule, target)
        finally:
            await target.aclose()
        await sample_memory(run, out, "after_workload", None)
    finally:
        await asyncio.wait_for(asyncio.to_thread(serve.delete, APP_NAME), 180)


# ---------------------------------------------------------------------------------------------------------------
# Phases in order
# ---------------------------------------------------------------------------------------------------------------

async def phase_bandwidth(run: Run) -> None:
    """Copy bandwidth and the single-stream roofline."""
    a = run.args
    device = "cuda" if run.on_gpu else "cpu"
    gib = a.bw_gib if a.bw_gib else (4.0 if run.on_gpu else 1.0)

    async def body(out: dict[str, Any]) -> None:
        out.update(await asyncio.to_thread(measure_bandwidth, device, gib, a.bw_repeats, BANDWIDTH_TIMEOUT_S))

    bw = await run_phase(run, f"bandwidth ({device}, {gib:g} GiB buffer)", BANDWIDTH_TIMEOUT_S + 30, body)
    per_token = run.report["model"].get("bytes_read_per_token")
    roof = roofline_tok_s(bw.get("bytes_per_s"), per_token)
    run.report["bandwidth"] = bw
    run.report["roofline_tok_s_single_stream"] = roof
    if bw.get("bytes_per_s"):
        say(f"  bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s (read+write, median of {bw['copies']})"
            + (f" -> roofline {roof:.1f} tok/s at {per_token / 1e9:.3f} GB/token" if roof else ""))


def model_facts(run: Run) -> None:
    """Header facts (bytes read per token) and predictions need tuning.memory; a failure leaves them unset."""
    path = Path(run.args.model)
    facts: dict[str, Any] = {"path": str(path), "file_bytes": path.stat().st_size if path.is_file() else None}
    try:
        from tuning.memory import ModelShape

        run.shape = ModelShape.from_gguf(path)
        facts["shape"] = dataclasses.asdict(run.shape)
        facts["bytes_read_per_token"] = run.shape.bytes_read_per_token
    except Exception as exc:
        facts["error"] = describe_error(exc, 0)
        run.report["errors"].append(f"model shape: {facts['error']}")
        say(f"model shape: FAILED: {facts['error']}")
    run.report["model"] = facts


def predicted_bytes(run: Run, cfg: BenchConfig) -> dict[str, int] | None:
    """tuning.memory's prediction for this config on this device (GPU memory, or process memory on CPU)."""
    if run.shape is None:
        return None
    try:
        from serving.config import EngineConfig
        from tuning.memory import predict

        config = EngineConfig(**cfg.engine_fields(run.args.model, run.args.threads))
        return predict(run.shape, config, on_gpu=run.on_gpu).as_dict()
    except Exception as exc:
        run.report["errors"].append(f"{cfg.name} prediction: {describe_error(exc, 0)}")
        return None


async def ensure_serve(run: Run) -> None:
    """Start Ray + Serve once, before the first HTTP phase; a failure skips every HTTP phase with the reason."""
    if run.serve_port is not None or run.serve_error is not None:
        return
    say("starting Ray and Serve ...")
    try:
        n_gpus = int(run.gpu.info.get("count", 1)) if run.on_gpu else 0
        preload = libllama_path() if run.args.serve_preload_libllama else None
        if run.args.serve_preload_libllama and not preload:
            raise RuntimeError("--serve-preload-libllama: no libllama.so loaded in this process to preload")
        run.serve_port = start_serve(n_gpus, preload)
        run.report["serve"] = {"port": run.serve_port, "num_gpus": n_gpus, "ld_preload": preload}
        say(f"  Serve proxy on 127.0.0.1:{run.serve_port}")
    except Exception as exc:
        run.serve_error = describe_error(exc, 0)
        run.report["errors"].append(f"ray/serve start: {run.serve_error}")
        run.report["serve"] = {"error": run.serve_error}
        say(f"  Ray/Serve start FAILED: {run.serve_error}")


async def bench_config(run: Run, cfg: BenchConfig) -> None:
    """One config on every enabled target, one engine at a time."""
    a = run.args
    entry = run.report["configs"].setdefault(cfg.name, {
        "spec": dataclasses.asdict(cfg), "server_args": cfg.server_args(a.threads),
        "engine_fields": cfg.engine_fields(a.model, a.threads), "predicted": predicted_bytes(run, cfg),
        "targets": {}})
    steps: list[tuple[str, Callable[[Run, BenchConfig, dict[str, Any]], Awaitable[None]], bool]] = [
        ("llama-server", bench_llama_server, not a.skip_llama_server),
        ("ours in-process", bench_in_process, not a.skip_in_process),
        ("ours HTTP", bench_http, not a.skip_http),
    ]
    for label, fn, enabled in steps:
        if not enabled:
            continue
        if label == "ours HTTP":
            await ensure_serve(run)
        entry["targets"][label] = await run_phase(
            run, f"[{cfg.name}] {label}", a.phase_timeout, lambda out, fn=fn: fn(run, cfg, out))


def stop_serve(run: Run) -> None:
    """serve.shutdown(); ray.shutdown() when this run started them."""
    if run.serve_port is None:
        return
    try:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    except Exception as exc:
        run.report["errors"].append(f"ray/serve shutdown: {describe_error(exc, 0)}")


# ---------------------------------------------------------------------------------------------------------------
# The table (pure; unit-tested)
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the final table: one target under one config."""

    config: str
    target: str
    single_tok_s: float | None = None
    multi_tok_s: float | None = None
    ratio_single: float | None = None
    ratio_multi: float | None = None
    roofline_fraction: float | None = None
    ttft_ms: float | None = None
    memory_measured: int | None = None
    memory_predicted: int | None = None
    error: str | None = None


def _median(results: dict[str, Any] | None, level: int, key: str) -> float | None:
    value = ((results or {}).get(str(level)) or {}).get("median", {}).get(key)
    return value if isinstance(value, (int, float)) else None


def _measured(target: dict[str, Any]) -> int | None:
    """After the workload (llama.cpp's pools and CUDA graphs have grown by then), else right after load."""
    memory = target.get("memory") or {}
    value = memory.get("after_workload")
    return value if value is not None else memory.get("loaded_idle")


def build_rows(report: dict[str, Any]) -> list[Row]:
    """Table rows from the report: figures per target, ratios to llama-server of the same config."""
    roof = report.get("roofline_tok_s_single_stream")
    rows = []
    for name, entry in report.get("configs", {}).items():
        targets = entry.get("targets", {})
        ref = targets.get("llama-server", {}).get("results")
        ref_single, ref_multi = _median(ref, SINGLE, "decode_tok_s_per_stream"), _median(ref, MULTI, "aggregate_tok_s")
        predicted = (entry.get("predicted") or {}).get("total")
        for label in TARGETS:
            if label not in targets:
                continue
            t = targets[label]
            res = t.get("results")
            single, multi = _median(res, SINGLE, "decode_tok_s_per_stream"), _median(res, MULTI, "aggregate_tok_s")
            rows.append(Row(name, label, single, multi, ratio(single, ref_single), ratio(multi, ref_multi),
                            ratio(single, roof), _median(res, SINGLE, "ttft_ms_mean"), _measured(t), predicted,
                            t.get("error")))
    return rows


def _num(value: float | None, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _gib(value: int | None) -> str:
    return _num(value / GiB if value is not None else None, ".2f")


COLUMNS = (("config", 8, "<"), ("target", 15, "<"), ("1-stream tok/s", 14, ">"), ("4-way agg tok/s", 15, ">"),
           ("x llama-server 1/4", 18, ">"), ("% roofline", 10, ">"), ("TTFT ms", 8, ">"),
           ("mem GiB meas / pred", 20, ">"))


def format_table(rows: Sequence[Row], memory_label: str = "VRAM") -> str:
    """The one fixed-width table printed at the end; a failed phase shows its error under its row."""
    header = "  ".join(f"{(title.replace('mem', memory_label, 1)):{align}{width}}" for title, width, align in COLUMNS)
    lines = [header, "-" * len(header)]
    for r in rows:
        cells = (r.config, r.target, _num(r.single_tok_s, ".1f"), _num(r.multi_tok_s, ".1f"),
                 f"{_num(r.ratio_single, '.3f')} / {_num(r.ratio_multi, '.3f')}",
                 _num(100 * r.roofline_fraction if r.roofline_fraction is not None else None, ".1f"),
                 _num(r.ttft_ms, ".1f"), f"{_gib(r.memory_measured)} / {_gib(r.memory_predicted)}")
        lines.append("  ".join(f"{c:{align}{width}}" for c, (_, width, align) in zip(cells, COLUMNS, strict=True)))
        if r.error:
            lines.append(f"    ! {r.error[:200]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary (required unless --skip-llama-server)")
    p.add_argument("--configs", type=parse_configs, default=parse_configs("article,np4"),
                   help=f"comma list from {sorted(CONFIGS)} (default article,np4)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per stream (EOS ignored)")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds per level after a warm-up; median")
    p.add_argument("--threads", type=int, help="-t for llama-server and n_threads for ours (default: each its own)")
    p.add_argument("--skip-llama-server", action="store_true")
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--serve-preload-libllama", action="store_true",
                   help="LD_PRELOAD libllama.so into Ray's workers (libllama before numpy; see serving/llama.py)")
    p.add_argument("--bw-gib", type=float, help="bandwidth buffer size (default 4 GiB on GPU, 1 GiB on CPU)")
    p.add_argument("--bw-repeats", type=int, default=20, help="timed copies after warm-up (median)")
    p.add_argument("--load-timeout", type=float, default=600.0, help="seconds for a model to load / a server start")
    p.add_argument("--phase-timeout", type=float, default=1500.0, help="seconds for one target's whole phase")
    p.add_argument("--round-timeout", type=float, default=300.0, help="seconds for one round of streams")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per HTTP read")
    p.add_argument("--json-out", default="results/bench_device.json")
    p.add_argument("--commit", help="repo commit to record (the GPU machine's copy has no .git)")
    return p


def initial_report(args: argparse.Namespace, gpu: GpuMemory) -> dict[str, Any]:
    """Who, where, what: the facts a figure needs to be reproduced and judged."""
    llama_mod = sys.modules.get("llama_cpp")
    version = bs.llama_server_version(args.llama_server) if args.llama_server else None
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "python": platform.python_version(),
        "repo_commit": repo_commit(args.commit),
        "device": {"kind": "gpu", **gpu.info} if gpu.present else {"kind": "cpu", "name": cpu_model(),
                                                                   "cpu_count": os.cpu_count()},
        "llama_server": {"binary": args.llama_server, "version": version, "commit": llama_cpp_commit(version)},
        "llama_cpp_python": getattr(llama_mod, "__version__", None),
        "serving_import_error": SERVING_IMPORT_ERROR,
        "env": {k: os.environ.get(k) for k in ENV_KEYS if os.environ.get(k) is not None},
        "workload": {"max_tokens": args.max_tokens, "repeats": args.repeats, "concurrency": [SINGLE, MULTI],
                     "endpoint": "/v1/completions", "temperature": 0.0, "ignore_eos": True, "stream": True,
                     "statistic": "median of repeats after one warm-up round per level"},
        "memory_measured_as": ("GPU memory used (all processes) minus the idle baseline at start" if gpu.present
                               else "RSS of the engine's process (llama-server; the in-process worker); "
                                    "not read for the Serve replica"),
        "errors": [], "configs": {},
    }


def new_run(args: argparse.Namespace) -> Run:
    """Probe the device and take the idle memory baseline before anything of ours touches it."""
    gpu = GpuMemory()
    run = Run(args, gpu, initial_report(args, gpu))
    run.baseline = gpu.used() if gpu.present else None
    run.report["memory_baseline_bytes"] = run.baseline
    run.report["other_gpu_processes_at_start"] = gpu.process_count() if gpu.present else None
    return run


async def main_async(run: Run) -> None:
    """Model facts, bandwidth, then each config on each target; Serve torn down at the end."""
    dev = run.report["device"]
    say(f"device: {dev.get('name')} ({dev['kind']}); llama-server: {run.report['llama_server']['version']}; "
        f"commit {run.report['repo_commit']}")
    model_facts(run)
    run.save()
    try:
        await phase_bandwidth(run)
        for cfg in run.args.configs:
            await bench_config(run, cfg)
    finally:
        stop_serve(run)


def finish(run: Run) -> None:
    """Print the table, store it in the report, write the JSON."""
    rows = build_rows(run.report)
    run.report["table"] = [dataclasses.asdict(r) for r in rows]
    run.save()
    roof = run.report.get("roofline_tok_s_single_stream")
    bw = (run.report.get("bandwidth") or {}).get("bytes_per_s")
    print()
    print(f"device: {run.report['device'].get('name')}   bandwidth: {_num(bw / 1e9 if bw else None, '.1f')} GB/s "
          f"(read+write)   single-stream roofline: {_num(roof, '.1f')} tok/s")
    print(format_table(rows, "VRAM" if run.on_gpu else "RSS"))
    if run.report["errors"]:
        print(f"{len(run.report['errors'])} error(s); see 'errors' in the JSON")
    print(f"wrote {run.args.json_out}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--in-process-worker"]:
        return asyncio.run(in_process_worker(json.loads(argv[1])))
    if argv[:1] == ["--bandwidth-worker"]:
        w = argparse.ArgumentParser()
        w.add_argument("device", choices=("cuda", "cpu"))
        w.add_argument("--bw-gib", type=float, required=True)
        w.add_argument("--bw-repeats", type=int, required=True)
        wa = w.parse_args(argv[1:])
        return bandwidth_worker(wa.device, wa.bw_gib, wa.bw_repeats)
    args = build_parser().parse_args(argv)
    if not args.skip_llama_server and not args.llama_server:
        raise SystemExit("error: pass --llama-server PATH (or --skip-llama-server)")
    if args.model is None:
        from serving.config import embedded_model_path

        args.model = embedded_model_path()
    args.model = args.model.resolve()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(_main_with_signals(args))


async def _main_with_signals(args: argparse.Namespace) -> int:
    """SIGTERM cancels the run: servers and engines are stopped, and the table of what was measured is printed."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    run = new_run(args)
    try:
        await main_async(run)
    except asyncio.CancelledError:
        say("cancelled: stopped early; the table and JSON hold what was measured so far")
        finish(run)
        return 143
    finish(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
