"""Engine replicas that follow the cluster: Serve's autoscaling, with a policy of ours that reads the cluster's nodes.

With `num_replicas=auto` the app wants as many engine replicas as the cluster's GPUs hold: each node holds its GPUs
// gpus_per_replica of them (a replica's GPUs are all on one node). Counting that once, when the app is built,
misses every GPU node that joins later (on KubeRay the workers often start after the head builds the app). So the
count is Serve's autoscaling policy instead: the controller calls it every control-loop tick, it reads the live
nodes (every READ_EVERY_S, not every tick), and Serve starts or stops replicas to match, without a redeploy.
`num_replicas=load` is Serve's own policy (ongoing requests against target_ongoing_requests), capped by the same
count: no replica is asked for that no GPU can hold.

Serve cloudpickles the policy by value into its controller, which may not have this repository on its path: this
module imports nothing of serving/, only the standard library and Ray.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger("ray.serve")

POLICY = "serving.replica.scaling:ClusterPolicy"  # by import path, as AutoscalingConfig names a policy
READ_EVERY_S = 2.0  # the controller asks every 0.1 s; the nodes change far more rarely
FOLLOW_UPSCALE_DELAY_S = 0.0  # a GPU that joined gets its replica at once ...
FOLLOW_DOWNSCALE_DELAY_S = 10.0  # ... a node gone for this long loses its replica's place (one back sooner keeps it)


def replicas_held(nodes: Iterable[Mapping[str, Any]], gpus_per_replica: int) -> int:
    """How many replicas of `gpus_per_replica` GPUs the live nodes hold (ray.nodes()'s records): each node its own
    GPUs // gpus_per_replica, since one replica's GPUs are on one node."""
    return sum(int(node.get("Resources", {}).get("GPU", 0)) // gpus_per_replica for node in nodes
               if node.get("Alive") and gpus_per_replica > 0)


class ClusterPolicy:
    """Serve's custom autoscaling policy (a class: Serve makes one per deployment and calls it each tick): the
    replicas the cluster's GPUs hold, or with `follow_load` Serve's request-based count capped by that. Serve
    applies min_replicas, max_replicas and the delays around what it returns."""

    def __init__(self, gpus_per_replica: int = 1, follow_load: bool = False,
                 read_every_s: float = READ_EVERY_S) -> None:
        self._gpus_per_replica, self._follow_load, self._read_every_s = gpus_per_replica, follow_load, read_every_s
        self._held: int | None = None
        self._read_at = -math.inf

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        held = self._held_now(ctx.current_time, ctx.target_num_replicas)
        if not self._follow_load:
            return held, {}
        from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

        wanted, state = replica_queue_length_autoscaling_policy(ctx)
        return min(wanted, max(held, ctx.capacity_adjusted_min_replicas)), state

    def _held_now(self, now: float | None, target: int) -> int:
        """The count from the nodes, read again once READ_EVERY_S has passed; a read that fails keeps the last one
        (the first: Serve's current target), so a slow GCS never moves replicas."""
        if now is None or now - self._read_at >= self._read_every_s:
            self._read_at = now if now is not None else self._read_at
            try:
                held = replicas_held(self._nodes(), self._gpus_per_replica)
            except Exception as exc:  # the GCS did not answer this time
                log.warning("engine replicas: could not read the cluster's nodes (%s); keeping %s", exc,
                            self._held if self._held is not None else target)
            else:
                if held != self._held:
                    log.info("engine replicas: the cluster's GPUs hold %d replica(s) of %d GPU(s)", held,
                             self._gpus_per_replica)
                self._held = held
        return self._held if self._held is not None else target

    def _nodes(self) -> list[dict[str, Any]]:
        """The cluster's nodes as Ray's GCS lists them, dead ones included."""
        import ray

        return list(ray.nodes())
