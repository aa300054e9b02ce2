"""scripts/bench_conversations.py's llama-server flags (the measuring itself: run the script)."""

from __future__ import annotations

import pytest

from tests.helpers import script_module

pytestmark = pytest.mark.engine  # the script imports serving.llama (libllama) first, as every script does


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    yield from script_module("bench_conversations")


def test_llama_server_gets_its_cache_and_the_repack_setting_ours_runs_with(bench) -> None:  # noqa: ANN001
    """Without `--no-repack` where ours loads without the repack, llama-server ran other kernels, and on an
    AMX VM (whose repack path faults) it crashed at load: the peer of a CPU run was missing."""
    from serving.config import EngineConfig

    off = EngineConfig(cpu_repack="off")
    assert bench.peer_args(off, "-np 2 -c 8192 -t 2", 8192) == [
        "-np", "2", "-c", "8192", "-t", "2", "--cache-ram", "8192", "--no-repack"]
    assert bench.peer_args(EngineConfig(cpu_repack="on"), "-np 2", 0) == ["-np", "2", "--cache-ram", "0"]
    assert bench.peer_args(off, "--repack", 0) == ["--repack", "--cache-ram", "0"]  # the caller's own wins
