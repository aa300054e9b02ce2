#!/usr/bin/env python3
"""What constrained decoding costs per token: each request under a grammar the API builds (json_object, a JSON
schema, a forced tool call) and the same request unconstrained, through our engine, interleaved.

The unconstrained twin has the same prompt and generates as many tokens as the constrained run did (EOS
ignored), so the ratio is the grammar's cost alone: a tool call's prompt (the tools listed) is longer than a
plain question's, and a longer context decodes slower whatever constrains it. Reported per mode: median decode
tok/s of a single stream (after its first token) constrained and unconstrained, ms per token, the median of the
per-round ratios (the twin runs right after its constrained run), and how often the grammar rejected the
model's own choice (greedy: then the best candidates
are checked one by one, serving/llama.py). Greedy; each round alternates the order.

    python scripts/bench_constrained.py --rounds 5 --out docs/results/bench_constrained_cpu.json
    python scripts/bench_constrained.py --model big.gguf --gpu-layers -1     # the GPU model
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/llama.py)
from measure.provenance import provenance, write_report  # noqa: E402
from serving.config import EngineConfig  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.request import FinishReason, GenerationChunk, SamplingParams, Usage  # noqa: E402
from serving.structured import json_schema_grammar, response_format_grammar, tool_call_grammar  # noqa: E402
from serving.tools import messages_for_plain_template  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 40},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                       "maxItems": 4}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}


def modes() -> dict[str, tuple[str, str | None, bool]]:
    """mode -> (user message, grammar, tools shown)."""
    return {
        "none": ("Describe a person: name, age, city and hobbies.", None, False),
        "json_object": ("Describe a person as JSON: name, age, city and hobbies.",
                        response_format_grammar("json_object"), False),
        "json_schema": ("Describe a person: name, age, city and hobbies.", json_schema_grammar(PERSON), False),
        "tool_call": ("What's the weather in Paris, in celsius?",
                      tool_call_grammar([("get_weather", WEATHER["function"]["parameters"])], parallel=False), True),
    }


def prompt(engine: Engine, text: str, tools: bool, n: int) -> list[int]:
    messages = [{"role": "user", "content": f"(request {n}) {text}"}]
    if tools:
        messages = messages_for_plain_template(messages, [WEATHER])
    return engine.tokenize_prompt(engine.render_chat(messages))


def generate(engine: Engine, tokens: list[int], params: SamplingParams) -> Usage:
    """One request to its end; an error ends the measurement (a failed run is no figure)."""
    last = GenerationChunk()
    for chunk in engine.submit(tokens, params):
        last = chunk
    if last.finish_reason not in (FinishReason.stop, FinishReason.length) or last.usage is None:
        raise RuntimeError(f"a measured request ended with {last.finish_reason}: {last.error}")
    return last.usage


def run(engine: Engine, text: str, grammar: str | None, tools: bool, n: int, gen: int,
        ignore_eos: bool = False) -> dict[str, Any]:
    before = engine.stats()["counters"]
    usage = generate(engine, prompt(engine, text, tools, n), SamplingParams(max_tokens=gen, temperature=0.0,
                                                                            grammar=grammar, ignore_eos=ignore_eos))
    after = engine.stats()["counters"]
    return {"decode_tok_s": usage.decode_tok_s, "tokens": usage.completion_tokens,
            "resamples": after.get("grammar_resamples", 0) - before.get("grammar_resamples", 0)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded model)")
    parser.add_argument("--gpu-layers", type=int, default=-1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_constrained.json")
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, n_gpu_layers=args.gpu_layers, n_parallel=1, n_ctx=2048, seed=1,
                          n_threads=args.threads)
    engine = Engine(config)
    table = {name: mode for name, mode in modes().items() if mode[1] is not None}
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in table}
    twins: dict[str, list[dict[str, Any]]] = {m: [] for m in table}
    try:
        for text, grammar, tools in table.values():  # warm-up
            run(engine, text, grammar, tools, 0, 16)
            run(engine, text, None, tools, 0, 16)
        for r in range(args.rounds):
            order = list(table) if r % 2 == 0 else list(reversed(table))
            for name in order:
                text, grammar, tools = table[name]
                constrained = run(engine, text, grammar, tools, r + 1, args.gen_tokens)
                twin = run(engine, text, None, tools, r + 1, constrained["tokens"], ignore_eos=True)
                samples[name].append(constrained)
                twins[name].append(twin)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{m} {samples[m][-1]['decode_tok_s']:.1f} / {twins[m][-1]['decode_tok_s']:.1f}" for m in table),
                flush=True)
    finally:
        engine.close()
    results = {}
    for name, runs in samples.items():
        tok_s = statistics.median(s["decode_tok_s"] for s in runs)
        free = statistics.median(s["decode_tok_s"] for s in twins[name])
        ratio = statistics.median(c["decode_tok_s"] / t["decode_tok_s"] for c, t in zip(runs, twins[name],
                                                                                         strict=True))
        tokens = sum(s["tokens"] for s in runs)
        results[name] = {"decode_tok_s": tok_s, "unconstrained_tok_s": free, "ms_per_token": 1e3 / tok_s,
                         "vs_unconstrained": ratio, "tokens": tokens,
                         "resample_rate": sum(s["resamples"] for s in runs) / max(tokens, 1)}
    report = {"provenance": provenance(), "config": config.to_yaml_dict(), "results": results}
    write_report(args.out, report)
    print("| mode | decode tok/s | same request unconstrained | ms/token | x unconstrained (paired) | "
          "resampled tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, res in results.items():
        print(f"| {name} | {res['decode_tok_s']:.1f} | {res['unconstrained_tok_s']:.1f} | {res['ms_per_token']:.2f} "
              f"| {res['vs_unconstrained']:.3f} | {res['resample_rate']:.0%} |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
