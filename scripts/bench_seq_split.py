#!/usr/bin/env python3
"""What a decode step costs by WHICH slots it carries, not only how many: one token each for a set of sequence
ids, through the engine's own context (serving/engine/llama.py, one K/V stream per slot, kv_unified off).

llama.cpp puts a batch's rows in one micro-batch only for consecutive sequence ids, in order
(llama_batch_allocr::split_equal, `sequential`): rows for slots 0 and 2 run as two graph evaluations. This
measures that: median ms per decode for each slot set, and its ratio to one slot. The scheduler keeps busy
slots consecutive because of it (serving/engine/scheduler.py, `_pick_slot`).

    python scripts/bench_seq_split.py --model big.gguf --depth 256 --repeats 7 --out results/bench_seq_split.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine.llama import LlamaContext, LlamaModel  # noqa: E402  (first: the library load order)
from measure.provenance import provenance, write_report  # noqa: E402
from serving.engine.config import CacheType, EngineConfig, FlashAttn  # noqa: E402
from serving.engine.config import default_threads  # noqa: E402
from serving.engine.repack import use_extra_bufts  # noqa: E402

SETS: tuple[tuple[int, ...], ...] = ((0,), (0, 1), (0, 2), (0, 3), (1, 2), (0, 1, 2, 3))
BURST = 4  # decodes per set and round after a dropped first one (a new batch shape costs once)


def decode(ctx: LlamaContext, seqs: tuple[int, ...], pos: int, token: int) -> float:
    ctx.clear_batch()
    for seq in seqs:
        ctx.batch.add([token], pos, seq, logits_for_last=True)
    t0 = time.perf_counter()
    if ctx.decode() != 0:
        raise SystemExit("llama_decode failed")
    _ = ctx.logits(len(seqs) - 1)[0]  # read back, as the scheduler does
    elapsed = time.perf_counter() - t0
    for seq in seqs:
        ctx.forget(seq, pos)
    return elapsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded model)")
    parser.add_argument("--depth", type=int, default=256, help="tokens cached in every slot")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--type-kv", default="q8_0", choices=[c.value for c in CacheType])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_seq_split.json")
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, n_parallel=4, n_ctx=4 * (args.depth + 256), n_batch=512, n_ubatch=512,
                          type_k=args.type_kv, type_v=args.type_kv, flash_attn=FlashAttn.on)
    model = LlamaModel(config.model_path, config.n_gpu_layers, use_extra_bufts(config))
    ctx = LlamaContext(model, config, default_threads())
    prompt = [(17 + 31 * i) % (model.n_vocab - 10) + 5 for i in range(args.depth)]
    for seq in range(4):
        ctx.clear_batch()
        ctx.batch.add(prompt, 0, seq, logits_for_last=True)
        if ctx.decode() != 0:
            raise SystemExit("prefill failed")
    times: dict[tuple[int, ...], list[float]] = {s: [] for s in SETS}
    for r in range(args.repeats):  # rounds alternate the order: drift hits every set alike
        for seqs in SETS if r % 2 else tuple(reversed(SETS)):
            for i in range(BURST + 1):
                dt = decode(ctx, seqs, args.depth, 7 + i)
                if i:
                    times[seqs].append(dt)
    median_ms = {s: statistics.median(v) * 1e3 for s, v in times.items()}
    one = median_ms[(0,)]
    print("| slots in the step | ms per decode | x one slot |\n| --- | --- | --- |")
    for seqs, ms in median_ms.items():
        print(f"| {', '.join(map(str, seqs))} | {ms:.2f} | {ms / one:.2f} |")
    write_report(args.out, {"provenance": provenance(), "model": str(config.model_path), "depth": args.depth,
                            "type_kv": args.type_kv, "median_ms": {",".join(map(str, s)): v
                                                                    for s, v in median_ms.items()}})
    ctx.free()
    model.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
