"""Metrics of one replica, in two sinks: Prometheus text on `/metrics`, and `ray.serve.metrics` (exported by
Ray's metrics agent on every node).

Both stay because they answer different questions. `/metrics` answers with every replica's series (each
labelled with its replica; the replica that takes the scrape asks the others, `merge_expositions` joins
them), which is what a llama-server-style scraper of the app's one address wants. The Ray export is the
cluster-wide path that needs no replica to answer: the agent on each node exports every replica's series with
Serve's deployment/replica tags, so a Prometheus that scrapes the agents misses none between scrapes.

Counters and TTFT are recorded as requests finish (once per request, never per token). The per-request
token histograms (vLLM's request_prompt_tokens / request_generation_tokens / request_params_n) come from the
engine's traffic record (serving/engine/traffic.py): one sample per client request, all its choices counted, taken
with the snapshot. Queue depth and busy slots come from the engine's snapshot: sampled each second for Ray,
read fresh for each scrape of `/metrics`. The decode loop never touches a metric.
"""

from __future__ import annotations

from typing import Any

import prometheus_client as prom
from ray.serve import metrics as ray_metrics

from serving.engine.request import FinishReason, Usage
from serving.engine.stats import EngineStats
from serving.engine.traffic import N_EDGES, TOKEN_EDGES, RequestShape
from serving.replica.affinity import RoutedBy

TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
E2E_BOUNDARIES_S = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0]
ITL_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0]
CONFIG_LABELS = ("n_parallel", "n_ctx", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn", "spec_mode")
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
        self._prom: dict[str, Any] = {
            "prompt": prom.Counter("llm_prompt_tokens", "Prompt tokens received.", labels, registry=reg),
            "cached": prom.Counter("llm_prompt_tokens_cached", "Prompt tokens served from a slot's cache.",
                                   labels, registry=reg),
            "generated": prom.Counter("llm_generated_tokens", "Tokens generated.", labels, registry=reg),
            "requests": prom.Counter("llm_requests", "Finished requests by finish reason.",
                                     (*labels, "reason"), registry=reg),
            "rejected": prom.Counter("llm_requests_rejected", "Requests turned away with 503 by cause.",
                                     (*labels, "cause"), registry=reg),
            "routed": prom.Counter("llm_requests_routed", "Requests the router sent here, by why: affinity (this "
                                   "replica held the longest prefix of the prompt), load (none held enough), "
                                   "imbalance (its holder was too busy), overflow (picked for another replica).",
                                   (*labels, "by"), registry=reg),
            "ttft": prom.Histogram("llm_time_to_first_token_seconds", "Time from arrival to first token.",
                                   labels, buckets=TTFT_BOUNDARIES_S, registry=reg),
            "e2e": prom.Histogram("llm_e2e_request_latency_seconds", "Time from arrival to the last token.",
                                  labels, buckets=E2E_BOUNDARIES_S, registry=reg),
            "itl": prom.Histogram("llm_inter_token_latency_seconds", "Mean time between tokens, one sample per "
                                  "request.", labels, buckets=ITL_BOUNDARIES_S, registry=reg),
            "prompt_len": prom.Histogram("llm_request_prompt_tokens", "Prompt tokens of each finished request.",
                                         labels, buckets=TOKEN_EDGES, registry=reg),
            "output_len": prom.Histogram("llm_request_generation_tokens", "Tokens generated for each finished "
                                         "request, all its choices.", labels, buckets=TOKEN_EDGES, registry=reg),
            "n": prom.Histogram("llm_request_params_n", "Choices (n) of each finished request.", labels,
                                buckets=N_EDGES, registry=reg),
            "queue": prom.Gauge("llm_queue_depth", "Requests waiting for a slot.", labels, registry=reg),
            "busy": prom.Gauge("llm_slots_busy", "Slots in use.", labels, registry=reg),
            "kv": prom.Gauge("llm_kv_cells_used", "K/V cells holding tokens, all slots.", labels, registry=reg),
            "kv_total": prom.Gauge("llm_kv_cells", "K/V cells allocated, all slots.", labels, registry=reg),
            "config": prom.Gauge("llm_engine_config", "The running engine config (value 1; the config in labels).",
                                 (*labels, *CONFIG_LABELS), registry=reg),
            "drafted": prom.Counter("llm_spec_draft_tokens", "Speculative guesses verified.", labels, registry=reg),
            "accepted": prom.Counter("llm_spec_accepted_tokens", "Speculative guesses kept.", labels, registry=reg),
            "acceptance": prom.Gauge("llm_spec_acceptance_rate", "Guesses kept / verified, since the engine started.",
                                     labels, registry=reg),
            "cache_hits": prom.Counter("llm_prompt_cache_hits", "Prompts whose saved state was restored from host "
                                       "RAM into a slot.", labels, registry=reg),
            "cache_hit_tokens": prom.Counter("llm_prompt_cache_hit_tokens", "Prompt tokens restored from host RAM "
                                             "instead of prefilled.", labels, registry=reg),
            "cache_evictions": prom.Counter("llm_prompt_cache_evictions", "Saved prompt states dropped to stay "
                                            "within cache_ram_mib.", labels, registry=reg),
            "cache_saves": prom.Counter("llm_prompt_cache_saves", "Slot states saved to host RAM.", labels,
                                        registry=reg),
            "cache_skipped": prom.Counter("llm_prompt_cache_skipped_saves", "Saves priced out: a stored state "
                                          "covered all but what prefills faster than the copy.", labels,
                                          registry=reg),
            "cache_bytes": prom.Gauge("llm_prompt_cache_bytes", "Host RAM held by saved prompt states.", labels,
                                      registry=reg),
            "cache_entries": prom.Gauge("llm_prompt_cache_entries", "Saved prompt states.", labels, registry=reg),
        }
        tags = ("model",)
        # Ray annotates tag_keys as a one-element tuple; any length works (hence two type: ignore below)
        self._ray: dict[str, Any] = {
            "prompt": ray_metrics.Counter("llm_prompt_tokens", description="Prompt tokens received.", tag_keys=tags),
            "cached": ray_metrics.Counter("llm_prompt_tokens_cached",
                                          description="Prompt tokens served from a slot's cache.", tag_keys=tags),
            "generated": ray_metrics.Counter("llm_generated_tokens", description="Tokens generated.", tag_keys=tags),
            "requests": ray_metrics.Counter("llm_requests", description="Finished requests by finish reason.",
                                            tag_keys=("model", "reason")),  # type: ignore[arg-type]
            "rejected": ray_metrics.Counter("llm_requests_rejected",
                                            description="Requests turned away with 503 by cause.",
                                            tag_keys=("model", "cause")),  # type: ignore[arg-type]
            "routed": ray_metrics.Counter("llm_requests_routed", description="Requests the router sent here, by "
                                          "why (affinity, load, imbalance, overflow).",
                                          tag_keys=("model", "by")),  # type: ignore[arg-type]
            "ttft": ray_metrics.Histogram("llm_time_to_first_token_seconds", description="Time from arrival to "
                                          "first token.", boundaries=TTFT_BOUNDARIES_S, tag_keys=tags),
            "e2e": ray_metrics.Histogram("llm_e2e_request_latency_seconds", description="Time from arrival to the "
                                         "last token.", boundaries=E2E_BOUNDARIES_S, tag_keys=tags),
            "itl": ray_metrics.Histogram("llm_inter_token_latency_seconds", description="Mean time between tokens, "
                                         "one sample per request.", boundaries=ITL_BOUNDARIES_S, tag_keys=tags),
            "prompt_len": ray_metrics.Histogram("llm_request_prompt_tokens", description="Prompt tokens of each "
                                                "finished request.", boundaries=list(TOKEN_EDGES), tag_keys=tags),
            "output_len": ray_metrics.Histogram("llm_request_generation_tokens", description="Tokens generated for "
                                                "each finished request, all its choices.",
                                                boundaries=list(TOKEN_EDGES), tag_keys=tags),
            "n": ray_metrics.Histogram("llm_request_params_n", description="Choices (n) of each finished request.",
                                       boundaries=list(N_EDGES), tag_keys=tags),
            "queue": ray_metrics.Gauge("llm_queue_depth", description="Requests waiting for a slot.", tag_keys=tags),
            "busy": ray_metrics.Gauge("llm_slots_busy", description="Slots in use.", tag_keys=tags),
            "kv": ray_metrics.Gauge("llm_kv_cells_used", description="K/V cells holding tokens.", tag_keys=tags),
            "kv_total": ray_metrics.Gauge("llm_kv_cells", description="K/V cells allocated.", tag_keys=tags),
            "drafted": ray_metrics.Counter("llm_spec_draft_tokens", description="Speculative guesses verified.",
                                           tag_keys=tags),
            "accepted": ray_metrics.Counter("llm_spec_accepted_tokens", description="Speculative guesses kept.",
                                            tag_keys=tags),
            "acceptance": ray_metrics.Gauge("llm_spec_acceptance_rate", description="Guesses kept / verified, "
                                            "since the engine started.", tag_keys=tags),
            "cache_hits": ray_metrics.Counter("llm_prompt_cache_hits", description="Prompts whose saved state "
                                              "was restored from host RAM into a slot.", tag_keys=tags),
            "cache_hit_tokens": ray_metrics.Counter("llm_prompt_cache_hit_tokens", description="Prompt tokens "
                                                    "restored from host RAM instead of prefilled.", tag_keys=tags),
            "cache_evictions": ray_metrics.Counter("llm_prompt_cache_evictions", description="Saved prompt states "
                                                   "dropped to stay within cache_ram_mib.", tag_keys=tags),
            "cache_saves": ray_metrics.Counter("llm_prompt_cache_saves", description="Slot states saved to host "
                                               "RAM.", tag_keys=tags),
            "cache_skipped": ray_metrics.Counter("llm_prompt_cache_skipped_saves", description="Saves priced "
                                                 "out: a stored state covered all but what prefills faster than "
                                                 "the copy.", tag_keys=tags),
            "cache_bytes": ray_metrics.Gauge("llm_prompt_cache_bytes", description="Host RAM held by saved "
                                             "prompt states.", tag_keys=tags),
            "cache_entries": ray_metrics.Gauge("llm_prompt_cache_entries", description="Saved prompt states.",
                                               tag_keys=tags),
        }
        self._seen: dict[str, int] = {}  # the engine's totals at the last snapshot, by counter

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
                self._observe("ttft", usage.ttft_s)
                self._observe("e2e", usage.ttft_s + usage.decode_s)
            if usage.completion_tokens > 1 and usage.decode_s > 0:
                self._observe("itl", usage.decode_s / (usage.completion_tokens - 1))
        self._inc("requests", reason=_reason(reason))

    def _observe(self, name: str, value: float) -> None:
        labels, tags = self._labels()
        self._prom[name].labels(**labels).observe(value)
        self._ray[name].observe(value, tags=tags)

    def record_shapes(self, shapes: list[RequestShape]) -> None:
        """Client requests the traffic record has taken since the last call: one sample each."""
        for shape in shapes:
            self._observe("prompt_len", shape.prompt_tokens)
            self._observe("output_len", shape.output_tokens)
            self._observe("n", shape.n)

    def record_rejected(self, cause: str) -> None:
        """A request turned away before it reached a slot (`queue_full`, `engine_stopped`, `loading`)."""
        self._inc("rejected", cause=cause)

    def record_routed(self, by: RoutedBy) -> None:
        """A relayed request arrived with the router's note of why it came here (serving/replica/routing.py)."""
        self._inc("routed", by=by.value)

    def record_snapshot(self, stats: EngineStats) -> None:
        labels, tags = self._labels()
        values = {"queue": stats.queue_depth, "busy": stats.slots_busy, "kv": stats.cells_cached,
                  "kv_total": stats.n_ctx_slot * len(stats.slots)}
        for name, value in values.items():
            self._prom[name].labels(**labels).set(value)
            self._ray[name].set(value, tags=tags)
        self._record_speculation(stats)
        self._record_prompt_cache(stats)
        config = stats.config.to_yaml_dict()
        self._prom["config"].clear()
        self._prom["config"].labels(**labels, **{k: str(config.get(k, "")) for k in CONFIG_LABELS}).set(1)

    def _record_speculation(self, stats: EngineStats) -> None:
        """The engine counts guesses since it started; the counters here grow by what it counted since the
        last snapshot (all of it after an engine restart, whose totals start again)."""
        self._grow("drafted", stats.counters.spec_drafted)
        self._grow("accepted", stats.counters.spec_accepted)
        if stats.spec_acceptance is not None:
            labels, tags = self._labels()
            self._prom["acceptance"].labels(**labels).set(stats.spec_acceptance)
            self._ray["acceptance"].set(stats.spec_acceptance, tags=tags)

    def _record_prompt_cache(self, stats: EngineStats) -> None:
        cache = stats.prompt_cache
        if cache is None:
            return
        self._grow("cache_hits", cache.hits)
        self._grow("cache_hit_tokens", cache.hit_tokens)
        self._grow("cache_evictions", cache.evictions)
        self._grow("cache_saves", cache.saves)
        self._grow("cache_skipped", cache.skipped)
        labels, tags = self._labels()
        for name, value in (("cache_bytes", cache.bytes), ("cache_entries", cache.entries)):
            self._prom[name].labels(**labels).set(value)
            self._ray[name].set(value, tags=tags)

    def _grow(self, name: str, total: int) -> None:
        """Counter `name` grows by what the engine's `total` gained since the last snapshot (all of it after
        an engine restart, whose totals start again)."""
        seen = self._seen.get(name, 0)
        delta = total - seen if total >= seen else total
        if delta:
            self._inc(name, delta)
        self._seen[name] = total

    def exposition(self, stats: EngineStats | None = None) -> bytes:
        """Prometheus text format of this replica's metrics; gauges refreshed from `stats` when given."""
        if stats is not None:
            self.record_snapshot(stats)
        return prom.generate_latest(self.registry)


def merge_expositions(texts: list[str]) -> str:
    """Several replicas' Prometheus text as one: each metric family's HELP and TYPE once, then every replica's
    samples of it (their `replica` labels keep them apart), families in the order first seen."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for text in texts:
        family = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                families.setdefault(family, [])
                if line not in families[family]:
                    families[family].append(line)
            elif line.strip():
                samples.setdefault(family, []).append(line)
    out = []
    for family, head in families.items():
        out += head + samples.get(family, [])
    return "\n".join(out) + "\n"
