"""The engine replicas' router (serving/replica/routing.py): requests that would wait for a trial go to replicas not
running one; read-only routes go anywhere. Pure: fake replicas, no Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from serving.front.relay import RelayedRequest

pytestmark = pytest.mark.engine  # no Ray cluster, but serving.replica.routing imports Ray Serve's router classes


@dataclass(eq=False)
class FakeReplica:
    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)


def relayed(path: str, root_path: str = "") -> RelayedRequest:
    from serving.front.relay import RelayedRequest

    return RelayedRequest(method="POST", path=path, root_path=root_path, query_string=b"", headers=[], body=b"")


def test_generation_requests_and_trials_wait_for_trials_read_only_routes_do_not() -> None:
    from serving.replica.routing import waits_for_trials

    assert waits_for_trials("forward", [relayed("/v1/chat/completions")])
    assert waits_for_trials("forward", [relayed("/v1/completions")])
    assert waits_for_trials("tune_trial", ["study", 40, {}, None])
    for path in ("/slots", "/metrics", "/props", "/health", "/v1/models", "/v1/models/x"):
        assert not waits_for_trials("forward", [relayed(path)]), path
    assert not waits_for_trials("forward", [relayed("/app/slots", "/app")])  # an app under a route prefix
    assert waits_for_trials("forward", [relayed("/app/v1/completions", "/app")])
    assert not waits_for_trials("served_config", [])
    assert not waits_for_trials("forward", [])


def test_replicas_in_a_trial_are_the_last_rank() -> None:
    from serving.replica.routing import IN_TRIAL, rank

    a, b, c = FakeReplica("a"), FakeReplica("b", {IN_TRIAL: True}), FakeReplica("c")
    for _ in range(20):
        ranks = rank([a, b, c], avoid_trials=True)
        assert sorted(r.name for r in ranks[0]) == ["a", "c"] and ranks[-1] == [b]
    only = rank([b], avoid_trials=True)
    assert only == [[b]]  # the only replica: its clients wait their turn there


def test_power_of_two_choices_first_then_the_rest() -> None:
    from serving.replica.routing import rank

    replicas = [FakeReplica(str(i)) for i in range(5)]
    seen = set()
    for _ in range(50):
        first, rest = rank(replicas, avoid_trials=True)
        assert len(first) == 2 and len(rest) == 3 and set(first + rest) == set(replicas)
        seen.update(r.name for r in first)
    assert seen == {r.name for r in replicas}  # every replica gets chosen


def test_read_only_routes_ignore_trials() -> None:
    from serving.replica.routing import IN_TRIAL, rank

    a, b = FakeReplica("a", {IN_TRIAL: True}), FakeReplica("b")
    ranks = rank([a, b], avoid_trials=False)
    assert len(ranks) == 1 and set(ranks[0]) == {a, b}
    assert rank([], avoid_trials=True) == []
