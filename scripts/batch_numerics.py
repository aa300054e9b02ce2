#!/usr/bin/env python3
"""Does llama.cpp give the same logits for a position whether it is decoded alone or with more rows of the
same sequence behind it? (Speculation verifies guesses in multi-row decodes; plain decoding is one row.)

Decodes a prompt, then the same next token once as a single row and once as the first of k rows, and prints
the largest logit difference and whether the argmax agrees. A difference means greedy output with and without
speculation can part at a near-tie: the cause is the backend's kernels, not the scheduler.

    python scripts/batch_numerics.py [--model M.gguf] [--flash-attn on|off]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.llama import LlamaContext, LlamaModel  # noqa: E402  (first: the library load order)
from measure.workload import source_text  # noqa: E402
from serving.config import EngineConfig  # noqa: E402
from serving.engine import default_threads  # noqa: E402
from serving.repack import use_extra_bufts  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--flash-attn", default="auto", choices=["on", "off", "auto"])
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, n_parallel=1, n_ctx=4096, flash_attn=args.flash_attn)
    model = LlamaModel(config.model_path, config.n_gpu_layers, use_extra_bufts(config))
    ctx = LlamaContext(model, config, default_threads())
    prompt = model.tokenize("Repeat this code:\n\n" + source_text()[:2000])

    def decode(tokens: list[int], pos: int, every_row: bool) -> None:
        ctx.clear_batch()
        ctx.batch.add(tokens, pos, 0, True, every_row)
        if ctx.decode() != 0:
            raise SystemExit("llama_decode failed")

    decode(prompt, 0, False)
    n = len(prompt)
    token = int(ctx.logits(ctx.batch.n - 1).argmax())
    decode([token], n, False)
    alone = ctx.logits(0).copy()
    ctx.forget(0, n)
    for k in (2, 4, 8, 16):
        decode([token] * k, n, True)
        first = ctx.logits(0)
        print(f"{k:>2} rows: max |logit difference| at the same position = {abs(alone - first).max():.4f}; "
              f"argmax {'agrees' if alone.argmax() == first.argmax() else 'differs'}")
        ctx.forget(0, n)
    ctx.free()
    model.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
