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


def test_a_first_replica_is_the_first_rank_unless_it_is_in_a_trial() -> None:
    from serving.replica.routing import IN_TRIAL, rank

    a, b, c = FakeReplica("a"), FakeReplica("b", {IN_TRIAL: True}), FakeReplica("c")
    assert rank([a, b, c], avoid_trials=True, first=c) == [[c], [a], [b]]
    assert len(rank([a, b, c], avoid_trials=True, first=b)[0]) == 2  # in a trial: power of two instead


@dataclass(frozen=True)
class FakeId:
    unique_id: str


@dataclass(eq=False)
class Running:
    """What the router reads of a Serve replica: its id and routing stats."""

    replica_id: FakeId
    routing_stats: dict[str, Any] = field(default_factory=dict)


def chat(turns: list[str]) -> RelayedRequest:
    import json

    from serving.front.relay import RelayedRequest

    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return RelayedRequest(method="POST", path="/v1/chat/completions", root_path="", query_string=b"", headers=[],
                          body=json.dumps({"messages": messages}).encode())


def test_the_router_sends_a_returning_conversation_where_it_went_and_notes_why() -> None:
    """EngineRouter on fake replicas: a new conversation goes to the replica holding least; once Serve says
    where it went (on_request_routed), its next turn is sent there, and the note for the replica says
    affinity; a replica in a trial, or one that left, is not chosen for it; affinity off notes nothing."""
    import asyncio
    import uuid

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from serving.replica.affinity import RoutedBy
    from serving.replica.routing import IN_TRIAL, ROUTE_NOTE, EngineRouter

    history = "A long opening of a conversation about rivers and lakes. " * 40

    async def scenario() -> None:
        router = EngineRouter(deployment_id=DeploymentID("engines", "app"),
                              handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
        router.initialize_state(affinity=True, max_imbalance=4)
        a, b = Running(FakeId("a")), Running(FakeId("b"))

        def pending(request: RelayedRequest) -> PendingRequest:
            rid = uuid.uuid4().hex
            return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata(rid, rid, "forward"))

        first = pending(chat([history]))
        ranks = await router.choose_replicas([a, b], first)  # type: ignore[list-item]
        went = ranks[0][0]
        assert len(ranks[0]) == 1 and first.kwargs[ROUTE_NOTE].by is RoutedBy.load
        router.on_request_routed(first, went.replica_id, None)  # type: ignore[arg-type]
        for _ in range(5):
            back = pending(chat([history, "Rivers flow.", "And lakes?"]))
            assert (await router.choose_replicas([a, b], back))[0] == [went]  # type: ignore[list-item]
            note = back.kwargs[ROUTE_NOTE]
            assert note.by is RoutedBy.affinity and note.replica == went.replica_id.unique_id
        went.routing_stats[IN_TRIAL] = True
        back = pending(chat([history, "Rivers flow.", "And lakes?"]))
        assert (await router.choose_replicas([a, b], back))[0] != [went]  # type: ignore[list-item]
        assert back.kwargs[ROUTE_NOTE].by is RoutedBy.load
        went.routing_stats[IN_TRIAL] = False
        other = b if went is a else a
        router.on_replica_actor_died(went.replica_id)  # type: ignore[arg-type]
        back = pending(chat([history, "Rivers flow.", "And lakes?"]))
        assert (await router.choose_replicas([other], back))[0] == [other]  # type: ignore[list-item]
        assert back.kwargs[ROUTE_NOTE].by is RoutedBy.load  # its memory left with it
        read_only = PendingRequest(args=[relayed("/slots")], kwargs={}, metadata=RequestMetadata("s", "s", "forward"))
        await router.choose_replicas([a, b], read_only)  # type: ignore[list-item]
        assert ROUTE_NOTE not in read_only.kwargs
        router.initialize_state(affinity=False)
        off = pending(chat([history]))
        await router.choose_replicas([a, b], off)  # type: ignore[list-item]
        assert ROUTE_NOTE not in off.kwargs

    asyncio.run(scenario())
