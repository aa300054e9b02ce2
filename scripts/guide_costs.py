#!/usr/bin/env python3
"""What each llguidance call costs per token, on the guides `scripts/bench_constrained.py` measures.

A constrained token costs the host a check of the model's choice, the advance of the grammar, and on a refusal
the mask of allowed tokens and its unpacking; bench_constrained.py gives the sum as a ratio to unconstrained
decode. This replays a valid answer of each mode token by token through a fresh matcher and times every call,
computing the mask at every step (the server computes it only on a refusal), so a machine whose ratio is low
can be told apart: the grammar's own calls, or the host time around them. No decoding: only the vocabulary is
loaded.

    python scripts/guide_costs.py [--model GGUF] [--repeats 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving.engine import llama  # noqa: E402  (first: the library load order, see serving/engine/llama.py)
from measure.constrained import ANSWERS, CALLS, modes, replay, summary  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from serving.engine.config import EngineConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF (default: the engine config's, else the embedded model)")
    parser.add_argument("--repeats", type=int, default=20, help="replays of each answer (the first compiles)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    config = EngineConfig(model=args.model) if args.model else EngineConfig()
    model = llama.LlamaModel(config.model_path, n_gpu_layers=0)
    results: dict[str, Any] = {}
    print(f"{'mode':12s} {'tokens':>6s}  " + "  ".join(f"{c + ' us (median/mean)':>24s}" for c in CALLS))
    for name, mode in modes().items():
        tokens = model.tokenize(ANSWERS[name], add_special=False, parse_special=True)
        spent: dict[str, list[float]] = {call: [] for call in CALLS}
        for _ in range(args.repeats):
            for call, seconds in replay(model, mode.guide.text, tokens).items():
                spent[call] += seconds
        results[name] = {"tokens": len(tokens), **{call: summary(spent[call]) for call in CALLS}}
        cells = [f"{results[name][c]['median_us']:11.1f} / {results[name][c]['mean_us']:8.1f}" for c in CALLS]
        print(f"{name:12s} {len(tokens):6d}  " + "  ".join(f"{cell:>24s}" for cell in cells))
    if args.out:
        write_report(args.out, {"provenance": provenance(), "model": str(config.model_path), "repeats": args.repeats,
                                "results": results})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
