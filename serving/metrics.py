"""Metrics of one replica, in two sinks: Prometheus text on the replica's own `/metrics`, and
`ray.serve.metrics` (exported by Ray's metrics agent on every node).

Both stay because they answer different questions. `/metrics` reached through Serve's proxy is one
replica's view (whichever the router picked), which is what a single-replica server, a debugging session
or a llama-server-style scraper wants. The Ray export is the cluster-wide path: the agent on each node
exports every replica's series with Serve's deployment/replica tags, so a Prometheus that scrapes the
agents sees all replicas, and none goes missing between scrapes.

Counters and TTFT are recorded as requests finish (once per request, never per token); queue depth and
busy slots come from the engine's snapshot: sampled each second for Ray, read fresh for each scrape of
`/metrics`. The decode loop never touches a metric.
"""

from __future__ import annotations

from typing import Any

import prometheus_client as prom
from ray.serve import metrics as ray_metrics

from serving.request import FinishReason, Usage

TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
CONTENT_TYPE = prom.CONTENT_TYPE_LATEST


def _reason(reason: FinishReason | str) -> str:
    return reason.value if isinstance(reason, FinishReason) else str(reason)


class ReplicaMetrics:
    """The metrics this replica records, labelled with the served model's name (and, on `/metrics`, the
    replica, so a scrape through the proxy says which replica answered)."""

    def __init__(self, replica: str, model: str = "") -> None:
        self.replica, self.model = replica, model
        self.registry = prom.CollectorRegistry(auto_describe=True)
        labels = ("model", "replica")
        reg = self.registry
        self._prom = {
            "prompt": prom.Counter("llm_prompt_tokens", "Prompt tokens received.", labels, registry=reg),
            "cached": prom.Counter("llm_prompt_tokens_cached", "Prompt tokens served from a slot's cache.",
                                   labels, registry=reg),
            "generated": prom.Counter("llm_generated_tokens", "Tokens generated.", labels, registry=reg),
            "requests": prom.Counter("llm_requests", "Finished requests by finish reason.",
                                     (*labels, "reason"), registry=reg),
            "rejected": prom.Counter("llm_requests_rejected", "Requests turned away with 503 by cause.",
                                     (*labels, "cause"), registry=reg),
            "ttft": prom.Histogram("llm_time_to_first_token_s", "Time from arrival to first token.", labels,
                                   buckets=TTFT_BOUNDARIES_S, registry=reg),
            "queue": prom.Gauge("llm_queue_depth", "Requests waiting for a slot.", labels, registry=reg),
            "busy": prom.Gauge("llm_slots_busy", "Slots in use.", labels, registry=reg),
        }
        tags = ("model",)
        self._ray = {
            "prompt": ray_metrics.Counter("llm_prompt_tokens", description="Prompt tokens received.", tag_keys=tags),
            "cached": ray_metrics.Counter("llm_prompt_tokens_cached",
                                          description="Prompt tokens served from a slot's cache.", tag_keys=tags),
            "generated": ray_metrics.Counter("llm_generated_tokens", description="Tokens generated.", tag_keys=tags),
            "requests": ray_metrics.Counter("llm_requests", description="Finished requests by finish reason.",
                                            tag_keys=("model", "reason")),
            "rejected": ray_metrics.Counter("llm_requests_rejected",
                                            description="Requests turned away with 503 by cause.",
                                            tag_keys=("model", "cause")),
            "ttft": ray_metrics.Histogram("llm_time_to_first_token_s", description="Time from arrival to first token.",
                                          boundaries=TTFT_BOUNDARIES_S, tag_keys=tags),
            "queue": ray_metrics.Gauge("llm_queue_depth", description="Requests waiting for a slot.", tag_keys=tags),
            "busy": ray_metrics.Gauge("llm_slots_busy", description="Slots in use.", tag_keys=tags),
        }

    def _labels(self, **extra: str) -> tuple[dict[str, str], dict[str, str]]:
        """(prometheus labels, Ray tags) for the current model."""
        return {"model": self.model, "replica": self.replica, **extra}, {"model": self.model, **extra}

    def _inc(self, name: str, amount: float = 1, **extra: str) -> None:
        labels, tags = self._labels(**extra)
        self._prom[name].labels(**labels).inc(amount)
        self._ray[name].inc(amount, tags=tags)

    def record_request(self, usage: Usage | None, reason: FinishReason | str) -> None:
        """One request ended (any reason: stop, length, cancelled, error)."""
        if usage is not None:
            if usage.prompt_tokens:
                self._inc("prompt", usage.prompt_tokens)
            if usage.cached_tokens:
                self._inc("cached", usage.cached_tokens)
            if usage.completion_tokens:
                self._inc("generated", usage.completion_tokens)
            if usage.ttft_s is not None:
                labels, tags = self._labels()
                self._prom["ttft"].labels(**labels).observe(usage.ttft_s)
                self._ray["ttft"].observe(usage.ttft_s, tags=tags)
        self._inc("requests", reason=_reason(reason))

    def record_rejected(self, cause: str) -> None:
        """A request turned away before it reached a slot (`queue_full`, `engine_stopped`, `loading`)."""
        self._inc("rejected", cause=cause)

    def record_snapshot(self, stats: dict[str, Any]) -> None:
        labels, tags = self._labels()
        for name, key in (("queue", "queue_depth"), ("busy", "slots_busy")):
            self._prom[name].labels(**labels).set(stats[key])
            self._ray[name].set(stats[key], tags=tags)

    def exposition(self, stats: dict[str, Any] | None = None) -> bytes:
        """Prometheus text format of this replica's metrics; gauges refreshed from `stats` when given."""
        if stats is not None:
            self.record_snapshot(stats)
        return prom.generate_latest(self.registry)
