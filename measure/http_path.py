"""What the HTTP path costs, and what a deployment setting wins back: several variants of our Serve app side by
side in one Ray, each under its own route prefix, and our engine in-process, interleaved in one run.

Each variant is a name, `serve run` KEY=VALUE words and environment variables for its replicas (e.g. Serve's
own RAY_SERVE_* switches). Only the variant being measured generates; the others idle. The figures are
measure/'s (the tuner's workload and definitions); the ratios are each variant over the in-process engine of
the same run.

    python scripts/bench_http_path.py --variant default --variant 't1:n_threads=1' \\
        --variant 'no-thread:env:RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0' --repeats 5

Serve's direct ingress is cluster-wide (set at `ray start`), so a variant cannot have it: `--direct` runs the
app in a Ray of its own under direct ingress and measures its ingress replica's own port in the same rounds
(`--direct 'thin:ingress=engine'`: the engine replica takes HTTP itself, no hop at all). A server started
another way joins with `--server NAME=URL` (its API root, e.g. http://127.0.0.1:30000/v1). `--local
'unified:kv_unified=true'` adds another engine in this process with other settings: an engine setting's own
effect on TTFT and decode, in the same rounds, without the HTTP path. On a CPU build of llama.cpp with OpenMP
(llama-cpp-python's), two engines that have both decoded in one process run slower, both of them: libgomp cuts
its threads' spin-wait once its teams outnumber the cores (2-core machine, embedded model, one stream: ~87
tok/s with one engine, ~35 with two; `OMP_WAIT_POLICY=active` gave one of them its speed back), so on a CPU
compare `--local` engines with each other, not with other targets.

A server's streams run in this process's one event loop by default, so the last of four requests leaves some
milliseconds after the first and that counts in its TTFT; `--clients processes` runs each stream from a client
process of its own (measure/clients.py), as separate programs would, and `--clients both` measures each server
both ways in the same rounds (the second named NAME+procs).

`--server-trace` has our apps stamp each request as it reaches the app, is handed to the engine and has its first
bytes written ($LLAMA_SERVE_TUNE_HTTP_TRACE, serving/front/http.py), and splits each traced stream's TTFT (`--trace`,
and every probe request's, `--probe`) into the client's send, the way in to the app (the HTTP server and Serve),
the app's own work, the engine's TTFT, the way out to the first write and to the client: on one host every
process reads one monotonic clock.

Every TTFT gap against the in-process engine is a paired median with its quartiles and a 95% confidence interval
of the median (measure/design.py `median_interval`): a bar in milliseconds is met where the interval's top is
under it, and only missed by the noise where the interval straddles it.

In process, a stream's output is its text, as our server's stream shows it: a token that renders as nothing
(a special token, half a UTF-8 character) gets no SSE event, so a client sees it with the next text, and the
in-process targets count it there too (measure/targets.py, EngineTarget `text_only`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

from serving.engine import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/engine/llama.py)
from measure import serve_app  # noqa: E402
from measure.clients import ProcessClients  # noqa: E402
from measure.cluster import ClusterApp, LocalCluster, direct_ingress_settings, direct_url  # noqa: E402
from measure.device import Gpu  # noqa: E402
from measure.design import PairedGap, paired_gap, paired_ratios, ratios, round_order  # noqa: E402
from measure.metrics import RoundFigures, StreamRecord, stream_figures  # noqa: E402
from measure.provenance import provenance, write_report  # noqa: E402
from measure.targets import HttpTarget, free_loopback_port, loaded_engine  # noqa: E402
from measure.workload import Prompt, PromptSet, Runner, Target, Workload  # noqa: E402
from serving.engine.config import load_engine_config  # noqa: E402
from serving.front.http import TRACE_ENV  # noqa: E402

IN_PROCESS = "in-process"
PROCS = "+procs"  # the suffix of a server's target whose streams come from client processes (--clients both)


class Clients(str, Enum):
    """How a server's streams are run: in this process's event loop, from a process each, or both ways."""

    loop = "loop"
    processes = "processes"
    both = "both"


@dataclass(frozen=True)
class Variant:
    """`name[:KEY=VALUE ...][:env:NAME=VALUE ...]`: serve run words, then replica environment."""

    name: str
    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, *parts = text.split(":")
        args: dict[str, str] = {}
        env: dict[str, str] = {}
        target = args
        for part in parts:
            if part == "env":
                target = env
                continue
            for word in part.split(","):
                key, sep, value = word.partition("=")
                if not sep:
                    raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, got {word!r}")
                target[key] = value
        if not name or name == IN_PROCESS:
            raise argparse.ArgumentTypeError(f"{text!r}: give the variant a name (not {IN_PROCESS!r})")
        return cls(name, args, env)


@contextlib.contextmanager
def direct_app(variant: Variant, overrides: dict[str, str], timeout_s: float) -> Iterator[str]:
    """`serve run` of the app with `variant`'s words, in a Ray of its own under Serve's direct ingress (its
    environment added to every node's); yields the API root of its ingress replica's own port."""
    first_port = free_loopback_port()
    gpus = 1 if Gpu.open() is not None else 0
    cluster = LocalCluster.start(gpus_per_node=gpus, cpus_per_node=os.cpu_count() or 1, workers=0,
                                 settings={**direct_ingress_settings(first_port), **variant.env})
    work = Path(tempfile.mkdtemp(prefix="direct-"))
    app = None
    try:
        app = ClusterApp(cluster, work, {"config": "configs/default.yaml", **overrides, **variant.args})
        url = direct_url(app, first_port, timeout_s)
        app.wait(lambda health: health.get("status") == "ok", "/health ok", timeout_s, url=url)
        print(f"  {variant.name}: direct ingress at {url} (serve run log {app.log})", file=sys.stderr)
        yield f"{url}/v1"
    finally:
        if app is not None:
            app.stop()
        cluster.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    overrides = dict(word.split("=", 1) for word in args.engine)
    defaults = REPO_ROOT / "configs" / "default.yaml"
    config = load_engine_config(defaults, overrides)
    port = serve_app.start_serve(0, None) if args.variant else 0
    stamps_dir = Path(tempfile.mkdtemp(prefix="stamps-")) if args.server_trace else None
    traced_env = {TRACE_ENV: str(stamps_dir)} if stamps_dir else {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            # in process, output is text, as our server's stream shows it (EngineTarget._read)
            targets: list[Target] = [stack.enter_context(loaded_engine(config, IN_PROCESS, text_only=True))]
            for v in args.local:  # another engine in this process: settings compared without any HTTP
                local = load_engine_config(defaults, {**overrides, **v.args})
                targets.append(stack.enter_context(loaded_engine(local, v.name, text_only=True)))
            servers = list(args.server)
            for v in args.direct:
                v = replace(v, env={**v.env, **traced_env})
                servers.append((v.name, stack.enter_context(direct_app(v, overrides, args.load_timeout))))
            for name, url in servers:
                targets += await http_targets(stack, name, url, args.clients, max(args.levels, default=1))
            for v in args.variant:
                targets.append(await stack.enter_async_context(serve_app.deployed(
                    port, {**overrides, **v.args}, args.load_timeout, 300.0, name=v.name, env={**v.env, **traced_env})))
            workload = Workload(gen_tokens=args.max_tokens, levels=args.levels, repeats=args.repeats,
                                prompt_set=args.prompt_set)
            runner = Runner(workload, pause_s=args.pause_ms / 1000)
            results = await runner.levels(targets, lambda name, level, rep, f: print(
                f"  {name:<12} c={level} rep {rep}: {f.aggregate_tok_s:.1f} tok/s", file=sys.stderr))
            probe = await first_token_probe(targets, args.probe, args.pause_ms / 1000) if args.probe else {}
            trace = await stream_trace(runner, targets, args.trace) if args.trace else {}
    finally:
        if args.variant:
            serve_app.stop_serve()
    stamps = load_stamps(stamps_dir) if stamps_dir else {}
    reference = results[IN_PROCESS]
    probed = {name: [stream_figures(r) for r in records] for name, records in probe.items()}
    return {"provenance": provenance(), "engine_config": config.to_yaml_dict(),
            "variants": {v.name: {"args": v.args, "env": v.env} for v in args.variant},
            "servers": dict(args.server),
            "direct": {v.name: {"args": v.args, "env": v.env} for v in args.direct},
            "local": {v.name: {"args": v.args} for v in args.local}, "pause_ms": args.pause_ms,
            "clients": args.clients.value, "prompt_set": args.prompt_set.value,
            "results": {name: {str(n): level.as_dict() for n, level in levels.items()}
                        for name, levels in results.items()},
            "ratios": {name: {str(n): ratios(level.median, reference[n].median) for n, level in levels.items()}
                       for name, levels in results.items() if name != IN_PROCESS},
            "paired_ratios": {name: {str(n): paired_ratios(level.rounds, reference[n].rounds)
                                     for n, level in levels.items()}
                              for name, levels in results.items() if name != IN_PROCESS},
            "ttft_gap_ms": ttft_gaps({name: {n: level.rounds for n, level in levels.items()}
                                      for name, levels in results.items()}),
            "probe_ttft_ms": {name: [f.ttft_s * 1000 for f in figures] for name, figures in probed.items()},
            "probe_engine_ttft_ms": {name: [_ms(f.engine_ttft_s) for f in figures] for name, figures in probed.items()},
            "server_trace": args.server_trace,
            "trace": {name: [[asdict(stream) for stream in traced_round(records, stamps)] for records in rounds]
                      for name, rounds in trace.items()},
            "probe_trace": {name: [[asdict(stream) for stream in traced_round([r], stamps)] for r in records]
                            for name, records in probe.items()} if stamps else {}}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


async def http_targets(stack: contextlib.AsyncExitStack, name: str, url: str, clients: Clients,
                       streams: int) -> list[Target]:
    """The server at `url` as a target per way of being a client: streams in this process's event loop (named
    `name`), and/or streams from client processes of their own (`name+procs`, measure/clients.py)."""
    targets: list[Target] = []
    if clients in (Clients.loop, Clients.both):
        server = HttpTarget(name, url)
        stack.push_async_callback(server.aclose)
        await server.preflight()
        targets.append(server)
    if clients in (Clients.processes, Clients.both):
        procs = ProcessClients(name + PROCS if clients is Clients.both else name, url, streams)
        stack.push_async_callback(procs.aclose)
        await procs.start()
        targets.append(procs)
    return targets


async def first_token_probe(targets: Sequence[Target], rounds: int,
                            pause_s: float = 0.0) -> dict[str, list[StreamRecord]]:
    """What the path adds where no prefill hides it: a prompt of a few tokens and one token out, one request at a
    time, each target in turn (`round_order`'s), `rounds` times after a warm-up, `pause_s` idle before each
    request (on a CPU, so the last target's engine threads have stopped spinning: they share the cores with
    this one's path); each request's record."""
    records: dict[str, list[StreamRecord]] = {t.name: [] for t in targets}
    for target in targets:
        await target.run_stream(Prompt("Request 0.", chat=False), 1, True)
    for i in range(1, rounds + 1):
        for target in round_order(targets, i - 1):
            if pause_s > 0:
                await asyncio.sleep(pause_s)
            records[target.name].append(await target.run_stream(Prompt(f"Request {i}.", chat=False), 1, True))
    return records


@dataclass(frozen=True)
class StreamTrace:
    """One stream of a traced round, ms from the round's start: when it started and when its request had left
    the client (HTTP), its TTFT, and the engine's own TTFT; TTFT minus that is what the path held it (in
    before the engine's intake, and out after its first token). With --server-trace, our app's stamps too:
    when the request reached the app, was handed to the engine, and had its first body bytes written."""

    start_ms: float
    sent_ms: float | None
    ttft_ms: float
    engine_ttft_ms: float | None
    received_ms: float | None = None
    submitted_ms: float | None = None
    first_body_ms: float | None = None


async def stream_trace(runner: Runner, targets: Sequence[Target], rounds: int) -> dict[str, list[list[StreamRecord]]]:
    """`rounds` more rounds of the largest level per target, each stream as it went: which of a round's
    requests reached the engine late, and which step each joined, shows here, not in a round's means."""
    traces: dict[str, list[list[StreamRecord]]] = {t.name: [] for t in targets}
    for i in range(rounds):
        for target in round_order(targets, i):
            _, records = await runner.run_round(target, runner.workload.concurrency)
            traces[target.name].append(records)
    return traces


def load_stamps(directory: Path) -> dict[str, dict[str, Any]]:
    """The apps' request stamps (serving/front/http.py StampLog), by request id."""
    stamps: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            stamps[entry["request_id"]] = entry
    return stamps


def traced_round(records: Sequence[StreamRecord], stamps: dict[str, dict[str, Any]]) -> list[StreamTrace]:
    """A round's streams on its own clock (ms from its first start), with the server's stamps where it left some."""
    t0 = min(r.t_start for r in records)

    def ms(t: float | None) -> float | None:
        return None if t is None else (t - t0) * 1e3

    traced = []
    for r in records:
        f = stream_figures(r)
        s = stamps.get(r.request_id or "", {})
        traced.append(StreamTrace(ms(r.t_start) or 0.0, None if f.send_s is None else ms(r.t_start + f.send_s),
                                  f.ttft_s * 1e3, None if f.engine_ttft_s is None else f.engine_ttft_s * 1e3,
                                  ms(s.get("received")), ms(s.get("submitted")), ms(s.get("first_body"))))
    return traced


def trace_table(trace: dict[str, list[list[dict[str, Any]]]]) -> str:
    """Each traced round on a line per target: every stream's TTFT, its engine's own, and what the path held."""
    lines = ["| target | round | each stream: TTFT ms (engine's own; the path's) |", "| --- | ---: | --- |"]
    for name, rounds in trace.items():
        for i, streams in enumerate(rounds, 1):
            lines.append(f"| {name} | {i} | {', '.join(_trace_cell(s) for s in streams)} |")
    return "\n".join(lines)


def _trace_cell(stream: dict[str, Any]) -> str:
    ttft, own = stream["ttft_ms"], stream["engine_ttft_ms"]
    return f"{ttft:.0f} (-)" if own is None else f"{ttft:.0f} ({own:.0f}; {ttft - own:.0f})"


PARTS = ("send", "to the app", "in the app", "engine", "to the write", "to the client")


def ttft_parts(stream: dict[str, Any]) -> tuple[float, ...] | None:
    """A stream's TTFT in PARTS (ms, summing to it): the client's send; on to our app (the HTTP server, Serve);
    the app's own work until the engine took it; the engine's TTFT (its queue included); from the first token
    to its bytes' write; on to the client. None without every stamp."""
    start, sent, ttft, own = stream["start_ms"], stream["sent_ms"], stream["ttft_ms"], stream["engine_ttft_ms"]
    received, submitted, first = stream.get("received_ms"), stream.get("submitted_ms"), stream.get("first_body_ms")
    if sent is None or own is None or received is None or submitted is None or first is None:
        return None
    return (sent - start, received - sent, submitted - received, own, first - submitted - own, start + ttft - first)


def parts_table(trace: dict[str, list[list[dict[str, Any]]]]) -> str:
    """Where the traced streams' TTFT went, median ms per part, by the order in which a round's requests
    reached the app (1 = first): the late ones' extra time shows in the part that holds it."""
    lines = ["| target | reached the app | streams | " + " | ".join(PARTS) + " | TTFT |",
             "| --- | ---: | ---: |" + " ---: |" * (len(PARTS) + 1)]
    for name, rounds in trace.items():
        by_order: dict[int, list[tuple[float, ...]]] = {}
        for streams in rounds:
            timed = sorted((s for s in streams if ttft_parts(s) is not None), key=lambda s: s["received_ms"])
            for order, stream in enumerate(timed, 1):
                parts = ttft_parts(stream)
                assert parts is not None
                by_order.setdefault(order, []).append((*parts, stream["ttft_ms"]))
        for order, rows in sorted(by_order.items()):
            medians = (statistics.median(column) for column in zip(*rows, strict=True))
            lines.append(f"| {name} | {order} | {len(rows)} | " + " | ".join(f"{m:.1f}" for m in medians) + " |")
    return "\n".join(lines)


def probe_gaps(probe: dict[str, list[float]]) -> dict[str, PairedGap]:
    """Each target's probe TTFT against the engine in-process, request by request."""
    gaps = {name: paired_gap(values, probe[IN_PROCESS]) for name, values in probe.items() if name != IN_PROCESS}
    return {name: gap for name, gap in gaps.items() if gap is not None}


def probe_table(probe: dict[str, list[float]], own: dict[str, list[float | None]] | None = None) -> str:
    """The probe's TTFT per target, and each against the engine in-process request by request; with the
    engine's own TTFT of each request (`own`, reports since it was kept), the path's share: TTFT minus it,
    the part of the gap that is not the engine's noise."""
    lines = ["| target | requests | TTFT ms (median) | engine's own ms (median) | the path's ms (median) "
             "| TTFT - in-process ms: paired median [quartiles] (95% CI of the median) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    gaps = probe_gaps(probe)
    for name, values in probe.items():
        gap = gaps.get(name)
        own_values = (own or {}).get(name, [])
        engine = [v for v in own_values if v is not None]
        paths = [t - e for t, e in zip(values, own_values, strict=False) if e is not None]
        lines.append(f"| {name} | {len(values)} | {statistics.median(values):.1f} "
                     f"| {f'{statistics.median(engine):.1f}' if engine else '-'} "
                     f"| {f'{statistics.median(paths):.1f}' if paths else '-'} | {gap.text() if gap else '-'} |")
    return "\n".join(lines)


def ttft_gaps(rounds: dict[str, dict[Any, list[RoundFigures]]]) -> dict[str, dict[str, Any]]:
    """Per target and level, its TTFT minus the in-process engine's, round by round (median, quartiles)."""
    gaps = {name: {str(n): paired_gap([r.ttft_ms for r in level], [r.ttft_ms for r in rounds[IN_PROCESS][n]])
                   for n, level in levels.items()}
            for name, levels in rounds.items() if name != IN_PROCESS}
    return {name: {n: asdict(g) if g else None for n, g in levels.items()} for name, levels in gaps.items()}


def with_paired_ratios(report: dict[str, Any]) -> dict[str, Any]:
    """A saved report with its paired ratios and TTFT gaps (worked out from its rounds when an older run lacks
    them)."""
    if "paired_ratios" in report and "ttft_gap_ms" in report:
        return report
    rounds = {name: {n: [RoundFigures(**r) for r in level["rounds"]] for n, level in levels.items()}
              for name, levels in report["results"].items()}
    paired = {name: {n: paired_ratios(level, rounds[IN_PROCESS][n]) for n, level in levels.items()}
              for name, levels in rounds.items() if name != IN_PROCESS}
    return {**report, "paired_ratios": report.get("paired_ratios", paired), "ttft_gap_ms": ttft_gaps(rounds)}


def _named_url(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or name == IN_PROCESS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=URL (a name other than {IN_PROCESS!r})")
    return name, url


def table(report: dict[str, Any]) -> str:
    """Medians, and each target over the in-process engine two ways: paired (the median of round-by-round
    ratios) and of medians. "last request sent": when the round's last request had left the client, from
    the round's start (the client's own share of a round's TTFT; measure/metrics.py). "engine's own TTFT":
    what the server reported (ours: from the engine's intake, its queue included; llama-server: its prompt
    processing alone): TTFT minus it is the path around the engine, and where four streams' TTFT grows
    more through a server than in process, this says whether the engine's part grew (the requests reached
    it apart) or the path's."""
    lines = ["| target | streams | agg tok/s | decode tok/s | TTFT ms | engine's own TTFT ms | last request sent ms "
             "| TTFT - in-process ms: paired median [quartiles] (95% CI of the median) "
             "| agg / in-process: paired, of medians | decode / in-process: paired, of medians |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, levels in report["results"].items():
        for n, level in levels.items():
            m = level["median"]
            r, p = report["ratios"].get(name, {}).get(n), report["paired_ratios"].get(name, {}).get(n)
            agg, dec = (f"{p[k]:.3f}, {r[k]:.3f}" if r and p else "1" for k in ("aggregate_tok_s", "decode_tok_s"))
            gap = report["ttft_gap_ms"].get(name, {}).get(n)
            gap_text = PairedGap(**gap).text() if gap else "-"
            sent, own = m.get("send_ms_max"), m.get("engine_ttft_ms")
            lines.append(f"| {name} | {n} | {m['aggregate_tok_s']:.1f} | {m['decode_tok_s']:.1f} | {m['ttft_ms']:.0f} "
                         f"| {'-' if own is None else f'{own:.1f}'} | {'-' if sent is None else f'{sent:.1f}'} "
                         f"| {gap_text} | {agg} | {dec} |")
    return "\n".join(lines)


def gap_rows(report: dict[str, Any]) -> list[tuple[str, PairedGap]]:
    """Every TTFT gap of a report against the in-process engine, labelled: per target and level, then the
    probe's per target (its interval worked out from the requests where the report predates it)."""
    rows = [(f"{name}, {n} stream{'s' if n != '1' else ''}", PairedGap(**gap))
            for name, levels in report["ttft_gap_ms"].items() for n, gap in levels.items() if gap]
    rows += [(f"{name}, probe", gap) for name, gap in probe_gaps(report.get("probe_ttft_ms") or {}).items()]
    return rows


def plot(report: dict[str, Any], path: Path) -> None:
    """Each TTFT gap against the in-process engine: the paired median, its 95% interval (thick) and quartiles
    (thin), as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = gap_rows(report)
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.4))
    for y, (_, gap) in enumerate(rows):
        ax.plot([gap.q1, gap.q3], [y, y], color="grey", lw=1)
        if gap.ci_low is not None and gap.ci_high is not None:
            ax.plot([gap.ci_low, gap.ci_high], [y, y], color="tab:blue", lw=5, solid_capstyle="butt")
        ax.plot([gap.median], [y], "o", color="black")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("TTFT minus the engine in process, ms (paired)")
    prov = report.get("provenance", {})
    ax.set_title(f"The HTTP path's TTFT: median (dot), 95% interval (thick), quartiles (thin)\n"
                 f"{prov.get('cpu', '')} {prov.get('commit', '')} {prov.get('date', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_tables(report: dict[str, Any]) -> None:
    print(table(report))
    if report.get("probe_ttft_ms"):
        print(probe_table(report["probe_ttft_ms"], report.get("probe_engine_ttft_ms")))
        probe_trace = report.get("probe_trace")
        if probe_trace and any(ttft_parts(s) is not None for rounds in probe_trace.values()
                               for streams in rounds for s in streams):
            print("The probe's requests, part by part:")
            print(parts_table(probe_trace))
    trace = report.get("trace")
    if trace:
        print(trace_table(trace))
        if any(ttft_parts(s) is not None for rounds in trace.values() for streams in rounds for s in streams):
            print(parts_table(trace))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", type=Variant.parse, action="append", default=[],
                   help="name[:KEY=VALUE,...][:env:NAME=VALUE,...]; repeat for more")
    p.add_argument("--direct", type=Variant.parse, action="append", default=[],
                   help="name[:KEY=VALUE,...][:env:NAME=VALUE,...]: the app in a Ray of its own under Serve's direct "
                        "ingress, measured at its ingress replica's port; repeat for more")
    p.add_argument("--local", type=Variant.parse, action="append", default=[],
                   help="name[:KEY=VALUE,...]: another engine in this process with these settings over --engine's, "
                        "measured in the same rounds (no HTTP: engine settings against the in-process one)")
    p.add_argument("--server", type=_named_url, action="append", default=[], metavar="NAME=URL",
                   help="also measure a server already running at URL (its API root); repeat for more")
    p.add_argument("--engine", action="append", default=["n_parallel=4", "n_ctx=4096"], metavar="KEY=VALUE",
                   help="engine settings of every target (default n_parallel=4, n_ctx=4096)")
    p.add_argument("--levels", type=lambda t: () if t == "none" else tuple(int(x) for x in t.split(",")),
                   default=(1, 4), help="streams at once, comma-separated (default 1,4); none: the probe alone")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-set", type=PromptSet, choices=[PromptSet.plain, PromptSet.chat], default=PromptSet.plain,
                   help="plain: raw completions of instructions; chat: the same as chat messages, as a chat "
                        "client sends them")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--probe", type=int, default=0, metavar="N",
                   help="also N one-token requests of a few-token prompt per target, one at a time: the TTFT the "
                        "path adds where no prefill hides it (default 0: none)")
    p.add_argument("--server-trace", action="store_true",
                   help="our apps (--direct, --variant) stamp each request (serving/front/http.py); the traced rounds "
                        "(--trace) and the probe (--probe) then show where each stream's TTFT went, part by part")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="also N rounds of the largest level per target, each stream's TTFT and the engine's own "
                        "printed (default 0: none)")
    p.add_argument("--pause-ms", type=float, default=0.0,
                   help="idle time before each round (the levels, the trace) and each probe request, so each "
                        "target's idle work (the prompt cache's saves; on a CPU, its engine threads' spin after a "
                        "graph) is done before the next round and never during another target's (default 0: rounds "
                        "back to back)")
    p.add_argument("--clients", type=Clients, choices=list(Clients), default=Clients.loop,
                   help="how the streams of a --server or --direct target are run: loop (one event loop in this "
                        "process, as before), processes (a client process per stream: no stream waits on "
                        "another's client), both (each server twice, the second named NAME+procs); default loop")
    p.add_argument("--load-timeout", type=float, default=300.0)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--from-json", type=Path, help="print the table of a saved run instead of measuring")
    p.add_argument("--plot", type=Path, help="each TTFT gap with its interval and quartiles, as PNG")
    args = p.parse_args(argv)
    if args.pause_ms < 0:
        p.error("--pause-ms must be 0 or more")
    if any(v.env for v in args.local):
        p.error("--local takes engine settings (name:KEY=VALUE,...), not env: an engine in this process has ours")
    names = [IN_PROCESS, *(v.name for v in [*args.variant, *args.direct, *args.local]), *(n for n, _ in args.server)]
    if len(set(names)) < len(names):
        p.error(f"every target needs a name of its own: {', '.join(names)}")
    if args.from_json:
        saved = with_paired_ratios(json.loads(args.from_json.read_text()))
        print_tables(saved)
        if args.plot:
            plot(saved, args.plot)
        return 0
    if not args.variant and not args.server and not args.direct and not args.local:
        p.error("give at least one --variant, --direct, --server or --local")
    if args.server_trace and not args.trace and not args.probe:
        p.error("--server-trace splits the traced rounds' and the probe's TTFT: give --trace N or --probe N too")
    report = asyncio.run(run(args))
    print_tables(report)
    if args.json_out:
        write_report(args.json_out, report)
    if args.plot:
        plot(report, args.plot)
    return 0

