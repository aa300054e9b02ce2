"""What a trial measures, on serving's own Engine: the shared workload (measure/workload.py) plus quality.

Trials differ only in the engine config; the workload (prompts, generation length, greedy, warm-up,
medians, the TTFT definition) is the one the benchmark scripts run too.
"""

from __future__ import annotations

from importlib import resources

from measure.workload import Runner, Speed, Workload
from serving.engine import Engine

__all__ = ["Runner", "Speed", "Workload", "quality_tokens"]


def quality_tokens(engine: Engine) -> list[int]:
    """The shipped quality-probe text, tokenised for this model."""
    text = resources.files("tuning").joinpath("data/quality.txt").read_text(encoding="utf-8")
    return engine.tokenize_prompt(text)
