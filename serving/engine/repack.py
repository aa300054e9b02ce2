"""Should llama.cpp put CPU weights in its extra buffer types (weight repack, AMX)? Decided once per machine.

Why: llama.cpp's CPU backend offers "extra buffer types" that re-lay weights at load time for faster kernels.
They are on by default (llama_model_params.use_extra_bufts; llama-server's --repack / --no-repack), and one of
them can kill the process: on an Intel Xeon with AMX inside a VM, a GGML_NATIVE build (pip's default) enables
AMX, and ggml_backend_amx_mul_mat segfaults at its first `ldtilecfg`, on the first decode. Nothing can catch
that in-process, so `auto` runs a small probe in a CHILD process, once per machine and llama.cpp build, and
loads with the extra buffer types only when the child survived.

The extra buffer types in this llama.cpp (llama-cpp-python 0.3.36, ggml/src/ggml-cpu/), first match wins:
- AMX (amx/amx.cpp, amx/common.h `qtype_has_amx_kernels`): mat-muls of Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and
  IQ4_XS weights, in builds with __AMX_INT8__ and __AVX512VNNI__. The tile path (`ldtilecfg`, where the fault
  is) runs for more than one activation row (a prompt); one-token decode takes its AVX512-VNNI path.
- CPU_REPACK (repack.cpp `ggml_repack_get_optimal_repack_type`): on x86, Q4_0, Q4_K, IQ4_NL and MXFP4 with
  AVX2 and Q2_K with AVX-512, for weights whose row count is a multiple of 8; ARM (NEON dotprod/i8mm) and
  RISC-V V repack more types. Not Q4_1 or Q8_0 on x86.
- KleidiAI on ARM, when built with it.

The probe loads the embedded model (SmolLM2-135M: Q4_1 weights, a Q8_0 embedding) with the extra buffer types
on, n_gpu_layers=0, and decodes a 32-token prompt and then one token. Q4_1 has AMX kernels, so on an AMX build
this runs the faulting tile path. It does NOT exercise x86 CPU_REPACK kernels (no Q4_1 repack): those are
plain AVX2/AVX-512 code that needs no OS permission, and no fault is known there. Exit 0 = safe; a signal, a
nonzero exit or a timeout = unsafe (repack off, with a warning saying what happened).

The verdict is cached as JSON under $LLAMA_SERVE_TUNE_CACHE_DIR, else $XDG_CACHE_HOME/llama-serve-tune, else
~/.cache/llama-serve-tune, keyed by the CPU (model name and flags from /proc/cpuinfo), the kernel release and
the libllama/libggml files (path, size, mtime): a new CPU, kernel or llama.cpp build probes again.
`python -m serving.engine.repack` prints the verdict (`--again` re-probes).

Only weights on the CPU are affected: layers offloaded to a GPU never use these buffer types. So `auto` with
every layer on a GPU (n_gpu_layers -1 and a GPU visible to llama.cpp) needs no probe; a GPU build that sees no
device, or a config keeping layers on the CPU, is probed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from serving.engine.buffers import llama_buffers
from serving.engine.config import CpuRepack, EngineConfig, embedded_model_path

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "LLAMA_SERVE_TUNE_CACHE_DIR"
FAULT_ENV = "LLAMA_SERVE_TUNE_PROBE_FAULT"  # tests only: "segv" makes the probe child kill itself with SIGSEGV
PROBE_VERSION = 1  # bump when the probe changes what it exercises: old verdicts are then ignored
PROBE_TIMEOUT_S = 120.0  # the probe took 1-8 s on 2 busy cores; only a hang comes near this
PROMPT_TOKENS = 32  # > 1 activation row: AMX's tile path (mmq.cpp), then a 1-token decode (its VNNI path)
_RESULT_TAG = "@@repack-probe@@ "
_CPUINFO_KEYS = ("model name", "flags", "hardware", "cpu implementer", "cpu part", "features", "isa")


@dataclass(frozen=True)
class Verdict:
    """What the probe concluded on this machine and build, and where the answer came from."""

    safe: bool
    reason: str  # what the probe child did: "decoded 32+1 tokens (...)", "killed by SIGSEGV", ...
    key: str  # the machine/build key the verdict belongs to
    cached: bool = False  # read from the cache file rather than probed now


def use_extra_bufts(config: EngineConfig) -> bool:
    """Value for llama_model_params.use_extra_bufts: `on`/`off` as forced, `auto` = the probe's verdict."""
    if config.cpu_repack is CpuRepack.on:
        return True
    if config.cpu_repack is CpuRepack.off:
        return False
    from serving.engine.llama import gpu_offload_supported

    if config.n_gpu_layers < 0 and gpu_offload_supported():
        return True  # every layer on a GPU: no CPU weights to re-lay, nothing to probe or warn about
    verdict = probe_verdict()
    if not verdict.safe:
        log.warning("CPU weight repack is OFF: with llama.cpp's extra buffer types on, the probe child %s "
                    "(verdict in %s). Set cpu_repack=on to force it, or delete that file to probe again.",
                    verdict.reason, cache_file(verdict.key))
    return verdict.safe


def llama_server_args(config: EngineConfig) -> list[str]:
    """llama-server flags with the same meaning (its default is repack on); for scripts that start one.

    The verdict was probed with the pip-built libllama, not the llama-server binary; both come from the same
    llama.cpp source on the same CPU, so it is applied to both.
    """
    return [] if use_extra_bufts(config) else ["--no-repack"]


def llama_bench_args(config: EngineConfig) -> list[str]:
    """llama-bench's spelling of the same setting (`--repack 0|1`)."""
    return ["--repack", "1" if use_extra_bufts(config) else "0"]


def probe_verdict(*, again: bool = False, command: Sequence[str] | None = None,
                  timeout_s: float = PROBE_TIMEOUT_S) -> Verdict:
    """The cached verdict for this machine and build, or a fresh probe (written to the cache).

    `again` ignores the cache. `command` replaces the probe child (tests); it must exit 0 for "safe".
    """
    key = cache_key()
    path = cache_file(key)
    if not again:
        cached = _read_cache(path, key)
        if cached is not None:
            return cached
    if command is None:
        try:
            command = [sys.executable, "-m", "serving.engine.repack", "--probe-child", str(embedded_model_path())]
        except FileNotFoundError as exc:  # no probe model: stay safe, and try again next time
            return Verdict(False, f"could not run: {exc}", key)
    verdict = _run_probe(command, timeout_s, key)
    if library_files():
        _write_cache(path, verdict)
    log.info("CPU weight repack probe: %s -> %s", verdict.reason, "safe" if verdict.safe else "UNSAFE")
    return verdict


# -- the machine/build key and the cache file --------------------------------------------------------------
def library_dir() -> Path | None:
    """Where llama_cpp loads libllama from: the loaded module's directory, else where it would look."""
    loaded = sys.modules.get("llama_cpp.llama_cpp")
    if loaded is not None and hasattr(loaded, "_base_path"):
        return Path(loaded._base_path)
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Path(os.environ["LLAMA_CPP_LIB_PATH"])
    spec = find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def library_files(lib_dir: Path | None = None) -> list[Path]:
    """The llama.cpp shared libraries in `lib_dir` (default library_dir()), symlinks resolved, sorted."""
    lib_dir = lib_dir or library_dir()
    if lib_dir is None or not lib_dir.is_dir():
        return []
    names = (p for p in lib_dir.iterdir() if re.match(r"(lib)?(llama|ggml).*\.(so|dylib|dll)", p.name))
    return sorted({p.resolve() for p in names if p.is_file()})


def cpu_identity() -> dict[str, str]:
    """CPU model and feature flags (first processor in /proc/cpuinfo), kernel release, architecture."""
    found: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            name, sep, value = line.partition(":")
            name = name.strip().lower()
            if sep and name in _CPUINFO_KEYS and name not in found:
                found[name] = " ".join(value.split())
    except OSError:
        found["processor"] = platform.processor()
    return {**found, "kernel": platform.release(), "machine": platform.machine()}


def cache_key(lib_dir: Path | None = None) -> str:
    """sha256 over the CPU identity, the llama.cpp libraries' path/size/mtime and the probe version."""
    libs = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in library_files(lib_dir)]
    blob = json.dumps({"cpu": cpu_identity(), "libs": libs, "probe": PROBE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llama-serve-tune"


def cache_file(key: str) -> Path:
    return cache_dir() / f"cpu-repack-{key[:16]}.json"


def _read_cache(path: Path, key: str) -> Verdict | None:
    """The cached verdict, or None when absent, unreadable, corrupt or for another key (then: probe again)."""
    try:
        data = json.loads(path.read_text())
        if data["key"] == key and isinstance(data["safe"], bool) and isinstance(data["reason"], str):
            return Verdict(data["safe"], data["reason"], key, cached=True)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the unreadable repack verdict %s (%s): probing again", path, exc)
        return None
    log.warning("ignoring the repack verdict %s: it is for another machine/build", path)
    return None


def _write_cache(path: Path, verdict: Verdict) -> None:
    """Write atomically (temp file + rename), so a concurrent reader sees the old file or the new one."""
    record = {"key": verdict.key, "safe": verdict.safe, "reason": verdict.reason,
              "probed_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "cpu": cpu_identity().get("model name", platform.processor()),
              "libraries": [str(p) for p in library_files()], "probe_version": PROBE_VERSION}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp",
                                         delete=False) as fh:
            json.dump(record, fh, indent=2)
        os.replace(fh.name, path)
    except OSError as exc:  # a read-only home: the verdict still holds for this process
        log.warning("could not cache the repack verdict in %s: %s", path, exc)


# -- the probe: parent side ----------------------------------------------------------------------------
def _run_probe(command: Sequence[str], timeout_s: float, key: str) -> Verdict:
    """Run the probe child; its fate is the verdict."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # `-m serving.engine.repack` from any working directory
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run(list(command), capture_output=True, text=True, errors="replace", env=env,
                              timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"did not finish within {timeout_s:.0f} s (killed)", key)
    except OSError as exc:
        return Verdict(False, f"could not start: {exc}", key)
    result = next((ln[len(_RESULT_TAG):] for ln in proc.stdout.splitlines() if ln.startswith(_RESULT_TAG)), None)
    if proc.returncode == 0:
        return Verdict(True, result or "exited 0", key)
    tail = " ".join(proc.stderr.split()[-40:])
    if proc.returncode < 0:
        try:
            how = f"was killed by {signal.Signals(-proc.returncode).name}"
        except ValueError:
            how = f"was killed by signal {-proc.returncode}"
    else:
        how = f"exited with code {proc.returncode}"
    return Verdict(False, f"{how}{': ' + result if result else ''}{' (stderr: ' + tail + ')' if tail else ''}",
                   key)


# -- the probe: child side ---------------------------------------------------------------------------------
def _probe_child(model_path: Path) -> int:
    """Load `model_path` on the CPU with the extra buffer types on and decode; a fault kills this process.

    serving.engine.llama.probe_decode, not the engine: the probe must be the smallest program that reaches the kernels,
    independent of the engine's own settings.
    """
    if os.environ.get(FAULT_ENV) == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    from serving.engine.llama import probe_decode

    def report(text: str, code: int) -> int:
        print(_RESULT_TAG + text, flush=True)
        return code

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with llama_buffers() as buffers:
        failure = probe_decode(model_path, PROMPT_TOKENS, min(4, cpus))
    if failure is not None:
        return report(failure.message, failure.code)
    used = ", ".join(f"{name} {mib:.1f} MiB" for name, mib in buffers.get("model", {}).items()) or "none"
    return report(f"decoded {PROMPT_TOKENS}+1 tokens of {model_path.name} (weight buffers: {used})", 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.engine.repack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--again", action="store_true", help="ignore the cached verdict and probe again")
    parser.add_argument("--probe-child", type=Path, metavar="GGUF", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_child is not None:
        return _probe_child(args.probe_child)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    verdict = probe_verdict(again=args.again)
    print(f"cpu_repack=auto -> {'on' if verdict.safe else 'OFF'} ({'cached' if verdict.cached else 'probed'}): "
          f"{verdict.reason}\nverdict file: {cache_file(verdict.key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
