"""What a trial reads of the device (through measure/device.py): the engine's memory, and the state that
makes a measurement untrustworthy (clocks held down, another process on the same GPU).

On a GPU: this process's GPU memory (in place, the whole device's, weights included). On CPU: the growth of
this process's resident memory since just before the engine loaded (in place, all of it).
"""

from __future__ import annotations

import os
from typing import Any

from measure.device import Gpu, rss_bytes


class DeviceProbe:
    """Reads memory and device state for the current process."""

    def __init__(self, on_gpu: bool, whole_device: bool = False) -> None:
        self.whole_device = whole_device
        self._baseline = 0
        self._gpu = Gpu.open() if on_gpu else None
        if on_gpu and self._gpu is None:
            raise RuntimeError("a GPU trial, but NVML finds no GPU for this process")

    def mark_baseline(self) -> None:
        """Remember memory in use before the engine loads, so it is not counted as the engine's."""
        self._baseline = self._gpu.used() if self._gpu is not None else _rss()

    def memory_in_use(self) -> int:
        """The engine's memory: this process's GPU memory (NVML), else growth over the baseline; with
        `whole_device`, all the GPU memory in use (every process's), or this process's resident memory."""
        gpu = self._gpu
        if self.whole_device:
            return gpu.used() if gpu is not None else _rss()
        if gpu is None:
            return _rss() - self._baseline
        own = gpu.process_memory(os.getpid())
        return own if own is not None else gpu.used() - self._baseline

    def state(self) -> dict[str, Any]:
        """Clocks, temperature and the two flags the report marks: throttled, shared."""
        if self._gpu is None:
            return {"throttled": False, "shared": False}
        return self._gpu.state()


def _rss() -> int:
    rss = rss_bytes()
    if rss is None:
        raise RuntimeError("cannot read this process's resident memory (/proc/self/statm)")
    return rss
