#!/usr/bin/env python3
"""CPU weight repack on vs off: prefill and decode speed through our engine, interleaved.

Why: llama.cpp's CPU extra buffer types (serving/engine/repack.py) change the matmul kernels on the CPU, and
`cpu_repack: auto` turns them off wherever a probe crashed. This measures what that costs, per weight type:
both engines (cpu_repack=on and cpu_repack=off) are loaded side by side, the same requests alternate between
them (on off, off on, ...) so drift on a shared machine hits both alike, and the median of each is reported.
Which buffer type really holds the weights is read from llama.cpp's load log ("CPU_REPACK model buffer
size"), so a run that did not get what it asked for fails instead of reporting a false comparison.

Models: any GGUF; random-weight ones of a chosen shape come from scripts/make_synthetic_gguf.py, e.g.

    python scripts/make_synthetic_gguf.py --preset smollm2 --layers 8 --hidden 2048 --heads 16 --kv-heads 4 \\
        --ffn 5632 --qtype q4_0 --out /tmp/repack/q4_0.gguf
    python scripts/bench_repack.py --model /tmp/repack/q4_0.gguf --model /tmp/repack/q4_k.gguf --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/engine/llama.py)
from serving.engine.config import CpuRepack, EngineConfig  # noqa: E402
from serving.engine.core import Engine  # noqa: E402
from serving.engine.buffers import llama_buffers  # noqa: E402
from serving.engine.request import SamplingParams  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402

MODES = (CpuRepack.on, CpuRepack.off)
EXTRA_BUFFERS = ("CPU_REPACK", "AMX", "KLEIDIAI")


def load(model: Path, mode: CpuRepack, args: argparse.Namespace) -> tuple[Engine, dict[str, float]]:
    """An engine for `model` with cpu_repack=`mode`, and the weight buffers llama.cpp reported loading it."""
    config = EngineConfig(model=model, cpu_repack=mode, n_parallel=args.streams,
                          n_ctx=2 * args.streams * (args.prompt + args.gen), n_batch=512, n_ubatch=512,
                          n_threads=args.threads, seed=1)
    with llama_buffers() as loaded:
        engine = Engine(config)
    buffers = loaded.get("model", {})
    if (mode is CpuRepack.on) != any(name in EXTRA_BUFFERS for name in buffers):
        engine.close()
        raise SystemExit(f"error: cpu_repack={mode.value} loaded {model.name} into {buffers} (MiB): the engine "
                         "did not apply the setting, or this model has no weights this CPU repacks")
    return engine, buffers


def run_round(engine: Engine, round_id: int, args: argparse.Namespace) -> dict[str, float]:
    """`streams` greedy requests at once, EOS ignored, prompts distinct from their first token (no prefix reuse).

    prefill tok/s = all prompt tokens / the slowest time to first token; decode tok/s = the sum of the
    streams' own decode speeds (after their first token), i.e. the aggregate while all of them generate.
    """
    n_vocab = engine.n_vocab
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    handles = []
    for stream in range(args.streams):
        seed = round_id * 7919 + stream * 104729
        tokens = [(seed + i * 131 + 17) % (n_vocab - 200) + 100 for i in range(args.prompt)]
        handles.append(engine.submit(tokens, params))
    usages = []
    for handle in handles:
        chunks = list(handle)
        if chunks[-1].error or chunks[-1].usage is None:
            raise SystemExit(f"error: request failed: {chunks[-1].error}")
        usages.append(chunks[-1].usage)
    if not all(u.ttft_s and u.decode_tok_s for u in usages):
        raise SystemExit("error: the engine reported no timings")
    return {"prefill_tok_s": sum(u.prompt_tokens for u in usages) / max(u.ttft_s or 0.0 for u in usages),
            "decode_tok_s": sum(u.decode_tok_s or 0.0 for u in usages)}


def bench_model(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Both modes loaded side by side; a warm-up each, then `repeats` rounds alternating the order."""
    engines, buffers = {}, {}
    try:
        for mode in MODES:
            engines[mode], buffers[mode.value] = load(model, mode, args)
        samples: dict[str, list[dict[str, float]]] = {mode.value: [] for mode in MODES}
        for mode in MODES:
            run_round(engines[mode], 0, args)
        for r in range(1, args.repeats + 1):
            for mode in (MODES if r % 2 else MODES[::-1]):
                samples[mode.value].append(run_round(engines[mode], r, args))
                print(f"  {model.name} round {r} {mode.value:>3}: {samples[mode.value][-1]}", file=sys.stderr)
    finally:
        for engine in engines.values():
            engine.close()
    medians = {m: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for m, runs in samples.items()}
    ratio = {k: medians["on"][k] / medians["off"][k] for k in medians["on"]}
    return {"model": str(model), "streams": args.streams, "buffers_mib": buffers, "samples": samples,
            "median": medians, "on_over_off": ratio}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | streams | repacked | prefill tok/s on / off | x | decode tok/s on / off | x |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        on, off, x = res["median"]["on"], res["median"]["off"], res["on_over_off"]
        repacked = ", ".join(f"{k} {v:.0f} MiB" for k, v in res["buffers_mib"]["on"].items() if k in EXTRA_BUFFERS)
        lines.append(f"| {Path(res['model']).name} | {res['streams']} | {repacked} | {on['prefill_tok_s']:.1f} / {off['prefill_tok_s']:.1f}"
                     f" | {x['prefill_tok_s']:.2f} | {on['decode_tok_s']:.2f} / {off['decode_tok_s']:.2f}"
                     f" | {x['decode_tok_s']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, action="append", required=True, help="GGUF file (repeat for several)")
    p.add_argument("--threads", type=int, default=None, help="n_threads (default: every CPU available)")
    p.add_argument("--streams", type=int, default=1, help="concurrent requests = n_parallel (default 1)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per request (default 256)")
    p.add_argument("--gen", type=int, default=64, help="generated tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed requests per mode (default 5)")
    p.add_argument("--json-out", type=Path, help="write samples, medians and provenance here")
    args = p.parse_args(argv)
    report: dict[str, Any] = {"provenance": provenance(), "results": [bench_model(m, args) for m in args.model]}
    print(json.dumps(report["provenance"]))
    print(table(report["results"]))
    if args.json_out:
        write_report(args.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
