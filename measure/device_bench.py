"""Device benchmark: bandwidth roofline, llama-server vs our engine (in-process and over Ray Serve), memory.

A figure on a lent GPU is only worth the device time when it can be judged, so ONE run on ONE device
measures side by side: the device's copy bandwidth, hence the single-stream decode roofline (bandwidth /
bytes read per token, from the GGUF header); llama-server with the flags that mean the same as our config;
our engine in-process (in a child process: measure/isolated.py); our Serve app over HTTP; and device memory
(GPU: NVML 'used' minus the idle baseline at start; CPU: the process's RSS) next to serving.engine.memory's
prediction, and the host memory (RSS) of the engine's process next to the prediction of what stays in host
memory. Every target runs measure/'s workload (the tuner's) at 1 and 4 streams. One engine holds the
model at a time, so memory readings are clean and a 15 GB model never sits on the device twice. Every phase
has a timeout; a failed phase is recorded and the run goes on, and the JSON report is rewritten after every
phase, so a run cut short keeps its figures.

    # CPU smoke test (embedded SmolLM2-135M; about a minute on 2 cores)
    python scripts/bench_device.py --llama-server .llama-build/bin/llama-server --configs article \\
        --max-tokens 16 --repeats 1 --json-out results/bench_device_cpu.json
    # GPU: the 27B-class synthetic model, both configs
    PYTHONUNBUFFERED=1 python3 scripts/bench_device.py --model /tmp/qwen27b.gguf \\
        --llama-server build/bin/llama-server --json-out $OUT/bench_device.json

Placements of a model that does not fit (`--placement NAME:KEY=VALUE,...`, engine settings over the article's
config, e.g. `moe30:n_cpu_moe=30`) are configs like the others; with `--fit-budget SIZE`, llama-server also
runs with `--fit on`, its margin (`--fit-target`) set so that it sees SIZE of free GPU memory, and the other
targets' ratios are to it (placements that differ only in what --fit decides share one --fit run: its command
is the same):

    python3 scripts/bench_device.py --model /tmp/moe.gguf --llama-server build/bin/llama-server \
        --configs article --placement 'cpu-moe40:n_cpu_moe=40' --fit-budget 8GiB --skip-http

Our own fit at start beside it is a placement that leaves the weights `auto` at the same budget
(`--placement 'fit:n_gpu_layers=auto,vram_budget=8GiB'`); a config with `auto` settings is predicted, and given
to llama-server, as the engine sizes it (its `sized_config` in the report).

Progress goes to stderr, the table to stdout. SIGTERM stops the run cleanly and still prints the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

from serving.engine import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/engine/llama.py)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from measure import serve_app  # noqa: E402
from measure.device import GiB, Gpu, measure_bandwidth, roofline_tok_s, rss_bytes  # noqa: E402
from measure.isolated import child_engine  # noqa: E402
from measure.provenance import provenance  # noqa: E402
from measure.targets import llama_server, llama_server_flags, llama_server_version  # noqa: E402
from measure.workload import Runner, Workload  # noqa: E402
from serving.engine.config import EngineConfig, embedded_model_path, load_engine_config  # noqa: E402
from serving.engine.devices import available_memory, visible_gpus  # noqa: E402
from serving.engine.fit import budget_for, fit  # noqa: E402
from serving.engine.memory import MiB, ModelShape, predict  # noqa: E402
from serving.engine.units import parse_bytes  # noqa: E402

SINGLE, MULTI = 1, 4
FIT = "llama-server --fit"
TARGETS = ("llama-server", FIT, "ours in-process", "ours HTTP")
PLACEMENT_FLAGS = ("-ngl", "--n-cpu-moe", "-ot")  # what --fit decides: left out of its command
BANDWIDTH_TIMEOUT_S = 300.0  # child process: torch import + CUDA init + ~25 copies of a 4 GiB buffer
ENV_KEYS = ("LLAMA_CPP_LIB_PATH", "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "LLAMA_ATTN_ROT_DISABLE",
            "GGML_CUDA_DISABLE_GRAPHS", "OMP_NUM_THREADS")
ARTICLE = load_engine_config(REPO_ROOT / "configs" / "article.yaml")
CONFIGS = {"article": ARTICLE, "np4": ARTICLE.model_copy(update={"n_parallel": 4, "n_ctx": 8192})}
_T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_configs(text: str) -> list[str]:
    """'article,np4' -> the names, in order ('' for none: only --placement's); an unknown name is an error
    listing the known ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    return names


def parse_placement(text: str) -> tuple[str, EngineConfig]:
    """'NAME:KEY=VALUE,...' -> the article's config with those engine settings (validated now)."""
    name, sep, rest = text.partition(":")
    if not sep or not name or name in CONFIGS:
        raise argparse.ArgumentTypeError(f"{text!r}: write NAME:KEY=VALUE,... with a new NAME")
    try:
        updates = dict(word.split("=", 1) for word in rest.split(",") if word)
        return name, EngineConfig(**{**ARTICLE.model_dump(), **updates})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def without_placement(flags: Sequence[str]) -> list[str]:
    """llama-server's flags for a config less the ones --fit sets itself."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in PLACEMENT_FLAGS:
            skip = True
        else:
            out.append(flag)
    return out


def ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


@dataclasses.dataclass
class Run:
    """What the phases share: arguments, the GPU (None on CPU), the model's shape, the report being built."""

    args: argparse.Namespace
    gpu: Gpu | None
    report: dict[str, Any]
    shape: ModelShape | None = None
    baseline: int | None = None  # GPU memory in use before anything of ours loaded
    configs: dict[str, EngineConfig] = dataclasses.field(default_factory=dict)  # by name: the built-in and --placement
    serve_port: int | None = None
    serve_error: str | None = None
    fit_runs: dict[tuple[str, ...], str] = dataclasses.field(default_factory=dict)  # --fit flags -> config measured

    def fit_flags(self, name: str) -> tuple[str, ...]:
        """llama-server --fit's command for a config: its flags less the placement, which --fit decides."""
        return tuple(without_placement(llama_server_flags(self.sized(name))))

    def config(self, name: str) -> EngineConfig:
        config = self.configs.get(name) or CONFIGS[name]
        return config.model_copy(update={"model": self.args.model,
                                         "n_threads": self.args.threads or config.n_threads})

    def sized(self, name: str) -> EngineConfig:
        """A config as our engine will run it: the settings it leaves `auto` sized as the engine sizes them when it
        loads (serving/engine/fit.py), from the memory found now; so the prediction, llama-server's flags and its
        --fit run (which decides only the placement) are at the context our engine takes."""
        config = self.config(name)
        if config.sized or self.shape is None:
            return config
        found = budget_for(config, visible_gpus() if self.gpu is not None else (), available_memory())
        return fit(self.shape, config, found).config

    @property
    def workload(self) -> Workload:
        return Workload(gen_tokens=self.args.max_tokens, levels=(SINGLE, MULTI), repeats=self.args.repeats)

    def save(self) -> None:
        path = Path(self.args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.report, indent=2, default=str) + "\n", encoding="utf-8")

    def engine_memory(self, pid: int | None) -> int | None:
        """GPU: device memory used minus the idle baseline; CPU: the engine process's RSS."""
        if self.gpu is not None:
            return None if self.baseline is None else self.gpu.used() - self.baseline
        return rss_bytes(pid) if pid is not None else None

    async def settle(self, limit_s: float = 90.0, slack: int = 512 << 20) -> int | None:
        """Wait until the previous engine's device memory is given back; what is still held over baseline."""
        if self.gpu is None or self.baseline is None:
            return None
        deadline = time.monotonic() + limit_s
        while True:
            held = self.gpu.used() - self.baseline
            if held < slack or time.monotonic() > deadline:
                if held >= slack:
                    say(f"  warning: {held / GiB:.2f} GiB still held over the baseline before loading")
                return held
            await asyncio.sleep(1.0)

    async def sample_memory(self, out: dict[str, Any], key: str, pid: int | None) -> None:
        await asyncio.sleep(1.0)  # a short pause, so allocations have landed
        out.setdefault("memory", {})[key] = self.engine_memory(pid)
        out.setdefault("host_memory", {})[key] = rss_bytes(pid) if pid is not None else None


def describe_error(exc: BaseException, timeout_s: float) -> str:
    """One line for the report; a bare timeout says which limit it hit."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"TimeoutError: phase exceeded {timeout_s:.0f} s"
    return f"{type(exc).__name__}: {exc}"[:2000]


async def run_phase(run: Run, label: str, timeout_s: float,
                    body: Callable[[dict[str, Any]], Awaitable[None]]) -> dict[str, Any]:
    """One phase under a timeout; its error is recorded instead of stopping the run, and what `body` put in
    `out` before a failure is kept."""
    out: dict[str, Any] = {"error": None}
    t0 = time.monotonic()
    say(f"{label}: start")
    try:
        await asyncio.wait_for(body(out), timeout_s)
    except Exception as exc:
        out["error"] = describe_error(exc, timeout_s)
        run.report["errors"].append(f"{label}: {out['error']}")
        say(f"{label}: FAILED: {out['error']}")
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    run.save()
    return out


def _levels(results: dict[int, Any]) -> dict[str, Any]:
    return {str(n): level.as_dict() for n, level in results.items()}


async def bench_llama_server(run: Run, name: str, out: dict[str, Any], fit: bool = False) -> None:
    out["memory"] = {"before_load": await run.settle()}
    a = run.args
    flags = llama_server_flags(run.config(name))
    if fit:
        flags = [*run.fit_flags(name), "--fit", "on", "--fit-target", str(fit_margin_mib(run))]
    async with llama_server(a.llama_server, a.model, flags, a.load_timeout, a.request_timeout) as target:
        out["server"] = target.describe()
        await run.sample_memory(out, "loaded_idle", target.extra["pid"])
        out["results"] = _levels((await Runner(run.workload).levels([target]))[target.name])
        await run.sample_memory(out, "after_workload", target.extra["pid"])


def fit_margin_mib(run: Run) -> int:
    """--fit-target: the free memory llama-server must leave, so that what it may use is --fit-budget."""
    if run.gpu is None or run.baseline is None:
        raise RuntimeError("--fit-budget needs a GPU")
    free = run.gpu.info()["memory_total_bytes"] - run.baseline
    return max(0, (free - run.args.fit_budget) // MiB)


async def bench_in_process(run: Run, name: str, out: dict[str, Any]) -> None:
    out["memory"] = {"before_load": await run.settle()}
    workload = dataclasses.asdict(run.workload)
    async with child_engine(run.config(name).to_yaml_dict(), workload, run.args.load_timeout) as child:
        out["engine"] = await child.loaded()
        say(f"[{name}] llama.cpp's buffers (MiB): {out['engine'].get('buffers_mib')}")
        await run.sample_memory(out, "loaded_idle", child.pid)
        out["results"] = await child.run(run.args.phase_timeout)
        await run.sample_memory(out, "after_workload", child.pid)


async def bench_http(run: Run, name: str, out: dict[str, Any]) -> None:
    if run.serve_port is None:
        raise RuntimeError(f"Ray Serve did not start: {run.serve_error}")
    out["memory"] = {"before_load": await run.settle()}
    async with serve_app.deployed(run.serve_port, run.config(name).to_yaml_dict(), run.args.load_timeout,
                                  run.args.request_timeout) as target:
        out["engine"] = {"config": target.extra["served_config"]}
        await run.sample_memory(out, "loaded_idle", None)
        out["results"] = _levels((await Runner(run.workload).levels([target]))[target.name])
        await run.sample_memory(out, "after_workload", None)


def ensure_serve(run: Run) -> None:
    """Ray and Serve, started once before the first HTTP phase; a failure skips every HTTP phase."""
    if run.serve_port is not None or run.serve_error is not None:
        return
    say("starting Ray and Serve ...")
    try:
        preload = None
        if run.args.serve_preload_libllama:
            preload = getattr(getattr(sys.modules.get("llama_cpp.llama_cpp"), "_lib", None), "_name", None)
            if not preload:
                raise RuntimeError("--serve-preload-libllama: no libllama.so loaded in this process to preload")
        run.serve_port = serve_app.start_serve(len(run.gpu.indices) if run.gpu else 0, preload)
        run.report["serve"] = {"port": run.serve_port, "ld_preload": preload}
    except Exception as exc:
        run.serve_error = describe_error(exc, 0)
        run.report["errors"].append(f"ray/serve start: {run.serve_error}")


async def bench_config(run: Run, name: str) -> None:
    """One config on every enabled target, one engine at a time."""
    a, config = run.args, run.config(name)
    sized = run.sized(name)
    predicted = predict(run.shape, sized, on_gpu=run.gpu is not None).as_dict() if run.shape else None
    entry = run.report["configs"].setdefault(name, {"engine_config": config.to_yaml_dict(), "predicted": predicted,
                                                    "sized_config": sized.to_yaml_dict(),
                                                    "server_args": llama_server_flags(sized), "targets": {}})
    fitted: Callable[[Run, str, dict[str, Any]], Awaitable[None]] = functools.partial(bench_llama_server, fit=True)
    steps: list[tuple[str, Callable[[Run, str, dict[str, Any]], Awaitable[None]], bool]] = [
             ("llama-server", bench_llama_server, not (a.skip_llama_server or a.fit_only)),
             (FIT, fitted, bool(a.fit_budget) and not a.skip_llama_server),
             ("ours in-process", bench_in_process, not a.skip_in_process),
             ("ours HTTP", bench_http, not a.skip_http)]
    fit_key = run.fit_flags(name)
    for label, fn, enabled in steps:
        if not enabled:
            continue
        if label == FIT and fit_key in run.fit_runs:  # placements differing only in what --fit sets
            measured = run.fit_runs[fit_key]
            entry["targets"][label] = {**run.report["configs"][measured]["targets"][label], "same_run_as": measured}
            say(f"[{name}] {label}: the same command as [{measured}]'s, measured there")
            continue
        if label == "ours HTTP":
            ensure_serve(run)
        entry["targets"][label] = await run_phase(run, f"[{name}] {label}", a.phase_timeout,
                                                  functools.partial(fn, run, name))
        if label == FIT:
            run.fit_runs[fit_key] = name


async def phase_bandwidth(run: Run) -> None:
    a = run.args
    gib = a.bw_gib or (4.0 if run.gpu else 1.0)

    async def body(out: dict[str, Any]) -> None:
        bw = await asyncio.to_thread(measure_bandwidth, run.gpu is not None, gib, a.bw_repeats, BANDWIDTH_TIMEOUT_S)
        out.update(dataclasses.asdict(bw))

    bw = await run_phase(run, f"bandwidth ({gib:g} GiB buffer)", BANDWIDTH_TIMEOUT_S + 30, body)
    per_token = run.shape.bytes_read_per_token if run.shape else None
    run.report["bandwidth"] = bw
    run.report["roofline_tok_s_single_stream"] = roofline_tok_s(bw.get("bytes_per_s"), per_token)


# -- the table (pure; unit-tested) ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the final table: one target under one config."""

    config: str
    target: str
    single_tok_s: float | None = None
    multi_tok_s: float | None = None
    ratio_single: float | None = None
    ratio_multi: float | None = None
    roofline_fraction: float | None = None
    ttft_ms: float | None = None
    memory_measured: int | None = None
    memory_predicted: int | None = None
    host_measured: int | None = None
    host_predicted: int | None = None
    error: str | None = None


def _median(results: dict[str, Any] | None, level: int, key: str) -> float | None:
    value = ((results or {}).get(str(level)) or {}).get("median", {}).get(key)
    return value if isinstance(value, (int, float)) else None


def build_rows(report: dict[str, Any]) -> list[Row]:
    """Rows from the report: figures per target, ratios to llama-server of the same config (to its --fit run
    where there is one: then the question is the placement)."""
    roof = report.get("roofline_tok_s_single_stream")
    rows = []
    for name, entry in report.get("configs", {}).items():
        targets = entry.get("targets", {})
        ref = (targets.get(FIT) or targets.get("llama-server", {})).get("results")
        ref_single, ref_multi = _median(ref, SINGLE, "decode_tok_s"), _median(ref, MULTI, "aggregate_tok_s")
        for label in (t for t in TARGETS if t in targets):
            t = targets[label]
            res, memory = t.get("results"), t.get("memory") or {}
            single, multi = _median(res, SINGLE, "decode_tok_s"), _median(res, MULTI, "aggregate_tok_s")
            host = t.get("host_memory") or {}
            predicted = entry.get("predicted") or {}
            rows.append(Row(name, label, single, multi, ratio(single, ref_single), ratio(multi, ref_multi),
                            ratio(single, roof), _median(res, SINGLE, "ttft_ms"), _latest(memory),
                            predicted.get("total"), _latest(host), predicted.get("host"), t.get("error")))
    return rows


def _latest(memory: dict[str, Any]) -> int | None:
    """After the workload if read, else loaded and idle."""
    return memory.get("after_workload") if memory.get("after_workload") is not None else memory.get("loaded_idle")


def _num(value: float | None, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


COLUMNS = (("config", 8, "<"), ("target", 15, "<"), ("1-stream tok/s", 14, ">"), ("4-way agg tok/s", 15, ">"),
           ("x llama-server 1/4", 18, ">"), ("% roofline", 10, ">"), ("TTFT ms", 8, ">"),
           ("mem GiB meas / pred", 20, ">"), ("host GiB meas / pred", 20, ">"))


def format_table(rows: Sequence[Row], memory_label: str = "VRAM") -> str:
    """The fixed-width table printed at the end; a failed phase shows its error under its row."""
    header = "  ".join(f"{(title.replace('mem', memory_label, 1)):{align}{width}}" for title, width, align in COLUMNS)
    lines = [header, "-" * len(header)]
    for r in rows:
        gib = [_num(m / GiB if m is not None else None, ".2f") for m in (r.memory_measured, r.memory_predicted,
                                                                          r.host_measured, r.host_predicted)]
        cells = (r.config, r.target, _num(r.single_tok_s, ".1f"), _num(r.multi_tok_s, ".1f"),
                 f"{_num(r.ratio_single, '.3f')} / {_num(r.ratio_multi, '.3f')}",
                 _num(100 * r.roofline_fraction if r.roofline_fraction is not None else None, ".1f"),
                 _num(r.ttft_ms, ".1f"), f"{gib[0]} / {gib[1]}", f"{gib[2]} / {gib[3]}")
        lines.append("  ".join(f"{c:{align}{width}}" for c, (_, width, align) in zip(cells, COLUMNS, strict=True)))
        if r.error:
            lines.append(f"    ! {r.error[:200]}")
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary (required unless --skip-llama-server)")
    p.add_argument("--configs", type=parse_configs, default=["article", "np4"],
                   help=f"comma list from {sorted(CONFIGS)} (default article,np4)")
    p.add_argument("--placement", type=parse_placement, action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="one more config: the article's with these engine settings (e.g. cpu-moe30:n_cpu_moe=30)")
    p.add_argument("--fit-budget", type=parse_bytes, help="also run llama-server --fit on, seeing this much free "
                   "GPU memory (e.g. 8GiB); ratios are then to it")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per stream (EOS ignored)")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds per level after a warm-up; median")
    p.add_argument("--threads", type=int, help="-t for llama-server and n_threads for ours (default: each its own)")
    p.add_argument("--skip-llama-server", action="store_true")
    p.add_argument("--fit-only", action="store_true", help="with --fit-budget: llama-server runs only with --fit, "
                   "not with each config's own flags (a placement study's shortest run)")
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--serve-preload-libllama", action="store_true",
                   help="LD_PRELOAD libllama.so into Ray's workers (libllama before numpy; see "
                        "serving/engine/llama.py)")
    p.add_argument("--bw-gib", type=float, help="bandwidth buffer size (default 4 GiB on GPU, 1 GiB on CPU)")
    p.add_argument("--bw-repeats", type=int, default=20, help="timed copies after warm-up (median)")
    p.add_argument("--load-timeout", type=float, default=600.0, help="seconds for a model to load / a server start")
    p.add_argument("--phase-timeout", type=float, default=1500.0, help="seconds for one target's whole phase")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per HTTP read")
    p.add_argument("--json-out", default="results/bench_device.json")
    return p


def new_run(args: argparse.Namespace) -> Run:
    """Probe the device and take the idle memory baseline before anything of ours touches it."""
    gpu = Gpu.open()
    version = llama_server_version(args.llama_server) if args.llama_server else None
    report = {**provenance(), "device": gpu.info() if gpu else {"kind": "cpu", "cpus": os.cpu_count()},
              "llama_server": {"binary": args.llama_server, "version": version},
              "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
              "workload": {"max_tokens": args.max_tokens, "repeats": args.repeats, "levels": [SINGLE, MULTI]},
              "memory_measured_as": ("GPU memory used (all processes) minus the idle baseline at start" if gpu
                                     else "RSS of the engine's process (llama-server; the in-process child); "
                                          "not read for the Serve replica"),
              "errors": [], "configs": {}}
    run = Run(args, gpu, report, baseline=gpu.used() if gpu else None, configs=dict(args.placement))
    report["memory_baseline_bytes"] = run.baseline
    report["other_gpu_processes_at_start"] = len(gpu.other_processes(os.getpid())) if gpu else None
    try:
        run.shape = ModelShape.from_gguf(args.model)
        report["model"] = {"path": str(args.model), "shape": dataclasses.asdict(run.shape),
                           "bytes_read_per_token": run.shape.bytes_read_per_token}
    except Exception as exc:
        report["errors"].append(f"model shape: {describe_error(exc, 0)}")
    return run


async def main_async(run: Run) -> None:
    say(f"device: {run.report['device'].get('name', 'cpu')}; llama-server: {run.report['llama_server']['version']}; "
        f"commit {run.report['commit']}")
    run.save()
    try:
        await phase_bandwidth(run)
        for name in [*run.args.configs, *run.configs]:
            await bench_config(run, name)
    finally:
        if run.serve_port is not None:
            serve_app.stop_serve()


def finish(run: Run) -> None:
    rows = build_rows(run.report)
    run.report["table"] = [dataclasses.asdict(r) for r in rows]
    run.save()
    roof = run.report.get("roofline_tok_s_single_stream")
    bw = (run.report.get("bandwidth") or {}).get("bytes_per_s")
    print(f"\ndevice: {run.report['device'].get('name', 'cpu')}   bandwidth: "
          f"{_num(bw / 1e9 if bw else None, '.1f')} GB/s (read+write)   "
          f"single-stream roofline: {_num(roof, '.1f')} tok/s")
    print(format_table(rows, "VRAM" if run.gpu else "RSS"))
    if run.report["errors"]:
        print(f"{len(run.report['errors'])} error(s); see 'errors' in the JSON")
    print(f"wrote {run.args.json_out}", flush=True)


async def _main_with_signals(args: argparse.Namespace) -> int:
    """SIGTERM cancels the run: servers and engines are stopped, and the table of what was measured is printed."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    run = new_run(args)
    try:
        await main_async(run)
    except asyncio.CancelledError:
        say("cancelled: the table and JSON hold what was measured so far")
        finish(run)
        return 143
    finish(run)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.skip_llama_server and not args.llama_server:
        raise SystemExit("error: pass --llama-server PATH (or --skip-llama-server)")
    if not args.configs and not args.placement:
        raise SystemExit("error: no config to measure: --configs names none and no --placement was given")
    args.model = (args.model or embedded_model_path()).resolve()
    return asyncio.run(_main_with_signals(args))

