"""What the device says: memory in use, clocks, throttling, other tenants (NVML), resident memory on CPU,
and the copy bandwidth that sets the single-stream decode roofline.

One NVML wrapper for the tuner's trials (tuning/device.py) and the device benchmark (scripts/bench_device.py).
Bandwidth runs in a child process (`python -m measure.device --bandwidth ...`), so the measuring process holds
no CUDA context or cached allocation that would then count as an engine's memory, and a hung copy is killed
by a plain timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

GiB = 1 << 30
# NVML clock-event bits that mean "slower than it should be" (idle and user-set clocks are not)
_THROTTLE_BITS = {
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
}


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident memory of a process (this one by default), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def visible_gpu_indices() -> list[int]:
    """NVML indices of the GPUs this process was given (Ray and the caller set CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v for v in visible.split(",") if v.strip().isdigit()]
    return [int(v) for v in ids] or [0]


class Gpu:
    """The GPUs this process was given, through NVML. `Gpu.open()` is None where there is none."""

    def __init__(self, nvml: Any, indices: Sequence[int]) -> None:
        self._nv = nvml
        self.indices = list(indices)
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]

    @classmethod
    def open(cls, indices: Sequence[int] | None = None) -> Gpu | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() == 0:
                return None
            return cls(pynvml, indices if indices is not None else visible_gpu_indices())
        except Exception:  # no driver, no library, no device: a CPU machine
            return None

    def info(self) -> dict[str, Any]:
        nv, handle = self._nv, self._handles[0]
        return {"name": _text(nv.nvmlDeviceGetName(handle)), "driver": _text(nv.nvmlSystemGetDriverVersion()),
                "memory_total_bytes": int(nv.nvmlDeviceGetMemoryInfo(handle).total),
                "count": int(nv.nvmlDeviceGetCount()), "indices": self.indices}

    def smallest_total_on_machine(self) -> int:
        """The smallest total memory over every GPU of this machine, given to this process or not."""
        nv = self._nv
        return min(int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).total)
                   for i in range(nv.nvmlDeviceGetCount()))

    def used(self) -> int:
        """Bytes in use on these devices, by every process."""
        return sum(int(self._nv.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles)

    def process_memory(self, pid: int) -> int | None:
        """GPU memory of one process, where the driver reports it (not in every container)."""
        found = [p.usedGpuMemory for h in self._handles for p in self._nv.nvmlDeviceGetComputeRunningProcesses(h)
                 if p.pid == pid and p.usedGpuMemory is not None]
        return sum(found) if found else None

    def other_processes(self, pid: int) -> list[int]:
        """Compute processes on these devices other than `pid` (another tenant makes every figure suspect)."""
        return [p.pid for h in self._handles for p in self._nv.nvmlDeviceGetComputeRunningProcesses(h)
                if p.pid != pid]

    def state(self) -> dict[str, Any]:
        """Clocks, temperature, throttling (the first device), and whether another process shares them."""
        nv, handle = self._nv, self._handles[0]
        reasons = nv.nvmlDeviceGetCurrentClocksEventReasons(handle)
        throttles = [name for bit, name in _THROTTLE_BITS.items() if reasons & bit]
        return {
            "sm_clock_mhz": nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),
            "mem_clock_mhz": nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM),
            "sm_clock_max_mhz": nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM),
            "temperature_c": nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU),
            "throttle_reasons": ",".join(throttles),
            "throttled": bool(throttles),
            "shared": bool(self.other_processes(os.getpid())),
        }


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def gpu_memory_total() -> int | None:
    """The smallest total memory over this machine's GPUs (the tuner's default budget), or None."""
    gpu = Gpu.open()
    return gpu.smallest_total_on_machine() if gpu is not None else None


# -- bandwidth and the roofline -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Bandwidth:
    """Copy bandwidth from timed copies of one buffer: each copy reads AND writes `buffer_bytes`."""

    buffer_bytes: int
    copies: int
    median_s: float
    bytes_per_s: float
    best_bytes_per_s: float
    worst_bytes_per_s: float
    method: str = ""

    @classmethod
    def of(cls, buffer_bytes: int, seconds: Sequence[float], method: str = "") -> Bandwidth:
        times = [t for t in seconds if t > 0]
        if not times:
            raise ValueError("no positive copy time to compute a bandwidth from")
        moved = 2 * buffer_bytes
        median = statistics.median(times)
        return cls(buffer_bytes, len(times), median, moved / median, moved / min(times), moved / max(times), method)


def roofline_tok_s(bytes_per_s: float | None, bytes_per_token: int | None) -> float | None:
    """Single-stream decode ceiling: every weight byte read once per token at the measured bandwidth."""
    if not bytes_per_s or not bytes_per_token or bytes_per_token <= 0:
        return None
    return bytes_per_s / bytes_per_token


def _copy_times_cuda(n_bytes: int, repeats: int, warmup: int = 3) -> tuple[list[float], str]:
    """Device-to-device copies timed with CUDA events."""
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


def _copy_times_host(n_bytes: int, repeats: int, warmup: int = 2) -> tuple[list[float], str]:
    """numpy copies of a host buffer (the warm-up also faults in the destination's pages)."""
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


def measure_bandwidth(cuda: bool, gib: float, repeats: int, timeout_s: float) -> Bandwidth:
    """Copy bandwidth measured in a child Python; a failure raises with its stderr's tail."""
    cmd = [sys.executable, "-m", "measure.device", "--bandwidth", "cuda" if cuda else "cpu", "--gib", str(gib),
           "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"the bandwidth child exited {proc.returncode}: {tail}")
    return Bandwidth(**json.loads(lines[-1]))


def _bandwidth_child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.device")
    parser.add_argument("--bandwidth", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--gib", type=float, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    args = parser.parse_args(argv)
    n_bytes = int(args.gib * GiB)
    copy = _copy_times_cuda if args.bandwidth == "cuda" else _copy_times_host
    times, method = copy(n_bytes, args.repeats)
    print(json.dumps(asdict(Bandwidth.of(n_bytes, times, method))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_bandwidth_child(sys.argv[1:]))
