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
from typing import Any

MEM_UNKNOWN = 1e18  # the memory constraint of a trial that measured none (rejected, failed): infeasible by far
QUALITY_UNKNOWN = 1e9


class Objective(str, Enum):
    """The search's second objective; the first is always single-stream decode tok/s."""

    aggregate = "aggregate"  # the 4-way aggregate (the mission's figure)
    capacity = "capacity"  # the best aggregate up to the config's slots with every stream over a floor

    @property
    def key(self) -> str:
        """The trial result's field for it (Optuna's metric name)."""
        return f"{self.value}_tok_s"

    @property
    def label(self) -> str:
        return "4-way aggregate tok/s" if self is Objective.aggregate else "capacity tok/s"


@dataclass(frozen=True, kw_only=True)
class SpeedFigures:
    """The speed alone (the confirmation round's re-measurements): single stream, 4-way, capacity if asked."""

    single_tok_s: float
    aggregate_tok_s: float
    capacity_tok_s: float | None = None

    def second(self, objective: Objective) -> float:
        """The second objective's figure."""
        value = self.capacity_tok_s if objective is Objective.capacity else self.aggregate_tok_s
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
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    temperature_c: float | None = None
    throttle_reasons: str | None = None
    throttled: bool = False
    shared: bool = False

    @property
    def nll_delta(self) -> float:
        return self.nll - self.nll_baseline


@dataclass(frozen=True, kw_only=True)
class MeasuredRun:
    """A measurement and what running it cost: the context rebuild, and in place how long the replica was held."""

    measurement: Measurement
    setup_s: float | None = None
    held_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """One trial: the proposal, the memory prediction, what was measured (or why nothing was), the constraints."""

    params: dict[str, Any]
    n_ctx: int
    mem_predicted: int
    mem_budget: int
    actor: str = ""
    rejected: str = ""  # why the config was refused without loading ("" = it ran)
    error: str = ""  # why it failed while running ("" = it did not)
    single_tok_s: float = 0.0
    aggregate_tok_s: float = 0.0
    capacity_tok_s: float | None = None
    capacity_streams: int | None = None
    capacity_curve: tuple[CurvePoint, ...] | None = None
    single_copy_tok_s: float | None = None
    ttft_ms: float | None = None
    prefill_tok_s: float | None = None
    nll: float | None = None
    nll_baseline: float | None = None
    nll_delta: float | None = None
    mem_measured: int | None = None
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
    constraint_mem: float = MEM_UNKNOWN
    constraint_quality: float = QUALITY_UNKNOWN
    feasible: bool = False
    reused: bool = False  # the trial actor had measured this engine config already
    answered_from: int | None = None  # the study trial whose measurement answered this proposal
    is_baseline: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # attributes of other versions, kept as read

    def measured(self, run: MeasuredRun, *, reused: bool = False) -> TrialResult:
        """This trial with a measurement in it."""
        m = run.measurement
        figures = {f.name: getattr(m, f.name) for f in fields(m)}
        return replace(self, **figures, nll_delta=m.nll_delta, setup_s=run.setup_s, held_s=run.held_s,
                       reused=reused)

    def second(self, objective: Objective) -> float:
        """The second objective's figure (0 when not measured)."""
        value = self.capacity_tok_s if objective is Objective.capacity else self.aggregate_tok_s
        return float(value or 0.0)

    def constrained(self, budget: int, max_quality_loss: float) -> TrialResult:
        """With Optuna's constraint values (feasible when <= 0) for the memory budget and the quality margin; a
        trial that measured nothing violates both."""
        mem = float(self.mem_measured - budget) if self.mem_measured is not None else MEM_UNKNOWN
        quality = float(self.nll_delta - max_quality_loss) if self.nll_delta is not None else QUALITY_UNKNOWN
        return replace(self, constraint_mem=mem, constraint_quality=quality, feasible=mem <= 0 and quality <= 0)

    def to_attrs(self) -> dict[str, Any]:
        """Optuna user attributes (and Ray Tune's result dict): JSON values, None left out."""
        attrs = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        if self.capacity_curve is not None:
            attrs["capacity_curve"] = [asdict(p) for p in self.capacity_curve]
        return {**self.extra, **attrs}

    @classmethod
    def from_tune(cls, result: dict[str, Any]) -> TrialResult:
        """The record a trial sent through Ray Tune (its own keys; Tune's bookkeeping dropped)."""
        record = cls.from_attrs(result)
        return replace(record, extra={})

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> TrialResult:
        """The record back from user attributes; attributes it does not know are kept in `extra`."""
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in attrs.items() if k in names}
        if known.get("capacity_curve") is not None:
            known["capacity_curve"] = tuple(CurvePoint(**p) for p in known["capacity_curve"])
        known.setdefault("params", {})
        known.setdefault("n_ctx", 0)
        known.setdefault("mem_predicted", 0)
        known.setdefault("mem_budget", 0)
        return cls(**known, extra={k: v for k, v in attrs.items() if k not in names})
