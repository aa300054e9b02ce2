"""What a trial measured, as one typed record from the measurement to the report.

A trial's figures travel three ways: Ray Tune passes a trial's result as a dict (its transport), the Optuna study
keeps them as user attributes (the record that outlives the run: a resumed study and `python -m tuning.report`
read them back), and the report and pick read them. `TrialResult` is the one shape all three use: `to_attrs` /
`from_attrs` are its projection to and from Optuna's user attributes (and Tune's dict), so a field is named once,
here, and read by attribute everywhere else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from measure.replay import ReplayFigures

MEM_UNKNOWN = 1e18  # the memory constraint of a trial that measured none (rejected, failed): infeasible by far
QUALITY_UNKNOWN = 1e9


class Objective(str, Enum):
    """The search's second objective; the first is always single-stream decode tok/s."""

    aggregate = "aggregate"  # the 4-way aggregate (the mission's figure)
    capacity = "capacity"  # the best aggregate up to the config's slots with every stream over a floor
    goodput = "goodput"  # a traffic workload's requests/s that met every latency target (measure/slo.py)

    @property
    def key(self) -> str:
        """The trial result's field for it (Optuna's metric name)."""
        return "goodput_rps" if self is Objective.goodput else f"{self.value}_tok_s"

    @property
    def label(self) -> str:
        return {Objective.aggregate: "4-way aggregate tok/s", Objective.capacity: "capacity tok/s",
                Objective.goodput: "goodput req/s"}[self]

    @property
    def first_label(self) -> str:
        """The first objective: the single stream's decode tok/s; on a workload, its median request's."""
        return "median stream" if self is Objective.goodput else "single stream"


@dataclass(frozen=True, kw_only=True)
class TrafficFigures:
    """A trial's replay of a traffic workload (measure/replay.py), as plain values a study can store: goodput,
    throughput, the SLO's outcome and the latency percentiles with their bootstrap spread."""

    workload: str
    requests: int
    failed: int
    goodput_rps: float
    goodput_tok_s: float
    throughput_rps: float
    output_tok_s: float
    median_stream_tok_s: float
    slo_met: bool
    slo_violation: float  # <= 0: met (the headroom); else the worst target's observed / bound - 1
    slo_outcome: str  # in words: "met (60/64 requests good)", "missed: ttft_p95 2.31s > 1.50s (+54%)"
    percentiles: dict[str, tuple[float, float, float, int]] = field(default_factory=dict)  # value, low, high, n
    errors: tuple[str, ...] = ()

    @classmethod
    def of(cls, replay: ReplayFigures) -> TrafficFigures:
        return cls(workload=replay.workload, requests=replay.requests, failed=replay.failed,
                   goodput_rps=replay.goodput_rps, goodput_tok_s=replay.goodput_tok_s,
                   throughput_rps=replay.throughput_rps, output_tok_s=replay.output_tok_s,
                   median_stream_tok_s=replay.median_stream_tok_s, slo_met=replay.slo.met,
                   slo_violation=replay.slo.violation, slo_outcome=replay.slo.describe(),
                   percentiles={k: (s.value, s.low, s.high, s.samples) for k, s in replay.percentiles.items()},
                   errors=replay.errors)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrafficFigures:
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        known["percentiles"] = {k: tuple(v) for k, v in (known.get("percentiles") or {}).items()}
        known["errors"] = tuple(known.get("errors") or ())
        return cls(**known)

    def percentile_text(self, name: str) -> str:
        """`ttft_p95` as "1.23 s [1.10-1.41]" (its bootstrap 5-95% range), or "-"."""
        if name not in self.percentiles:
            return "-"
        value, low, high, _ = self.percentiles[name]
        if value < 1.0:
            return f"{value * 1000:.0f} ms [{low * 1000:.0f}-{high * 1000:.0f}]"
        return f"{value:.2f} s [{low:.2f}-{high:.2f}]"


@dataclass(frozen=True, kw_only=True)
class SpeedFigures:
    """The speed alone (the confirmation round's re-measurements): single stream, 4-way, capacity if asked,
    goodput on a traffic workload."""

    single_tok_s: float
    aggregate_tok_s: float
    capacity_tok_s: float | None = None
    goodput_rps: float | None = None

    def second(self, objective: Objective) -> float:
        """The second objective's figure."""
        value = {Objective.capacity: self.capacity_tok_s, Objective.goodput: self.goodput_rps}.get(
            objective, self.aggregate_tok_s)
        return float(value or 0.0)


@dataclass(frozen=True, kw_only=True)
class CurvePoint:
    """One point of a capacity curve: `streams` at once, their aggregate tok/s, the slowest one's decode tok/s."""

    streams: int
    aggregate_tok_s: float
    slowest_tok_s: float


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What measuring an engine running a trial's config gives (tuning/objective.py's `measure_engine`)."""

    single_tok_s: float
    aggregate_tok_s: float
    ttft_ms: float
    prefill_tok_s: float
    nll: float
    nll_baseline: float
    mem_measured: int
    weight_loads: int
    weight_load_s: float
    capacity_tok_s: float | None = None
    capacity_streams: int | None = None
    capacity_curve: tuple[CurvePoint, ...] | None = None
    single_copy_tok_s: float | None = None
    traffic: TrafficFigures | None = None  # on a traffic workload: single / aggregate come from its replay
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    temperature_c: float | None = None
    throttle_reasons: str | None = None
    throttled: bool = False
    shared: bool = False
    # where the engine measured ran (serving.replica.node.node_label): trials spread over a cluster's nodes
    node: str = ""

    @property
    def nll_delta(self) -> float:
        return self.nll - self.nll_baseline


@dataclass(frozen=True, kw_only=True)
class MeasuredRun:
    """A measurement and what running it cost: the context rebuild, and in place how long the replica was held."""

    measurement: Measurement
    setup_s: float | None = None
    held_s: float | None = None
    buffers_mib: dict[str, dict[str, float]] | None = None  # llama.cpp's own (serving/engine/buffers.py), offline


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """One trial: the proposal, the memory prediction, what was measured (or why nothing was), the constraints."""

    params: dict[str, Any]
    n_ctx: int
    mem_predicted: int
    mem_budget: int
    mem_host_predicted: int | None = None  # on a GPU: what stays in host memory (weights, K/V, buffers)
    actor: str = ""
    rejected: str = ""  # why the config was refused without loading ("" = it ran)
    error: str = ""  # why it failed while running ("" = it did not)
    single_tok_s: float = 0.0
    aggregate_tok_s: float = 0.0
    capacity_tok_s: float | None = None
    capacity_streams: int | None = None
    capacity_curve: tuple[CurvePoint, ...] | None = None
    single_copy_tok_s: float | None = None
    workload: str = ""  # the traffic workload trials replay ("" = the fixed benchmark); set even when rejected
    goodput_rps: float | None = None  # the traffic's goodput, at the top level: Ray Tune's metric by name
    traffic: TrafficFigures | None = None
    ttft_ms: float | None = None
    prefill_tok_s: float | None = None
    nll: float | None = None
    nll_baseline: float | None = None
    nll_delta: float | None = None
    mem_measured: int | None = None
    buffers_mib: dict[str, dict[str, float]] | None = None  # llama.cpp's buffers (weights, K/V, compute) by type
    setup_s: float | None = None  # rebuilding the context (or loading, for a trial actor's first)
    held_s: float | None = None  # in place: how long the trial held its replica (clients waited up to this)
    weight_loads: int | None = None
    weight_load_s: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    temperature_c: float | None = None
    throttle_reasons: str | None = None
    throttled: bool = False
    shared: bool = False
    node: str = ""  # where the engine measured ran ("" = nothing ran)
    constraint_mem: float = MEM_UNKNOWN
    constraint_quality: float = QUALITY_UNKNOWN
    constraint_slo: float = QUALITY_UNKNOWN  # on a workload: the SLO's violation (<= 0: met)
    feasible: bool = False
    reused: bool = False  # the trial actor had measured this engine config already
    answered_from: int | None = None  # the study trial whose measurement answered this proposal
    is_baseline: bool = False
    pruned: bool = False  # its short measurement was clearly behind (tuning/prune.py): no full measurement
    short_single_tok_s: float | None = None  # the short measurement (pruning on), compared with other trials'
    short_second: float | None = None
    short_s: float | None = None  # seconds the short measurement took
    measure_s: float | None = None  # seconds the full measurement took (the context rebuild included)
    extra: dict[str, Any] = field(default_factory=dict)  # attributes of other versions, kept as read

    def measured(self, run: MeasuredRun, *, reused: bool = False) -> TrialResult:
        """This trial with a measurement in it."""
        m = run.measurement
        figures = {f.name: getattr(m, f.name) for f in fields(m)}
        goodput = m.traffic.goodput_rps if m.traffic is not None else self.goodput_rps
        return replace(self, **figures, nll_delta=m.nll_delta, setup_s=run.setup_s, held_s=run.held_s,
                       buffers_mib=run.buffers_mib, reused=reused, goodput_rps=goodput)

    def second(self, objective: Objective) -> float:
        """The second objective's figure (0 when not measured)."""
        if objective is Objective.goodput:
            return float(self.goodput_rps or 0.0)
        value = self.capacity_tok_s if objective is Objective.capacity else self.aggregate_tok_s
        return float(value or 0.0)

    def constrained(self, budget: int, max_quality_loss: float) -> TrialResult:
        """With Optuna's constraint values (feasible when <= 0) for the memory budget, the quality margin and, on
        a workload, the SLO; a trial that measured nothing violates them all."""
        mem = float(self.mem_measured - budget) if self.mem_measured is not None else MEM_UNKNOWN
        quality = float(self.nll_delta - max_quality_loss) if self.nll_delta is not None else QUALITY_UNKNOWN
        slo = (self.traffic.slo_violation if self.traffic is not None else QUALITY_UNKNOWN) if self.workload else 0.0
        return replace(self, constraint_mem=mem, constraint_quality=quality, constraint_slo=slo,
                       feasible=mem <= 0 and quality <= 0 and slo <= 0)

    def to_attrs(self) -> dict[str, Any]:
        """Optuna user attributes (and Ray Tune's result dict): JSON values, None left out."""
        attrs = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        if self.capacity_curve is not None:
            attrs["capacity_curve"] = [asdict(p) for p in self.capacity_curve]
        if self.traffic is not None:
            attrs["traffic"] = {**asdict(self.traffic), "errors": list(self.traffic.errors),
                                "percentiles": {k: list(v) for k, v in self.traffic.percentiles.items()}}
        return {**self.extra, **attrs}

    @classmethod
    def from_tune(cls, result: dict[str, Any]) -> TrialResult:
        """The record a trial sent through Ray Tune (its own keys; Tune's bookkeeping dropped). A searcher
        gets the dict flattened (`traffic/goodput_rps`): nested again first."""
        record = cls.from_attrs(_nested(result))
        return replace(record, extra={})

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> TrialResult:
        """The record back from user attributes; attributes it does not know are kept in `extra`."""
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in attrs.items() if k in names}
        if known.get("capacity_curve") is not None:
            known["capacity_curve"] = tuple(CurvePoint(**p) for p in known["capacity_curve"])
        if isinstance(known.get("traffic"), dict):
            known["traffic"] = TrafficFigures.from_dict(known["traffic"])
        known.setdefault("params", {})
        known.setdefault("n_ctx", 0)
        known.setdefault("mem_predicted", 0)
        known.setdefault("mem_budget", 0)
        return cls(**known, extra={k: v for k, v in attrs.items() if k not in names})


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """Ray Tune's flattened keys (`a/b/c`) as nested dicts again; other keys as they are."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
