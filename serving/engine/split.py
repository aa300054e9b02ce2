"""One model over several GPUs: each GPU's part of what the memory model predicts for the whole
(serving/engine/memory.py), as llama.cpp spreads a model by split_mode, tensor_split and main_gpu.

- `layer` (llama.cpp's default): each GPU holds whole layers and their K/V, in the proportion of tensor_split, or
  where none is set of each GPU's free memory (llama_model_load's default). Each GPU runs its layers' part of the
  graph, so each reserves a compute buffer (at most the largest stage: counted whole on each) and has a CUDA
  runtime of its own.
- `row`: each weight matrix's rows are split by the same proportion; the K/V cache and the compute buffer stay on
  main_gpu, which runs the graph; every GPU has its runtime.
- `none`: main_gpu holds everything offloaded.

The fit at start (serving/engine/fit.py) checks every GPU against its own free memory with these parts: a model
split 3:1 over two equal cards is bounded by the first card, not by the sum of both.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.engine.config import EngineConfig, SplitMode
from serving.engine.memory import GPU_RUNTIME_OVERHEAD, MemoryEstimate


def shares(config: EngineConfig, free: Sequence[int]) -> tuple[float, ...]:
    """Each GPU's fraction of the split (summing to 1): main_gpu's alone for `none` (or one GPU); else
    tensor_split's, normalised (GPUs past its end get none), or where it is unset each GPU's free memory."""
    count = len(free)
    if config.split_mode is SplitMode.none or count == 1:
        main = min(config.main_gpu, count - 1)
        return tuple(1.0 if i == main else 0.0 for i in range(count))
    given = (list(config.tensor_split) + [0.0] * count)[:count]
    weights = given if any(given) else [float(max(f, 0)) for f in free]
    total = sum(weights)
    return tuple(w / total for w in weights) if total > 0 else tuple(1.0 / count for _ in range(count))


def per_gpu(estimate: MemoryEstimate, config: EngineConfig, split: Sequence[float]) -> tuple[int, ...]:
    """Bytes each GPU holds of `estimate` (a GPU prediction of the whole model) at `split` (from `shares`); a GPU
    with no share holds nothing."""
    main = min(config.main_gpu, len(split) - 1)
    runtime = estimate.overhead
    if config.split_mode is SplitMode.row:
        return tuple(int(s * estimate.weights) + (estimate.kv_cache + estimate.compute if i == main else 0)
                     + (runtime if s > 0 or i == main else 0) for i, s in enumerate(split))
    spread = estimate.weights + estimate.kv_cache
    return tuple(int(s * spread) + estimate.compute + runtime if s > 0 else 0 for s in split)


def equivalent_total(free: Sequence[int], split: Sequence[float]) -> int:
    """The whole-model prediction (memory.py's total, one runtime counted) the GPUs hold at `split`: the tightest
    GPU's free memory over its share, less the runtime each further GPU carries beside it. The fit's first
    estimate and what its log line reports; every GPU is then checked on its own (`per_gpu`)."""
    used = [(f, s) for f, s in zip(free, split, strict=True) if s > 0]
    return max(int(min((f - GPU_RUNTIME_OVERHEAD) / s for f, s in used)) + GPU_RUNTIME_OVERHEAD, 0)
