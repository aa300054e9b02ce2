"""Replicas that follow the cluster, and one model over several GPUs, without a cluster: the autoscaling policy's
count from the nodes (serving/replica/scaling.py), the deployment the app builder describes for each num_replicas
and gpus_per_replica, /health while a replica starts or is lost (serving/front/ingress.py), each GPU's part of a
split model and the fit at start against every GPU (serving/engine/split.py, fit.py), and split_mode in the
tuner's space. The cluster lane runs them on raylets (tests/test_cluster.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from serving.engine.config import EngineConfig, SplitMode
from serving.engine.devices import DeviceMemory
from serving.engine.memory import GPU_RUNTIME_OVERHEAD, MemoryEstimate
from serving.engine.units import GiB, MiB
from tests.test_fit import dense


def node(gpus: int, alive: bool = True) -> dict[str, Any]:
    return {"Alive": alive, "Resources": {"CPU": 2.0, **({"GPU": float(gpus)} if gpus else {})}}


# -- the policy --------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_replicas_the_live_nodes_hold_count_each_nodes_own_gpus() -> None:
    from serving.replica.scaling import replicas_held

    nodes = [node(1), node(3), node(0), node(4, alive=False)]
    assert replicas_held(nodes, 1) == 4
    assert replicas_held(nodes, 2) == 1  # one of the 3-GPU node; two single GPUs on two nodes make no replica
    assert replicas_held(nodes, 0) == 0


@pytest.mark.unit
def test_the_policy_reads_the_nodes_now_and_then_and_keeps_its_count_when_a_read_fails() -> None:
    from serving.replica.scaling import ClusterPolicy

    cluster: list[dict[str, Any]] | None = [node(1)]
    reads = []

    class Policy(ClusterPolicy):
        def _nodes(self) -> list[dict[str, Any]]:
            reads.append(1)
            if cluster is None:
                raise ConnectionError("GCS away")
            return list(cluster)

    policy = Policy(gpus_per_replica=1, read_every_s=2.0)

    def decide(now: float, target: int = 1) -> float:
        return policy(SimpleNamespace(current_time=now, target_num_replicas=target))[0]

    assert decide(0.0) == 1
    cluster = [node(1), node(1)]  # a node joins
    assert decide(1.0) == 1 and len(reads) == 1  # not read again before READ_EVERY_S
    assert decide(2.5) == 2 and len(reads) == 2
    cluster = None
    assert decide(5.0, target=2) == 2  # the read failed: the last count stands
    cluster = [node(1)]  # the second node left
    assert decide(7.5, target=2) == 1


@pytest.mark.engine  # Serve's own policy: imports ray
def test_under_load_the_policy_asks_for_no_more_replicas_than_the_gpus_hold() -> None:
    from serving.replica.scaling import ClusterPolicy

    class Policy(ClusterPolicy):
        def _nodes(self) -> list[dict[str, Any]]:
            return [node(2)]

    policy = Policy(gpus_per_replica=1, follow_load=True)
    config = SimpleNamespace(get_target_ongoing_requests=lambda: 4.0)

    def decide(requests: float) -> float:
        ctx = SimpleNamespace(current_time=0.0, target_num_replicas=1, current_num_replicas=1,
                              total_num_requests=requests, capacity_adjusted_min_replicas=1, config=config,
                              policy_state={})
        policy._read_at = -1e9  # read again every decision
        return policy(ctx)[0]

    assert decide(4.0) == 1 and decide(8.0) == 2
    assert decide(40.0) == 2  # ten replicas' worth of requests, two GPUs


# -- the deployment the builder describes -------------------------------------------------------------------------
def engines(gpus: int, **options: Any) -> Any:
    from serving import app as serving_app

    serving_app_module: Any = serving_app
    serving_app_module._gpus_available = lambda: gpus
    built = serving_app.build_app(EngineConfig(n_parallel=2, n_ctx=2048), serving_app.ServerOptions(**options))
    front = built._bound_deployment
    return front, (front.init_args[0]._bound_deployment if options.get("ingress") != "engine" else front)


@pytest.mark.engine
def test_auto_replicas_follow_the_clusters_gpus_through_serves_autoscaling(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving import app as serving_app
    from serving.replica.scaling import POLICY

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 2)
    ingress, d = engines(2)
    scaling = d._deployment_config.autoscaling_config
    assert scaling.initial_replicas == 2 and scaling.min_replicas == 1 and scaling.upscale_delay_s == 0
    assert scaling.policy.policy_function == POLICY
    assert scaling.policy.policy_kwargs == {"gpus_per_replica": 1, "follow_load": False}
    assert d.ray_actor_options["num_gpus"] == 1
    assert ingress.init_args[2] == 2  # /health's first expectation, until it reads Serve's count
    assert ingress.max_ongoing_requests == 256 * d.max_ongoing_requests + 16  # any count the policy may reach


@pytest.mark.engine
def test_a_replica_of_two_gpus_asks_ray_for_both_on_one_node_and_counts_two_per_replica(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from serving import app as serving_app

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 4)
    _, d = engines(4, gpus_per_replica="2", max_replicas=3)
    scaling = d._deployment_config.autoscaling_config
    assert d.ray_actor_options["num_gpus"] == 2  # one actor: Ray places all its GPUs on one node
    assert scaling.initial_replicas == 2 and scaling.max_replicas == 3
    assert scaling.policy.policy_kwargs["gpus_per_replica"] == 2
    # declared before any GPU joined (a KubeRay head): one replica waits for a node that holds it
    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 0)
    _, waiting = engines(0, gpus_per_replica=1)
    assert waiting.ray_actor_options["num_gpus"] == 1
    assert waiting._deployment_config.autoscaling_config.initial_replicas == 1


@pytest.mark.engine
def test_load_scaling_is_serves_within_the_gpus_and_a_number_or_the_cpu_is_fixed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from serving import app as serving_app

    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 2)
    _, d = engines(2, num_replicas="load", min_replicas=0, max_replicas=2, target_ongoing_requests=3)
    scaling = d._deployment_config.autoscaling_config
    assert scaling.target_ongoing_requests == 3 and scaling.min_replicas == 0 and scaling.max_replicas == 2
    assert scaling.policy.policy_kwargs == {"gpus_per_replica": 1, "follow_load": True}
    _, slots = engines(2, num_replicas="load")
    assert slots._deployment_config.autoscaling_config.target_ongoing_requests == 2  # the config's n_parallel
    _, fixed = engines(2, num_replicas="3")
    assert fixed.num_replicas == 3 and fixed._deployment_config.autoscaling_config is None
    monkeypatch.setattr(serving_app, "_gpus_available", lambda: 0)
    _, cpu = engines(0)
    assert cpu.num_replicas == 1 and "num_gpus" not in cpu.ray_actor_options
    with pytest.raises(ValueError, match="below min_replicas"):
        serving_app.ServerOptions(min_replicas=3, max_replicas=2)


# -- /health while the count changes -------------------------------------------------------------------------------
@pytest.mark.engine  # the ingress module imports Ray Serve
def test_health_calls_a_starting_replica_starting_and_a_lost_one_degraded_until_serves_count_drops_it() -> None:
    from serving.front.ingress import DEGRADED, Expectation, HealthReport, combined, live_replicas

    ok, loading = HealthReport(200, {"status": "ok"}), HealthReport(503, {"status": "loading"})
    failed = HealthReport(503, {"status": "error", "error": "failed to load"})
    seen = Expectation(target=1)

    def health(answers: list[Any]) -> dict[str, Any]:
        seen.heard(answers)
        return combined(answers, seen.expected, seen.target).body

    assert health([ok]) == {"status": "ok", "replicas": 1}
    seen.retarget(2)  # a GPU node joined: Serve starts a second replica
    assert health([ok]) == {"status": "ok", "replicas": 1, "replicas_starting": 1}
    assert health([ok, loading]) == {"status": "ok", "replicas": 1, "replicas_starting": 1}
    assert health([ok, ok]) == {"status": "ok", "replicas": 2}
    assert health([ok, ConnectionError()]) == {"status": DEGRADED, "replicas": 2, "replicas_serving": 1}  # lost
    assert health([ok]) == {"status": DEGRADED, "replicas": 2, "replicas_serving": 1}  # its place still counted
    seen.retarget(1)  # its node is gone for good: Serve's count drops it
    assert health([ok]) == {"status": "ok", "replicas": 1}
    seen.retarget(2)
    assert health([ok, failed])["status"] == DEGRADED  # a replica that failed to load is never just starting
    assert live_replicas({"RUNNING": 2, "STARTING": 1, "STOPPING": 1}) == 3


# -- each GPU's part of a split model ---------------------------------------------------------------------------------
def card(index: int, free: int) -> DeviceMemory:
    return DeviceMemory(index, "test GPU", 24 * GiB, 24 * GiB - free, free)


@pytest.mark.unit
def test_each_gpu_holds_its_share_of_the_layers_and_row_split_keeps_the_cache_on_the_main_gpu() -> None:
    from serving.engine.split import per_gpu, shares

    layer = EngineConfig(tensor_split="3,1")
    assert shares(layer, [10, 10]) == (0.75, 0.25)
    assert shares(EngineConfig(), [30, 10]) == (0.75, 0.25)  # unset: by free memory, as llama.cpp splits
    assert shares(EngineConfig(split_mode="none", main_gpu=1), [10, 10]) == (0.0, 1.0)
    estimate = MemoryEstimate(weights=800 * MiB, kv_cache=200 * MiB, compute=50 * MiB, overhead=GPU_RUNTIME_OVERHEAD)
    parts = per_gpu(estimate, layer, (0.75, 0.25))
    assert parts == (750 * MiB + 50 * MiB + GPU_RUNTIME_OVERHEAD, 250 * MiB + 50 * MiB + GPU_RUNTIME_OVERHEAD)
    rows = per_gpu(estimate, EngineConfig(split_mode="row"), (0.5, 0.5))
    assert rows == (400 * MiB + 250 * MiB + GPU_RUNTIME_OVERHEAD, 400 * MiB + GPU_RUNTIME_OVERHEAD)


@pytest.mark.unit
def test_the_fit_at_start_places_a_split_model_by_its_tightest_gpu() -> None:
    """A 70-layer model of ~27 GiB over two cards of 20 GiB free: split evenly every layer fits; split 3:1 the
    first card bounds it, whatever the second has left."""
    from serving.engine.fit import gpu_budget, fit
    from serving.engine.split import per_gpu

    shape = dense(n_layer=70, layer_bytes=400 * MiB)
    cards = [card(0, 20 * GiB), card(1, 20 * GiB)]
    even = EngineConfig(n_gpu_layers="auto", n_parallel=1, n_ctx=8192)
    assert fit(shape, even, gpu_budget(cards, even)).config.n_gpu_layers == -1
    skewed = even.model_copy(update={"tensor_split": (3.0, 1.0)})
    budget = gpu_budget(cards, skewed)
    assert budget.split == (0.75, 0.25) and "split by layer 0.75:0.25" in budget.source
    placed = fit(shape, skewed, budget).config
    assert 0 < placed.n_gpu_layers < 70
    from serving.engine.memory import predict

    parts = per_gpu(predict(shape, placed, on_gpu=True), placed, budget.split)
    assert all(part <= free for part, free in zip(parts, budget.gpus, strict=True))
    assert sum(parts) < sum(budget.gpus) * 0.9  # the second card is far from full: the first one bounds it
    single = gpu_budget(cards[:1], even)
    assert single.gpus == () and single.split == ()  # one GPU: the whole is the check, as before


@pytest.mark.unit
def test_split_mode_is_searched_only_where_an_engine_holds_several_gpus() -> None:
    from tuning.space import SearchSpace, suggest

    class Draw:
        def suggest_categorical(self, name: str, values: list[Any]) -> Any:
            return values[-1]

    space = SearchSpace.from_yaml(None)  # the shipped space lists both
    assert space.split_mode == [SplitMode.layer, SplitMode.row]
    assert "split_mode" not in suggest(Draw(), SearchSpace().for_gpus(2, EngineConfig()), [1024], None)  # one value
    one = space.for_gpus(1, EngineConfig())
    assert one.split_mode == [SplitMode.layer] and "split_mode" not in suggest(Draw(), one, [1024], None)
    assert suggest(Draw(), space.for_gpus(2, EngineConfig()), [1024], None)["split_mode"] == "row"


@pytest.mark.engine  # the trial module imports Ray Tune
def test_a_trial_whose_replica_is_lost_fails_with_the_reason_and_the_study_goes_on() -> None:
    """The in-place trial's call to a replica that died with its node: the trial fails (its result carries the
    error; the study goes on), with words that say so, not Ray's RPC error."""
    import itertools

    from ray.exceptions import ActorUnavailableError

    from tuning.inplace import LOST, ON_HEAD, ReplicaTrial

    class Lost:
        def result(self) -> None:
            raise ActorUnavailableError("Socket closed", b"\0" * 16)

    trial = ReplicaTrial.__new__(ReplicaTrial)
    trial.settings = SimpleNamespace(workload=None, on_gpu=False, traffic=None)
    trial.study, trial.trials, trial.baseline, trial.requests = "s", 4, None, itertools.count(1)
    trial.handle = SimpleNamespace(tune_trial=SimpleNamespace(remote=lambda *args: Lost()))
    with pytest.raises(RuntimeError, match="was lost") as raised:
        trial._measure(EngineConfig())
    assert str(raised.value).startswith(LOST)
    assert ON_HEAD["node:__internal_head__"] > 0  # the trial's own actor is not lost with a node
