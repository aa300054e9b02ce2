"""What fits a VRAM budget, predicted from the GGUF header alone (serving/engine/memory.py): the most layers on the GPU,
and for a mixture of experts the fewest layers whose experts must move to host memory. The starting points of a
placement search, and the naive answer it is measured against.

    python -m tuning.fit --model moe.gguf --vram-budget 8GiB [--engine n_parallel=2 --engine n_ctx=4096 ...]

prints one JSON object: {"n_gpu_layers": K, "n_cpu_moe": N or null, "predicted": {...}} (null where nothing fits).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path

from serving.engine.config import EngineConfig, load_engine_config
from serving.engine.memory import ModelShape, parse_bytes, predict

ARTICLE_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "article.yaml"


def _first(values: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    return next((v for v in values if fits(v)), None)


def most_layers(shape: ModelShape, config: EngineConfig, budget: int) -> int | None:
    """The largest n_gpu_layers (counting the output layer, as llama.cpp does) predicted within `budget`."""
    return _first(range(shape.n_layer + 1, -1, -1), lambda n: predict(
        shape, config.model_copy(update={"n_gpu_layers": n, "n_cpu_moe": 0}), on_gpu=True).total <= budget)


class ExpertEnd(str, Enum):
    """Which end of the model the layers whose experts live in host memory are taken from. `first`: layers
    0..N-1, llama-server's --n-cpu-moe; `last`: the N nearest the output, where its --fit puts them. At the same
    count and VRAM the speed can differ: on an H100, 29 of 48 layers' experts, last instead of first, ran four
    streams 1.19x faster with TTFT 0.53x, one stream the same (docs/log/2026-12-06-h100-sixth-run.md); so the
    tuner measures both."""

    first = "first"
    last = "last"

    def start(self, shape: ModelShape, n: int) -> int:
        """cpu_moe_start for `n` layers' experts at this end."""
        return 0 if self is ExpertEnd.first else max(shape.n_layer - n, 0)


def expert_placement(shape: ModelShape, n: int, end: ExpertEnd) -> dict[str, int]:
    """The engine settings that keep `n` layers' experts in host memory, taken from `end`."""
    return {"n_cpu_moe": n, "cpu_moe_start": end.start(shape, n)}


def fewest_expert_layers(shape: ModelShape, config: EngineConfig, budget: int,
                         end: ExpertEnd = ExpertEnd.first) -> int | None:
    """The smallest n_cpu_moe (all layers on the GPU otherwise), its layers taken from `end`, predicted within
    `budget`; None for a dense model, or when even every layer's experts in host memory do not fit."""
    if not shape.n_expert:
        return None
    return _first(range(shape.n_layer + 1), lambda n: predict(
        shape, config.model_copy(update={"n_gpu_layers": -1, **expert_placement(shape, n, end)}),
        on_gpu=True).total <= budget)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--vram-budget", type=parse_bytes, required=True, help="e.g. 8GiB")
    p.add_argument("--config", type=Path, default=ARTICLE_CONFIG, help="engine config (default: the article's)")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="engine setting over it")
    args = p.parse_args(argv)
    config = load_engine_config(args.config, {**dict(w.split("=", 1) for w in args.engine), "model": str(args.model)})
    shape = ModelShape.from_gguf(args.model)
    layers = most_layers(shape, config, args.vram_budget)
    experts = fewest_expert_layers(shape, config, args.vram_budget)
    predicted = {name: predict(shape, config.model_copy(update=update), on_gpu=True).as_dict()
                 for name, update in (("n_gpu_layers", {"n_gpu_layers": layers}), ("n_cpu_moe", {"n_cpu_moe": experts}))
                 if update[name] is not None}
    print(json.dumps({"n_gpu_layers": layers, "n_cpu_moe": experts, "predicted": predicted}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
