"""Which engine replica a request goes to: the one already holding the start of its prompt (prefix affinity),
within a bound on queue imbalance, else the least loaded; and away from replicas that are running an in-place
tuning trial (serving/replica/trials.py).

Prefix affinity (serving/replica/affinity.py says how prefixes are remembered): a conversation's returning turn
goes to the replica that served its earlier turns, where its history sits in a slot or in the host-RAM prompt
cache, instead of prefilling all of it again elsewhere. The router remembers, per replica, the text of what it
routed there (no round trip to a replica on the way); a prompt of which no replica holds MATCH_RATE goes to the
least loaded replica, and so does one whose holder has more than `max_imbalance` more requests in flight (as
Serve counts them: running and queued) than the least loaded. A replica that leaves or is replaced takes its
memory with it. Each router keeps its own memory: the ingress's one router sees every relayed request; with
`ingress=engine`, Serve's proxies route HTTP without the body, so there is no affinity.

A replica in a trial has its engine to itself: a client request sent there waits until the trial ends.
With other replicas serving, that wait is needless, so generation requests and other trials go to the
replicas not in a trial first; a replica in a trial is only the last rank (taken when every other one is
full, and always when it is the only replica: its clients then wait their turn, as `--in-place` says).
Read-only control routes (/slots, /metrics, /props, /health, /v1/models, /traffic) never wait for a trial, so they
go anywhere: /slots of a replica in a trial still says "tuning: trial 7/40".

Each replica reports `{"in_trial": bool}` through Serve's routing stats (`record_routing_stats`, polled
every ROUTING_STATS_PERIOD_S); a report can be that old, and the replica's own turn-taking stays the
guarantee of correctness: the router only makes waiting rare.

The router tells the replica what it decided (`RouteNote`, a keyword argument of `forward`), and the replica
counts it in /metrics (llm_requests_routed, by affinity, load, imbalance or overflow). Requests are matched to
replicas one by one (not Serve's FIFO hand-over, which gives a replica found for one request to the oldest
waiting one, and so would send a conversation to a replica chosen for another).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from serving.replica.affinity import PrefixIndex, RouteNote, block_hashes, choose, prompt_text

ROUTER = "serving.replica.routing:EngineRouter"  # by import path: every process with a handle loads it
IN_TRIAL = "in_trial"
ROUTING_STATS_PERIOD_S = 0.5
READ_ONLY_PATHS = ("/slots", "/metrics", "/props", "/health", "/v1/models", "/models", "/traffic")
ROUTE_NOTE = "routed"  # the keyword argument of LlamaServer.forward that carries the RouteNote
PENDING_PROMPTS = 4096  # prompts' block keys kept from choosing a replica to hearing where they went


class Replica(Protocol):
    @property
    def routing_stats(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=Replica)


def relayed_path(request: Any) -> str:
    """A relayed request's path inside the app (an app under a route prefix has it stripped)."""
    path, root = getattr(request, "path", ""), getattr(request, "root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def waits_for_trials(method: str, args: Sequence[Any]) -> bool:
    """Whether a call to a replica would wait while that replica runs a trial: trials and relayed requests
    to anything but the read-only routes."""
    if method == "tune_trial":
        return True
    if method != "forward" or not args:
        return False
    path = relayed_path(args[0])
    return not any(path == p or path.startswith(p + "/") for p in READ_ONLY_PATHS)


def rank(replicas: Sequence[R], avoid_trials: bool, pick: int = 2, first: R | None = None) -> list[list[R]]:
    """Ranks of replicas to try in order: `first` alone if given (and serving), else `pick` chosen at random
    (power of two choices: Serve takes the one with the shorter queue), then the rest; with `avoid_trials`,
    replicas in a trial come last."""
    serving = [r for r in replicas if not (avoid_trials and r.routing_stats.get(IN_TRIAL))]
    tuning = [r for r in replicas if r not in serving]
    chosen = [first] if first is not None and first in serving else random.sample(serving, min(pick, len(serving)))
    return [rank for rank in (chosen, [r for r in serving if r not in chosen], tuning) if rank]


class EngineRouter(RequestRouter):
    """The engine replicas' request router (the deployment's `request_router_config`; its
    `request_router_kwargs` are `initialize_state`'s)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._affinity, self._max_imbalance = False, 0
        self._index = PrefixIndex()
        self._pending: dict[str, tuple[list[int], int]] = {}  # by Serve's request id: block keys, text length

    def initialize_state(self, affinity: bool = False, max_imbalance: int = 0, **_: Any) -> None:
        """The app's `prefix_affinity` and `affinity_max_imbalance` (serving/replica/options.py)."""
        self._affinity, self._max_imbalance = affinity, max_imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return rank(candidate_replicas, False)
        avoid = waits_for_trials(pending_request.metadata.call_method, pending_request.args)
        prompt = self._prompt(pending_request) if self._affinity and avoid else None
        serving = [r for r in candidate_replicas if not r.routing_stats.get(IN_TRIAL)]
        picked = None if prompt is None else choose(prompt[0], prompt[1], serving, _name, self._ongoing,
                                                    self._index, self._max_imbalance)
        if picked is None:
            return rank(candidate_replicas, avoid)
        pending_request.kwargs[ROUTE_NOTE] = RouteNote(picked.by, picked.replica)
        return rank(candidate_replicas, avoid, first=next(r for r in serving if _name(r) == picked.replica))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        """The replica took the request: its prompt's prefixes are now that replica's."""
        prompt = self._pending.pop(pending_request.metadata.internal_request_id, None)
        if prompt is not None:
            self._index.insert(replica_id.unique_id, prompt[0])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._pending.pop(internal_request_id, None)  # refused or failed before it was routed

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._index.keep_only(_name(r) for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.keep_only(_name(r) for r in self.curr_replicas.values())

    def _prompt(self, pending_request: PendingRequest) -> tuple[list[int], int] | None:
        """The block keys and length of a relayed generation request's prompt text, kept until it is routed
        (Serve may ask for replicas more than once for one request)."""
        rid = pending_request.metadata.internal_request_id
        if rid in self._pending:
            return self._pending[rid]
        request = pending_request.args[0]
        text = prompt_text(relayed_path(request), getattr(request, "body", b""))
        if not text:
            return None
        while len(self._pending) >= PENDING_PROMPTS:  # requests cancelled before they were routed
            del self._pending[next(iter(self._pending))]
        self._pending[rid] = (block_hashes(text), len(text))
        return self._pending[rid]

    def _ongoing(self, replica: RunningReplica) -> int:
        """Requests in flight at `replica` as Serve last counted them (0 where it has no count yet)."""
        return self.replica_queue_len_cache.get(replica.replica_id) or 0


def _name(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id
