"""The engine's state as one typed record: slots, queue, counters, the prompt cache, the config. Read by
attribute inside the server (the replica's metrics, its summary for /slots) and turned into JSON only at the
edge (`as_dict`: what /slots shows). Pure data: importing it loads no libllama."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from serving.engine.config import EngineConfig
from serving.engine.prompt_cache import PromptCacheStats
from serving.engine.scheduler import Counters, SlotView


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /slots, the metrics and the tests; cheap, never blocks the step thread."""

    config: EngineConfig
    n_ctx_slot: int
    weight_loads: int
    slots: list[SlotView]
    slots_busy: int
    queue_depth: int
    counters: Counters  # a copy: the scheduler's own go on counting
    spec_acceptance: float | None = None  # accepted / drafted guesses since start; None before any guess
    prompt_cache: PromptCacheStats | None = None  # the host-RAM prompt cache's counts; None when off

    @property
    def cells_cached(self) -> int:
        """K/V cells that hold a slot's tokens now, over every slot."""
        return sum(slot.n_cached for slot in self.slots)

    def as_dict(self) -> dict[str, Any]:
        """The JSON /slots shows (llama-server's field names where they exist)."""
        return {
            "config": self.config.to_yaml_dict(), "n_ctx_slot": self.n_ctx_slot, "weight_loads": self.weight_loads,
            "slots": [{**asdict(v), "state": v.state.value} for v in self.slots], "slots_busy": self.slots_busy,
            "queue_depth": self.queue_depth, "counters": asdict(self.counters),
            "spec_acceptance": self.spec_acceptance,
            "prompt_cache": asdict(self.prompt_cache) if self.prompt_cache is not None else None,
        }
