"""Prometheus metrics of one replica, through ray.serve.metrics (exported by Ray's metrics agent).

Token counters and TTFT are recorded as requests finish; queue depth and busy slots are sampled from the
engine's snapshot by a small background task, so the decode loop never touches a metric.
"""

from __future__ import annotations

from typing import Any

from ray.serve import metrics

from serving.request import Usage

_TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class ReplicaMetrics:
    """The metrics this replica exports; tagged with the served model's name."""

    def __init__(self, model_name: str) -> None:
        tags = ("model",)
        self._tags = {"model": model_name}
        self.prompt_tokens = metrics.Counter(
            "llm_prompt_tokens", description="Prompt tokens received.", tag_keys=tags)
        self.cached_prompt_tokens = metrics.Counter(
            "llm_prompt_tokens_cached", description="Prompt tokens served from a slot's cache.", tag_keys=tags)
        self.generated_tokens = metrics.Counter(
            "llm_generated_tokens", description="Tokens generated.", tag_keys=tags)
        self.requests = metrics.Counter(
            "llm_requests", description="Finished requests by finish reason.", tag_keys=("model", "reason"))
        self.ttft = metrics.Histogram(
            "llm_time_to_first_token_s", description="Time from arrival to first token.",
            boundaries=_TTFT_BOUNDARIES_S, tag_keys=tags)
        self.queue_depth = metrics.Gauge(
            "llm_queue_depth", description="Requests waiting for a slot.", tag_keys=tags)
        self.slots_busy = metrics.Gauge("llm_slots_busy", description="Slots in use.", tag_keys=tags)

    def record_request(self, usage: Usage, reason: str) -> None:
        tags = self._tags
        if usage.prompt_tokens:
            self.prompt_tokens.inc(usage.prompt_tokens, tags=tags)
        if usage.cached_tokens:
            self.cached_prompt_tokens.inc(usage.cached_tokens, tags=tags)
        if usage.completion_tokens:
            self.generated_tokens.inc(usage.completion_tokens, tags=tags)
        if usage.ttft_s is not None:
            self.ttft.observe(usage.ttft_s, tags=tags)
        self.requests.inc(1, tags={**self._tags, "reason": reason})

    def record_snapshot(self, stats: dict[str, Any]) -> None:
        self.queue_depth.set(stats["queue_depth"], tags=self._tags)
        self.slots_busy.set(stats["slots_busy"], tags=self._tags)
