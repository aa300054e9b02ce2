"""The tuner through its real code: the CLI end to end on CPU, the memory budget, bad input, live write-back,
and the pieces it is built from (search space rules, memory model, Pareto pick)."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from serving.engine.config import (CacheType, CpuRepack, EngineConfig, FlashAttn, SpecMode, embedded_model_path,
                            load_engine_config)
from serving.engine.memory import GPU_PROCESS_HOST_OVERHEAD, ModelShape, kv_cache_bytes, predict
from serving.engine.units import GiB, MiB, parse_bytes
from tuning.report import TrialRow, best_curves, markdown, pareto_front, pick, plot_capacity, trial_table
from tuning.results import TrialResult
from tuning.space import SearchSpace, suggest, to_engine_config
from tests.helpers import script_module

SMALL_SPACE = {
    "n_parallel": [1, 2], "n_batch": [256, 512], "n_ubatch": [256], "ctx_per_slot": [1024],
    "type_k": ["f16", "q8_0"], "type_v": ["f16", "q8_0"], "flash_attn": ["on"],
}
# --prune-below 0.01: every trial is measured short first and gets its bar (tuning/prune.py), but none is that far
# behind, so these tests read every trial's full figures
FAST = ["--gen-tokens", "8", "--repeats", "1", "--min-ctx-per-slot", "1024", "--no-apply", "--offline",
        "--prune-below", "0.01"]


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    """The embedded model's shape from its GGUF header: seconds to read, so the tests using it are in lane engine."""
    return ModelShape.from_gguf(embedded_model_path())


def write_space(path: Path, space: dict) -> Path:
    path.write_text(yaml.safe_dump(space))
    return path


def tuner_args(tmp_path: Path, space: dict, *extra: str) -> list[str]:
    return ["--space", str(write_space(tmp_path / "space.yaml", space)), "--results-dir", str(tmp_path),
            "--out", str(tmp_path / "tuned.yaml"), "--study-name", "t", *FAST, *extra]


def load_trials(tmp_path: Path) -> list:
    import optuna

    study = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    return study.trials


# -- the CLI end to end -----------------------------------------------------------------------------
@pytest.mark.serve
@pytest.mark.timeout(300)
def test_search_runs_end_to_end_and_writes_a_loadable_config(ray_session: None, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    from tuning.search import main

    assert main(["--trials", "3", *tuner_args(tmp_path, SMALL_SPACE)]) == 0
    # the pick line, tuned.yaml's header and the report's winner say the same (the confirmed figures)
    summary = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("pick: "))[len("pick: "):]
    assert f"# {summary}\n" in (tmp_path / "tuned.yaml").read_text()
    assert summary in (tmp_path / "t" / "report.md").read_text()

    tuned = load_engine_config(tmp_path / "tuned.yaml")
    assert tuned.n_parallel in (1, 2) and tuned.n_batch in (256, 512) and tuned.n_ubatch == 256
    assert tuned.n_ctx == 1024 * tuned.n_parallel and tuned.flash_attn == FlashAttn.on
    assert tuned.type_k in (CacheType.f16, CacheType.q8_0) and tuned.type_v in (CacheType.f16, CacheType.q8_0)
    report = (tmp_path / "t" / "report.md").read_text()
    assert "# Tuning report" in report and "## Winner" in report and "## Pareto front" in report
    assert (tmp_path / "t" / "pareto.png").stat().st_size > 1000

    trials = load_trials(tmp_path)
    assert len(trials) == 3 and all(t.state.name == "COMPLETE" for t in trials)
    for t in trials:
        a = t.user_attrs
        assert a["single_tok_s"] > 0 and a["aggregate_tok_s"] > 0 and a["ttft_ms"] > 0
        assert a["mem_predicted"] > 0 and a["mem_measured"] > 0 and a["rejected"] == "" and a["error"] == ""
        assert a["nll"] > 0 and abs(a["nll_delta"]) < 0.5
        assert a["params"]["ctx_per_slot"] == 1024 and a["n_ctx"] == 1024 * a["params"]["n_parallel"]
        assert a["weight_loads"] == 1  # the actor is reused: later trials rebuild only the context
        assert a["short_single_tok_s"] > 0 and a["short_s"] > 0 and not a["pruned"]  # measured short first
        buffers = a["buffers_mib"]  # llama.cpp's own sizes, the weights' kept from the load across rebuilds
        assert buffers["model"] and buffers["KV"] and buffers["compute"], buffers
    # the written config is the one a trial measured
    winner_params = [t.user_attrs["params"] for t in trials]
    assert any(to_engine_config(p, EngineConfig()).model_dump(exclude={"seed"}) ==
               tuned.model_dump(exclude={"seed"}) for p in winner_params)


@pytest.mark.serve
@pytest.mark.timeout(300)
def test_tight_budget_rejects_big_contexts_without_loading(ray_session: None, tmp_path: Path,
                                                           shape: ModelShape) -> None:
    from tuning.search import main

    space = {"n_parallel": [1, 4], "n_batch": [256], "n_ubatch": [256], "ctx_per_slot": [1024, 8192],
             "type_k": ["f16"], "type_v": ["f16"], "flash_attn": ["on"]}

    def need(n_parallel: int, ctx: int) -> int:
        params = {"n_parallel": n_parallel, "n_batch": 256, "n_ubatch": 256, "ctx_per_slot": ctx,
                  "type_k": "f16", "type_v": "f16", "flash_attn": "on"}
        return predict(shape, to_engine_config(params, EngineConfig()), on_gpu=False).total

    # between the largest 1024-per-slot config and the smallest 8192-per-slot one
    small, big = need(4, 1024), need(1, 8192)
    assert small < big
    budget = (small + big) // 2
    assert main(["--trials", "6", "--vram-budget", str(budget), *tuner_args(tmp_path, space)]) == 0

    trials = load_trials(tmp_path)
    assert len([t for t in trials if "answered_from" not in t.user_attrs]) == 6, "Tune ran 6 trials"
    rejected = [t for t in trials if t.user_attrs["rejected"]]
    ran = [t for t in trials if not t.user_attrs["rejected"]]
    assert rejected and ran, "the seeded sampler should propose both kinds of point"
    for t in rejected:
        a = t.user_attrs
        assert a["rejected"] == "predicted memory over budget"
        assert a["params"]["ctx_per_slot"] == 8192 and a["mem_predicted"] > budget
        assert a["single_tok_s"] == 0 and "mem_measured" not in a and not a["feasible"]
    for t in ran:
        a = t.user_attrs
        assert a["params"]["ctx_per_slot"] == 1024 and a["mem_predicted"] <= budget
        assert a["single_tok_s"] > 0 and 0 < a["mem_measured"] <= budget and a["feasible"]
    tuned = load_engine_config(tmp_path / "tuned.yaml")
    assert tuned.n_ctx_per_slot == 1024
    assert predict(shape, tuned, on_gpu=False).total <= budget


# -- bad input: exit code 2, a message, no traceback, no hang -----------------------------------------
@pytest.mark.engine
@pytest.mark.timeout(120)
def test_unknown_flag_value_is_an_argparse_error(capsys: pytest.CaptureFixture) -> None:
    from tuning.search import main

    with pytest.raises(SystemExit) as info:
        main(["--prefer", "fastest"])
    assert info.value.code == 2
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


@pytest.mark.serve
@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra,message", [
    (["--vram-budget", "1MiB"], "impossible space"),
    (["--model", "/nonexistent.gguf"], "/nonexistent.gguf does not exist"),
    (["--device", "gpu"], "has no GPU"),
    (["--vram-budget", "lots"], "cannot read 'lots' as a size"),
    (["--min-ctx-per-slot", "100000"], "over the model's trained context of 8192"),
], ids=["impossible-budget", "no-model", "no-gpu", "bad-size", "min-ctx-too-big"])
def test_bad_input_returns_2_with_a_clear_message(ray_session: None, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  extra: list[str], message: str) -> None:
    from tuning.search import main

    args = ["--trials", "1", "--results-dir", str(tmp_path), "--out", str(tmp_path / "tuned.yaml"), "--no-apply",
            "--offline"]
    t0 = time.monotonic()
    assert main(args + extra) == 2
    assert time.monotonic() - t0 < 60
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "tuned.yaml").exists() and not (tmp_path / "optuna.db").exists()


# -- write-back --------------------------------------------------------------------------------------
@pytest.mark.unit
def test_write_config_is_atomic_and_reads_back_equal(tmp_path: Path) -> None:
    from tuning.writeback import write_config

    path = tmp_path / "sub" / "tuned.yaml"
    first = EngineConfig(n_parallel=2, n_ctx=4096, n_batch=512, n_ubatch=256, type_k="q8_0", type_v="q8_0",
                         flash_attn="on", seed=7)
    write_config(path, first, header="line one\nline two")
    assert load_engine_config(path) == first
    assert path.read_text().startswith("# Written by python -m tuning.search") and "# line two" in path.read_text()
    second = first.model_copy(update={"n_parallel": 8, "n_ctx": 8192})
    write_config(path, second)
    assert load_engine_config(path) == second
    assert [p.name for p in path.parent.iterdir()] == ["tuned.yaml"]  # no temp file left behind


@pytest.mark.unit
def test_write_config_failure_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from tuning import writeback

    path = tmp_path / "tuned.yaml"
    old = EngineConfig(n_parallel=1, n_ctx=1024)
    writeback.write_config(path, old)

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        writeback.write_config(path, EngineConfig(n_parallel=2, n_ctx=2048))
    assert load_engine_config(path) == old
    assert [p.name for p in tmp_path.iterdir()] == ["tuned.yaml"]


def _slots(serve_url: str) -> dict:
    return httpx.get(f"{serve_url}/slots", timeout=30).json()


@pytest.mark.serve
@pytest.mark.timeout(300)
def test_live_apply_switches_the_running_app_without_failing_a_request(serve_url: str) -> None:
    from tuning.writeback import apply_to_serve

    before = _slots(serve_url)
    original = EngineConfig(**before["config"])
    new = original.model_copy(update={"n_parallel": 2, "n_ctx": 2048, "n_batch": 512})
    assert new != original
    statuses: list[int] = []
    errors: list[str] = []
    stop = threading.Event()
    switched_at: list[int] = []
    spans: list[tuple[float, float]] = []  # (sent, answered) of each request

    def client(i: int) -> None:
        with httpx.Client(timeout=60) as http:
            n = 0
            while not stop.is_set() and len(statuses) < 200:
                start = time.monotonic()
                try:
                    r = http.post(f"{serve_url}/v1/completions",
                                  json={"prompt": f"Client {i}, request {n}: the weather is", "max_tokens": 4})
                    statuses.append(r.status_code)
                    spans.append((start, time.monotonic()))
                    if r.status_code != 200:
                        errors.append(r.text)
                except httpx.HTTPError as exc:
                    statuses.append(-1)
                    errors.append(repr(exc))
                n += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(statuses) < 3 and time.monotonic() < deadline:  # traffic is flowing before the switch
            time.sleep(0.05)
        t0 = time.monotonic()
        result = apply_to_serve(new, app_name="llama", timeout_s=120)
        switch_s = time.monotonic() - t0
        switched_at.append(len(statuses))
        time.sleep(2.0)  # and keeps flowing after it
        stop.set()
        for t in threads:
            t.join(60)
        print(f"live apply took {switch_s:.1f} s; {len(statuses)} requests, {switched_at[0]} before the switch ended")
        assert result.applied, result.message
        assert statuses and not errors and set(statuses) == {200}, errors[:3]
        assert len(statuses) > switched_at[0], "no request was served after the switch"
        assert any(sent < t0 + switch_s and answered > t0 for sent, answered in spans), \
            "no request was in flight during the switch"
        after = _slots(serve_url)
        assert after["config"]["n_parallel"] == 2 and after["config"]["n_ctx"] == 2048
        assert after["config"]["n_batch"] == 512 and len(after["slots"]) == 2 and after["n_ctx_slot"] == 1024
        assert after["weight_loads"] == before["weight_loads"] == 1  # only the context was rebuilt
        assert after["counters"]["requests_failed"] == before["counters"]["requests_failed"]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        restored = apply_to_serve(original, app_name="llama", timeout_s=120)
        assert restored.applied, restored.message
        back = _slots(serve_url)
        assert EngineConfig(**back["config"]) == original and len(back["slots"]) == original.n_parallel


@pytest.mark.serve
def test_live_apply_to_a_missing_app_only_reports(ray_session: None) -> None:
    from tuning.writeback import apply_to_serve

    result = apply_to_serve(EngineConfig(n_parallel=1, n_ctx=1024), app_name="no-such-app", timeout_s=5)
    assert not result.applied and "no-such-app" in result.message and "only the file was written" in result.message


# -- report: Pareto front and pick -------------------------------------------------------------------
def trial_row(number: int, params: dict, attrs: dict, baseline: bool) -> TrialRow:
    """A study row as the report reads it back from the trial's user attributes."""
    return TrialRow(number, TrialResult.from_attrs({**attrs, "params": params, "is_baseline": baseline}))


def row(n: int, single: float, aggregate: float, feasible: bool = True) -> TrialRow:
    return trial_row(n, {"n_parallel": 1}, {"single_tok_s": single, "aggregate_tok_s": aggregate,
                                           "feasible": feasible}, False)


ROWS = [
    row(0, 100.0, 100.0),                   # best single
    row(1, 96.0, 180.0),                    # within 5% of the best single, best aggregate there: balanced
    row(2, 80.0, 300.0),                    # best aggregate
    row(3, 90.0, 150.0),                    # dominated by 1
    row(4, 200.0, 900.0, feasible=False),   # dominates everything, but infeasible
    row(5, 94.0, 179.0),                    # within 5%, dominated by 1
]


@pytest.mark.unit
def test_pareto_front_excludes_dominated_and_infeasible_rows() -> None:
    front = pareto_front(ROWS)
    assert [r.number for r in front] == [0, 1, 2]  # sorted by single stream, best first
    assert pareto_front([row(0, 1.0, 1.0, feasible=False)]) == []
    # equal on both objectives: neither dominates the other
    assert {r.number for r in pareto_front([row(0, 5.0, 5.0), row(1, 5.0, 5.0)])} == {0, 1}


@pytest.mark.unit
def test_pick_by_preference() -> None:
    assert pick(ROWS, "balanced").number == 1
    assert pick(ROWS, "single").number == 0
    assert pick(ROWS, "aggregate").number == 2
    assert pick([row(0, 1.0, 1.0, feasible=False)], "balanced") is None
    assert pick([], "single") is None
    # nothing else within 5%: balanced is the best single stream
    assert pick([row(0, 100.0, 10.0), row(1, 90.0, 500.0)], "balanced").number == 0
    # exactly at the 5% line counts as within
    assert pick([row(0, 100.0, 10.0), row(1, 95.0, 500.0)], "balanced").number == 1


@pytest.mark.unit
def test_an_answered_proposal_is_not_a_second_point_of_the_front() -> None:
    answered = trial_row(6, {"n_parallel": 1}, {"single_tok_s": 96.0, "aggregate_tok_s": 180.0, "feasible": True,
                                               "answered_from": 1}, False)
    assert [r.number for r in pareto_front([*ROWS, answered])] == [0, 1, 2]
    assert "answered from #1" in trial_table([answered])


def capacity_row(n: int, slots: int, curve: list[tuple[int, float, float]], capacity: float) -> TrialRow:
    return trial_row(n, {"n_parallel": slots, "n_batch": 512, "n_ubatch": 512, "ctx_per_slot": 2048},
                    {"single_tok_s": curve[0][1], "aggregate_tok_s": curve[-1][1], "feasible": True,
                     "capacity_tok_s": capacity, "capacity_streams": curve[-1][0],
                     "capacity_curve": [{"streams": s, "aggregate_tok_s": a, "slowest_tok_s": w}
                                        for s, a, w in curve]}, False)


@pytest.mark.unit
def test_the_capacity_section_draws_the_best_curve_per_slot_count(tmp_path: Path) -> None:
    rows = [capacity_row(0, 2, [(1, 100.0, 100.0), (2, 170.0, 85.0)], 170.0),
            capacity_row(1, 2, [(1, 90.0, 90.0), (2, 150.0, 75.0)], 150.0),
            capacity_row(2, 16, [(1, 100.0, 100.0), (16, 640.0, 41.0)], 640.0),
            row(3, 100.0, 100.0)]
    assert [r.number for r in best_curves(rows)] == [0, 2]
    assert plot_capacity(rows, 20.0, tmp_path / "capacity.png") and (tmp_path / "capacity.png").stat().st_size > 0
    assert not plot_capacity([row(0, 1.0, 1.0)], 20.0, tmp_path / "none.png")
    text = markdown(rows, rows[2], "balanced", {}, "pareto.png", "capacity.png")
    assert "![Capacity curves](capacity.png)" in text and "| 2 | np16 b512/512 c2048/slot" in text
    assert "640.0 (41.0)" in text and "| 1 | np2" not in text.split("## All trials")[0]
    assert "## Capacity" not in markdown(rows, rows[2], "balanced", {}, "pareto.png")


@pytest.mark.engine
def test_confirmation_candidates_are_distinct_configs_and_the_baseline() -> None:
    from tuning.confirm import confirmation_candidates

    def trial(n: int, single: float, aggregate: float, n_parallel: int, baseline: bool = False) -> TrialRow:
        params = {"n_parallel": n_parallel, "n_batch": 512, "n_ubatch": 512, "ctx_per_slot": 2048, "type_k": "f16",
                  "type_v": "f16", "flash_attn": "on"}
        return trial_row(n, params, {"single_tok_s": single, "aggregate_tok_s": aggregate, "feasible": True}, baseline)

    rows = [trial(0, 90.0, 150.0, 2, baseline=True), trial(1, 100.0, 240.0, 4), trial(2, 100.0, 240.0, 4),
            trial(3, 101.0, 200.0, 8), trial(4, 102.0, 180.0, 1)]
    chosen = confirmation_candidates(rows, rows[1], EngineConfig(), 3, "balanced")
    assert [r.number for r in chosen] == [1, 3, 4, 0]  # trial 2 is trial 1's config again
    assert [r.number for r in confirmation_candidates(rows, rows[0], EngineConfig(), 2, "balanced")] == [0, 1]


# -- search space ----------------------------------------------------------------------------------
def draw(**fixed: object) -> dict:
    import optuna

    values = {"n_parallel": 2, "n_batch": 256, "n_ubatch": 512, "ctx_per_slot": 1024, "type_k": "f16",
              "type_v": "f16", "flash_attn": "off", "kv_unified": False, **fixed}
    space = SearchSpace()
    return suggest(optuna.trial.FixedTrial(values), space, space.contexts(1024), None)


@pytest.mark.unit
def test_quantised_v_cache_forces_flash_attention_on() -> None:
    assert draw(type_v="q8_0", flash_attn="off")["flash_attn"] == "on"
    assert draw(type_v="q4_0")["flash_attn"] == "on"
    assert draw(type_v="f16", flash_attn="off")["flash_attn"] == "off"
    config = to_engine_config(draw(type_k="q8_0", type_v="q8_0"), EngineConfig())
    assert config.flash_attn == FlashAttn.on and config.type_v == CacheType.q8_0


@pytest.mark.unit
def test_n_ubatch_is_clamped_to_n_batch_and_context_is_per_slot() -> None:
    params = draw(n_batch=256, n_ubatch=2048, n_parallel=4, ctx_per_slot=2048)
    config = to_engine_config(params, EngineConfig(n_threads=3))
    assert config.n_batch == 256 and config.n_ubatch == 256
    assert config.n_ctx == 8192 and config.n_ctx_per_slot == 2048 and config.n_threads == 3


@pytest.mark.unit
def test_the_kv_layout_is_searched_only_where_there_are_slots_to_share_it() -> None:
    assert "kv_unified" not in draw(n_parallel=1)
    assert draw(n_parallel=4, kv_unified=True)["kv_unified"] is True
    assert to_engine_config(draw(n_parallel=4, kv_unified=True), EngineConfig()).kv_unified
    import optuna

    one = SearchSpace(kv_unified=[True])  # a single value is set, not drawn
    values = {"n_parallel": 2, "n_batch": 256, "n_ubatch": 256, "ctx_per_slot": 1024, "type_k": "f16",
              "type_v": "f16", "flash_attn": "on"}
    assert suggest(optuna.trial.FixedTrial(values), one, one.contexts(1024), None)["kv_unified"] is True
    with pytest.raises(ValueError, match="at least one"):
        SearchSpace(kv_unified=[])


@pytest.mark.unit
def test_contexts_below_the_minimum_or_over_the_trained_length_are_dropped(capsys: pytest.CaptureFixture[str]) -> None:
    space = SearchSpace(ctx_per_slot=[512, 1024, 4096, 2048])
    assert space.contexts(1024) == [1024, 2048, 4096]
    assert space.contexts(1) == [512, 1024, 2048, 4096]
    assert space.contexts(1, longest=2048) == [512, 1024, 2048]
    # a request longer than the space: the study searches at its length, and says so, never refuses
    assert space.contexts(8192) == [8192] and "searching 8192 tokens per slot" in capsys.readouterr().err
    assert SearchSpace.from_yaml(None).contexts(2048)[-2:] == [65536, 131072]  # agent-sized contexts
    with pytest.raises(ValueError):
        SearchSpace(n_parallel=[])
    assert SearchSpace(flash_attn=[True, False]).flash_attn == [FlashAttn.on, FlashAttn.off]  # YAML on/off


@pytest.mark.unit
def test_shipped_search_space_parses() -> None:
    space = SearchSpace.from_yaml(None)
    assert space.n_parallel and space.contexts(1024)


# -- memory model ----------------------------------------------------------------------------------
def _header(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    get = lambda key: reader.fields[f"{arch}.{key}"].contents()  # noqa: E731
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    return {"layers": get("block_count"), "kv_heads": get("attention.head_count_kv"),
            "head_dim": get("embedding_length") // get("attention.head_count"), "tensors": tensors}


@pytest.mark.engine
def test_kv_cache_is_exact_arithmetic(shape: ModelShape) -> None:
    h = _header(embedded_model_path())
    per_elem_cells = 2 * h["layers"] * h["kv_heads"] * h["head_dim"]  # K and V, every layer
    f16 = EngineConfig(n_parallel=1, n_ctx=1024)
    assert predict(shape, f16, on_gpu=False).kv_cache == per_elem_cells * 2 * 1024
    q8 = EngineConfig(n_parallel=1, n_ctx=1024, type_k="q8_0", type_v="q8_0", flash_attn="on")
    assert predict(shape, q8, on_gpu=False).kv_cache == int(per_elem_cells * 34 / 32 * 1024)
    # cells are padded as llama.cpp pads them: n_ctx to 256, then each slot's share to 256
    padded = EngineConfig(n_parallel=3, n_ctx=3000)
    assert padded.n_ctx_cells == 3 * 1024  # pad(3000)=3072, /3 = 1024 per slot
    assert predict(shape, padded, on_gpu=False).kv_cache == per_elem_cells * 2 * 3 * 1024
    mixed = EngineConfig(n_parallel=1, n_ctx=1024, type_k="f16", type_v="q8_0", flash_attn="on")
    assert predict(shape, mixed, on_gpu=False).kv_cache == int(per_elem_cells / 2 * (2 + 34 / 32) * 1024)
    assert shape.kv_bytes_per_token_f16 == per_elem_cells * 2


@pytest.mark.engine
def test_tied_output_layer_is_counted(shape: ModelShape) -> None:
    """SmolLM2 has no output.weight: its output layer is token_embd, read in full for every token and
    (with all layers offloaded) held on the GPU as well."""
    tensors = _header(embedded_model_path())["tensors"]
    assert "output.weight" not in tensors and shape.tied_embeddings
    assert shape.weight_bytes == sum(tensors.values())
    assert shape.token_embd_bytes == tensors["token_embd.weight"] > 0
    assert shape.bytes_read_per_token == shape.weight_bytes
    on_gpu = predict(shape, EngineConfig(n_parallel=1, n_ctx=1024), on_gpu=True)
    assert on_gpu.weights == shape.weight_bytes
    # a model with its own output.weight: the embedding is a lookup, neither streamed nor on the GPU
    untied = dataclasses.replace(shape, tied_embeddings=False)
    assert untied.bytes_read_per_token == shape.weight_bytes - shape.token_embd_bytes
    assert predict(untied, EngineConfig(n_parallel=1, n_ctx=1024), on_gpu=True).weights == \
        shape.weight_bytes - shape.token_embd_bytes
    # partial offload, as llama.cpp places it: n_gpu_layers counts the output layer as one more, so 15 of 30
    # puts blocks 16..29 on the GPU with the output layer (the tied embedding's copy, the final norm)
    half = predict(shape, EngineConfig(n_parallel=1, n_ctx=1024, n_gpu_layers=shape.n_layer // 2), on_gpu=True)
    first = shape.n_layer + 1 - shape.n_layer // 2
    on_gpu_blocks = sum(size for name, size in tensors.items() if name.startswith("blk.")
                        and int(name.split(".")[1]) >= first)
    assert half.weights == on_gpu_blocks + tensors["output_norm.weight"] + tensors["token_embd.weight"]
    assert half.host == pytest.approx(shape.weight_bytes - on_gpu_blocks - tensors["output_norm.weight"]
                                      + half.compute + (1 - (shape.n_layer - first) / shape.n_layer)
                                      * kv_cache_bytes(shape, EngineConfig(n_parallel=1, n_ctx=1024))
                                      + GPU_PROCESS_HOST_OVERHEAD, abs=1024)


@pytest.mark.engine
def test_compute_term_grows_without_flash_attention(shape: ModelShape) -> None:
    on = predict(shape, EngineConfig(n_parallel=1, n_ctx=8192, flash_attn="on"), on_gpu=False)
    off = predict(shape, EngineConfig(n_parallel=1, n_ctx=8192, flash_attn="off"), on_gpu=False)
    assert off.compute > on.compute and off.kv_cache == on.kv_cache
    assert predict(shape, EngineConfig(n_parallel=1, n_ctx=1024), on_gpu=True).overhead > on.overhead


@pytest.mark.unit
def test_parse_bytes() -> None:
    assert parse_bytes("32GiB") == 32 * GiB
    assert parse_bytes("16 GB") == 16 * 10**9
    assert parse_bytes("900MiB") == 900 * 2**20
    assert parse_bytes("123456") == 123456
    assert parse_bytes("1.5gib") == int(1.5 * GiB)
    for bad in ("lots", "", "12 parsecs", "GiB", "0", "-1GiB", "inf", "nan", "1e999GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_measured_engine_memory_is_near_the_prediction(shape: ModelShape) -> None:
    from serving.engine.core import Engine
    from serving.engine.request import SamplingParams
    from measure.device import rss_bytes

    config = EngineConfig(n_parallel=1, n_ctx=1024, n_batch=256, n_ubatch=256)
    predicted = predict(shape, config, on_gpu=False)
    gc.collect()
    before = rss_bytes()
    assert before is not None
    engine = Engine(config)
    try:
        for _ in engine.submit(engine.tokenize_prompt("Hello, how are you today?"),
                               SamplingParams(max_tokens=8, temperature=0.0)):
            pass
        after = rss_bytes()
        assert after is not None
        grown = after - before
    finally:
        engine.close()
    ratio = grown / predicted.total
    print(f"RSS growth {grown / 2**20:.0f} MiB vs predicted {predicted.total / 2**20:.0f} MiB: {ratio:.2f}x")
    assert 0.3 < ratio < 2.0


@pytest.mark.engine
def test_a_config_already_measured_is_answered_without_measuring_again() -> None:
    """Two parameter sets that make the same engine (n_ubatch above n_batch is clamped) cost one measurement."""
    from serving.engine.memory import ModelShape
    from tuning.objective import Workload
    from tuning.results import Measurement, MeasuredRun
    from tuning.plan import TrialSettings
    from tuning.trial import EngineTrial

    base = EngineConfig()
    shape = ModelShape.from_gguf(base.model_path)
    trial = object.__new__(EngineTrial)  # the trainable's logic without a Ray Tune actor around it
    trial.settings = TrialSettings(base=base, shape=shape, budget_bytes=2**40, on_gpu=False, workload=Workload(),
                                   max_quality_loss=0.1)
    trial.actor, trial.measured = "test", {}
    calls: list[EngineConfig] = []

    def fake_measure(config: EngineConfig) -> MeasuredRun:
        calls.append(config)
        return MeasuredRun(measurement=Measurement(
            single_tok_s=10.0, aggregate_tok_s=20.0, ttft_ms=1.0, prefill_tok_s=1.0, nll=2.0, nll_baseline=2.0,
            mem_measured=1, weight_loads=1, weight_load_s=0.1))

    prepared: list[EngineConfig] = []
    trial._measure = fake_measure  # type: ignore[method-assign]
    trial._prepare = prepared.append  # type: ignore[method-assign]  # no engine built: the reuse is the subject
    params = {"n_parallel": 2, "n_batch": 256, "ctx_per_slot": 1024, "type_k": "f16", "type_v": "f16",
              "flash_attn": "on"}
    results = []
    for n_ubatch in (512, 1024, 256):  # all three clamp to n_ubatch = 256
        trial.config = {**params, "n_ubatch": n_ubatch}
        results.append(trial.step())
    assert len(calls) == 1
    assert prepared == calls, "a config answered from an earlier measurement builds no context either"
    assert [r.get("reused", False) for r in results] == [False, True, True]
    assert all(r["single_tok_s"] == 10.0 for r in results)


@pytest.mark.engine
def test_a_proposal_the_study_already_measured_is_answered_from_it_not_run() -> None:
    """n_ubatch 512 with n_batch 256 is the engine of n_ubatch 256: once one is measured, the sampler's
    proposal of the other is told the measured values at once and Tune gets a config not measured yet."""
    from functools import partial

    import optuna

    from tuning.recording import RecordingOptunaSearch
    from tuning.results import Objective
    from tuning.space import SpaceFunction

    space = SearchSpace(n_parallel=[1], n_batch=[256, 512], n_ubatch=[256, 512], ctx_per_slot=[1024],
                        type_k=["f16"], type_v=["f16"], flash_attn=["on"])
    canonical = partial(to_engine_config, base=EngineConfig())
    searcher = RecordingOptunaSearch(
        space=SpaceFunction(space, [1024], None), metric=["single_tok_s", "aggregate_tok_s"], mode=["max", "max"],
        sampler=optuna.samplers.RandomSampler(seed=3), study_name="dedup", storage=optuna.storages.InMemoryStorage(),
        first_is_baseline=False, canonical=canonical, objective=Objective.aggregate)
    ran = []
    for i in range(3):
        params = searcher.suggest(f"t{i}")
        assert params is not None
        ran.append(canonical(params))
        searcher.on_trial_complete(f"t{i}", result={"single_tok_s": 10.0 + i, "aggregate_tok_s": 20.0 + i,
                                                   "params": params})
    assert len(set(ran)) == 3, "every run trial measured an engine not measured before"
    trials = searcher._ot_study.get_trials()
    answered = [t for t in trials if "answered_from" in t.user_attrs]
    assert answered, "the sampler proposed a twin (n_batch 256, n_ubatch 512) at least once with this seed"
    for t in answered:
        twin = trials[t.user_attrs["answered_from"]]
        assert canonical(t.user_attrs["params"]) == canonical(twin.user_attrs["params"])
        assert t.values == twin.values and t.state.name == "COMPLETE"


@pytest.mark.serve
@pytest.mark.timeout(300)
def test_offline_confirmation_measures_on_an_engine_of_its_own(ray_session: None) -> None:
    from tuning.objective import Workload
    from tuning.report import Objective
    from tuning.confirm import confirmation_measure

    configs = [EngineConfig(n_parallel=1, n_ctx=1024), EngineConfig(n_parallel=2, n_ctx=2048)]
    with confirmation_measure(app=None, workload=Workload(gen_tokens=8, repeats=1), on_gpu=False, study="s",
                              total_trials=2, objective=Objective.aggregate) as measure:
        speeds = [measure(c) for c in configs]
    assert all(s.single > 0 and s.second > 0 for s in speeds)


@pytest.mark.unit
def test_speculation_is_searched_only_when_the_space_lists_it(tmp_path: Path) -> None:
    import optuna

    plain = SearchSpace.from_yaml(write_space(tmp_path / "a.yaml", SMALL_SPACE))
    spec = SearchSpace.from_yaml(write_space(tmp_path / "b.yaml", {**SMALL_SPACE, "spec_mode": [False, "ngram"]}))
    assert plain.spec_mode == [SpecMode.off] and spec.spec_mode == [SpecMode.off, SpecMode.ngram]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    assert "spec_mode" not in suggest(study.ask(), plain, [1024], None)
    modes = {to_engine_config(suggest(study.ask(), spec, [1024], None), EngineConfig()).spec_mode for _ in range(12)}
    assert modes == {SpecMode.off, SpecMode.ngram}
    busy = SearchSpace.from_yaml(write_space(tmp_path / "c.yaml", {**SMALL_SPACE, "spec_mode": [False, "ngram"],
                                                                   "spec_max_busy": [1, 3], "spec_draft_max": [8]}))
    drawn = [suggest(study.ask(), busy, [1024], None) for _ in range(16)]
    on = [p for p in drawn if p["spec_mode"] == "ngram"]
    assert {p["spec_max_busy"] for p in on} == {1, 3} and {p["spec_draft_max"] for p in on} == {8}
    assert all("spec_max_busy" not in p for p in drawn if p["spec_mode"] == "off"), "searched only when on"
    assert to_engine_config(on[0], EngineConfig()).spec_draft_max == 8


@pytest.mark.serve
@pytest.mark.timeout(300)
def test_capacity_and_the_copy_set_are_measured_per_trial(ray_session: None, tmp_path: Path) -> None:
    from tuning.search import main

    args = tuner_args(tmp_path, SMALL_SPACE, "--objective", "capacity", "--min-stream-tok-s", "0.5",
                      "--confirm-rounds", "0", "--prompt-set", "both")
    assert main(["--trials", "2", *args]) == 0
    trials = [t for t in load_trials(tmp_path) if "answered_from" not in t.user_attrs]
    assert len(trials) == 2
    for t in trials:
        a = t.user_attrs
        assert a["capacity_tok_s"] > 0 and a["capacity_streams"] >= 1
        assert [p["streams"] for p in a["capacity_curve"]] == [1, 2][:a["params"]["n_parallel"]]
        assert t.values[1] == a["capacity_tok_s"], "the study's second objective is the capacity figure"
        assert a["single_copy_tok_s"] > 0, "--prompt-set both: the copy set's single stream is reported too"
    report = (tmp_path / "t" / "report.md").read_text()
    assert "capacity tok/s (streams)" in report and "objectives: single stream, capacity tok/s" in report
    assert "copy-set single tok/s" in report


@pytest.mark.engine
def test_capacity_objective_needs_its_floor(capsys: pytest.CaptureFixture) -> None:
    from tuning.search import main

    with pytest.raises(SystemExit) as exit_:
        main(["--objective", "capacity"])
    assert exit_.value.code == 2 and "--min-stream-tok-s" in capsys.readouterr().err


@pytest.fixture(scope="module")
def wide_ffn_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A synthetic model whose feed-forward (3 x 32768 floats a row) outweighs its logits (49152), unlike the
    embedded model's: 2 layers, Q4_K, ~30 MB. Random weights: memory only."""
    for synthetic in script_module("make_synthetic_gguf"):
        wide = dataclasses.replace(synthetic.PRESETS["qwen7b"], layers=2, hidden=256, heads=4, kv_heads=2, ffn=32768,
                                   vocab=49152)
        out = tmp_path_factory.mktemp("wide") / "wide_ffn.gguf"
        synthetic.write_model(wide, out, seed=5, log=lambda _: None)
        yield out


@pytest.mark.engine
@pytest.mark.timeout(240)
@pytest.mark.parametrize("gguf", ["embedded", "wide_ffn"])
@pytest.mark.parametrize("overrides", [
    {"n_parallel": 2, "n_ctx": 2048},
    {"n_parallel": 4, "n_ctx": 4096, "type_k": CacheType.q8_0, "type_v": CacheType.q8_0, "flash_attn": FlashAttn.on},
    {"n_parallel": 1, "n_ctx": 8192, "n_batch": 256, "n_ubatch": 256},
    {"n_parallel": 1, "n_ctx": 8192, "flash_attn": FlashAttn.off},
    {"n_parallel": 1, "n_ctx": 2048, "n_batch": 128, "n_ubatch": 128, "flash_attn": FlashAttn.on},
    # one K/V stream for all slots: a row's scores span every slot's cells (the largest stage, embedded)
    {"n_parallel": 4, "n_ctx": 16384, "n_batch": 512, "flash_attn": FlashAttn.off, "kv_unified": True},
])
def test_the_memory_models_terms_match_what_llama_cpp_allocates(gguf: str, overrides: dict[str, Any],
                                                                 request: pytest.FixtureRequest) -> None:
    """Term by term against llama.cpp's own report of its buffers (serving/engine/buffers.py), on the CPU: the weights
    and the K/V cache to 1%; the compute buffers never under and at most 7% over (the largest graph stage and
    the allocator's fragmentation allowance: an over-prediction leaves memory unused, an under-prediction lets
    a config through that does not fit). Two models, so both stages that can be the largest are checked: the
    embedded one's logits, the wide one's feed-forward (and, without flash attention, the f32 mask with it)."""
    from serving.engine.buffers import llama_buffers
    from serving.engine.core import Engine

    path = embedded_model_path() if gguf == "embedded" else request.getfixturevalue("wide_ffn_model")
    shape = ModelShape.from_gguf(path)
    config = EngineConfig(model=path, **overrides, cpu_repack=CpuRepack.off)  # the weights in one mapped buffer
    predicted = predict(shape, config, on_gpu=False)
    with llama_buffers() as buffers:
        engine = Engine(config)
    engine.close()
    size = {kind: sum(by_type.values()) * MiB for kind, by_type in buffers.items()}
    assert size["model"] == pytest.approx(predicted.weights, rel=0.01)
    assert size["KV"] == pytest.approx(predicted.kv_cache, rel=0.01)
    assert size["compute"] <= predicted.compute <= 1.07 * size["compute"]


@pytest.mark.engine
def test_a_draft_model_counts_in_the_memory_prediction(shape: ModelShape) -> None:
    from serving.engine.config import embedded_model_path

    plain = EngineConfig(n_parallel=2, n_ctx=2048)
    drafting = plain.model_copy(update={"spec_mode": SpecMode.draft, "draft_model": embedded_model_path()})
    alone, both = predict(shape, plain, on_gpu=False), predict(shape, drafting, on_gpu=False)
    assert both.weights == 2 * alone.weights and both.overhead == alone.overhead
    assert both.kv_cache == alone.kv_cache + kv_cache_bytes(shape, drafting.draft)  # f16 K/V of its own


@pytest.mark.engine
def test_bench_memory_reads_configs_refuses_bad_ones_and_reports_each_term(tmp_path: Path) -> None:
    import argparse
    import json

    from measure import memory_terms as bench

    config = bench.parse_config("256/2/4096/off", Path("/m.gguf"), 1)
    assert (config.n_ubatch, config.n_batch, config.n_parallel, config.n_ctx, config.flash_attn) == \
        (256, 256, 2, 4096, FlashAttn.off)
    assert not config.kv_unified and bench.parse_config("256/2/4096/off/unified", Path("/m.gguf"), 1).kv_unified
    for bad in ("256/2/4096", "a/2/4096/on", "256/2/4096/maybe", "0/2/4096/on", "256/2/4096/on/shared"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_config(bad, Path("/m.gguf"), 1)
    assert bench.main(["--config", "64/1/1024/on", "--json-out", str(tmp_path / "m.json")]) == 0
    (row,) = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert row["config"] == "64/1/1024/on"
    assert row["weights_mib"] == pytest.approx(row["weights_predicted_mib"], rel=0.01)
    assert 1.0 <= row["compute_ratio"] <= 1.07
