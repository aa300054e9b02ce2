"""What the device says during a trial: memory in use, clocks, temperature, throttling, other tenants.

On a GPU (NVML): this process's GPU memory (in place, the whole device's), and the state that makes a
measurement untrustworthy: clocks held down (thermal, power, hardware slowdown) or another process on
the same GPU. On CPU: the growth of this process's resident memory since just before the engine loaded
(in place, all of it).
"""

from __future__ import annotations

import os
from typing import Any

# NVML clock-event bits that mean "slower than it should be" (idle and user-set clocks are not)
_THROTTLE_BITS = {
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def gpu_indices() -> list[int]:
    """NVML indices of the GPUs this process was given (Ray sets CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v for v in visible.split(",") if v.strip().isdigit()]
    return [int(v) for v in ids] or [0]


class DeviceProbe:
    """Reads memory and device state for the current process."""

    def __init__(self, on_gpu: bool, whole_device: bool = False) -> None:
        self.on_gpu, self.whole_device = on_gpu, whole_device
        self._baseline = 0
        self._nvml: Any = None  # the pynvml module, on a GPU
        if on_gpu:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpu_indices()]

    def mark_baseline(self) -> None:
        """Remember memory in use before the engine loads, so it is not counted as the engine's."""
        self._baseline = self._device_used() if self.on_gpu else rss_bytes()

    def memory_in_use(self) -> int:
        """The engine's memory: this process's GPU memory (NVML), else growth over the baseline; with
        `whole_device`, all the GPU memory in use (every process's), or this process's resident memory."""
        if self.whole_device:
            return self._device_used() if self.on_gpu else rss_bytes()
        if not self.on_gpu:
            return rss_bytes() - self._baseline
        own = self._own_gpu_memory()
        return own if own is not None else self._device_used() - self._baseline

    def _own_gpu_memory(self) -> int | None:
        total, found = 0, False
        for handle in self._handles:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    total += proc.usedGpuMemory
                    found = True
        return total if found else None

    def _device_used(self) -> int:
        return sum(self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles)

    def state(self) -> dict[str, Any]:
        """Clocks, temperature and the two flags the report marks: throttled, shared."""
        if not self.on_gpu:
            return {"throttled": False, "shared": False}
        nv, handle = self._nvml, self._handles[0]
        reasons = nv.nvmlDeviceGetCurrentClocksEventReasons(handle)
        throttles = [name for bit, name in _THROTTLE_BITS.items() if reasons & bit]
        others = [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid != os.getpid()]
        return {
            "sm_clock_mhz": nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),
            "mem_clock_mhz": nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM),
            "sm_clock_max_mhz": nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM),
            "temperature_c": nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU),
            "throttle_reasons": ",".join(throttles),
            "throttled": bool(throttles),
            "shared": bool(others),
        }


def gpu_memory_total() -> int | None:
    """The smallest total memory over this machine's GPUs (the default budget's base), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            sizes = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                     for i in range(count)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return min(sizes) if sizes else None
