"""Test helpers. Those that collect a generation FAIL on an error chunk: a test that passes on an error path
(an errored generation returning "" that happens to differ from something) is the worst kind."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from serving.engine.request import FinishReason, GenerationChunk, RequestHandle, Usage

WAIT_S = 120.0  # per chunk: a hang fails the test instead of the whole run
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(name: str) -> Iterator[ModuleType]:
    """A script of scripts/ imported as a module (scripts/ is not a package: it is on the path just for the
    import), for a fixture to `yield from`."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))


@dataclass
class Generation:
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    usage: Usage | None


def collect(handle: RequestHandle, allow: tuple[FinishReason, ...] = (FinishReason.stop, FinishReason.length)
            ) -> Generation:
    """Read a handle to its end; assert it ended in one of `allow` (never silently on an error)."""
    chunks: list[GenerationChunk] = []
    while not handle.finished:
        chunks.append(handle.get(timeout=WAIT_S))
    last = chunks[-1]
    if FinishReason.error not in allow:
        assert last.finish_reason != FinishReason.error, f"the generation failed: {last.error}"
    assert last.finish_reason in allow, f"ended with {last.finish_reason}, expected one of {allow}"
    return Generation("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                      last.finish_reason, last.usage)
