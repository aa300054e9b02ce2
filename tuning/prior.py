"""A prediction of which configs of the space are fastest, from what the project already models: the memory model
(serving/engine/memory.py) and the bandwidth roofline (measure/device.py, `roofline_tok_s`).

Decode is bound by memory bandwidth: one stream's token reads every weight once and the K/V of its context, so
single-stream tok/s ~ bandwidth / (weights + K/V bytes per cell x depth); N streams decoding together read the
weights once per step and each its own K/V, so the aggregate ~ N x bandwidth / (weights + N x K/V x depth). The
bandwidth is the same for every config of a study, so the ranking needs none measured: the predicted rates are
kept in tokens per byte of bandwidth. A config the memory model puts over the budget is never proposed.

What the prediction cannot rank, it calls a tie: settings it says nothing about (batch sizes, flash attention,
one K/V buffer or one per slot, the context per slot beyond whether it fits), and rates within TIE_STEP of each
other (on a small model at a short depth the K/V types move the rate by a fraction of a percent: a real but
unmeasurable difference). Ties are broken by the seed, so each seed walks the same tie groups in another order.
Quality is not in the prediction: a quantised K/V cache reads fewer bytes, and the quality probe may refuse it
(tuning/prior_sampler.py skips the K/V types a trial of the study already found too lossy).

Pure: no Optuna, no Ray, no libllama.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from serving.engine.config import CacheType, EngineConfig, FlashAttn
from serving.engine.memory import CACHE_TYPE_BYTES, ModelShape, predict
from tuning.space import SearchSpace, to_engine_config

TIE_STEP = 0.01  # predicted rates within 1% of each other are one tie group: the roofline is not that exact
PROMPT_TOKENS = 32  # about what the fixed benchmark's prompts hold (measure/workload.py's plain set)


@dataclass(frozen=True)
class Prediction:
    """One point's roofline rates, in tokens per byte of bandwidth (multiply by bytes/s for tok/s)."""

    single: float
    aggregate: float


@dataclass(frozen=True)
class Ranked:
    """A point of the space (tuning/space.py's `suggest` names) with its prediction."""

    point: dict[str, Any]
    prediction: Prediction


def kv_bytes_per_cell(shape: ModelShape, type_k: CacheType, type_v: CacheType) -> float:
    """K and V bytes of one token over all layers that cache them: what a decoded token reads per token of depth."""
    return shape.n_layer_kv * shape.n_head_kv * (
        shape.head_dim_k * CACHE_TYPE_BYTES[type_k] + shape.head_dim_v * CACHE_TYPE_BYTES[type_v])


def predict_rates(shape: ModelShape, config: EngineConfig, depth: int, streams: int) -> Prediction:
    """The roofline at `depth` tokens of context: one stream, and min(streams, slots) streams decoding together
    (more streams than slots queue, so the slots bound the aggregate)."""
    kv = kv_bytes_per_cell(shape, config.type_k, config.type_v) * depth
    weights = shape.bytes_read_per_token
    n = max(1, min(streams, config.n_parallel))
    return Prediction(single=1.0 / (weights + kv), aggregate=n / (weights + n * kv))


def points(space: SearchSpace, contexts: Sequence[int]) -> Iterator[dict[str, Any]]:
    """Every distinct engine config of the space over the settings the prediction or the fit reads, in the
    space's order: n_ubatch only up to n_batch (a larger one is clamped to it: the same engine), flash attention
    on with a quantised V cache (llama.cpp needs it), kv_unified only with two or more slots."""
    seen: set[tuple[Any, ...]] = set()
    for n_parallel, n_batch, n_ubatch, ctx, type_k, type_v in itertools.product(
            space.n_parallel, space.n_batch, space.n_ubatch, contexts, space.type_k, space.type_v):
        engine = (n_parallel, n_batch, min(n_ubatch, n_batch), ctx, type_k, type_v)
        if engine in seen:
            continue  # a larger n_ubatch clamped to n_batch: the same engine as one already listed
        seen.add(engine)
        flashes = [FlashAttn.on] if type_v.is_quantized else space.flash_attn
        layouts: Sequence[bool | None] = space.kv_unified if n_parallel > 1 else [None]
        for flash, unified in itertools.product(flashes, layouts):
            point: dict[str, Any] = {"n_parallel": n_parallel, "n_batch": n_batch, "n_ubatch": n_ubatch,
                                     "ctx_per_slot": ctx, "type_k": type_k.value, "type_v": type_v.value,
                                     "flash_attn": flash.value}
            if unified is not None:
                point["kv_unified"] = unified
            yield point


def _tier(rate: float) -> int:
    """The tie group of a predicted rate: rates within TIE_STEP share one."""
    return round(math.log(rate) / math.log1p(TIE_STEP))


def rank(space: SearchSpace, contexts: Sequence[int], shape: ModelShape, base: EngineConfig, budget: int,
         on_gpu: bool, depth: int, streams: int, single_first: bool, seed: int) -> list[Ranked]:
    """The space's configs that fit `budget`, best predicted first: by the aggregate at `streams` streams, then
    the single stream (`single_first`: the other way round), each in tie groups of TIE_STEP; ties in the order
    the seed shuffles them into."""
    shuffle = random.Random(seed)
    ranked = []
    for point in points(space, contexts):
        config = to_engine_config(point, base)
        if predict(shape, config, on_gpu).total > budget:
            continue
        ranked.append((Ranked(point, predict_rates(shape, config, depth, streams)), shuffle.random()))

    def key(item: tuple[Ranked, float]) -> tuple[int, int, float]:
        p = item[0].prediction
        first, second = (p.single, p.aggregate) if single_first else (p.aggregate, p.single)
        return -_tier(first), -_tier(second), item[1]

    return [r for r, _ in sorted(ranked, key=key)]


def workload_depth(gen_tokens: int, requests: Sequence[tuple[int, int]] = ()) -> int:
    """The context a decoded token sees on average: a traffic workload's mean prompt plus half its output
    (`requests`: (prompt, output) tokens), else the fixed benchmark's prompt plus half its `gen_tokens`."""
    if requests:
        return round(sum(p + o / 2 for p, o in requests) / len(requests))
    return PROMPT_TOKENS + gen_tokens // 2
