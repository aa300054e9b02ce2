"""The memory an engine finds where it runs: the GPUs this process may use (CUDA_VISIBLE_DEVICES), read with NVML,
and the host memory available. The engine sizes its `auto` settings from them when it loads (serving/engine/fit.py),
and the replica lists the GPUs in /slots (serving/replica/node.py): one reader for both, so both see the same
devices. Without a driver (a CPU-only machine) there are no GPUs, never an error."""

from __future__ import annotations

import os
from dataclasses import dataclass

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
MEMINFO = "/proc/meminfo"


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU as NVML sees it on this node."""

    index: int
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int = 0  # what a new allocation can take now (NVML's free: total less used and reserved)


def visible_gpus(visible: str | None = None) -> tuple[DeviceMemory, ...]:
    """NVML's view of the GPUs this process may use: `visible` (default: $CUDA_VISIBLE_DEVICES) names them by
    index or UUID; all when it is unset, none when it is empty."""
    visible = os.environ.get(VISIBLE_DEVICES) if visible is None else visible
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return ()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        wanted = None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]
        found = []
        for index, handle in enumerate(handles):
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            if wanted is not None and str(index) not in wanted and uuid not in wanted:
                continue
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            found.append(DeviceMemory(index, _text(pynvml.nvmlDeviceGetName(handle)), int(memory.total),
                                      int(memory.used), int(memory.free)))
        return tuple(found)
    except Exception:
        return ()
    finally:
        pynvml.nvmlShutdown()


def available_memory() -> int:
    """Host memory a new allocation can take without swapping: the kernel's MemAvailable (free memory plus the
    page cache it can drop), else free pages."""
    try:
        with open(MEMINFO) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
