"""What fits a VRAM budget, predicted from the GGUF header alone (serving/engine/memory.py, the searches in
serving/engine/fit.py): the most layers on the GPU, and for a mixture of experts the fewest layers whose experts
must move to host memory. The starting points of a placement search, and the naive answer it is measured against.

    python -m tuning.fit --model moe.gguf --vram-budget 8GiB [--engine n_parallel=2 --engine n_ctx=4096 ...]

prints one JSON object: {"n_gpu_layers": K, "n_cpu_moe": N or null, "predicted": {...}} (null where nothing fits).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from serving.engine.config import load_engine_config
from serving.engine.fit import fewest_expert_layers, most_layers
from serving.engine.memory import ModelShape, predict
from serving.engine.units import parse_bytes

ARTICLE_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "article.yaml"


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
