#!/usr/bin/env python3
"""What verifying k guessed tokens of ONE sequence costs: one llama_decode of k rows at a given depth, through
the engine's own context (serving/engine/llama.py), against one row. The figure speculative decoding lives on:
t(k) / t(1) rows -> how many accepted guesses pay for a verify.

    python scripts/bench_verify.py --model big.gguf --depth 512 --repeats 7 --out results/bench_verify.json

Prints median ms per decode for k = 1, 2, 4, 8, 16 (and 32 with --max-k 32) and, given the acceptance rate
prompt lookup reached elsewhere (--acceptance, e.g. from scripts/bench_spec.py on the real model), the
projected single-stream speed-up of a k-token draft: E[tokens per step] * t(1) / t(k + 1), with
E = (1 - a^(k+1)) / (1 - a) for per-token acceptance a. A projection, not a measurement.

t(1) at an agent's depth is also what the K/V type and flash attention cost a decoded token at long context
(the trade-off the tuner's 64k and 128k contexts meet), one run per pair:

    python scripts/bench_verify.py --model big.gguf --depth 65536 --max-k 1 --type-kv q8_0 --flash-attn on
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine.llama import LlamaContext, LlamaModel  # noqa: E402  (first: the library load order)
from measure.provenance import provenance, write_report  # noqa: E402
from measure.verify_cost import prefill, timed_decode  # noqa: E402
from serving.engine.config import CacheType, EngineConfig, FlashAttn  # noqa: E402
from serving.engine.config import default_threads  # noqa: E402
from serving.engine.repack import use_extra_bufts  # noqa: E402


BURST = 4  # decodes per k and round after the dropped first one


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--depth", type=int, default=512, help="tokens already cached")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--type-kv", default="f16", choices=[c.value for c in CacheType])
    parser.add_argument("--flash-attn", default=FlashAttn.on.value, choices=[f.value for f in FlashAttn],
                        help="flash attention (a quantised V cache needs it)")
    parser.add_argument("--acceptance", type=float, default=None, help="per-token acceptance for the projection")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_verify.json")
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, n_parallel=1, n_ctx=args.depth + 256, n_batch=512, n_ubatch=512,
                          type_k=args.type_kv, type_v=args.type_kv, flash_attn=FlashAttn(args.flash_attn))
    model = LlamaModel(config.model_path, config.n_gpu_layers, use_extra_bufts(config))
    ctx = LlamaContext(model, config, default_threads())
    vocab = model.n_vocab
    prompt = [(17 + 31 * i) % (vocab - 10) + 5 for i in range(args.depth)]
    prefill(ctx, prompt, config.n_batch)
    ks = [k for k in (1, 2, 4, 8, 16, 32) if k <= args.max_k]
    times: dict[int, list[float]] = {k: [] for k in ks}
    # Each k runs as a burst of consecutive decodes, the first of which is dropped: a change of batch shape
    # makes CUDA rebuild its graph (single-row decodes use CUDA graphs), which is not the cost of k rows.
    # Rounds alternate the order of k, so drift on a shared machine hits all of them alike.
    for r in range(args.repeats):
        for k in ks if r % 2 else reversed(ks):
            for i in range(BURST + 1):
                dt = timed_decode(ctx, [(3 + 7 * j) % (vocab - 10) + 5 for j in range(k)], args.depth)
                ctx.forget(0, args.depth)
                if i:
                    times[k].append(dt)
    median_ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    report: dict[str, object] = {"provenance": provenance(), "model": str(config.model_path),
                                 "depth": args.depth, "type_kv": args.type_kv, "flash_attn": args.flash_attn,
                                 "median_ms": median_ms,
                                 "ratio_to_one_row": {k: median_ms[k] / median_ms[1] for k in ks}}
    print("| k rows | ms per decode | x one row |")
    print("| --- | --- | --- |")
    for k in ks:
        print(f"| {k} | {median_ms[k]:.2f} | {median_ms[k] / median_ms[1]:.2f} |")
    if args.acceptance is not None:
        a = args.acceptance
        projection = {}
        for k in ks[:-1]:
            rows = next((r for r in ks if r >= k + 1), None)
            if rows is None:
                continue
            expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
            projection[k] = expected * median_ms[1] / median_ms[rows]
        report["projection"] = {"acceptance": a, "speedup_by_draft": projection,
                                "note": "projection from measured verify cost and an acceptance measured elsewhere"}
        print(f"projected single-stream speed-up at acceptance {a:.0%} (a projection): "
              + ", ".join(f"draft {k}: {x:.2f}x" for k, x in projection.items()))
    write_report(args.out, report)
    ctx.free()
    model.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
