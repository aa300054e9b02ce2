"""Conversations that come back: more conversations than slots take turns; how long does a returning turn wait
for its first token, against a first turn?

Each conversation opens with a long history of its own (a document, a system prompt: `--history-tokens`),
then every turn appends the answer it got and a new question. Turns go round robin (conversation 1, 2, ...,
N, then 1 again), one request at a time, so with fewer slots than conversations every returning turn finds
its slot taken by another conversation. Without a cache across conversations it prefills its whole history
again; with one (ours: `cache_ram_mib`; llama-server: `--cache-ram`) it restores the history and prefills only
the new question. The figure: median TTFT of returning turns / median TTFT of first turns, per target, and
each target's returning-turn TTFT over ours.

    python scripts/bench_conversations.py --engine n_parallel=2 --engine n_ctx=8192          # in-process, CPU
    python scripts/bench_conversations.py --model /tmp/m27.gguf --engine n_parallel=2 --engine n_ctx=8192 \\
        --llama-server /tmp/lcpp/build/bin/llama-server --server-args "-np 2 -c 8192 -fa on"

Targets: our engine in-process with the cache (`cache_ram_mib` as configured, 8192 by default) and without it
(0); with `--llama-server`, llama-server with `--cache-ram 8192` and `--cache-ram 0` (its other flags:
`--server-args`); with `--server NAME=URL`, any OpenAI-compatible server already running. Greedy, answers of
`--answer-tokens` (EOS ignored), so every target does the same work. JSON report, markdown table and a plot.

`--replicas N` measures our Serve app instead (Ray and Serve started here, the app deployed with N engine
replicas and the `--engine` settings), once with prefix affinity and once without (`prefix_affinity=false`:
by load alone), and reports where the router sent the turns (/metrics' llm_requests_routed):

    LLAMA_SERVE_TUNE_THREADS=1 python scripts/bench_conversations.py --replicas 2 --conversations 8 \\
        --engine n_parallel=2 --engine n_ctx=8192

`--think-ms` pauses after each answer before the next turn, as a user reading it does (default 0: back to
back). Where the slots' states are saved matters there: ours saves a finished slot while the engine is idle,
llama-server when a new prompt takes the slot, between that prompt and its first token; back to back, the
save made as one turn ends is still under way when the next arrives, so both pay it.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

REPO_ROOT = Path(__file__).resolve().parents[1]

from measure.metrics import StreamRecord  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from measure.workload import Prompt, source_text  # noqa: E402
from serving.engine.config import EngineConfig, load_engine_config  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "results" / "bench_conversations.json"
CHARS_PER_TOKEN = 3.5  # this project's source as text, in SmolLM2's and Qwen's tokenizers: about 3-4


class Target(Protocol):
    name: str

    async def run_stream(self, prompt: Prompt, max_tokens: int, ignore_eos: bool) -> StreamRecord: ...


@dataclass(frozen=True)
class Turn:
    """One request of the run: which conversation, which of its turns, and what it measured."""

    conversation: int
    turn: int  # 1: the conversation's first
    prompt_chars: int
    prompt_tokens: int | None  # as the server counted them
    cached_tokens: int | None  # as the server reported them (None: not reported)
    ttft_s: float


@dataclass(frozen=True)
class Summary:
    """A target's turns, summed up."""

    target: str
    first_ttft_s: float  # median over first turns
    returning_ttft_s: float  # median over returning turns
    ratio: float  # returning / first
    returning_cached_tokens: float | None  # median reported cached tokens of returning turns
    returning_mean_ttft_s: float  # the mean shows what the median hides: the few turns that prefilled again
    returning_missed: int | None  # returning turns with under half their prompt cached (None: not reported)


def history(conversation: int, tokens: int) -> str:
    """A conversation's opening text, its own: the shipped source text from an offset of its own, repeated
    to about `tokens` tokens, headed by its number (so no two conversations share more than a few tokens)."""
    text = source_text()
    start = (conversation * 7919) % len(text)
    body = (text[start:] + text) * (1 + int(tokens * CHARS_PER_TOKEN) // len(text))
    return f"Conversation {conversation}. Read this file, then answer.\n\n" + body[:int(tokens * CHARS_PER_TOKEN)]


def question(conversation: int, turn: int) -> str:
    return f"\n\nUser (turn {turn}): what does the part above about item {conversation * 31 + turn} do?\nAssistant:"


async def run_target(target: Target, conversations: int, turns: int, history_tokens: int,
                     answer_tokens: int, think_s: float = 0.0) -> list[Turn]:
    """Every conversation's turns, round robin, one request at a time, `think_s` after each answer."""
    texts = {c: history(c, history_tokens) for c in range(1, conversations + 1)}
    measured: list[Turn] = []
    for turn in range(1, turns + 1):
        for c in range(1, conversations + 1):
            texts[c] += question(c, turn)
            record = await target.run_stream(Prompt(texts[c], chat=False), answer_tokens, ignore_eos=True)
            if record.finish_reason not in ("length", "stop") or not record.output_times:
                raise SystemExit(f"{target.name}: conversation {c} turn {turn} ended without an answer "
                                 f"(finish {record.finish_reason!r})")
            texts[c] += record.text
            ttft = record.output_times[0] - record.t_start
            measured.append(Turn(c, turn, len(texts[c]), record.prompt_tokens, record.cached_tokens, ttft))
            print(f"[{target.name}] conversation {c} turn {turn}: TTFT {ttft * 1000:.0f} ms, prompt "
                  f"{record.prompt_tokens} tokens, cached {record.cached_tokens}", file=sys.stderr, flush=True)
            if think_s > 0:
                await asyncio.sleep(think_s)
    return measured


def summarize(name: str, turns: Sequence[Turn]) -> Summary:
    first = [t.ttft_s for t in turns if t.turn == 1]
    back = [t for t in turns if t.turn > 1]
    cached = [t.cached_tokens for t in back if t.cached_tokens is not None]
    first_s, back_s = statistics.median(first), statistics.median(t.ttft_s for t in back)
    missed = sum(t.cached_tokens < (t.prompt_tokens or 0) / 2 for t in back if t.cached_tokens is not None)
    return Summary(name, first_s, back_s, back_s / first_s, statistics.median(cached) if cached else None,
                   statistics.fmean(t.ttft_s for t in back), missed if cached else None)


def markdown(summaries: Sequence[Summary], reference: str) -> str:
    ref = next(s for s in summaries if s.target == reference)
    lines = ["| target | first turn TTFT (median) | returning turn TTFT (median) | returning / first | "
             f"returning TTFT / {reference}'s | cached tokens of a returning turn (median) | returning turn TTFT "
             "(mean) | returning turns prefilled again |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summaries:
        cached = "n/a" if s.returning_cached_tokens is None else f"{s.returning_cached_tokens:.0f}"
        missed = "n/a" if s.returning_missed is None else str(s.returning_missed)
        lines.append(f"| {s.target} | {s.first_ttft_s * 1000:.0f} ms | {s.returning_ttft_s * 1000:.0f} ms | "
                     f"{s.ratio:.3f} | {s.returning_ttft_s / ref.returning_ttft_s:.2f} | {cached} | "
                     f"{s.returning_mean_ttft_s * 1000:.0f} ms | {missed} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, list[Turn]], path: Path) -> None:
    """TTFT of every request in order, one line per target: first turns high, returning turns low or not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, turns in results.items():
        ax.plot(range(1, len(turns) + 1), [t.ttft_s * 1000 for t in turns], marker="o", ms=3, label=name)
    ax.set_xlabel("request (conversations round robin; the first round is every conversation's first turn)")
    ax.set_ylabel("time to first token, ms")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO_ROOT / "configs" / "default.yaml", help="engine config YAML")
    p.add_argument("--model", type=Path, help="GGUF file (default: the config's, else the embedded model)")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="engine setting over the config's (repeat), e.g. n_parallel=2")
    p.add_argument("--conversations", type=int, default=6, help="conversations taking turns (default 6)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--history-tokens", type=int, default=1500,
                   help="about how many tokens each conversation opens with (default 1500)")
    p.add_argument("--answer-tokens", type=int, default=32, help="tokens per answer (default 32)")
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="pause after each answer before the next turn, a user reading it (default 0: back to back)")
    p.add_argument("--llama-server", metavar="BINARY", help="also run llama-server, with --cache-ram 8192 and 0")
    p.add_argument("--server-args", default="", help="llama-server's other flags, e.g. \"-np 2 -c 8192 -fa on\"")
    p.add_argument("--server", action="append", default=[], metavar="NAME=URL",
                   help="an OpenAI-compatible server already running (its API root, e.g. http://127.0.0.1:8000/v1)")
    p.add_argument("--replicas", type=int, metavar="N",
                   help="measure our Serve app with N engine replicas, prefix affinity on and off, instead of the "
                        "in-process engine and llama-server")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report; .md and .png beside it")
    args = p.parse_args(argv)
    if min(args.conversations, args.turns, args.history_tokens, args.answer_tokens) < 1:
        p.error("--conversations, --turns, --history-tokens and --answer-tokens must be at least 1")
    if args.turns < 2:
        p.error("--turns must be at least 2: the figure compares returning turns with first turns")
    if args.think_ms < 0:
        p.error("--think-ms must be 0 or more")
    if args.replicas is not None and (args.replicas < 1 or args.llama_server or args.server):
        p.error("--replicas must be 1 or more, and measures the Serve app alone (no --llama-server, --server)")
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    overrides: dict[str, Any] = dict(item.split("=", 1) for item in args.engine)
    if args.model is not None:
        overrides["model"] = str(args.model)
    try:
        return load_engine_config(args.config, overrides)
    except Exception as exc:  # a bad key or value: say which, without a traceback
        raise SystemExit(f"engine config: {exc}") from None



def peer_args(config: EngineConfig, server_args: str, cache_mib: int) -> list[str]:
    """llama-server's flags for one run: the caller's, its prompt cache, and `--no-repack` where our engine
    loads without the CPU weight repack (the same kernels; on a CPU whose repack path faults, such as an
    AMX VM, llama-server would crash at load otherwise)."""
    from measure.targets import repack_server_args

    flags = [*shlex.split(server_args), "--cache-ram", str(cache_mib)]
    return flags + repack_server_args(config, flags)

def routed_by(metrics_text: str) -> dict[str, float]:
    """llm_requests_routed of a /metrics text, summed over replicas, by why (affinity, load, ...)."""
    import re

    counts: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("llm_requests_routed_total{") and (by := re.search(r'by="([^"]*)"', line)):
            counts[by.group(1)] = counts.get(by.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


async def served_model(target: Any, timeout_s: float = 120.0) -> None:
    """Ask /models until a replica names the served model: right after /health says ok, a /models relayed to a
    replica still settling can fail, and the requests would name no model the server has."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while target.model_name == "default" and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(1.0)
        await target.preflight()


async def measure_serve(args: argparse.Namespace, shape: tuple[Any, ...]) -> tuple[dict[str, list[Turn]],
                                                                                 dict[str, dict[str, float]]]:
    """Our Serve app with `args.replicas` engine replicas, prefix affinity on then off: each one's turns, and
    where the router sent them."""
    import httpx

    from measure.serve_app import deployed, start_serve, stop_serve

    words: dict[str, Any] = dict(item.split("=", 1) for item in args.engine)
    if args.model is not None:
        words["model"] = str(args.model)
    words.update(config=str(args.config), num_replicas=args.replicas, cpus_per_replica=0.5)
    results: dict[str, list[Turn]] = {}
    routed: dict[str, dict[str, float]] = {}
    port = start_serve(0, None)
    try:
        for affinity in (True, False):
            name = f"Serve, {args.replicas} replicas, prefix affinity {'on' if affinity else 'off'}"
            app = f"affinity-{'on' if affinity else 'off'}"
            async with deployed(port, {**words, "prefix_affinity": affinity}, 900, 600, name=app) as target:
                await served_model(target)
                results[name] = await run_target(target, *shape)
                async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
                    routed[name] = routed_by((await http.get(target.base_url.removesuffix("/v1") + "/metrics")).text)
                print(f"[{name}] routed: {routed[name]}", file=sys.stderr, flush=True)
    finally:
        stop_serve()
    return results, routed


async def measure_all(args: argparse.Namespace, config: EngineConfig, shape: tuple[Any, ...]
                      ) -> dict[str, list[Turn]]:
    from serving.engine import llama as _llama  # noqa: F401  (first: the library load order, see serving/engine/llama.py)
    from measure.targets import EngineTarget, HttpTarget, llama_server
    from serving.engine.core import Engine

    results: dict[str, list[Turn]] = {}
    cache_mib = config.cache_ram_mib or 8192
    for name, mib in ((f"ours (cache_ram_mib {cache_mib})", cache_mib), ("ours, cache off", 0)):
        engine = Engine(config.model_copy(update={"cache_ram_mib": mib}))
        try:
            results[name] = await run_target(EngineTarget(engine, name), *shape)
        finally:
            engine.close()
    if args.llama_server:
        model = config.model_path
        for mib in (8192, 0):
            async with llama_server(args.llama_server, model, peer_args(config, args.server_args, mib)) as target:
                target.name = f"llama-server --cache-ram {mib}"
                results[target.name] = await run_target(target, *shape)
    for item in args.server:
        name, _, url = item.partition("=")
        http = HttpTarget(name, url)
        try:
            await http.preflight()
            results[name] = await run_target(http, *shape)
        finally:
            await http.aclose()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    config = engine_config(args)
    shape = (args.conversations, args.turns, args.history_tokens, args.answer_tokens, args.think_ms / 1000)
    routed: dict[str, dict[str, float]] = {}
    if args.replicas is not None:
        results, routed = asyncio.run(measure_serve(args, shape))
    else:
        results = asyncio.run(measure_all(args, config, shape))
    summaries = [summarize(name, turns) for name, turns in results.items()]
    text = markdown(summaries, summaries[0].target) + "".join(
        f"\n{name}: requests routed by {', '.join(f'{by} {n:.0f}' for by, n in sorted(counts.items()))}\n"
        for name, counts in routed.items() if counts)
    print(text)
    report = {**provenance(), "command": shlex.join(["python", "scripts/bench_conversations.py", *argv]),
              "config": config.to_yaml_dict(), "conversations": args.conversations, "turns": args.turns,
              "history_tokens": args.history_tokens, "answer_tokens": args.answer_tokens, "think_ms": args.think_ms,
              "replicas": args.replicas, "routed": routed, "summary": [asdict(s) for s in summaries],
              "turns_measured": {name: [asdict(t) for t in turns] for name, turns in results.items()}}
    write_report(args.out, report)
    args.out.with_suffix(".md").write_text(text, encoding="utf-8")
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}, {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}", file=sys.stderr)
    return 0

