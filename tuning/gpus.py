"""The GPUs offline trials run on, read where they are.

Offline trials take one GPU each, wherever Ray finds one, on any node of the cluster. Before the study, every free
GPU is reserved at once (a placement group of one-GPU bundles: each bundle its own GPU) and a task in each bundle
reports its node, the GPU Ray gave it (NVML on that node) and whether the llama.cpp build there can put layers on
it: `serving.replica.node.here`, what the serving replicas report too. The study's device and memory budget come from
these, never from the machine the tuner runs on, which may have no GPU (a cluster's head node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving.replica.node import Placed, ReplicaPlace

PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TrialSlots(Placed):
    """Where offline trials run: one per GPU `places` lists (read on its node), or one at a time on the CPU."""

    places: tuple[ReplicaPlace, ...] = ()

    @property
    def count(self) -> int:
        """Trials at a time."""
        return max(len(self.places), 1)

    @property
    def resources(self) -> dict[str, float]:
        """What each trial asks Ray for: a GPU (also where the engine there runs on the CPU: a GPU is the unit of
        one engine, as for the serving replicas), else a CPU."""
        return {"gpu": 1, "cpu": 1} if self.places else {"cpu": 1}

    @property
    def nodes(self) -> int:
        return len({p.node_id for p in self.places})

    def without_offload(self) -> list[ReplicaPlace]:
        """The places whose engine cannot put layers on their GPU (a CPU build there, or NVML finds none)."""
        return [p for p in self.places if not p.offload]


def free_gpu_places(gpus: int, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[ReplicaPlace, ...]:
    """Each of `gpus` free GPUs of the connected cluster as read on its node (all reserved together, so every one
    is a distinct GPU); RuntimeError when they cannot all be reserved within `timeout_s` (taken meanwhile)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"GPU": 1}] * gpus, strategy="SPREAD")
    try:
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            raise RuntimeError(f"could not reserve the cluster's {gpus} free GPU(s) within {timeout_s:.0f} s")
        # max_calls=1: the worker exits after its probe, so nothing it loaded stays on the GPU during the trials
        probe = ray.remote(num_cpus=0, num_gpus=1, max_calls=1)(_place)
        refs = [probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle)).remote(bundle)
                for bundle in range(gpus)]
        return tuple(ReplicaPlace.from_dict(p) for p in ray.get(refs, timeout=timeout_s))
    finally:
        remove_placement_group(group)


def _place(bundle: int) -> dict[str, Any]:
    """Runs on the GPU's node: its place as a replica there would report it."""
    from serving.engine import llama
    from serving.replica.node import here

    return here(f"trial slot {bundle}", llama.gpu_offload_supported()).as_dict()
