#!/usr/bin/env python3
"""Streaming-generation benchmark: our server over HTTP, llama-server, and our engine in-process, side by side.

The workload and the figures are measure/'s, the same the tuner measures (measure/workload.py, definitions in
measure/metrics.py): greedy, `--max-tokens` per request, a fixed prompt set with a fresh number per request,
per concurrency level a warm-up round per target and then the median of `--repeats` rounds with the targets
interleaved (A B, B A, ...). Ratios (ours / llama-server, ours / in-process) come from one run.

    python scripts/bench_serving.py --url http://127.0.0.1:8000/v1 --concurrency 1,4
    python scripts/bench_serving.py --llama-server .llama-build/bin/llama-server \\
        --server-args "-np 4 -c 4096 -t 2" --in-process --engine n_parallel=4 --engine n_ctx=4096
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/engine/llama.py)
from measure.design import ratios  # noqa: E402
from measure.metrics import RoundFigures  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from measure.sse import StreamError  # noqa: E402
from measure.targets import HttpTarget, llama_server, loaded_engine, repack_server_args  # noqa: E402
from measure.workload import Level, PromptSet, Runner, Target, Workload  # noqa: E402
from serving.engine.config import EngineConfig, load_engine_config  # noqa: E402

PAIRS = (("ours", "llama-server"), ("in-process", "llama-server"), ("ours", "in-process"))


def parse_levels(text: str) -> tuple[int, ...]:
    """'1,4' -> (1, 4), each within 1..64."""
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4: {text!r}") from exc
    if not levels or any(not 1 <= c <= 64 for c in levels):
        raise argparse.ArgumentTypeError("levels must be in 1..64")
    return levels


def engine_config(path: Path | None, overrides: Sequence[str], model: Path | None) -> EngineConfig:
    """The in-process engine's config: a YAML file (default configs/default.yaml) plus KEY=VALUE overrides;
    `--model` fills `model` unless an override sets it, so by default both peers load the same file."""
    fields: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"error: --engine expects KEY=VALUE, got {item!r}")
        fields[key.strip()] = value
    if model is not None:
        fields.setdefault("model", str(model))
    try:
        return load_engine_config(path or REPO_ROOT / "configs" / "default.yaml", fields)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from exc


def levels_report(results: dict[str, dict[int, Level]]) -> dict[str, Any]:
    return {name: {str(n): level.as_dict() for n, level in levels.items()} for name, levels in results.items()}


def ratio_report(results: dict[str, dict[int, Level]]) -> dict[str, Any]:
    return {f"{a}/{b}": {str(n): ratios(results[a][n].median, results[b][n].median) for n in results[a]}
            for a, b in PAIRS if a in results and b in results}


def _num(value: float | None, spec: str = ".1f") -> str:
    return format(value, spec) if value is not None else "-"


def format_table(results: dict[str, dict[int, Level]]) -> str:
    head = (f"{'target':<13} {'conc':>4} {'agg tok/s':>10} {'dec tok/s':>10} {'TTFT ms':>9} "
            f"{'ITL p50':>8} {'ITL p95':>8} {'tokens':>7} {'short':>5}")
    rows = [head, "-" * len(head)]
    for name, levels in results.items():
        for n, level in levels.items():
            m: RoundFigures = level.median
            rows.append(f"{name:<13} {n:>4} {_num(m.aggregate_tok_s):>10} {_num(m.decode_tok_s):>10} "
                        f"{_num(m.ttft_ms):>9} {_num(m.itl_ms_p50, '.2f'):>8} {_num(m.itl_ms_p95, '.2f'):>8} "
                        f"{m.completion_tokens:>7.0f} {m.short_streams:>5.0f}")
    return "\n".join(rows)


def format_ratios(table: dict[str, Any]) -> str:
    """Throughput > 1: the first target is faster; latency < 1: it is quicker."""
    return "\n".join(f"{pair:<26} c={n:<3} agg x{_num(r['aggregate_tok_s'], '.3f')}  decode x{_num(r['decode_tok_s'], '.3f')}"
                     f"  TTFT x{_num(r['ttft_ms'], '.3f')}  ITL p50 x{_num(r['itl_ms_p50'], '.3f')}"
                     for pair, levels in table.items() for n, r in levels.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="OpenAI-compatible API root of OUR server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--llama-server", metavar="PATH", help="start this llama-server binary and benchmark it too")
    p.add_argument("--server-args", default="", help='extra llama-server flags, e.g. "-np 4 -c 4096 -t 2"')
    p.add_argument("--model", type=Path, help="GGUF for llama-server and the in-process engine (default: the "
                   "engine config's model, else the embedded SmolLM2-135M)")
    p.add_argument("--in-process", action="store_true", help="also time our Engine directly, without HTTP")
    p.add_argument("--engine-config", type=Path, metavar="YAML", help="the in-process engine's config "
                   "(default configs/default.yaml)")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="engine config override")
    p.add_argument("--prompt-set", choices=[s.value for s in PromptSet], default="plain",
                   help="plain: /v1/completions, EOS ignored; copy: chat, stops at EOS")
    p.add_argument("--concurrency", type=parse_levels, default=(1, 4), help="levels, e.g. 1,4 (default)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per HTTP read")
    p.add_argument("--server-start-timeout", type=float, default=180.0)
    p.add_argument("--json-out", type=Path, metavar="PATH", help="write the full report as JSON here")
    return p


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Set up the requested targets, run the interleaved schedule, tear everything down."""
    config = engine_config(args.engine_config, args.engine, args.model)
    workload = Workload(gen_tokens=args.max_tokens, levels=args.concurrency, repeats=args.repeats,
                        prompt_set=PromptSet(args.prompt_set))
    async with contextlib.AsyncExitStack() as stack:
        targets: list[Target] = []
        described: dict[str, Any] = {}
        if args.in_process:
            engine = stack.enter_context(loaded_engine(config))
            targets.append(engine)
            described[engine.name] = engine.describe()
        if args.url:
            ours = HttpTarget("ours", args.url, args.request_timeout)
            stack.push_async_callback(ours.aclose)
            await ours.preflight()
            targets.append(ours)
        if args.llama_server:
            flags = shlex.split(args.server_args)
            server = await stack.enter_async_context(llama_server(
                args.llama_server, config.model_path, flags + repack_server_args(config, flags),
                args.server_start_timeout, args.request_timeout))
            targets.append(server)

        def progress(name: str, level: int, repeat: int, figures: RoundFigures) -> None:
            print(f"  {name:<13} c={level:<3} rep {repeat}/{args.repeats}: {figures.aggregate_tok_s:.1f} tok/s "
                  "aggregate", file=sys.stderr)

        results = await Runner(workload).levels(targets, progress)
        described.update({t.name: t.describe() for t in targets if isinstance(t, HttpTarget)})
    return {"provenance": provenance(), "workload": {**vars(workload), "ignore_eos": workload.ignore_eos},
            "targets": described, "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.url or args.llama_server or args.in_process):
        raise SystemExit("error: give at least one of --url, --llama-server, --in-process")
    try:
        report = asyncio.run(run(args))
    except (StreamError, TimeoutError, ValueError, RuntimeError) as exc:
        raise SystemExit(f"error: benchmark aborted: {type(exc).__name__}: {exc}") from exc
    results = report.pop("results")
    report["results"], report["ratios"] = levels_report(results), ratio_report(results)
    print(format_table(results))
    if report["ratios"]:
        print(format_ratios(report["ratios"]))
    if args.json_out:
        write_report(args.json_out, report)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
