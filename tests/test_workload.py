"""The shared workload's capacity figure (measure/workload.py): the curve's stream counts, the floor, and
a real measurement on the embedded model."""

from __future__ import annotations

from serving.engine import Engine
from measure.workload import Capacity, CapacityPoint, Runner, Workload, capacity_levels


def test_the_curve_runs_at_powers_of_two_and_the_slot_count() -> None:
    assert capacity_levels(1) == [1]
    assert capacity_levels(4) == [1, 2, 4]
    assert capacity_levels(6) == [1, 2, 4, 6]
    assert capacity_levels(16) == [1, 2, 4, 8, 16]


def test_capacity_is_the_best_aggregate_whose_slowest_stream_keeps_the_floor() -> None:
    curve = [CapacityPoint(1, 60.0, 60.0), CapacityPoint(2, 100.0, 48.0), CapacityPoint(4, 150.0, 35.0),
             CapacityPoint(8, 200.0, 22.0)]
    assert Capacity.of(30.0, curve).tok_s == 150.0 and Capacity.of(30.0, curve).streams == 4
    assert Capacity.of(20.0, curve).streams == 8
    none = Capacity.of(100.0, curve)
    assert none.tok_s == 0.0 and none.streams == 0 and len(none.curve) == 4


def test_capacity_measured_on_the_engine(engine: Engine) -> None:
    runner = Runner(Workload(gen_tokens=8, repeats=1))
    low = runner.capacity(engine, engine.config.n_parallel, floor_tok_s=0.1)
    assert [p.streams for p in low.curve] == capacity_levels(engine.config.n_parallel)
    assert low.tok_s > 0 and low.streams in capacity_levels(engine.config.n_parallel)
    assert all(p.aggregate_tok_s > 0 and p.slowest_tok_s > 0 for p in low.curve)
    assert runner.capacity(engine, 2, floor_tok_s=1e9).tok_s == 0.0


def test_provenance_takes_the_commit_it_is_told(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On the GPU machine the tree's .git may be an older copy: LLAMA_SERVE_TUNE_COMMIT says what ran."""
    from measure.provenance import COMMIT_ENV, commit, provenance

    assert commit() != "feedc0de"
    monkeypatch.setenv(COMMIT_ENV, "feedc0de")
    assert commit() == "feedc0de" and provenance()["commit"] == "feedc0de"
