"""measure/conversations.py's llama-server flags (the measuring itself: run the script)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine  # the module imports serving.engine.llama (libllama) first, as every script does


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    from measure import conversations

    return conversations


def test_llama_server_gets_its_cache_and_the_repack_setting_ours_runs_with(bench) -> None:  # noqa: ANN001
    """Without `--no-repack` where ours loads without the repack, llama-server ran other kernels, and on an
    AMX VM (whose repack path faults) it crashed at load: the peer of a CPU run was missing."""
    from serving.engine.config import EngineConfig

    off = EngineConfig(cpu_repack="off")
    assert bench.peer_args(off, "-np 2 -c 8192 -t 2", 8192) == [
        "-np", "2", "-c", "8192", "-t", "2", "--cache-ram", "8192", "--no-repack"]
    assert bench.peer_args(EngineConfig(cpu_repack="on"), "-np 2", 0) == ["-np", "2", "--cache-ram", "0"]
    assert bench.peer_args(off, "--repack", 0) == ["--repack", "--cache-ram", "0"]  # the caller's own wins


@pytest.mark.parametrize("think_s", [0.0, 0.25])
def test_turns_go_round_robin_with_the_pause_asked_for_after_each_answer(bench, monkeypatch,  # noqa: ANN001
                                                                          think_s: float) -> None:
    """Each turn carries the conversation's history, its earlier answers and a new question; with --think-ms
    a pause follows every answer (a user reading it), none without."""
    import asyncio

    from measure.metrics import StreamRecord

    prompts: list[str] = []
    pauses: list[float] = []

    class Answering:
        name = "fake"

        async def run_stream(self, prompt, max_tokens: int, ignore_eos: bool) -> StreamRecord:  # noqa: ANN001
            prompts.append(prompt.text)
            record = StreamRecord(t_start=0.0, prompt_tokens=len(prompt.text), finish_reason="length")
            record.add_output(0.01, 1, f" answer {len(prompts)}")
            return record

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(bench.asyncio, "sleep", pause)
    turns = asyncio.run(bench.run_target(Answering(), 2, 2, 8, 4, think_s))
    assert [(t.conversation, t.turn) for t in turns] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    assert " answer 1" in prompts[2] and " answer 2" in prompts[3] and " answer 1" not in prompts[3]
    assert pauses == ([think_s] * 4 if think_s else [])


def test_a_summary_counts_the_returning_turns_that_prefilled_again_and_what_the_router_did(bench) -> None:  # noqa: ANN001
    """The median of returning turns hides the few that prefilled their history again (a conversation sent to a
    replica that never served it): the mean and the count show them; --replicas reports /metrics' routing."""
    turns = [bench.Turn(1, 1, 100, 1000, 0, 10.0), bench.Turn(2, 1, 100, 1000, 0, 12.0),
             bench.Turn(1, 2, 120, 1040, 1000, 0.5), bench.Turn(2, 2, 120, 1040, 1000, 0.7),
             bench.Turn(1, 3, 140, 1080, 3, 11.0)]
    summary = bench.summarize("t", turns)
    assert summary.returning_ttft_s == 0.7 and summary.returning_missed == 1
    assert abs(summary.returning_mean_ttft_s - 12.2 / 3) < 1e-9
    text = ('llm_requests_routed_total{by="affinity",model="m",replica="a"} 3.0\n'
            'llm_requests_routed_total{by="affinity",model="m",replica="b"} 2.0\n'
            'llm_requests_routed_created{by="load",model="m",replica="a"} 1.7e9\n'
            'llm_requests_routed_total{by="load",model="m",replica="a"} 1.0\n')
    assert bench.routed_by(text) == {"affinity": 5.0, "load": 1.0}
