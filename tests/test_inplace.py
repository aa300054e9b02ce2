"""In-place tuning end to end on the shared app (CPU, the embedded model): the trials run on the serving
replica, its weights load zero extra times, a client streaming throughout loses no request, and the pick
(or, after Ctrl-C, the old config) is what the replica serves afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from serving.engine.config import EngineConfig, load_engine_config
from tests.conftest import assert_stream_finished, sse_events, wait_idle

pytestmark = pytest.mark.serve

SPACE = {"n_parallel": [1, 2], "n_batch": [256, 512], "n_ubatch": [256], "ctx_per_slot": [1024],
         "type_k": ["f16", "q8_0"], "type_v": ["f16", "q8_0"], "flash_attn": ["on"]}
REPO = Path(__file__).resolve().parent.parent


def _slots(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/slots", timeout=30).json()


def _args(tmp_path: Path, study: str, trials: int, *where: str) -> list[str]:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    return ["--trials", str(trials), *where, "--app-name", "llama", "--space", str(tmp_path / "space.yaml"),
            "--results-dir", str(tmp_path), "--out", str(tmp_path / "tuned.yaml"), "--study-name", study,
            "--gen-tokens", "8", "--repeats", "1", "--min-ctx-per-slot", "1024", "--workload", "benchmark"]


class StreamingClient:
    """Streams chat completions back to back on a thread; every one must end normally."""

    def __init__(self, url: str) -> None:
        self.url, self.ok, self.failures = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StreamingClient:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=300)

    def _run(self) -> None:
        body = {"messages": [{"role": "user", "content": "Tell me about gardens."}], "max_tokens": 16,
                "stream": True}
        with httpx.Client(timeout=180) as http:
            while not self._stop.is_set():
                try:
                    with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
                        assert resp.status_code == 200, resp.read()
                        assert_stream_finished(sse_events(resp.iter_lines()))
                    self.ok += 1
                except Exception as exc:  # the test reads these: any one fails it
                    self.failures.append(repr(exc)[:300])


@pytest.fixture
def restored(serve_url: str) -> Iterator[EngineConfig]:
    """The shared app's config before the test, put back after it (other tests expect it)."""
    from tuning.writeback import apply_to_serve

    wait_idle(serve_url)
    before = EngineConfig(**_slots(serve_url)["config"])
    yield before
    assert apply_to_serve(before, app_name="llama").applied


@pytest.mark.timeout(600)
def test_an_in_place_study_runs_on_the_replica_and_applies_its_pick(serve_url: str, restored: EngineConfig,
                                                                    tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """No flag: an app is serving (one replica), so the study runs in place, as `--in-place` would."""
    import optuna

    from tuning.search import main

    loads = _slots(serve_url)["weight_loads"]
    with StreamingClient(serve_url) as client:  # the replica's model is the base: --model is not read in place
        assert main([*_args(tmp_path, "inplace", 3), "--model", "/nonexistent.gguf"]) == 0
    assert client.failures == [] and client.ok > 0
    out = capsys.readouterr().out
    plan = next(line for line in out.splitlines() if line.startswith("tuning "))
    assert "in place on Serve app 'llama' (1 replica(s)" in plan and "Ctrl-C puts back" in plan, plan
    assert "the first trial held its replica for" in out, out[-3000:]

    trials = optuna.load_study(study_name="inplace", storage=f"sqlite:///{tmp_path / 'optuna.db'}").trials
    assert len(trials) == 3 and all(t.state.name == "COMPLETE" for t in trials)
    assert all(t.user_attrs["weight_loads"] == loads for t in trials), "no trial loaded the weights again"
    assert all(t.user_attrs["single_tok_s"] > 0 for t in trials)
    assert "in place, on app 'llama'" in (tmp_path / "inplace" / "report.md").read_text()
    after = _slots(serve_url)
    assert after["weight_loads"] == loads and after["tuning"] is None
    assert "(served)" in (tmp_path / "inplace" / "report.md").read_text(), "what served was a candidate"
    if "pick: the served config stays" in out:  # no candidate beat it: nothing written, nothing switched
        assert EngineConfig(**after["config"]) == restored and not (tmp_path / "tuned.yaml").exists()
    else:
        assert EngineConfig(**after["config"]) == load_engine_config(tmp_path / "tuned.yaml"), "the pick serves"


@pytest.mark.timeout(600)
def test_in_place_the_study_replays_the_recorded_traffic_within_the_slo(serve_url: str, restored: EngineConfig,
                                                                       tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """No --workload: the app has recorded enough requests, so the trials replay them (open loop at their
    recorded pace) and the second objective is goodput under the SLO; a client streams throughout."""
    import optuna

    from tuning.search import main

    with httpx.Client(timeout=120) as http:  # the latest recorded requests: short ones, sent two at a time
        for i in range(0, 40, 2):
            for body in ({"prompt": f"Count {i}:", "max_tokens": 6}, {"prompt": f"Say {i + 1}", "max_tokens": 3}):
                assert http.post(f"{serve_url}/v1/completions", json=body).status_code == 200
    loads = _slots(serve_url)["weight_loads"]
    args = [arg for arg in _args(tmp_path, "live", 2) if arg not in ("--workload", "benchmark")]
    with StreamingClient(serve_url) as client:
        assert main([*args, "--slo", "ttft_p95=60s,itl_p95=5s", "--requests", "12", "--confirm-rounds", "0"]) == 0
    assert client.failures == [] and client.ok > 0
    out = capsys.readouterr().out
    assert "workload: live (live: the last 12 of " in out and "recorded by 1 replica(s))" in out, out[-3000:]
    trials = optuna.load_study(study_name="live", storage=f"sqlite:///{tmp_path / 'optuna.db'}").trials
    assert len(trials) == 2 and all(t.state.name == "COMPLETE" for t in trials)
    for trial in trials:
        attrs = trial.user_attrs
        assert attrs["workload"] == "live" and attrs["weight_loads"] == loads, attrs
        assert attrs["traffic"]["requests"] == 12 and attrs["traffic"]["failed"] == 0, attrs["traffic"]
        assert attrs["goodput_rps"] > 0 and attrs["traffic"]["slo_met"], attrs["traffic"]
    assert "goodput req/s" in (tmp_path / "live" / "report.md").read_text()
    assert _slots(serve_url)["weight_loads"] == loads


@pytest.mark.timeout(300)
def test_the_confirmation_round_measures_on_the_replica(serve_url: str, restored: EngineConfig) -> None:
    from tuning.serving_app import ServingApp
    from tuning.objective import Workload
    from tuning.report import Objective
    from tuning.confirm import confirmation_measure

    loads = _slots(serve_url)["weight_loads"]
    config = restored.model_copy(update={"n_parallel": 2, "n_ctx": 2048})
    with StreamingClient(serve_url) as client:
        with confirmation_measure(app=ServingApp("llama", 1, restored), workload=Workload(gen_tokens=8, repeats=1),
                                  on_gpu=False, study="confirming", total_trials=2,
                                  objective=Objective.aggregate) as measure:
            speed = measure(config)
    assert speed.single > 0 and speed.second > 0
    assert client.failures == [] and _slots(serve_url)["weight_loads"] == loads


@pytest.mark.timeout(300)
def test_on_a_workload_the_confirmation_round_replays_it_on_the_replica(serve_url: str,
                                                                       restored: EngineConfig) -> None:
    """The confirmation round of a traffic study measures goodput by replaying the workload there too."""
    from measure.replay import ReplayRequest, TrafficWorkload
    from measure.slo import Slo
    from tuning.serving_app import ServingApp
    from tuning.objective import Workload
    from tuning.report import Objective
    from tuning.confirm import confirmation_measure
    from tuning.workloads import TrafficPlan

    loads = _slots(serve_url)["weight_loads"]
    shapes = TrafficWorkload("tiny", "test", tuple(ReplayRequest(prompt_tokens=20 + i, output_tokens=4, prefix_tokens=8)
                                                   for i in range(6)), concurrency=2)
    plan = TrafficPlan(shapes, Slo.parse("e2e_p95=60s"))
    with confirmation_measure(app=ServingApp("llama", 1, restored), workload=Workload(gen_tokens=8, repeats=1),
                              on_gpu=False, study="confirming-traffic", total_trials=2, objective=Objective.goodput,
                              traffic=plan) as measure:
        speed = measure(restored.model_copy(update={"n_parallel": 2, "n_ctx": 2048}))
    assert speed.single > 0 and speed.second > 0, "goodput measured by the replay, not left at 0"
    assert _slots(serve_url)["weight_loads"] == loads


# `python -m tuning.search` whose own interpreter gives SIGINT its default action, whatever this process passes
# on (a shell's background job passes SIGINT ignored, and the study then ran to its end). Not a preexec_fn: with
# one, Popen fork()s a copy of this process (a Ray driver: Ray's failure-signal handler and its SIGTERM handler
# are live in it) and runs Python in it until exec; a SIGTERM landing there made Ray's handler arm its 3 s abort
# alarm, which outlives exec, and the tuner died of SIGALRM before its first trial. Without one, Popen vforks,
# and the child runs no handler of ours: all blocked, then reset to the default, until exec.
TUNER = [sys.executable, "-c", "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
         "runpy.run_module('tuning.search', run_name='__main__', alter_sys=True)"]


def _ended(proc: subprocess.Popen[str]) -> str:
    """How a child that should still run ended: its exit status and the end of its output."""
    if proc.poll() is None:
        return "still running"
    return f"exit status {proc.returncode}\n{(proc.communicate()[0] or '')[-3000:]}"


@pytest.mark.timeout(600)
def test_ctrl_c_mid_study_restores_the_config_the_replica_served(serve_url: str, restored: EngineConfig,
                                                                 tmp_path: Path) -> None:
    import ray

    address = ray.get_runtime_context().gcs_address
    tuner = subprocess.Popen([*TUNER, *_args(tmp_path, "interrupted", 20, "--in-place"), "--ray-address", address],
                             cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (_slots(serve_url)["tuning"] or {}).get("in_trial"):
            assert tuner.poll() is None and time.monotonic() < deadline, \
                f"no trial started on the replica; the tuner: {_ended(tuner)}"
            time.sleep(0.2)
        tuner.send_signal(signal.SIGINT)
        output, _ = tuner.communicate(timeout=240)
    finally:
        if tuner.poll() is None:
            tuner.kill()
    assert tuner.returncode == 130, output[-3000:]
    assert "restore: applied to 1 replica(s)" in output, output[-3000:]
    after = _slots(serve_url)
    assert after["tuning"] is None and EngineConfig(**after["config"]) == restored
