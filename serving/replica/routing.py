"""Which engine replica a request goes to: Serve's power of two choices, but away from replicas that are
running an in-place tuning trial (serving/replica/trials.py).

A replica in a trial has its engine to itself: a client request sent there waits until the trial ends.
With other replicas serving, that wait is needless, so generation requests and other trials go to the
replicas not in a trial first; a replica in a trial is only the last rank (taken when every other one is
full, and always when it is the only replica: its clients then wait their turn, as `--in-place` says).
Read-only control routes (/slots, /metrics, /props, /health, /v1/models, /traffic) never wait for a trial, so they
go anywhere: /slots of a replica in a trial still says "tuning: trial 7/40".

Each replica reports `{"in_trial": bool}` through Serve's routing stats (`record_routing_stats`, polled
every ROUTING_STATS_PERIOD_S); a report can be that old, and the replica's own turn-taking stays the
guarantee of correctness: the router only makes waiting rare.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

ROUTER = "serving.replica.routing:TrialAwareRouter"  # by import path: every process with a handle loads it
IN_TRIAL = "in_trial"
ROUTING_STATS_PERIOD_S = 0.5
READ_ONLY_PATHS = ("/slots", "/metrics", "/props", "/health", "/v1/models", "/models", "/traffic")


class Replica(Protocol):
    @property
    def routing_stats(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=Replica)


def waits_for_trials(method: str, args: Sequence[Any]) -> bool:
    """Whether a call to a replica would wait while that replica runs a trial: trials and relayed requests
    to anything but the read-only routes."""
    if method == "tune_trial":
        return True
    if method != "forward" or not args:
        return False
    path, root = getattr(args[0], "path", ""), getattr(args[0], "root_path", "")
    path = path[len(root):] if root and path.startswith(root) else path  # an app under a route prefix
    return not any(path == p or path.startswith(p + "/") for p in READ_ONLY_PATHS)


def rank(replicas: Sequence[R], avoid_trials: bool, pick: int = 2) -> list[list[R]]:
    """Ranks of replicas to try in order: `pick` chosen at random (power of two choices: the router takes
    the one with the shorter queue), then the rest; with `avoid_trials`, replicas in a trial come last."""
    serving = [r for r in replicas if not (avoid_trials and r.routing_stats.get(IN_TRIAL))]
    tuning = [r for r in replicas if r not in serving]
    chosen = random.sample(serving, min(pick, len(serving)))
    return [rank for rank in (chosen, [r for r in serving if r not in chosen], tuning) if rank]


class TrialAwareRouter(FIFOMixin, RequestRouter):
    """The engine replicas' request router (the deployment's `request_router_config`)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        avoid = pending_request is not None and waits_for_trials(pending_request.metadata.call_method,
                                                                 pending_request.args)
        return rank(candidate_replicas, avoid)
