"""Where an engine replica runs: its Ray node, the GPUs Ray gave it (CUDA_VISIBLE_DEVICES) and their memory, read
with NVML on that node. /slots lists it for every replica, and the in-place tuner takes its memory budget from
it, so nothing has to guess about GPUs it cannot see from where it runs (another node of the cluster)."""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

from serving.engine.config import default_threads
from serving.engine.devices import VISIBLE_DEVICES, DeviceMemory, visible_gpus


@dataclass(frozen=True)
class ReplicaPlace:
    """A replica's node and devices, and whether its engine can put layers on a GPU (a CUDA build and a GPU)."""

    replica: str
    node_id: str
    node_ip: str
    hostname: str
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES as Ray set it for this replica (None: not set)
    gpus: tuple[DeviceMemory, ...]
    offload: bool
    threads: int  # what an engine here runs when its config sets none (serving.engine.config.default_threads)

    @property
    def gpu_memory_total(self) -> int | None:
        """The memory of the replica's GPUs (one engine spreads its model over all of them: gpus_per_replica),
        None without a GPU."""
        return sum(g.total_bytes for g in self.gpus) if self.gpus else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gpu_memory_total": self.gpu_memory_total}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaPlace:
        fields = {k: v for k, v in data.items() if k != "gpu_memory_total"}
        return cls(**{**fields, "gpus": tuple(DeviceMemory(**g) for g in data.get("gpus", ()))})


class Placed:
    """What the places of a study's engines say (a serving app's replicas, offline trials' GPUs): the device kind,
    and the GPU a pick must fit. Subclasses hold `places`."""

    places: tuple[ReplicaPlace, ...]

    @property
    def on_gpu(self) -> bool:
        """Whether every engine puts layers on a GPU (one study, one device kind)."""
        return bool(self.places) and all(p.offload for p in self.places)

    @property
    def gpu_memory_total(self) -> int | None:
        """The smallest GPU over the places (a pick must fit every one), None where one has none."""
        totals = [p.gpu_memory_total for p in self.places]
        return min(totals) if totals and None not in totals else None  # type: ignore[type-var]

    @property
    def gpus_per_engine(self) -> int:
        """The fewest GPUs one engine holds over the places (2 or more: the model is split, split_mode matters)."""
        return min((len(p.gpus) for p in self.places), default=0)

    @property
    def threads(self) -> int | None:
        """The fewest default threads over the places' engines (what a searched thread count must suit)."""
        return min((p.threads for p in self.places), default=None)


def node_label() -> str:
    """Where this process runs, for a trial's record: the host name, and the Ray node's id (its first 8 hex
    digits) when Ray runs it: two nodes may share a host name (or a machine)."""
    node_id, _ = _ray_node()
    return f"{socket.gethostname()}/{node_id[:8]}" if node_id else socket.gethostname()


def here(replica: str, offload_built: bool) -> ReplicaPlace:
    """This process's place: the Ray node (if Ray runs it), its visible GPUs by NVML (none where NVML cannot be
    read: no driver, or a CPU-only node), and whether layers can go to one (`offload_built`: the build can)."""
    node_id, node_ip = _ray_node()
    gpus = visible_gpus()
    return ReplicaPlace(replica=replica, node_id=node_id, node_ip=node_ip, hostname=socket.gethostname(),
                        visible_devices=os.environ.get(VISIBLE_DEVICES), gpus=gpus,
                        offload=offload_built and bool(gpus), threads=default_threads())


def _ray_node() -> tuple[str, str]:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except Exception:  # outside Ray (a test's engine host): no node
        pass
    return "", ""
