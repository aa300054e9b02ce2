"""What a step of k rows of one sequence costs against one row: the figure speculative decoding lives on
(a verify of k - 1 guesses is a k-row step), timed through the engine's own context (serving/engine/llama.py)
by scripts/bench_verify.py (bursts of one k) and scripts/spec_ceiling.py (amid one-row steps, as speculation
meets it).
"""

from __future__ import annotations

import statistics
import time

from serving.engine.llama import LlamaContext, LlamaModel  # first: the library load order
from serving.engine.config import EngineConfig, default_threads  # noqa: E402
from serving.engine.repack import use_extra_bufts  # noqa: E402

def timed_decode(ctx: LlamaContext, tokens: list[int], pos: int) -> float:
    """Seconds one llama_decode of `tokens` at `pos` (sequence 0) takes, its logits read back as the scheduler
    reads them: the unit every verify cost is made of."""
    ctx.clear_batch()
    ctx.batch.add(tokens, pos, 0, logits_for_last=True, logits_for_all=True)
    t0 = time.perf_counter()
    if ctx.decode() != 0:
        raise SystemExit("llama_decode failed")
    _ = ctx.logits(len(tokens) - 1)[0]  # the result is read back, as the scheduler does
    return time.perf_counter() - t0


def prefill(ctx: LlamaContext, tokens: list[int], n_batch: int) -> None:
    """Cache `tokens` for sequence 0 from position 0, `n_batch` a decode (what the context's batch holds): the
    depth a verify is timed at, untimed. One decode of the whole depth overflowed the batch at 64k."""
    for start in range(0, len(tokens), n_batch):
        chunk = tokens[start:start + n_batch]
        ctx.clear_batch()
        ctx.batch.add(chunk, start, 0, logits_for_last=True)
        if ctx.decode() != 0:
            raise SystemExit(f"llama_decode failed caching {len(tokens)} tokens (at {start})")


REPEATS = 7  # timed decodes per row count (median kept), after one untimed


def row_costs(config: EngineConfig, depth: int, most: int) -> dict[int, float]:
    """Seconds a step of k rows of one sequence costs amid one-row steps, as speculation runs, with `depth`
    cells cached, k = 1..most: for k = 1 a one-row decode after another (on a GPU one row replays a captured
    graph), for k > 1 the k-row decode plus what it adds to the one-row decode after it (which may have to
    rebuild its graph). Medians of REPEATS, the order of k alternated (drift hits every k alike)."""
    model = LlamaModel(config.model_path, config.n_gpu_layers, use_extra_bufts(config))
    ctx = LlamaContext(model, config.model_copy(update={"n_parallel": 1}), default_threads())
    vocab = model.n_vocab
    token = [(3 + 7 * j) % (vocab - 10) + 5 for j in range(most + 3)]
    try:
        prefill(ctx, [(17 + 31 * i) % (vocab - 10) + 5 for i in range(depth)], config.n_batch)
        one: list[float] = []
        verify: dict[int, list[float]] = {k: [] for k in range(2, most + 1)}
        after: dict[int, list[float]] = {k: [] for k in range(2, most + 1)}
        for r in range(REPEATS + 1):
            for k in verify if r % 2 else reversed(verify):
                timed_decode(ctx, token[:1], depth)
                lone = timed_decode(ctx, token[1:2], depth + 1)
                rows = timed_decode(ctx, token[2:2 + k], depth + 2)
                next_one = timed_decode(ctx, token[2 + k:3 + k], depth + 2 + k)
                ctx.forget(0, depth)
                if r:  # the first round is a warm-up
                    one.append(lone)
                    verify[k].append(rows)
                    after[k].append(next_one)
        t1 = statistics.median(one)
        return {1: t1, **{k: statistics.median(verify[k]) + statistics.median(after[k]) - t1 for k in verify}}
    finally:
        ctx.free()
        model.free()
