"""The shared workload's capacity figure (measure/workload.py): the curve's stream counts, the floor, and
a real measurement on the embedded model."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import pytest

from measure.targets import EngineTarget
from measure.workload import Capacity, CapacityPoint, PromptSet, Runner, Workload, capacity_levels

if TYPE_CHECKING:
    from serving.engine.core import Engine


@pytest.mark.unit
def test_the_curve_runs_at_powers_of_two_and_the_slot_count() -> None:
    assert capacity_levels(1) == [1]
    assert capacity_levels(4) == [1, 2, 4]
    assert capacity_levels(6) == [1, 2, 4, 6]
    assert capacity_levels(16) == [1, 2, 4, 8, 16]


@pytest.mark.unit
def test_capacity_is_the_best_aggregate_whose_slowest_stream_keeps_the_floor() -> None:
    curve = [CapacityPoint(1, 60.0, 60.0), CapacityPoint(2, 100.0, 48.0), CapacityPoint(4, 150.0, 35.0),
             CapacityPoint(8, 200.0, 22.0)]
    assert Capacity.of(30.0, curve).tok_s == 150.0 and Capacity.of(30.0, curve).streams == 4
    assert Capacity.of(20.0, curve).streams == 8
    none = Capacity.of(100.0, curve)
    assert none.tok_s == 0.0 and none.streams == 0 and len(none.curve) == 4


@pytest.mark.engine
def test_capacity_measured_on_the_engine(engine: Engine) -> None:
    runner, target = Runner(Workload(gen_tokens=8, repeats=1)), EngineTarget(engine)
    low = asyncio.run(runner.capacity(target, engine.config.n_parallel, floor_tok_s=0.1))
    assert [p.streams for p in low.curve] == capacity_levels(engine.config.n_parallel)
    assert low.tok_s > 0 and low.streams in capacity_levels(engine.config.n_parallel)
    assert all(p.aggregate_tok_s > 0 and p.slowest_tok_s > 0 for p in low.curve)
    assert asyncio.run(runner.capacity(target, 2, floor_tok_s=1e9)).tok_s == 0.0


@pytest.mark.engine
def test_levels_on_the_engine_warm_up_interleave_and_keep_every_round(engine: Engine) -> None:
    """Two targets on one engine: every level measured `repeats` times per target after a warm-up, the
    prompts fresh (no prefix cache hit), the figures whole."""
    workload = Workload(gen_tokens=6, levels=(1, 2), repeats=2)
    runner = Runner(workload, first_request=500)
    seen: list[tuple[str, int, int]] = []
    results = asyncio.run(runner.levels([EngineTarget(engine, "a"), EngineTarget(engine, "b")],
                                        lambda name, level, repeat, _: seen.append((name, level, repeat))))
    assert seen == [("a", 1, 1), ("b", 1, 1), ("b", 1, 2), ("a", 1, 2), ("a", 2, 1), ("b", 2, 1), ("b", 2, 2),
                    ("a", 2, 2)]
    for levels in results.values():
        assert [len(levels[n].rounds) for n in (1, 2)] == [2, 2]
        single = levels[1].median
        assert single.completion_tokens == 6 and single.short_streams == 0  # EOS ignored: fixed lengths
        assert single.decode_tok_s and single.decode_tok_s > 0 and single.ttft_ms > 0
        assert single.prefill_tok_s and single.prefill_tok_s > 0
        assert levels[2].median.streams == 2 and levels[2].median.aggregate_tok_s > 0
        engine_ttft = single.engine_ttft_ms  # the engine's own account, inside what the caller waited
        assert engine_ttft is not None and 0 < engine_ttft <= single.ttft_ms
    assert runner.prompts.next_number == 500 + 2 * 3 * 1 + 2 * 3 * 2  # 2 targets x (warm-up + 2) rounds x streams
    assert engine.stats()["counters"]["prompt_tokens_cached"] < engine.stats()["counters"]["prompt_tokens"] / 2


@pytest.mark.engine
def test_the_copy_set_runs_as_chat_and_stops_at_eos(engine: Engine) -> None:
    speed = asyncio.run(Runner(Workload(gen_tokens=24, levels=(1,), repeats=1, prompt_set=PromptSet.copy))
                        .speed(EngineTarget(engine)))
    assert speed.single_tok_s > 0 and speed.aggregate_tok_s > 0 and speed.ttft_ms > 0


@pytest.mark.unit
def test_the_chat_set_is_the_plain_sets_instructions_as_chat_messages_with_eos_ignored() -> None:
    from measure.workload import Prompts

    plain, chat = Prompts(PromptSet.plain, first=7).round(3), Prompts(PromptSet.chat, first=7).round(3)
    assert [p.text for p in chat] == [p.text for p in plain]
    assert all(p.chat for p in chat) and not any(p.chat for p in plain)
    assert Workload(prompt_set=PromptSet.chat).ignore_eos and not Workload(prompt_set=PromptSet.copy).ignore_eos
    assert not Workload(prompt_set=PromptSet.chat, honour_eos=True).ignore_eos


@pytest.mark.engine
def test_under_ignore_eos_every_prompt_of_both_sets_opens_with_text(engine: Engine) -> None:
    """The workload ignores EOS; an end-of-generation token is then never sampled (as llama-server bans it),
    so no stream's first token is one that shows a client nothing until the next step. Before that 48 of the
    first 100 raw prompts opened with SmolLM2's EOS (greedy, the embedded model), none of the chat ones."""
    from measure.targets import prompt_tokens
    from measure.workload import Prompts
    from serving.engine.request import SamplingParams

    for prompt_set in (PromptSet.plain, PromptSet.chat):
        prompts = Prompts(prompt_set)
        for prompt in [p for _ in range(8) for p in prompts.round(4)]:
            handle = engine.submit_choices(prompt_tokens(engine, prompt),
                                           SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), 1)[0]
            chunks = list(handle)
            assert all(c.error is None for c in chunks)
            assert chunks[0].text, f"{prompt_set.value}: {prompt.text!r} opened with no text"


@pytest.mark.unit
def test_provenance_takes_the_commit_it_is_told(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On the GPU machine the tree's .git may be an older copy: LLAMA_SERVE_TUNE_COMMIT says what ran."""
    from measure.provenance import COMMIT_ENV, commit, provenance

    assert commit() != "feedc0de"
    monkeypatch.setenv(COMMIT_ENV, "feedc0de")
    assert commit() == "feedc0de" and provenance()["commit"] == "feedc0de"


@pytest.mark.unit
@pytest.mark.parametrize("pause_s", [0.0, 0.3])
def test_a_pause_comes_before_every_round_when_asked_for(monkeypatch: pytest.MonkeyPatch, pause_s: float) -> None:
    """With pause_s each round starts after that much idle time (a target's idle work, the prompt cache's
    saves, is done before the next round); without, rounds follow back to back."""
    from measure import workload as workload_module
    from measure.metrics import StreamRecord

    events: list[str] = []

    class Quick:
        name = "quick"

        async def run_stream(self, prompt: object, max_tokens: int, ignore_eos: bool) -> StreamRecord:
            events.append("stream")
            record = StreamRecord(t_start=0.0, t_end=0.02, finish_reason="length")
            record.add_output(0.01, max_tokens, "x")
            return record

    real_sleep, here = asyncio.sleep, threading.current_thread()

    async def pause(seconds: float) -> None:  # the module is shared: other threads' loops (Ray's) sleep as ever
        if threading.current_thread() is not here:
            return await real_sleep(seconds)
        events.append(f"pause {seconds}")

    monkeypatch.setattr(workload_module.asyncio, "sleep", pause)
    runner = Runner(Workload(gen_tokens=2, levels=(2,), repeats=1), pause_s=pause_s)
    asyncio.run(runner.levels([Quick()]))  # a warm-up round and one measured
    one_round = ["stream", "stream"]
    assert events == ([f"pause {pause_s}", *one_round] * 2 if pause_s else one_round * 2)
