"""What a trial measures, on serving's own Engine: single-stream and 4-way decode, TTFT, prefill, quality.

The workloads are fixed (prompt set, generation length, EOS ignored, greedy) so trials differ only in the
engine config. Each is warmed up once, then repeated and the median kept: these machines are noisy.
Every prompt starts with a different request number, so no run is flattered by a slot's prefix cache.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from importlib import resources

from serving.engine import Engine
from serving.request import SamplingParams

PROMPT = (
    "Request {n}. Write a detailed, practical guide to maintaining a small vegetable garden through the "
    "seasons: soil preparation, choosing what to plant, watering, dealing with pests, harvesting and "
    "storing the crop, and preparing the beds for winter. Use clear headings and short paragraphs."
)


@dataclass(frozen=True)
class Workload:
    """The fixed measurement plan of every trial."""

    gen_tokens: int = 64
    concurrency: int = 4
    repeats: int = 3

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.gen_tokens, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Speed:
    """Medians over the repeats."""

    single_tok_s: float
    aggregate_tok_s: float
    ttft_ms: float
    prefill_tok_s: float


def quality_tokens(engine: Engine) -> list[int]:
    """The shipped quality-probe text, tokenised for this model."""
    text = resources.files("tuning").joinpath("data/quality.txt").read_text(encoding="utf-8")
    return engine.tokenize_prompt(text)


class Runner:
    """Runs the workloads on one engine; request numbers keep counting across trials (fresh prefixes)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self._n = 0

    def _prompt(self, engine: Engine) -> list[int]:
        self._n += 1
        return engine.tokenize_prompt(PROMPT.format(n=self._n))

    def single(self, engine: Engine) -> tuple[float, float, float]:
        """One stream alone: (decode tok/s, TTFT s, prefill tok/s)."""
        tokens = self._prompt(engine)
        last = None
        for chunk in engine.submit(tokens, self.workload.params()):
            last = chunk
        usage = last.usage
        if last.finish_reason != "length" or usage.decode_tok_s is None:
            raise RuntimeError(f"the single-stream run ended with {last.finish_reason}: {last.error}")
        evaluated = usage.prompt_tokens - usage.cached_tokens
        return usage.decode_tok_s, usage.ttft_s, evaluated / usage.ttft_s

    def concurrent(self, engine: Engine) -> float:
        """`concurrency` streams at once: total generated tokens / wall time (queueing included)."""
        prompts = [self._prompt(engine) for _ in range(self.workload.concurrency)]
        t0 = time.perf_counter()
        handles = [engine.submit(p, self.workload.params()) for p in prompts]
        total = 0
        for handle in handles:
            for chunk in handle:
                if chunk.finish_reason == "error":
                    raise RuntimeError(f"a concurrent stream failed: {chunk.error}")
                total += len(chunk.token_ids)
        return total / (time.perf_counter() - t0)

    def measure(self, engine: Engine) -> Speed:
        self.single(engine)  # warm-up: first-use allocations, graph building, CPU caches
        self.concurrent(engine)
        singles = [self.single(engine) for _ in range(self.workload.repeats)]
        aggregates = [self.concurrent(engine) for _ in range(self.workload.repeats)]
        return Speed(
            single_tok_s=statistics.median(s[0] for s in singles),
            aggregate_tok_s=statistics.median(aggregates),
            ttft_ms=statistics.median(s[1] for s in singles) * 1e3,
            prefill_tok_s=statistics.median(s[2] for s in singles),
        )
