"""/metrics over several replicas: their expositions merged into one valid Prometheus text; the names in base
units; the Grafana dashboard in deploy/grafana reads only metrics the app exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "llama-serve-tune.json"
PROMQL_WORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                          "group_left", "group_right", "inf", "nan"})


def exported_names() -> set[str]:
    """Every sample name a replica's exposition can hold, read off its registry (so a metric renamed or
    dropped in serving/replica/metrics.py is missed here at once): counters with `_total`, histograms with
    `_bucket`, `_sum` and `_count`, gauges as named."""
    from serving.replica.metrics import ReplicaMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix for family in ReplicaMetrics("r", "m").registry.collect()
            for suffix in suffixes[family.type]}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges, Grafana
    variables, groupings, function calls and keywords are taken out."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\{?\w+\}?", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    return {m.group(1) for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", expr)
            if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS}


def dashboard_queries(node: Any) -> Iterator[str]:
    """Every PromQL expression in a Grafana dashboard: panel targets (rows' panels too) and variable queries."""
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            yield node["expr"]
        if node.get("type") == "query" and isinstance(node.get("definition"), str):
            yield re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", node["definition"])
        for value in node.values():
            yield from dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_queries(item)


def test_metric_names_are_in_base_units() -> None:
    """Prometheus' naming rule: a duration is in seconds and says so (`_seconds`), never `_s` or `_ms`."""
    assert not [n for n in exported_names() if re.search(r"_(s|ms|us|ns|mins?|hours?)(_bucket|_sum|_count)?$", n)]
    assert "llm_time_to_first_token_seconds_bucket" in exported_names()


def test_dashboard_reads_only_metrics_the_app_exports() -> None:
    """deploy/grafana/llama-serve-tune.json: each query names at least one metric, and every metric it names is
    one a replica exports; every metric family the app exports but the config labels appears somewhere."""
    exported = exported_names()
    queries = list(dashboard_queries(json.loads(DASHBOARD.read_text())))
    assert len(queries) > 10
    unknown = {q: sorted(metric_names(q) - exported) for q in queries if metric_names(q) - exported}
    assert not unknown, unknown
    assert all(metric_names(q) for q in queries), [q for q in queries if not metric_names(q)]
    used = set().union(*(metric_names(q) for q in queries))
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in exported}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert families - shown <= {"llm_request_params_n", "llm_spec_draft_tokens", "llm_spec_accepted_tokens"}


def test_promql_names_are_read_past_functions_labels_and_variables() -> None:
    expr = ('histogram_quantile(0.95, sum by (le) (rate(llm_x_bucket{model=~"$model", replica="a b"}'
            '[$__rate_interval]))) / on (replica) group_left sum without (le) (llm_y) > bool 0')
    assert metric_names(expr) == {"llm_x_bucket", "llm_y"}
