"""Every memory kind on real llama.cpp: a recurrent model (Mamba), a hybrid one (LFM2: short convolutions with a
recurrent state, and attention layers), both tiny synthetic GGUFs written here, and a sliding-window one (the
Gemma 3 270M GGUF of the dev extra). After going back (a prompt sharing less than its slot holds), after a
follow-up, through the host-RAM prompt cache and through a slot file, each answer is the one a cold slot gives:
the same tokens and, within float noise, the same log-probabilities (a state decoded onto the wrong prefix shows
there even where a random-weight model's greedy tokens would not). Before these rules a recurrent slot going
back failed its decode (llama.cpp kept the uncut state, and refused the batch's positions).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from serving.engine.config import EngineConfig
from serving.engine.memory import ModelShape, kv_cache_bytes
from serving.engine.request import FinishReason, GenerationChunk, RequestHandle, SamplingParams
from serving.engine.scheduler import CHECKPOINT_TAIL
from tests.helpers import WAIT_S, script_module

if TYPE_CHECKING:
    from serving.engine.core import Engine

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
HISTORY = ("The river begins as a thin line of water in the hills, where rain collects in the moss and runs "
           "down between the stones until it finds the valley floor.")
SYNTHETIC = {"mamba": "tinymamba", "lfm2": "tinylfm2"}
KINDS = {"mamba": "recurrent", "lfm2": "hybrid"}


@dataclass(frozen=True)
class Answer:
    """A greedy answer: its tokens, each one's log-probability, and the prompt tokens its slot reused."""

    tokens: list[int]
    logprobs: list[float]
    cached: int


def answer(engine: Engine, prompt: list[int]) -> Answer:
    """Run one request to its end; the test fails on an error chunk."""
    return read(engine.submit(prompt, PARAMS))


def read(handle: RequestHandle) -> Answer:
    """A request's answer, read to its end; the test fails on an error chunk."""
    chunks: list[GenerationChunk] = []
    while not handle.finished:
        chunks.append(handle.get(timeout=WAIT_S))
    last = chunks[-1]
    assert last.finish_reason == FinishReason.length, f"ended with {last.finish_reason}: {last.error}"
    assert last.usage is not None
    return Answer([t for c in chunks for t in c.token_ids], [p.logprob for c in chunks for p in c.logprobs],
                  last.usage.cached_tokens)


def assert_same(warm: Answer, cold: Answer) -> None:
    assert warm.tokens == cold.tokens
    assert warm.logprobs == pytest.approx(cold.logprobs, abs=1e-3)


@pytest.fixture(scope="module")
def synthetic() -> Iterator[ModuleType]:
    yield from script_module("make_synthetic_gguf")


@pytest.fixture(scope="module")
def models(synthetic: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The `tinymamba` and `tinylfm2` presets (~16-18 MB each, half a second to write)."""
    out = tmp_path_factory.mktemp("memory_kinds")
    tokenizer = synthetic.read_tokenizer(synthetic.embedded_gguf_path())
    written = {}
    for arch, preset in SYNTHETIC.items():
        written[arch] = out / f"{preset}.gguf"
        synthetic.write_model(synthetic.PRESETS[preset], written[arch], seed=5, log=lambda _: None,
                              tokenizer=tokenizer)
    return written


def config(path: Path, **settings: object) -> EngineConfig:
    base = EngineConfig(model=path, n_ctx=1024, n_parallel=1, n_batch=64, n_ubatch=64, n_threads=2, seed=1,
                        cache_ram_mib=0)
    return base.model_copy(update=settings)


@pytest.mark.unit
def test_the_memory_model_counts_k_and_v_only_in_the_layers_that_attend(models: dict[str, Path]) -> None:
    """A Mamba header has no attention heads, LFM2's lists K/V heads a layer (0 in its convolution layers):
    both were refused by the fit at start (a division by zero, a list read as a number)."""
    mamba, lfm2 = ModelShape.from_gguf(models["mamba"]), ModelShape.from_gguf(models["lfm2"])
    assert (mamba.n_layer_kv, mamba.n_head, mamba.kv_bytes_per_token_f16) == (0, 0, 0)
    assert (lfm2.n_layer, lfm2.n_layer_kv, lfm2.n_head_kv) == (4, 2, 2)
    cells = EngineConfig(model=models["lfm2"], n_ctx=1024, n_parallel=1)
    assert kv_cache_bytes(lfm2, cells) == 2 * 2 * (2 * 64) * 2 * 1024  # K and V, 2 layers, f16, 1,024 cells
    assert kv_cache_bytes(mamba, cells.model_copy(update={"model": models["mamba"]})) == 0


@pytest.mark.engine
@pytest.mark.parametrize("arch", list(SYNTHETIC))
def test_a_recurrent_slot_reuses_what_it_can_and_going_back_answers_as_cold(models: dict[str, Path],
                                                                           arch: str) -> None:
    """One slot: a follow-up that extends all the slot holds reuses it; going back behind every checkpoint
    prefills from the start, the same prompt again goes back to the checkpoint 4 tokens before its end
    (llama_state_seq_get/set_data_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), and each answers as a cold
    engine does."""
    from serving.engine.core import Engine

    warm, cold = Engine(config(models[arch])), Engine(config(models[arch]))
    try:
        assert warm._ctx.memory_kind.value == KINDS[arch]
        history = warm.tokenize_prompt(HISTORY)
        first = answer(warm, history)
        follow_up = history + first.tokens[:-1] + history[1:4]  # the last answer token was never decoded
        assert answer(warm, follow_up).cached == len(history) + len(first.tokens) - 1
        going_back = history[:12] + history[20:24]
        for cached in (0, len(going_back) - CHECKPOINT_TAIL):  # behind every checkpoint, then the same again
            went_back = answer(warm, going_back)
            assert went_back.cached == cached
            assert_same(went_back, answer(cold, going_back))
            cold.erase_slot(0)
        counters = warm.stats()["counters"]
        assert counters["checkpoints_restored"] == 1 and counters["prefixes_refused"] == 0
    finally:
        warm.close()
        cold.close()


@pytest.mark.engine
@pytest.mark.parametrize("arch", list(SYNTHETIC))
def test_a_recurrent_state_comes_back_from_host_ram_and_from_a_slot_file(models: dict[str, Path], arch: str,
                                                                        tmp_path: Path) -> None:
    """One slot, two conversations taking turns: the first's state is saved when the second takes the slot,
    and restored for its next turn (llama_state_seq_get/set_data); a prompt going back inside it is not
    restored into. A slot file (llama_state_seq_save/load_file) brings a state back the same way. Each
    answer is the cold one."""
    from serving.engine.core import Engine

    warm = Engine(config(models[arch], cache_ram_mib=64))
    cold = Engine(config(models[arch]))
    try:
        a = warm.tokenize_prompt(HISTORY * 3)  # over the 64 tokens a state must hold to be saved
        b = warm.tokenize_prompt("A different conversation about the weather in the mountains, " * 3)
        a_held = a + answer(warm, a).tokens[:-1]
        answer(warm, b)  # takes the slot: a's state goes to host RAM
        returning = a_held + b[1:5]
        back = answer(warm, returning)
        cache = warm.stats()["prompt_cache"]
        assert cache["hits"] == 1 and back.cached == len(a_held), cache
        assert_same(back, answer(cold, returning))
        inside = a[:10] + b[1:5]
        assert answer(warm, inside).cached == 0 and warm.stats()["prompt_cache"]["hits"] == 1

        held = warm.stats()["slots"][0]["n_cached"]
        saved = warm.save_slot(0, tmp_path / "state.bin")
        assert saved.n_tokens == held and warm.erase_slot(0) == held
        assert warm.restore_slot(0, tmp_path / "state.bin").n_tokens == held
        continued = inside + answer(cold, inside).tokens[:-1] + b[5:8]
        cold.erase_slot(0)
        from_file = answer(warm, continued)
        assert from_file.cached == held
        assert_same(from_file, answer(cold, continued))
    finally:
        warm.close()
        cold.close()


@pytest.mark.engine
@pytest.mark.parametrize("arch", list(SYNTHETIC))
def test_choices_copy_a_recurrent_state_whole(models: dict[str, Path], arch: str) -> None:
    """n choices prefill once and copy the slot's memory (llama_memory_seq_cp of the whole sequence: the
    recurrent state is shared, then copied at the next decode); each answers as one request alone."""
    from serving.engine.core import Engine

    engine = Engine(config(models[arch], n_parallel=3))
    try:
        prompt = engine.tokenize_prompt(HISTORY)
        choices = [read(handle) for handle in engine.submit_choices(prompt, PARAMS, 3)]
        for slot in range(3):
            engine.erase_slot(slot)
        alone = answer(engine, prompt)
        for choice in choices:
            assert_same(choice, alone)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def gemma() -> Path:
    from tests.models import gemma3_270m_path

    return gemma3_270m_path()


@pytest.mark.engine
def test_gemma_going_back_past_its_sliding_window_answers_as_cold(gemma: Path) -> None:
    """Gemma 3 270M attends over a 512-token window in most layers. The context keeps every window cell
    (llama.cpp's swa_full, its default), so pos_min stays 0 and a slot goes back anywhere: after a history
    of 1,000 tokens (whose last position's window starts at 488), a prompt sharing its first 384 reuses
    them and answers as the same slot emptied does.

    384 is a whole number of micro-batches (128 rows), so both compute every cell in batches of the same
    rows: the CPU's kernels round differently by a batch's shape (repacked weights take rows four at a
    time), and with the reuse point inside a batch the log-probabilities differed by up to 0.12 (the tokens
    were the same)."""
    from measure.workload import source_text
    from serving.engine.core import Engine

    engine = Engine(config(gemma, n_ctx=2048, n_batch=128, n_ubatch=128))
    try:
        assert engine._ctx.memory_kind.value == "swa" and engine._ctx.n_swa == 512
        history = engine.tokenize_prompt(source_text()[:6000])[:1000]
        answer(engine, history)
        went_back = history[:384] + engine.tokenize_prompt("\nIn short,")[1:]
        back = answer(engine, went_back)
        assert back.cached == 384 and engine.stats()["counters"]["prefixes_refused"] == 0
        engine.erase_slot(0)
        assert_same(back, answer(engine, went_back))
    finally:
        engine.close()
