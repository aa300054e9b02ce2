"""The engine in-process: slot isolation, prefix reuse, cancellation, limits, reconfigure, scoring."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest

from serving.engine.errors import PromptTooLongError
from serving.engine.request import ConstraintKind, FinishReason, SamplingParams
from tests.helpers import collect

if TYPE_CHECKING:
    from serving.engine.core import Engine

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
PROMPTS = [
    "The capital of France is",
    "List three colours of the rainbow:",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The quick brown fox",
]


def generate(engine: Engine, prompt: str, params: SamplingParams = GREEDY) -> tuple[str, list[int]]:
    """Text and tokens of one generation; fails the test if the generation ends in an error."""
    gen = collect(engine.submit(engine.tokenize_prompt(prompt), params))
    return gen.text, gen.tokens


def test_concurrent_requests_match_each_request_alone(engine: Engine) -> None:
    alone = [generate(engine, p) for p in PROMPTS]
    handles = [engine.submit(engine.tokenize_prompt(p), GREEDY) for p in PROMPTS]  # 5 > 4 slots: one queues
    together = [(g.text, g.tokens) for g in map(collect, handles)]
    assert together == alone
    assert all(len(tokens) == 24 for _, tokens in alone)


def test_follow_up_turn_reuses_the_slot_prefix(engine: Engine) -> None:
    first = "Tell me a short story about a lighthouse keeper who finds a message in a bottle."
    answer, _ = generate(engine, first)
    follow_up = first + answer + " What happened next?"
    before = engine.stats()["counters"]["prompt_tokens_evaluated"]
    text_reused, _ = generate(engine, follow_up)
    evaluated = engine.stats()["counters"]["prompt_tokens_evaluated"] - before
    n_prompt = len(engine.tokenize_prompt(follow_up))
    assert evaluated < n_prompt / 2
    # the same prompt on an engine with nothing cached gives the same answer
    from serving.engine.core import Engine

    fresh = Engine(engine.config)
    try:
        text_fresh, _ = generate(fresh, follow_up)
    finally:
        fresh.close()
    assert text_reused == text_fresh


def test_cancel_frees_the_slot_at_the_next_step(engine: Engine) -> None:
    handle = engine.submit(engine.tokenize_prompt("Count from one to one thousand:"),
                           SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    first = next(handle)
    assert first.finish_reason is None
    handle.cancel()
    last = collect(handle, allow=(FinishReason.cancelled,))
    assert last.finish_reason == FinishReason.cancelled
    assert engine.stats()["slots_busy"] == 0


def test_max_tokens_and_stop_strings(engine: Engine) -> None:
    text, tokens = generate(engine, "One, two, three, four,", SamplingParams(max_tokens=5, temperature=0.0))
    assert len(tokens) == 5
    full, _ = generate(engine, "One, two, three, four,", SamplingParams(max_tokens=20, temperature=0.0))
    stop = full.strip().split()[2]
    stopped, _ = generate(engine, "One, two, three, four,",
                          SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,)))
    assert stop not in stopped and full.startswith(stopped)


def test_seeded_sampling_repeats_and_differs_by_seed(engine: Engine) -> None:
    def sample(seed: int) -> str:
        return generate(engine, "Once upon a time",
                        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=40, seed=seed))[0]

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_penalties_change_greedy_output(engine: Engine) -> None:
    plain, _ = generate(engine, "la la la la la la", SamplingParams(max_tokens=16, temperature=0.0))
    penalised, _ = generate(engine, "la la la la la la",
                            SamplingParams(max_tokens=16, temperature=0.0, repeat_penalty=1.5,
                                           frequency_penalty=1.0))
    assert plain != penalised


def test_prompt_longer_than_a_slot_is_refused(engine: Engine) -> None:
    tokens = engine.tokenize_prompt("word " * 2000)
    with pytest.raises(PromptTooLongError) as info:
        engine.submit(tokens, GREEDY)
    assert info.value.n_ctx_slot == engine.n_ctx_slot


def test_generation_stops_at_the_slot_end(engine: Engine) -> None:
    tokens = engine.tokenize_prompt("word " * 900)
    gen = collect(engine.submit(tokens, SamplingParams(temperature=0.0, ignore_eos=True)))
    assert gen.finish_reason == FinishReason.length
    assert gen.usage.prompt_tokens + gen.usage.completion_tokens == engine.n_ctx_slot


def test_reconfigure_keeps_weights_and_waiting_requests(engine: Engine) -> None:
    old = engine.config
    loads = engine.weight_loads
    new = old.model_copy(update={"n_parallel": 2, "n_ctx": 2048, "n_batch": 512})
    results: list[str] = []
    worker = threading.Thread(target=lambda: results.append(generate(engine, PROMPTS[0])[0]))
    try:
        running = engine.submit(engine.tokenize_prompt(PROMPTS[1]), GREEDY)
        worker.start()
        engine.reconfigure(new)
        assert collect(running).finish_reason == FinishReason.length  # the running request finished first
        worker.join(60)
        assert results and results[0] == generate(engine, PROMPTS[0])[0]
        assert engine.config == new and engine.n_ctx_slot == 1024 and len(engine.stats()["slots"]) == 2
        assert engine.weight_loads == loads
    finally:
        engine.reconfigure(old)


def test_one_kv_buffer_for_all_slots_keeps_sequences_apart_bit_for_bit() -> None:
    """kv_unified: every slot's cells in one buffer, each row masked to its own sequence's. Four prompts of
    unequal lengths decoded in one batch give the logits each gives alone, and so do 8 greedy steps after."""
    import numpy as np

    from serving.engine.config import EngineConfig, embedded_model_path
    from serving.engine.llama import LlamaContext, LlamaModel

    unified = EngineConfig(n_parallel=4, n_ctx=4096, kv_unified=True)
    model = LlamaModel(embedded_model_path(), 0, extra_bufts=False)
    prompts = [model.tokenize(p) for p in PROMPTS[:4]]

    def decode(seqs: list[int]) -> dict[int, list[np.ndarray]]:
        ctx = LlamaContext(model, unified, 1)
        try:
            rows = {s: ctx.add_to_batch(prompts[s], 0, s, True) for s in seqs}
            logits: dict[int, list[np.ndarray]] = {s: [] for s in seqs}
            for step in range(8):
                assert ctx.decode() == 0
                for s in seqs:
                    logits[s].append(np.array(ctx.logits(rows[s])))
                ctx.clear_batch()
                rows = {s: ctx.add_to_batch([int(logits[s][-1].argmax())], len(prompts[s]) + step, s, True)
                        for s in seqs}
            return logits
        finally:
            ctx.free()

    try:
        together = decode([0, 1, 2, 3])
        for s in range(4):
            alone = decode([s])[s]
            assert all(np.array_equal(a, b) for a, b in zip(alone, together[s], strict=True)), f"sequence {s}"
    finally:
        model.free()


def test_one_kv_buffer_for_all_slots_serves_choices_and_keeps_slots_to_their_share(engine: Engine) -> None:
    """kv_unified through the engine: concurrent prompts of unequal lengths, n choices from one prefill, and a
    slot still ends at its n_ctx / n_parallel cells with every slot full, so the slots never overfill the
    shared cache. (Greedy text alone and beside others is not compared: in one buffer a sequence's cells can
    lie out of order after others were freed, which changes llama.cpp's summation order in the last bits.)"""
    old = engine.config
    engine.reconfigure(old.model_copy(update={"kv_unified": True}))
    try:
        assert engine.n_ctx_slot == old.n_ctx_per_slot and engine.weight_loads == 1
        handles = [engine.submit(engine.tokenize_prompt(p), GREEDY) for p in PROMPTS]
        assert all(len(collect(h).tokens) == 24 for h in handles)
        seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=7)
        choices = [collect(h) for h in engine.submit_choices(engine.tokenize_prompt(PROMPTS[2]), seeded, 3)]
        assert all(len(c.tokens) == 12 for c in choices) and len({tuple(c.tokens) for c in choices}) > 1
        to_the_end = SamplingParams(temperature=0.0, ignore_eos=True)
        long = [engine.submit(engine.tokenize_prompt(f"{i} " + "word " * 900), to_the_end)
                for i in range(old.n_parallel)]
        for gen in map(collect, long):
            assert gen.usage is not None and gen.finish_reason == FinishReason.length
            assert gen.usage.prompt_tokens + gen.usage.completion_tokens == old.n_ctx_per_slot
        assert engine.stats()["counters"]["decode_failures"] == 0
    finally:
        engine.reconfigure(old)


def test_score_is_finite_and_quantised_cache_costs_little(engine: Engine) -> None:
    tokens = engine.tokenize_prompt("The river begins as a thin line of water in the hills, where rain collects.")
    nll = engine.score(tokens)
    assert 0.5 < nll < 12.0
    assert engine.score(tokens) == pytest.approx(nll, abs=1e-6)


def test_a_conversation_that_lost_its_slot_comes_back_from_host_ram_with_the_same_answer(engine: Engine) -> None:
    """Two slots, three conversations: the third takes the first's slot, whose state goes to host RAM; the
    first's next turn gets it restored and prefills only its new question, and answers token for token as
    an engine where it never left its slot (four slots, no cache)."""
    from measure.workload import source_text
    from serving.engine.core import Engine

    text = source_text() * 2
    histories = [f"Conversation {i}.\n" + text[i * 700:i * 700 + 900] for i in range(3)]  # ~240 tokens each
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def converse(on: Engine) -> tuple[list[int], int]:
        for history in histories:
            generate(on, history, params)
        back = collect(on.submit(on.tokenize_prompt(histories[0] + "\nAnd then?"), params))
        assert back.usage is not None
        return back.tokens, back.usage.cached_tokens

    two = engine.config.model_copy(update={"n_parallel": 2, "n_ctx": 2048, "cache_ram_mib": 64})
    hot = Engine(two)
    try:
        tokens, cached = converse(hot)
        cache = hot.stats()["prompt_cache"]
    finally:
        hot.close()
    n_history = len(engine.tokenize_prompt(histories[0]))
    assert cache["hits"] == 1 and cache["saves"] >= 1 and cache["bytes"] > 0, cache
    assert cached >= n_history - 2, f"restored {cached} of the {n_history}-token history"
    wide = Engine(two.model_copy(update={"n_parallel": 4, "n_ctx": 4096, "cache_ram_mib": 0}))
    try:
        kept_tokens, kept_cached = converse(wide)
        assert wide.stats()["prompt_cache"] is None
    finally:
        wide.close()
    assert kept_cached == cached and kept_tokens == tokens



def test_an_idle_engine_saves_a_finished_slot_before_a_prompt_needs_the_slot(engine: Engine) -> None:
    """The step thread, finding nothing to do, saves the older of two finished slots (so the prompt that
    later takes it does not wait for the copy): its state is in the cache with no other prompt sent. The
    newer one is left where its conversation would come back to."""
    import time

    from measure.workload import source_text
    from serving.engine.core import Engine

    idle = Engine(engine.config.model_copy(update={"n_parallel": 2, "n_ctx": 2048, "cache_ram_mib": 64}))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        older, newer = source_text()[:900], source_text()[2000:2900]
        n_older = len(idle.tokenize_prompt(older))
        generate(idle, older, params)
        generate(idle, newer, params)
        deadline = time.monotonic() + 30
        while idle.stats()["prompt_cache"]["saves"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # room for a second save, which must not come
        cache = idle.stats()["prompt_cache"]
    finally:
        idle.close()
    assert cache["saves"] == 1 and cache["entries"] == 1, cache
    assert n_older + 3 <= cache["tokens"] <= n_older + 4, cache  # the older prompt and its answer's cells


def test_slot_files_save_erase_and_restore_into_another_slot(engine: Engine, tmp_path) -> None:  # noqa: ANN001
    """llama-server's slot save / erase / restore: a slot's cells go to a file and come back into another slot,
    where a prompt extending them prefills only the rest; a file this context cannot load is refused with a
    clear error and leaves the slot empty; a slot id out of range is refused before anything waits."""
    from measure.workload import source_text
    from serving.engine.config import CacheType
    from serving.engine.core import Engine

    prompt = "Slot files.\n" + source_text()[:1000]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    two = Engine(engine.config.model_copy(update={"n_parallel": 2, "n_ctx": 2048}))
    try:
        generate(two, prompt, params)
        held = {s["id"]: s["n_cached"] for s in two.stats()["slots"]}
        source = max(held, key=lambda i: held[i])
        saved = two.save_slot(source, tmp_path / "doc.bin")
        assert saved.n_tokens == held[source] > 200 and saved.n_bytes == (tmp_path / "doc.bin").stat().st_size
        assert two.erase_slot(source) == saved.n_tokens
        target = 1 - source
        restored = two.restore_slot(target, tmp_path / "doc.bin")
        assert restored.n_tokens == saved.n_tokens and restored.filename == "doc.bin"
        assert {s["id"]: s["n_cached"] for s in two.stats()["slots"]} == {source: 0, target: saved.n_tokens}
        back = collect(two.submit(two.tokenize_prompt(prompt + "\nMore."), params))
        assert back.usage is not None and back.usage.cached_tokens >= len(two.tokenize_prompt(prompt)) - 2
        (tmp_path / "junk.bin").write_bytes(b"not a slot state" * 64)
        with pytest.raises(ValueError, match="not a slot state this model and config can load"):
            two.restore_slot(source, tmp_path / "junk.bin")
        with pytest.raises(ValueError, match="out of range"):
            two.save_slot(2, tmp_path / "x.bin")
        two.reconfigure(two.config.model_copy(update={"type_k": CacheType.q8_0}))  # another cache layout
        with pytest.raises(ValueError, match="not a slot state"):
            two.restore_slot(0, tmp_path / "doc.bin")
        assert all(s["n_cached"] == 0 for s in two.stats()["slots"])
        assert len(generate(two, "Still serving:", params)[1]) == 4
    finally:
        two.close()


def _greedy_and_full_pass(chain: Any) -> tuple[Callable[[Any], int], Callable[[Any], int]]:
    """A sampler's greedy step under its constraint, and the full pass it must agree with (GBNF: llama.cpp's
    grammar over the vocabulary; a guide: the argmax of the logits under llguidance's mask)."""
    guide = chain._guide
    if guide is None:
        return chain._greedy_grammar, partial(chain._select, grammar_first=True)
    from serving.engine.llama import masked_logits

    return partial(chain._greedy_guided, guide), \
        lambda values: int(masked_logits(values, guide.allowed()).argmax())


def test_guided_greedy_keeps_forced_text_in_its_canonical_tokens() -> None:
    """Where a guide forces text (a tool's name), its mask allows only the canonical token ("get"), where
    llguidance's single-token check also takes a split ("g"): once the model's choice is refused, greedy
    follows the mask, even when the split ranks higher."""
    import numpy as np

    from serving.engine.config import EngineConfig, embedded_model_path
    from serving.engine.llama import LlamaContext, LlamaModel, SamplerChain
    from serving.openai.structured import tool_call_guide

    model = LlamaModel(embedded_model_path(), n_gpu_layers=0)
    ctx = LlamaContext(model, EngineConfig(n_parallel=1, n_ctx=256), 1)
    call = tool_call_guide([("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})],
                           parallel=False)
    chain = SamplerChain(ctx, SamplingParams(temperature=0.0, constraint=call), 1)
    try:
        guide = chain._guide
        assert guide is not None
        for token in model.tokenize('<tool_call>\n{"name": "', add_special=False, parse_special=True):
            guide.advance(token)
        split, canonical, refused = (model.tokenize(t, add_special=False, parse_special=False)[0]
                                     for t in ("g", "get", "{"))
        assert guide._ready().validate_tokens([split]) == 1 and not guide.allows(split) and guide.allows(canonical)
        logits = np.zeros(ctx.n_vocab, dtype=np.float32)
        logits[[refused, split, canonical]] = [3.0, 2.0, 1.0]
        assert chain._greedy_guided(guide, logits) == canonical and chain.resamples == 1
    finally:
        chain.free()
        ctx.free()
        model.free()


@pytest.mark.parametrize("kind", [ConstraintKind.gbnf, ConstraintKind.guide])
def test_constrained_greedy_takes_the_best_allowed_token_as_the_full_pass_does(kind: ConstraintKind) -> None:
    """Greedy under a grammar (GBNF) checks the best tokens one by one instead of a pass over the vocabulary, and
    under a guide (llguidance) picks from the mask computed ahead: each must pick what the full pass picks,
    whether the best allowed token ranks 2nd, 30th or beyond GBNF's tries."""
    import numpy as np

    from serving.engine.config import EngineConfig, embedded_model_path
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from serving.engine.llama import GREEDY_TRIES, LlamaContext, LlamaModel, SamplerChain
    from serving.engine.request import Constraint
    from serving.openai.structured import json_schema_guide

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    model = LlamaModel(embedded_model_path(), n_gpu_layers=0)
    ctx = LlamaContext(model, EngineConfig(n_parallel=1, n_ctx=256), 1)
    constraint = Constraint(kind, json_schema_to_gbnf(json.dumps(schema))) if kind is ConstraintKind.gbnf \
        else json_schema_guide(schema)
    rng = np.random.default_rng(7)
    try:
        for rank in (1, 2, 5, GREEDY_TRIES, GREEDY_TRIES + 5, 400):
            chain = SamplerChain(ctx, SamplingParams(temperature=0.0, constraint=constraint), 1)
            greedy, full = _greedy_and_full_pass(chain)
            try:
                logits = rng.standard_normal(ctx.n_vocab).astype(np.float32)
                allowed = full(logits)  # the best token the constraint allows
                order = np.sort(logits)[::-1]
                logits[allowed] = order[rank - 1] + 1e-4 if rank > 1 else order[0] + 1.0  # now ranks about `rank`
                best = full(logits)
                assert greedy(logits) == best == allowed, rank
                assert chain.resamples == (rank > 1)
            finally:
                chain.free()
    finally:
        ctx.free()
        model.free()


def test_ignore_eos_never_samples_an_end_of_generation_token(engine: Engine) -> None:
    """As llama-server (a logit bias on every EOG token): greedy, where this raw prompt's top first token is
    SmolLM2's EOS, and sampled, with a bias that makes EOS every step's choice; without ignore_eos the same
    bias ends the answer at once (so the bias does reach the sampler)."""
    prompt = engine.tokenize_prompt("Request 100. Write a short story about a lighthouse keeper who finds a "
                                    "message in a bottle.")
    [eos] = engine.tokenize("<|im_end|>", add_special=False, parse_special=True)
    greedy = collect(engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    assert len(greedy.tokens) == 8 and eos not in greedy.tokens
    assert all(engine.token_piece(t) for t in greedy.tokens)  # every token shows text, the first one too
    sampled = collect(engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0.8, seed=5,
                                                           logit_bias=((eos, 100.0),), ignore_eos=True)))
    assert len(sampled.tokens) == 8 and eos not in sampled.tokens
    ended = collect(engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0.8, seed=5,
                                                         logit_bias=((eos, 100.0),))))
    assert ended.finish_reason == FinishReason.stop and ended.usage is not None and ended.usage.completion_tokens == 0
