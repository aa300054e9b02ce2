"""Replicas that follow the cluster, and one replica over several GPUs, on raylets of this machine (measure/cluster.py):
a head without GPUs and a node declaring two, the app with gpus_per_replica=2 (one replica holding both GPUs, as
CUDA_VISIBLE_DEVICES shows); a node of one GPU joining holds no such replica, a node of two joining gets one, with
no redeploy and no `degraded` /health while it starts. Declared GPUs: Ray schedules by them, the engines run on the
CPU."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from measure.cluster import all_serving
from tests.test_cluster import READY_S, App

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from measure.cluster import LocalCluster

    started = LocalCluster.start(gpus_per_node=0, cpus_per_node=2, workers=0)
    try:
        started.add_node(gpus=2, cpus=2)
        yield started
    finally:
        started.stop()


def _watch(app: App, done: Any, timeout_s: float) -> list[str]:
    """/health's statuses until `done` holds; RuntimeError when time runs out."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = app.health()
        seen.append(str(health.get("status")))
        if done(health):
            return seen
        time.sleep(0.5)
    raise RuntimeError(f"not done within {timeout_s:.0f} s; /health said {sorted(set(seen))}, last {app.health()}")


def test_a_replica_holds_two_gpus_of_one_node_and_a_node_joining_gets_its_own(cluster: Any, tmp_path: Path) -> None:
    app = App(cluster, tmp_path, gpus_per_replica=2)
    try:
        app.wait(all_serving(1), "one replica serving", READY_S)
        (replica,) = app.slots()["replicas"]
        assert replica["node"]["visible_devices"] == "0,1", replica["node"]  # both GPUs Ray gave it, on one node
        cluster.add_node(gpus=1, cpus=1)  # one GPU holds no replica of two
        time.sleep(15)
        assert all_serving(1)(app.health()) and len(app.slots()["replicas"]) == 1
        cluster.add_node(gpus=2, cpus=2)
        t0 = time.monotonic()
        seen = _watch(app, all_serving(2), READY_S)
        followed_s = time.monotonic() - t0
        assert "degraded" not in seen, seen  # a replica that starts because a node joined is not a missing one
        replicas = app.slots()["replicas"]
        assert len({r["node"]["node_id"] for r in replicas}) == 2
        assert all(r["node"]["visible_devices"] == "0,1" for r in replicas), [r["node"] for r in replicas]
        assert app.complete().status_code == 200
        print(f"a node of two GPUs joined: its replica served {followed_s:.0f} s later (no redeploy)")
    finally:
        app.stop()
