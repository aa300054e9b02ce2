#!/usr/bin/env python3
"""What constrained decoding costs per token: each request under a constraint the API builds (json_object, a
JSON schema, a forced tool call) and the same request unconstrained, through our engine, interleaved; each
constraint both as the server compiles it (an llguidance guide, a token mask) and as GBNF through llama.cpp's
grammar sampler (rows marked "(GBNF)": the candidate it replaced, kept side by side).

The unconstrained twin has the same prompt and generates as many tokens as the constrained run did (EOS
ignored), so the ratio is the grammar's cost alone: a tool call's prompt (the tools listed) is longer than a
plain question's, and a longer context decodes slower whatever constrains it. Both runs start from an empty slot
(the slot erased, no host-RAM prompt cache; llama-server: `cache_prompt` off), so both prefill the prompt and pay
what follows a prefill: with the twin's prompt cached, it skipped that, and on the H100 (2026-12-05) every mode
then decoded ~10% slower than its twin while the sampler's own share was ~2% (`--breakdown`): a gap in the decode
calls, outside the grammar (the prefill and the first single-token steps after it, which the twin skipped).
Reported per mode: median decode
tok/s of a single stream (after its first token) constrained and unconstrained, ms per token, the median of the
per-round ratios (the twin runs right after its constrained run), and how often the grammar rejected the
model's own choice (then a guide samples from its mask; GBNF checks the best candidates one by one,
serving/engine/llama.py). Greedy unless `--temperature`; each round rotates the order (measure/design.py
`rotated`), and each ratio comes with the 95% interval of its median (`median_interval`). Every run is streamed
from the engine, a chunk a token read as it comes, as the routes read it.

The nested modes (`--modes json_schema_nested,tool_call_nested`) are one schema, an object with an array of
objects holding an array of objects (measure/constrained.py ORDER), as a forced call's arguments (the twin: the
same prompt with the tool offered and nothing forced) and as a json_schema answer to the same question.

With `--llama-server BINARY`, llama-server (same model, one slot) gets the same requests through its own API
(`response_format` json_object and json_schema; the forced tool call as the same rendered prompt and the same
grammar, its `grammar` field: with a chat template that knows no tools, as the embedded model's, llama-server
renders no tools and forces none) and the same unconstrained twins (`ignore_eos`), after ours; its decode rate
is its own `timings.predicted_per_second`, and each constrained answer of its that ended by itself is checked
(JSON; the schema's fields; one call of the tool, JSON arguments).

With `--breakdown N`, after the measured rounds, N more rounds of each guide mode and its twin run with the
step thread's parts timed (the decode call, sampling with the logits fetch, plain greedy, output processing,
the whole step), in microseconds per generated token: where a constrained token's extra time goes. Timing
wraps the engine's own methods for that pass only, so the figures above it are untouched.

Compile time is reported for a large schema (`large_schema`: 60 properties, nested objects, arrays, enums,
bounds) both ways: the grammar from the schema (first time, and again: cached), then for the vocabulary (the
matcher a request copies; llama.cpp's grammar sampler for GBNF).

    python scripts/bench_constrained.py --rounds 5 --out docs/results/bench_constrained_cpu.json
    python scripts/bench_constrained.py --model big.gguf --gpu-layers -1     # the GPU model
    python scripts/bench_constrained.py --llama-server .llama-build/bin/llama-server --server-args "-t 2"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
import json
import os
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/engine/llama.py)
from measure.constrained import PERSON, Mode, gbnf_of, modes  # noqa: E402
from measure.design import median_interval, rotated  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from measure.targets import llama_server, llama_server_flags  # noqa: E402
from serving.engine.config import THREADS_ENV, EngineConfig  # noqa: E402
from serving.engine.core import Engine  # noqa: E402
from serving.engine.request import (Constraint, ConstraintKind, FinishReason, GenerationChunk, SamplingParams,  # noqa: E402
                             Usage)
from serving.openai.structured import ANSWER_BOUNDS, bounded, json_schema_guide  # noqa: E402
from serving.openai.tools import messages_for_plain_template  # noqa: E402

PEER_MODES = ("json_object", "json_schema", "tool_call")  # what --llama-server runs (its answers are checked)


def large_schema(n: int = 60, salt: str = "") -> dict[str, Any]:
    """A schema of an API's size: `n` properties cycling through strings with bounds, integers with ranges,
    enums, nested objects and arrays of objects; `salt` makes it a new text (no cache hit)."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 80},
        {"type": "integer", "minimum": 0, "maximum": 10_000},
        {"enum": ["low", "medium", "high", "critical"]},
        {"type": "object", "properties": {"street": {"type": "string", "maxLength": 60},
                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                          "country": {"enum": ["FR", "DE", "US", "JP"]}},
         "required": ["street", "country"]},
        {"type": "array", "maxItems": 5, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}},
        {"type": "boolean"},
    ]
    props = {f"field_{i}{salt}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)[: n // 2]}


def compile_times(engine: Engine) -> dict[str, float]:
    """Milliseconds to compile the large schema: to a guide (first, cached) and for the vocabulary, and the same
    through GBNF (llama-cpp-python's converter, then llama.cpp's grammar sampler)."""
    def ms(work: Any) -> float:
        t0 = time.perf_counter()
        work()
        return (time.perf_counter() - t0) * 1e3

    fresh = large_schema(salt=f"_{time.time_ns()}")
    guide: list[Constraint] = []
    first = ms(lambda: guide.append(json_schema_guide(fresh)))
    again = ms(lambda: json_schema_guide(fresh))
    vocab_first = ms(lambda: engine.check_constraint(guide[0]))
    vocab_again = ms(lambda: engine.check_constraint(guide[0]))
    gbnf: list[str] = []
    gbnf_ms = ms(lambda: gbnf.append(gbnf_of(bounded(fresh, ANSWER_BOUNDS))[0]))
    sampler_ms = ms(lambda: engine.check_constraint(Constraint(ConstraintKind.gbnf, gbnf[0])))
    return {"properties": len(fresh["properties"]), "schema_chars": len(json.dumps(fresh)),
            "guide_ms": first, "guide_cached_ms": again, "guide_vocab_ms": vocab_first,
            "guide_vocab_cached_ms": vocab_again, "gbnf_ms": gbnf_ms, "gbnf_sampler_ms": sampler_ms}


def prompt(engine: Engine, text: str, tools: tuple[dict[str, Any], ...], n: int) -> list[int]:
    messages = [{"role": "user", "content": f"(request {n}) {text}"}]
    if tools:
        messages = messages_for_plain_template(messages, list(tools))
    return engine.tokenize_prompt(engine.render_chat(messages))


def generate(engine: Engine, tokens: list[int], params: SamplingParams) -> Usage:
    """One request to its end; an error ends the measurement (a failed run is no figure)."""
    last = GenerationChunk()
    for chunk in engine.submit(tokens, params):
        last = chunk
    if last.finish_reason not in (FinishReason.stop, FinishReason.length) or last.usage is None:
        raise RuntimeError(f"a measured request ended with {last.finish_reason}: {last.error}")
    return last.usage


def run(engine: Engine, text: str, constraint: Constraint | None, tools: tuple[dict[str, Any], ...], n: int,
        gen: int, ignore_eos: bool = False, temperature: float = 0.0) -> dict[str, Any]:
    """One request from an empty slot (the engine has one), so that every run prefills its prompt; streamed, as
    the routes take it (a chunk a token, read as it comes). Sampled (`temperature` > 0) with the seed `n`."""
    engine.erase_slot(0)
    before = engine.stats()["counters"]
    params = SamplingParams(max_tokens=gen, temperature=temperature, seed=n, constraint=constraint,
                            ignore_eos=ignore_eos)
    usage = generate(engine, prompt(engine, text, tools, n), params)
    after = engine.stats()["counters"]
    return {"decode_tok_s": usage.decode_tok_s, "tokens": usage.completion_tokens,
            "resamples": after.get("grammar_resamples", 0) - before.get("grammar_resamples", 0)}


def _parts() -> dict[str, tuple[Any, str]]:
    from serving.engine.llama import LlamaContext, SamplerChain
    from serving.engine.scheduler import Scheduler

    return {"step": (Scheduler, "step"), "decode": (LlamaContext, "decode"), "sample": (SamplerChain, "sample"),
            "greedy": (LlamaContext, "greedy"), "emit": (Engine, "_emit")}


@contextlib.contextmanager
def timed_parts(spent: dict[str, float]) -> Iterator[None]:
    """Add each part's seconds to `spent` while inside (the engine's methods wrapped, restored after)."""
    originals = {name: (owner, attr, getattr(owner, attr)) for name, (owner, attr) in _parts().items()}

    def timer(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return run

    for name, (owner, attr, method) in originals.items():
        setattr(owner, attr, timer(name, method))
    try:
        yield
    finally:
        for owner, attr, method in originals.values():
            setattr(owner, attr, method)


def breakdown(engine: Engine, table: dict[str, Mode], rounds: int, gen: int) -> dict[str, Any]:
    """Per guide mode, microseconds per generated token in each part of the step, constrained and its twin
    (summed over `rounds` rounds)."""
    out: dict[str, Any] = {}
    for name, mode in table.items():
        spent: dict[str, dict[str, float]] = {"constrained": {}, "unconstrained": {}}
        tokens = 0
        for r in range(rounds):
            with timed_parts(spent["constrained"]):
                n = run(engine, mode.text, mode.guide, mode.tools, 100 + r, gen)["tokens"]
            with timed_parts(spent["unconstrained"]):
                run(engine, mode.text, None, mode.tools, 100 + r, n, ignore_eos=True)
            tokens += n
        per = {kind: {part: 1e6 * seconds / max(tokens, 1) for part, seconds in sorted(parts.items())}
               for kind, parts in spent.items()}
        out[name] = per
        print(f"breakdown {name} (us/token): " + "; ".join(
            f"{kind} " + ", ".join(f"{part} {us:.1f}" for part, us in parts.items()) for kind, parts in per.items()),
            flush=True)
    return out


def server_body(name: str, mode: Mode, n: int, max_tokens: int, twin: bool) -> dict[str, Any]:
    """The request as llama-server's API says it: the mode's own fields, or (the twin) none of them."""
    messages = [{"role": "user", "content": f"(request {n}) {mode.text}"}]
    body: dict[str, Any] = {"messages": messages_for_plain_template(messages, list(mode.tools)) if mode.tools
                            else messages,
                            "max_tokens": max_tokens, "temperature": 0.0, "stream": False, "cache_prompt": False}
    if mode.tools and not twin:
        body["grammar"] = mode.gbnf
    if twin:
        body["ignore_eos"] = True
    elif name == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif name == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    return body


def check_answer(name: str, message: dict[str, Any], finish: str) -> None:
    """A constrained answer that ended by itself must be what was asked (one cut at max_tokens cannot be)."""
    if finish == "length":
        return
    if name == "tool_call":
        content = message.get("content") or ""
        opening, closing = "<tool_call>\n", "\n</tool_call>"
        if not (content.startswith(opening) and content.endswith(closing)):
            raise RuntimeError(f"llama-server's forced tool call gave {content!r}")
        call = json.loads(content[len(opening):-len(closing)])
        if call.get("name") != "get_weather" or not isinstance(call.get("arguments"), dict):
            raise RuntimeError(f"llama-server's forced tool call gave {call!r}")
    else:
        value = json.loads(message.get("content") or "")
        if name == "json_schema" and not set(cast(list[str], PERSON["required"])) <= set(value):
            raise RuntimeError(f"llama-server's json_schema answer lacks fields: {value!r}")


async def server_round(client: Any, base: str, name: str, mode: Mode, n: int, gen: int
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One constrained request to llama-server and its unconstrained twin of as many tokens."""
    async def post(body: dict[str, Any]) -> dict[str, Any]:
        resp = await client.post(f"{base}/v1/chat/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"llama-server answered {resp.status_code}: {resp.text[:300]}")
        return dict(resp.json())

    answer = await post(server_body(name, mode, n, gen, twin=False))
    choice = answer["choices"][0]
    check_answer(name, choice["message"], choice["finish_reason"])
    timings = answer["timings"]
    twin = (await post(server_body(name, mode, n, int(timings["predicted_n"]), twin=True)))["timings"]
    return ({"decode_tok_s": timings["predicted_per_second"], "tokens": timings["predicted_n"]},
            {"decode_tok_s": twin["predicted_per_second"], "tokens": twin["predicted_n"]})


async def measure_llama_server(binary: str, config: EngineConfig, server_args: list[str], table: dict[str, Mode],
                               rounds: int, gen: int) -> dict[str, Any]:
    """llama-server on the same requests: per mode, the summary of constrained runs and their twins."""
    import httpx

    flags = [*llama_server_flags(config), "--jinja", *server_args]
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in table}
    twins: dict[str, list[dict[str, Any]]] = {m: [] for m in table}
    async with (llama_server(binary, config.model_path, flags) as target,
                httpx.AsyncClient(timeout=600, trust_env=False) as client):
        base = target.base_url.removesuffix("/v1")
        for name, mode in table.items():  # warm-up
            await server_round(client, base, name, mode, 0, 16)
        for r in range(rounds):
            for name in (list(table) if r % 2 == 0 else list(reversed(table))):
                constrained, twin = await server_round(client, base, name, table[name], r + 1, gen)
                samples[name].append(constrained)
                twins[name].append(twin)
            print(f"llama-server round {r + 1}/{rounds}: " + ", ".join(
                f"{m} {samples[m][-1]['decode_tok_s']:.1f} / {twins[m][-1]['decode_tok_s']:.1f}" for m in table),
                flush=True)
        return {"command": target.extra.get("command"), "version": target.extra.get("version"),
                "results": summarise(samples, twins)}


def summarise(samples: dict[str, list[dict[str, Any]]], twins: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: median decode tok/s constrained and unconstrained, the median of the paired ratios, and the
    share of tokens the grammar resampled (ours only: llama-server does not count them)."""
    results = {}
    for name, runs in samples.items():
        tok_s = statistics.median(s["decode_tok_s"] for s in runs)
        free = statistics.median(s["decode_tok_s"] for s in twins[name])
        each = sorted(c["decode_tok_s"] / t["decode_tok_s"] for c, t in zip(runs, twins[name], strict=True))
        ratio = statistics.median(each)
        tokens = sum(s["tokens"] for s in runs)
        resampled = (sum(s["resamples"] for s in runs) / max(tokens, 1)) if all("resamples" in s for s in runs) \
            else None
        results[name] = {"decode_tok_s": tok_s, "unconstrained_tok_s": free, "ms_per_token": 1e3 / tok_s,
                         "vs_unconstrained": ratio, "vs_unconstrained_95": median_interval(each),
                         "ratios": each, "tokens": tokens, "resample_rate": resampled}
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded model)")
    parser.add_argument("--gpu-layers", type=int, default=-1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--modes", default=",".join(modes()),
                        help="comma-separated modes to run (default: all of measure/constrained.py's)")
    parser.add_argument("--no-gbnf", action="store_true", help="leave out the GBNF rows")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (seed: the round), constrained runs and twins alike")
    parser.add_argument("--breakdown", type=int, default=0, metavar="N",
                        help="then N rounds per guide mode with the step's parts timed (see above)")
    parser.add_argument("--llama-server", metavar="BINARY", help="also run llama-server on the same requests")
    parser.add_argument("--server-args", default="", help='llama-server\'s other flags, e.g. "-t 2"')
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_constrained.json")
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, n_gpu_layers=args.gpu_layers, n_parallel=1, n_ctx=2048, seed=1,
                          n_threads=args.threads, cache_ram_mib=0)
    engine = Engine(config)
    every = modes()
    table = {name: every[name] for name in args.modes.split(",")}
    ours = {**{name: (mode, mode.guide) for name, mode in table.items()},
            **({} if args.no_gbnf else {f"{name} (GBNF)": (mode, Constraint(ConstraintKind.gbnf, mode.gbnf))
                                       for name, mode in table.items()})}
    temperature = args.temperature
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in ours}
    twins: dict[str, list[dict[str, Any]]] = {m: [] for m in ours}
    try:
        for mode, constraint in ours.values():  # warm-up
            run(engine, mode.text, constraint, mode.tools, 0, 16)
            run(engine, mode.text, None, mode.tools, 0, 16)
        for r in range(args.rounds):
            for name in rotated(list(ours), r):
                mode, constraint = ours[name]
                constrained = run(engine, mode.text, constraint, mode.tools, r + 1, args.gen_tokens,
                                  temperature=temperature)
                twin = run(engine, mode.text, None, mode.tools, r + 1, constrained["tokens"], ignore_eos=True,
                           temperature=temperature)
                samples[name].append(constrained)
                twins[name].append(twin)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{m} {samples[m][-1]['decode_tok_s']:.1f} / {twins[m][-1]['decode_tok_s']:.1f}" for m in ours),
                flush=True)
        compiled = compile_times(engine)
        parts = breakdown(engine, table, args.breakdown, args.gen_tokens) if args.breakdown else None
    finally:
        engine.close()
    results = summarise(samples, twins)
    peer_modes = {name: mode for name, mode in table.items() if name in PEER_MODES}
    peer = (asyncio.run(measure_llama_server(args.llama_server, config, shlex.split(args.server_args), peer_modes,
                                             args.rounds, args.gen_tokens)) if args.llama_server else None)
    report = {"provenance": provenance(), "config": config.to_yaml_dict(),
              "run": {"modes": list(table), "rounds": args.rounds, "gen_tokens": args.gen_tokens,
                      "temperature": temperature, "threads_env": os.environ.get(THREADS_ENV)},
              "results": results,
              "llama_server": peer, "compile": compiled, "breakdown_us_per_token": parts}
    write_report(args.out, report)
    print("| server | mode | decode tok/s | same request unconstrained | ms/token | x unconstrained (paired) | "
          "95% interval | resampled tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for server, rows in (("ours", results), ("llama-server", peer["results"] if peer else {})):  # ours: both kinds
        for name, res in rows.items():
            rate = "" if res["resample_rate"] is None else f"{res['resample_rate']:.0%}"
            interval = res["vs_unconstrained_95"]
            low_high = f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else ""
            print(f"| {server} | {name} | {res['decode_tok_s']:.1f} | {res['unconstrained_tok_s']:.1f} | "
                  f"{res['ms_per_token']:.2f} | {res['vs_unconstrained']:.3f} | {low_high} | {rate} |")
    print("compile, a schema of {properties} properties ({schema_chars} characters): llguidance {guide_ms:.1f} ms "
          "(cached {guide_cached_ms:.3f}), for the vocabulary {guide_vocab_ms:.1f} ms (cached {guide_vocab_cached_ms:.3f}"
          "); GBNF {gbnf_ms:.1f} ms, llama.cpp's grammar sampler {gbnf_sampler_ms:.1f} ms".format(**compiled))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
