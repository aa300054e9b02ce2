"""Sizes in bytes, as people write them ('32GiB', '16 GB'): read by the engine's config (vram_budget), the
memory model and the tuner's budgets. Imports nothing of the project, so any of them can use it."""

from __future__ import annotations

MiB = 1 << 20
GiB = 1 << 30


def parse_bytes(text: str) -> int:
    """'32GiB', '16 GB', '900MiB', '123456' -> bytes (GiB/MiB binary, GB/MB decimal)."""
    units = {"kib": 1 << 10, "mib": MiB, "gib": GiB, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1, "": 1}
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("kmgtib")
    unit = cleaned[len(number):]
    error = ValueError(f"cannot read '{text}' as a size: write e.g. 32GiB, 16GB or 900MiB")
    if unit not in units or not number:
        raise error
    try:
        value = float(number)
    except ValueError:
        raise error from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise error
    return int(value * units[unit])
