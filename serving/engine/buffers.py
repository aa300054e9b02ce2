"""What llama.cpp itself says it allocated: its load log's "<buffer type> <kind> buffer size = N MiB" lines, for
the weights (`model`, per buffer type: CPU_Mapped, CPU_REPACK, AMX, CUDA0, ...), the K/V cache (`KV`), the
compute buffers (`compute`) and the logits (`output`).

The memory model (serving/engine/memory.py) predicts these terms from the GGUF header; this is what they came to, so a
placement whose VRAM differs from its prediction says which term was off. It reads Python logging
(serving/engine/llama.py routes llama.cpp's log to the "llama.cpp" logger), so importing it loads no libllama.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

LLAMA_LOGGER = "llama.cpp"  # serving/engine/llama.py's logger for llama.cpp's own log


class BufferLog(logging.Handler):
    """Collects llama.cpp's buffer-size lines as {kind: {buffer type: MiB}} (a kind's buffers summed over the
    models and contexts loaded while attached)."""

    _LINE = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size =\s*([\d.]+) MiB")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.buffers: dict[str, dict[str, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = self._LINE.search(record.getMessage())
        if match:
            by_type = self.buffers.setdefault(match[2], {})
            by_type[match[1]] = by_type.get(match[1], 0.0) + float(match[3])


@contextlib.contextmanager
def llama_buffers() -> Iterator[dict[str, dict[str, float]]]:
    """MiB per kind and buffer type that llama.cpp reported for what was loaded inside the block (any thread)."""
    handler, llama_log = BufferLog(), logging.getLogger(LLAMA_LOGGER)
    level = llama_log.level
    llama_log.addHandler(handler)
    llama_log.setLevel(logging.DEBUG)
    try:
        yield handler.buffers
    finally:
        llama_log.removeHandler(handler)
        llama_log.setLevel(level)
