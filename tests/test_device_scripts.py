"""The GPU recipe as a user meets it (scripts/device/): what can be checked without the GPU. Every script parses;
prepare.sh reads llama-cpp-python's version from pyproject's pin (nothing installed here) and checks each call of
the device setup against the 64 MiB a call carries; pick-settings.py passes on every setting a study searches
(cpu_moe_start among them); inplace-study.sh runs the README's tuning command as written and waits for recorded
traffic."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
DEVICE = REPO / "scripts" / "device"
MiB = 1 << 20


@pytest.mark.parametrize("script", sorted(DEVICE.glob("*.sh")), ids=lambda p: p.name)
@pytest.mark.unit
def test_every_device_script_parses(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def prepare(call: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """prepare.sh's functions (sourced: its steps do not run), then `call`."""
    return subprocess.run(["bash", "-c", f"source {DEVICE / 'prepare.sh'}; {call}"], cwd=cwd, capture_output=True,
                          text=True)


@pytest.mark.unit
def test_prepare_reads_the_version_from_pyprojects_pin() -> None:
    """No `import llama_cpp` or package metadata: the pin is what the device builds."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d.split("==")[1] for d in deps if d.startswith("llama-cpp-python=="))
    done = prepare(f"pinned_version {REPO / 'pyproject.toml'}")
    assert done.returncode == 0 and done.stdout.strip() == pin
    assert "importlib.metadata" not in (DEVICE / "prepare.sh").read_text()


@pytest.mark.unit
def test_prepare_sourced_runs_no_step(tmp_path: Path) -> None:
    assert prepare("true", cwd=tmp_path).returncode == 0 and not (tmp_path / ".devwork").exists()


def folder(tmp_path: Path, sizes: dict[str, int]) -> Path:
    """A prepared DIR with files of those sizes (paths relative to it)."""
    for name, size in sizes.items():
        path = tmp_path / "d" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * size)
    return tmp_path / "d"


SIZES = {"bundle_ray/ray-2.60.0.whl": 42 * MiB, "bundle/optuna.whl": 10 * MiB, "bundle/sqlalchemy.whl": 6 * MiB,
         "lcpp_trim.tgz": 6 * MiB, "tokenizer.gguf": 2 * MiB, "embedded.part1": 44 * MiB,
         "embedded.part2": 44 * MiB, "embedded.name": 30}


@pytest.mark.unit
def test_each_call_is_checked_with_what_it_carries(tmp_path: Path) -> None:
    """The whole folder (~154 MiB) never fits one call; each call's part and the tree do: ray's wheel alone,
    then setup.sh's bundle, sdist and tokenizer, then each embedded half."""
    done = prepare(f"check_calls {folder(tmp_path, SIZES)} {10 * MiB}")
    assert done.returncode == 0, done.stderr
    sizes = re.findall(r"^call (\S+) .*= (\d+) MiB of 64 MiB$", done.stdout, re.M)
    assert sizes == [("ray", "52"), ("setup", "34"), ("embedded-1", "54"), ("embedded-2", "54")]


@pytest.mark.unit
def test_a_call_over_the_limit_is_named_with_advice_that_keeps_every_wheel(tmp_path: Path) -> None:
    """The setup call over 64 MiB: split the bundle into another folder carried before setup.sh (which installs
    every DIR/bundle* folder), never drop a wheel the tuner imports."""
    big = {**SIZES, "bundle/optuna.whl": 50 * MiB}
    done = prepare(f"check_calls {folder(tmp_path, big)} {10 * MiB}")
    assert done.returncode == 1
    assert "OVER: call setup carries" in done.stderr and "bundle_more" in done.stderr
    assert "Drop none" in done.stderr and "call ray" not in done.stderr
    assert '"$DIR"/bundle*/' in (DEVICE / "setup.sh").read_text()


def load_pick_settings() -> Any:
    spec = importlib.util.spec_from_file_location("pick_settings", DEVICE / "pick-settings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_pick_settings_passes_every_setting_a_study_searches() -> None:
    """The search space's settings (context per slot as n_ctx), and every placement setting the fit can set:
    n_gpu_layers, n_cpu_moe and the first of its layers, cpu_moe_start."""
    from serving.engine.fit import ExpertEnd, expert_placement
    from tuning.space import EXPERT_END, PlacementKnob, SearchSpace

    shape: Any = SimpleNamespace(n_layer=48)
    placement = {k.value for k in PlacementKnob} | set(expert_placement(shape, 10, ExpertEnd.last))
    searched = (set(SearchSpace.model_fields) - {"ctx_per_slot", EXPERT_END}) | {"n_ctx"} | placement
    assert searched <= set(load_pick_settings().SEARCHED)
    assert "cpu_moe_start" in placement


@pytest.mark.engine  # measure.device_bench loads the bindings
def test_a_pick_of_the_last_layers_experts_is_benched_as_picked(tmp_path: Path) -> None:
    from measure.device_bench import parse_placement
    from serving.engine.config import EngineConfig
    from tuning.writeback import write_config

    pick = EngineConfig(n_parallel=2, n_ctx=8192, n_cpu_moe=12, cpu_moe_start=36, kv_unified=True)
    write_config(tmp_path / "tuned.yaml", pick, header="a pick")
    out = subprocess.run([sys.executable, str(DEVICE / "pick-settings.py"), str(tmp_path / "tuned.yaml")],
                         capture_output=True, text=True, check=True).stdout.strip()
    _, benched = parse_placement(f"tuned:{out}")
    assert (benched.n_cpu_moe, benched.cpu_moe_start, benched.kv_unified, benched.n_ctx) == (12, 36, True, 8192)


@pytest.mark.unit
def test_the_inplace_study_runs_the_readmes_command_as_written_after_recorded_traffic() -> None:
    """The command the README gives, flags only where the caller adds them; the wait for the recorded traffic
    the tuner replays comes before it, and what it measured is said after."""
    command = "python -m tuning.search --trials 40"
    assert command in (REPO / "README.md").read_text()
    script = (DEVICE / "inplace-study.sh").read_text()
    runs = [line.strip() for line in script.splitlines() if re.match(r"\s*python3? -m tuning\.search", line)]
    assert runs == [f'{command} "$@" > "$OUT/search.log" 2>&1']
    assert script.index("LIVE_MIN_REQUESTS") < script.index(runs[0]) < script.index("grep -m1 '^workload: '")


def _flags_of(script: str, command: str) -> set[str]:
    """The long flags a script passes to `command`, its continuation lines included."""
    joined = script.replace("\\\n", " ")
    calls = [line for line in joined.splitlines() if command in line]
    assert calls, f"{command} is not run"
    return {flag for call in calls for flag in re.findall(r"\s(--[a-z][a-z0-9-]*)", call.split(command, 1)[1])}


@pytest.mark.unit
def test_the_headline_script_passes_only_flags_its_commands_take() -> None:
    """headline.sh runs on a lent GPU: a flag that a command does not take would cost the whole call."""
    from measure.headline import parser as headline_parser
    from measure.traces import parser as traces_parser
    from tuning.options import _parser as tuner_parser

    script = (DEVICE / "headline.sh").read_text()
    for command, parser in (("-m tuning.search", tuner_parser()), ("scripts/bench_headline.py", headline_parser()),
                            ("scripts/make_traces.py", traces_parser())):
        known = set(parser._option_string_actions)
        assert _flags_of(script, command) <= known, (command, _flags_of(script, command) - known)
