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
import json
import statistics
import sys
import time
from functools import partial
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from serving.engine import llama  # noqa: E402  (first: the library load order, see serving/engine/llama.py)
import numpy as np  # noqa: E402
from bench_constrained import modes  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from serving.engine.config import EngineConfig  # noqa: E402

# One valid answer per mode of bench_constrained.py (its PERSON schema, its get_weather tool).
ANSWERS = {
    "json_object": json.dumps({"name": "Alice", "age": 34, "note": "likes chess and long walks"}),
    "json_schema": json.dumps({"name": "Alice Smith", "age": 34, "city": "Paris",
                               "hobbies": ["reading", "hiking", "chess"]}),
    "tool_call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                 '\n</tool_call>',
}
CALLS = ("check", "advance", "mask", "unpack")


def replay(model: llama.LlamaModel, grammar: str, tokens: list[int]) -> dict[str, list[float]]:
    """Seconds of each call at each token of `tokens`, through a fresh matcher of `grammar`."""
    guide = model.guides.matcher(grammar)
    mask = np.zeros((model.n_vocab + 31) // 32, dtype=np.int32)
    spent: dict[str, list[float]] = {call: [] for call in CALLS}

    def timed(call: str, work: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = work()
        spent[call].append(time.perf_counter() - start)
        return out

    for token in tokens:
        timed("mask", lambda: guide.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes))
        timed("unpack", lambda: np.unpackbits(mask.view(np.uint8), bitorder="little")[:model.n_vocab].astype(bool))
        if timed("check", partial(guide.validate_tokens, [token])) != 1:
            raise RuntimeError(f"the guide refuses token {token} ({model.token_text(token)!r}) of its own answer")
        if not timed("advance", partial(guide.consume_token, token)):
            raise RuntimeError(f"the guide could not advance on token {token}: {guide.get_error()}")
    return spent


def summary(seconds: list[float]) -> dict[str, float]:
    micro = [1e6 * s for s in seconds]
    return {"median_us": statistics.median(micro), "mean_us": statistics.fmean(micro), "max_us": max(micro)}


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
