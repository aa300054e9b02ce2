"""/metrics over several replicas: their expositions merged into one valid Prometheus text."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine  # serving.replica.metrics imports Ray's metrics module


def test_replicas_expositions_merge_into_one_valid_text() -> None:
    """/metrics over several replicas: each family's HELP and TYPE once, every replica's samples under it."""
    from prometheus_client.parser import text_string_to_metric_families

    from serving.replica.metrics import ReplicaMetrics, merge_expositions
    from serving.engine.request import FinishReason, Usage

    texts = []
    for name in ("r1", "r2"):
        metrics = ReplicaMetrics(name, "m")
        metrics.record_request(Usage(prompt_tokens=3, completion_tokens=2), FinishReason.stop)
        texts.append(metrics.exposition().decode())
    merged = merge_expositions(texts)
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    generated = families["llm_generated_tokens"]
    assert sorted(s.labels["replica"] for s in generated.samples if s.name.endswith("_total")) == ["r1", "r2"]
    assert merged.count("# TYPE llm_generated_tokens_total counter") + merged.count(
        "# TYPE llm_generated_tokens counter") == 1
