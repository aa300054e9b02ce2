"""Beyond one machine: a Ray cluster of two nodes on this one (a head and a second raylet, each declaring one GPU,
measure/cluster.py), and the app as a user runs it there: `serve run` of the shipped config with
num_replicas=auto puts one engine replica on each node; /health and /slots see both; requests reach both; a
missing model file is an error that names the node and the path; an in-place study runs over both, and one that
loses a node ends cleanly on the other; a node lost under load costs no hang and comes back with the current
config."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from measure.cluster import ClusterApp, all_serving
from tests.conftest import assert_generated, routed_counts

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]  # the tuner runs from the repository, as a user runs it
APP_ARGS = {"config": "configs/default.yaml", "num_replicas": "auto", "n_parallel": 1, "n_ctx": 1024,
            "cpus_per_replica": 0.5, "config_poll_s": 0.2}
READY_S = 300.0


class App(ClusterApp):
    """The app on the cluster, with what the tests send it."""

    def __init__(self, cluster: Any, tmp: Path, port: int | None = None, **args: Any) -> None:
        super().__init__(cluster, tmp, {**APP_ARGS, **args}, port)

    def complete(self, timeout_s: float = 120.0) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", json={"prompt": "Count: 1 2 3", "max_tokens": 8},
                          timeout=timeout_s)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from measure.cluster import LocalCluster

    two = LocalCluster.start(gpus_per_node=1, cpus_per_node=2, workers=1, dashboard=True)  # serve deploy needs it
    try:
        yield two
    finally:
        two.stop()


@pytest.fixture(scope="module")
def app(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    served = App(cluster, tmp_path_factory.mktemp("cluster"))
    try:
        served.wait(all_serving(2), "two replicas serving", READY_S)
        yield served
    finally:
        served.stop()


def _by_node(slots: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["node"]["node_id"]: r for r in slots["replicas"]}


def test_one_replica_per_node_and_both_seen_and_served(app: App) -> None:
    slots = app.slots()
    replicas = _by_node(slots)
    assert len(replicas) == 2 and slots["replicas_missing"] == 0, slots["replicas"]
    for replica in replicas.values():
        assert replica["health"]["status"] == "ok" and replica["load_error"] is None
        assert replica["node"]["visible_devices"] == "0"  # the one GPU Ray gave it on its node
        assert replica["config"]["n_parallel"] == 1 and replica["config"]["n_ctx"] == 1024
    for _ in range(16):
        resp = app.complete()
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] is not None, resp.text
    served = {node: r["counters"].get("requests_finished", 0) for node, r in _by_node(app.slots()).items()}
    assert all(n > 0 for n in served.values()), f"requests reached only some replicas: {served}"


def test_metrics_show_every_replica(app: App) -> None:
    replicas = [r["replica"] for r in app.slots()["replicas"]]
    text = httpx.get(f"{app.url}/metrics", timeout=30).text
    assert all(f'replica="{r}"' in text for r in replicas), replicas
    for family in ("llm_generated_tokens_total", "llm_requests_total"):  # each family's HELP and TYPE once
        assert text.count(f"# HELP {family} ") == 1 and text.count(f"# TYPE {family} ") == 1, family

def test_a_returning_conversation_goes_back_to_its_replica_across_nodes(app: App) -> None:
    """Prefix affinity (serving/replica/routing.py) with the two replicas on two nodes: four conversations take
    turns, one request at a time; first turns spread by load, every returning turn goes by affinity to the node
    that served its first turn and finds its history cached there. By chance alone all four would land there
    one time in sixteen."""
    before = routed_counts(app.url)
    texts = {c: f"Conversation {c}. " + " ".join(f"item {c * 100 + i} is a river" for i in range(30))
             for c in range(4)}
    usage: dict[tuple[int, int], dict[str, Any]] = {}
    with httpx.Client(timeout=120) as http:
        for turn in (1, 2):
            for c, text in texts.items():
                texts[c] = text + f"\nQuestion {turn}: which item comes first?\nAnswer:"
                r = http.post(f"{app.url}/v1/completions", json={"prompt": texts[c], "max_tokens": 8,
                                                                 "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
                body = assert_generated(r.json())
                texts[c] += body["choices"][0]["text"]
                usage[(c, turn)] = body["usage"]
    grew = {key: n - before.get(key, 0) for key, n in routed_counts(app.url).items() if n > before.get(key, 0)}
    by = {why: sum(n for (w, _), n in grew.items() if w == why) for why in ("affinity", "load", "imbalance",
                                                                          "overflow")}
    print(f"routed: {grew}")
    assert by == {"affinity": 4, "load": 4, "imbalance": 0, "overflow": 0}, grew
    assert sorted(n for (w, _), n in grew.items() if w == "load") == [2, 2]  # new conversations spread
    for c in texts:
        first, back = usage[(c, 1)], usage[(c, 2)]
        assert back["prompt_tokens_details"]["cached_tokens"] >= 0.9 * first["prompt_tokens"], (c, first, back)


def test_serve_deploy_of_the_shipped_config_updates_both_replicas_in_place(app: App, cluster: Any,
                                                                            tmp_path: Path) -> None:
    """`serve deploy` of configs/serve.yaml (as app's, with n_parallel 2) on the running cluster: a replica on
    each node still, both now with two slots."""
    shipped = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    shipped["http_options"]["port"] = app.port
    shipped["proxy_location"] = "HeadOnly"
    shipped["applications"][0]["args"] = {**APP_ARGS, "n_parallel": 2, "n_ctx": 2048}
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump(shipped))
    result = subprocess.run(["serve", "deploy", str(config)], cwd=REPO, env=cluster.env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    deadline = time.monotonic() + READY_S
    replicas: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        try:
            replicas = _by_node(app.slots())
        except httpx.HTTPError:
            replicas = {}
        if len(replicas) == 2 and all((r["config"] or {}).get("n_parallel") == 2 for r in replicas.values()):
            break
        time.sleep(2)
    assert len(replicas) == 2 and all(r["config"]["n_parallel"] == 2 for r in replicas.values()), replicas
    assert app.complete().status_code == 200


def test_the_in_place_study_runs_over_both_nodes_and_writes_the_pick_to_both(app: App, cluster: Any,
                                                                            tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"n_parallel": [1, 2], "n_batch": [256], "n_ubatch": [256],
                                     "ctx_per_slot": [512], "type_k": ["f16"], "type_v": ["f16"],
                                     "flash_attn": ["on"]}))
    result = subprocess.run(
        ["python", "-m", "tuning.search", "--in-place", "--trials", "2", "--app-name", "llama", "--space", str(space),
         "--gen-tokens", "8", "--repeats", "1", "--min-ctx-per-slot", "512", "--confirm-rounds", "0",
         "--results-dir", str(tmp_path), "--out", str(tmp_path / "tuned.yaml"), "--study-name", "cluster",
         "--workload", "benchmark"],
        cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "cluster" / "report.md").read_text()
    assert "in place, on app 'llama'" in report and "- device: CPU" in report, report[:2000]
    assert "cannot read the GPU's memory size" not in result.stdout + result.stderr
    configs = {json.dumps(r["config"], sort_keys=True) for r in app.slots()["replicas"]}
    assert len(configs) == 1, "every replica serves the same config after the study"


def test_a_node_lost_during_an_in_place_study_fails_its_trial_and_the_study_ends_cleanly(app: App, cluster: Any,
                                                                                        tmp_path: Path) -> None:
    """The worker's raylet killed while both replicas run trials: the trial on it fails, the study goes on with
    the survivor and ends (the pick applied to the replica that serves), nothing hangs; the node back, its replica
    serves what the other does."""
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"n_parallel": [1, 2], "n_batch": [128, 256], "n_ubatch": [128, 256],
                                     "ctx_per_slot": [512], "type_k": ["f16"], "type_v": ["f16"],
                                     "flash_attn": ["on"]}))
    log = tmp_path / "tuner.log"
    with log.open("wb") as out:
        tuner = subprocess.Popen(
            ["python", "-m", "tuning.search", "--in-place", "--trials", "6", "--app-name", "llama", "--space",
             str(space), "--gen-tokens", "16", "--repeats", "1", "--min-ctx-per-slot", "512", "--confirm-rounds", "0",
             "--results-dir", str(tmp_path), "--out", str(tmp_path / "tuned.yaml"), "--study-name", "lost",
             "--workload", "benchmark"], cwd=REPO, env=cluster.env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "the first trial held its replica" not in log.read_text() and time.monotonic() < deadline:
            assert tuner.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        lost = cluster.nodes[-1]
        cluster.kill_node(lost)  # both replicas take trials in turn: the worker's is in one, or about to be
        code = tuner.wait(timeout=900)
    finally:
        if tuner.poll() is None:
            tuner.kill()
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "pick:" in output and "live apply: applied to 1 replica(s)" in output, output[-3000:]
    report = (tmp_path / "lost" / "report.md").read_text()
    assert "in place, on app 'llama'" in report
    assert app.complete().status_code == 200  # the survivor serves, the pick
    cluster.add_node(gpus=1, cpus=2)
    app.wait(all_serving(2), "the replica back", 240)
    configs = {json.dumps(r["config"], sort_keys=True) for r in app.slots()["replicas"]}
    assert len(configs) == 1, "the replica that came back serves what the survivor serves"
    failed = "the replica running this trial was lost" in report
    print(f"node lost mid-study: tuner exited 0; a trial failed with its replica: {failed}")


def test_a_node_lost_under_load_costs_no_hang_and_comes_back_with_the_current_config(app: App,
                                                                                      cluster: Any) -> None:
    outcomes: list[int | str] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                resp = app.complete(timeout_s=60)
                if resp.status_code != 200:
                    assert resp.json()["error"]["message"], resp.text  # OpenAI's error JSON, never a bare 500
                outcomes.append(resp.status_code)
            except httpx.TimeoutException:
                outcomes.append("timeout")

    before = {json.dumps(r["config"], sort_keys=True) for r in app.slots()["replicas"]}
    worker = threading.Thread(target=client, daemon=True)
    worker.start()
    time.sleep(3)
    lost = cluster.nodes[-1]
    cluster.kill_node(lost)
    degraded = app.wait(lambda h: h.get("status") == "degraded", "degraded health", 60)
    assert degraded["replicas"] == 2 and degraded["replicas_serving"] == 1
    time.sleep(5)
    assert app.complete().status_code == 200  # the surviving replica serves
    cluster.add_node(gpus=1, cpus=2)
    t0 = time.monotonic()
    app.wait(all_serving(2), "the replica back", 240)
    recovered_s = time.monotonic() - t0
    stop.set()
    worker.join(timeout=120)
    assert "timeout" not in outcomes and outcomes.count(200) > 0, outcomes
    after = {json.dumps(r["config"], sort_keys=True) for r in app.slots()["replicas"]}
    assert after == before, "the replica that came back serves the config the others serve"
    print(f"node loss: {len(outcomes)} requests, {sum(o != 200 for o in outcomes)} failed; "
          f"back {recovered_s:.0f} s after the node rejoined")


def test_a_node_without_the_model_file_says_which_node_and_which_path(app: App, cluster: Any,
                                                                      tmp_path: Path) -> None:
    """Last: it replaces the module's app (the same name and port) with one whose model is nowhere."""
    missing = tmp_path / "nowhere" / "model.gguf"
    broken = App(cluster, tmp_path, port=app.port, model=str(missing))
    try:
        health = broken.wait(lambda h: h.get("status") == "error", "the load error", READY_S)
        assert "failed to load" in health["error"]
        deadline = time.monotonic() + 60
        while str(missing) not in broken.log.read_text() and time.monotonic() < deadline:
            time.sleep(1)
        log = broken.log.read_text()
        assert f"the model file {missing} is not on node" in log, log[-3000:]
        resp = broken.complete(timeout_s=30)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_load_failed"
    finally:
        broken.stop()



def test_offline_trials_run_one_per_gpu_across_the_nodes_each_measured_on_its_own(cluster: Any,
                                                                                 tmp_path: Path) -> None:
    """After the apps above are gone (their GPUs free again): an offline study takes every free GPU, read on its
    node; the nodes' engines cannot offload (a CPU build, no GPU), so CPU trials run, one per declared GPU, two at
    a time, one on each node, as the serving replicas do."""
    _wait_for_free_gpus(cluster, 2)
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"n_parallel": [1, 2], "n_batch": [256], "n_ubatch": [256],
                                     "ctx_per_slot": [512], "type_k": ["f16"], "type_v": ["f16"],
                                     "flash_attn": ["on"]}))
    base = tmp_path / "base.yaml"  # two engines on this machine's two cores: one thread each
    base.write_text(yaml.safe_dump({"engine": {"n_threads": 1}}))
    result = subprocess.run(
        ["python", "-m", "tuning.search", "--offline", "--trials", "2", "--space", str(space), "--gen-tokens", "8",
         "--repeats", "1", "--min-ctx-per-slot", "512", "--confirm-rounds", "0", "--results-dir", str(tmp_path),
         "--out", str(tmp_path / "tuned.yaml"), "--study-name", "offline", "--workload", "benchmark",
         "--base-config", str(base)],
        cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "2 trial(s) at a time, one per GPU on 2 nodes (their engines on the CPU" in output, output[-3000:]
    report = (tmp_path / "offline" / "report.md").read_text()
    assert "Trials measured on 2 nodes" in report, report[-3000:]
    assert (tmp_path / "tuned.yaml").is_file()


def _wait_for_free_gpus(cluster: Any, gpus: int, timeout_s: float = 120.0) -> None:
    """Until the cluster's `gpus` GPUs are free (a Serve app shut down gives its replicas' back a little later)."""
    code = "import ray; ray.init(); print(int(ray.available_resources().get('GPU', 0)))"
    deadline = time.monotonic() + timeout_s
    free = 0
    while time.monotonic() < deadline:
        out = subprocess.run(["python", "-c", code], env=cluster.env, capture_output=True, text=True, timeout=120)
        free = int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0
        if free >= gpus:
            return
        time.sleep(2)
    raise AssertionError(f"{free} of the cluster's {gpus} GPUs free after {timeout_s:.0f} s")
