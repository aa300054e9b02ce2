"""Prompt lookup on its own: what it proposes, and that it never matches the suffix with itself."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from serving.engine.speculate import PromptLookup, SpecSettings


@pytest.mark.unit
def test_proposes_what_followed_the_last_occurrence() -> None:
    lookup = PromptLookup(SpecSettings(ngram_min=2, ngram_max=3))
    text = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert lookup.propose(text, 4) == [4, 5, 9, 9]
    assert lookup.propose(text + [4], 2) == [5, 9]


@pytest.mark.unit
def test_prefers_the_longest_and_latest_match() -> None:
    lookup = PromptLookup(SpecSettings(ngram_min=1, ngram_max=3))
    tokens = [7, 1, 2, 50, 8, 2, 60, 1, 2]
    assert lookup.propose(tokens, 1) == [50]  # "1 2" beats the later "2"
    assert PromptLookup(SpecSettings(ngram_min=1, ngram_max=1)).propose(tokens, 1) == [60]


@pytest.mark.unit
def test_no_match_no_guess_and_no_self_match() -> None:
    lookup = PromptLookup(SpecSettings())
    assert lookup.propose([1, 2, 3, 4], 5) == []
    assert lookup.propose([5, 5], 3) == []  # the only "5 5" is the suffix itself


# -- on the real model -------------------------------------------------------------------------------
from serving.engine.config import EngineConfig  # noqa: E402
from serving.engine.request import SamplingParams  # noqa: E402
from measure.workload import COPY_TASKS, source_text  # noqa: E402
from tests.helpers import collect  # noqa: E402

if TYPE_CHECKING:
    from serving.engine.core import Engine

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def sub(a, b):
    """Return a minus b."""
    return a - b
'''
COPY = f"Repeat this code exactly, then stop:\n\n{CODE}\nHere it is again:\n"


@pytest.fixture(scope="module")
def pair() -> tuple[Engine, Engine]:
    from serving.engine.core import Engine

    plain = Engine(EngineConfig(n_parallel=2, n_ctx=2048, seed=3))
    spec = Engine(EngineConfig(n_parallel=2, n_ctx=2048, seed=3, spec_mode="ngram", spec_draft_max=8))
    yield plain, spec
    plain.close()
    spec.close()


def _chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenize_prompt(engine.render_chat([{"role": "user", "content": text}]))


@pytest.mark.engine
def test_greedy_text_is_identical_with_speculation(pair: tuple[Engine, Engine]) -> None:
    plain, spec = pair
    for text in (COPY, "Write two sentences about autumn."):
        params = SamplingParams(max_tokens=96, temperature=0.0)
        assert collect(spec.submit(_chat(spec, text), params)).text == \
            collect(plain.submit(_chat(plain, text), params)).text
    counters = spec.stats()["counters"]
    assert counters["spec_accepted"] > 0  # it did speculate, and some guesses held


@pytest.mark.engine
def test_stop_strings_and_max_tokens_inside_a_draft_end_where_plain_decoding_does(pair) -> None:  # noqa: ANN001
    plain, spec = pair
    prompt = _chat(plain, COPY)
    for params in (SamplingParams(max_tokens=9, temperature=0.0), SamplingParams(max_tokens=80, temperature=0.0,
                                                                                 stop=("minus",))):
        a, b = collect(plain.submit(prompt, params)), collect(spec.submit(prompt, params))
        assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)


@pytest.mark.engine
def test_a_forced_call_verifies_guesses_under_its_guide_and_answers_as_plain_decoding(pair) -> None:  # noqa: ANN001
    """Guesses of a guided request are checked row by row, each row's mask computed when first asked for (only the
    first row's is computed with the decode, serving/engine/guided.py): the forced call (nested arrays of
    objects, its keys in the prompt for prompt lookup to find) is the one plain decoding gives."""
    from measure.constrained import modes
    from serving.openai.tools import messages_for_plain_template

    plain, spec = pair
    mode = modes()["tool_call_nested"]
    messages = messages_for_plain_template([{"role": "user", "content": mode.text}], list(mode.tools))
    prompt = plain.tokenize_prompt(plain.render_chat(messages))
    params = SamplingParams(max_tokens=160, temperature=0.0, constraint=mode.guide)
    before = spec.stats()["counters"]
    a, b = collect(plain.submit(prompt, params)), collect(spec.submit(prompt, params))
    assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)
    assert b.text.startswith('<tool_call>\n{"name": "place_order", "arguments": {"customer": ')
    assert spec.stats()["counters"]["spec_drafted"] > before.get("spec_drafted", 0)


@pytest.mark.engine
def test_rollback_leaves_the_cache_exactly_the_tokens_it_holds(pair: tuple[Engine, Engine]) -> None:
    """A follow-up that reuses the speculating slot's cache must answer as an engine with nothing cached."""
    from serving.engine.core import Engine

    plain, spec = pair
    first = _chat(spec, COPY)
    answer = collect(spec.submit(first, SamplingParams(max_tokens=64, temperature=0.0)))
    follow = first + answer.tokens + spec.tokenize_prompt(" Now explain it.")[1:]  # [1:]: no second BOS
    reused = collect(spec.submit(follow, SamplingParams(max_tokens=24, temperature=0.0)))
    assert reused.usage.cached_tokens >= len(first) + len(answer.tokens) - 1
    fresh = Engine(EngineConfig(n_parallel=1, n_ctx=1024, seed=3))
    try:
        assert collect(fresh.submit(follow, SamplingParams(max_tokens=24, temperature=0.0))).text == reused.text
    finally:
        fresh.close()


@pytest.fixture(scope="module")
def batch_invariant_pair() -> tuple[Engine, Engine]:
    """Engines whose logits on CPU do not depend on what else is in the batch: a q8_0 K cache with flash
    attention (scripts/batch_numerics.py; an f16 cache takes another kernel for a lone row past 512 cells)."""
    from serving.engine.core import Engine

    base = {"n_parallel": 3, "n_ctx": 3 * 2048, "seed": 3, "type_k": "q8_0", "type_v": "q8_0", "flash_attn": "on"}
    plain = Engine(EngineConfig(**base))
    spec = Engine(EngineConfig(**base, spec_mode="ngram", spec_draft_max=8, spec_max_busy=3))
    yield plain, spec
    plain.close()
    spec.close()


@pytest.mark.engine
def test_past_512_cells_greedy_text_is_identical_alone_and_among_concurrent_streams(batch_invariant_pair) -> None:  # noqa: ANN001,E501
    """The copy set's long prompts, one stream and then three at once (guesses verified in batches shared with
    the other streams): speculation changes no token."""
    plain, spec = batch_invariant_pair
    prompts = [_chat(plain, f"Request {i}. " + COPY_TASKS[i % len(COPY_TASKS)].format(text=source_text()))
               for i in range(3)]
    assert min(len(p) for p in prompts) > 600
    params = SamplingParams(max_tokens=64, temperature=0.0)
    before = spec.stats()["counters"]
    for engine_prompts in ([prompts[0]], prompts):
        texts = [[collect(h).text for h in [engine.submit(p, params) for p in engine_prompts]]
                 for engine in (plain, spec)]
        assert texts[0] == texts[1]
    after = spec.stats()["counters"]
    assert after["spec_accepted"] > before["spec_accepted"]  # guesses were verified, and some held


@pytest.mark.engine
def test_sampled_requests_stay_seeded_with_speculation(pair: tuple[Engine, Engine]) -> None:
    _, spec = pair
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=11)
    prompt = _chat(spec, COPY)
    assert collect(spec.submit(prompt, params)).text == collect(spec.submit(prompt, params)).text


# -- how many guesses pay: the draft length policy -----------------------------------------------------------
from serving.engine.speculate import (  # noqa: E402
    COST_WINDOW, PROBE_EVERY, UNTIMED_PROBE, Acceptance, StepCosts, could_pay, draft_length, expected_tokens,
)


def costs(per_rows: dict[int, float]) -> StepCosts:
    c = StepCosts()
    for rows, seconds in per_rows.items():
        c.observe(rows, 100 * seconds)  # each shape's first step is a warm-up, not a price
        c.observe(rows, seconds)
    return c


def acceptance(p_accepted: int, misses: int) -> Acceptance:
    a = Acceptance()
    a.accepted, a.misses = float(p_accepted), float(misses)
    return a


@pytest.mark.unit
def test_expected_tokens_counts_the_next_token_and_each_guess_kept_in_order() -> None:
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(1.0, 8) == 9.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


@pytest.mark.unit
def test_step_costs_interpolate_extrapolate_and_follow_new_measurements() -> None:
    c = costs({1: 10.0, 4: 25.0})
    assert c.relative(1, 1) == 1.0 and abs(c.relative(2, 1) - 1.5) < 1e-9  # between 1 and 4 rows
    assert abs(c.relative(8, 1) - 2.75) < 1e-9  # beyond: optimistic (0.1 of the largest's cost per row), so
    # a longer draft gets tried and is then priced as it measured, whatever the last slope said
    c.observe(4, 15.0)
    assert abs(c.relative(4, 1) - 2.0) < 1e-9  # the median of 25 and 15
    for _ in range(COST_WINDOW):
        c.observe(4, 12.0)
    assert abs(c.relative(4, 1) - 1.2) < 1e-9  # only the last COST_WINDOW steps count
    assert abs(StepCosts().relative(5, 1) - 1.4) < 1e-9  # nothing measured: optimistic, so guesses get tried


@pytest.mark.unit
def test_a_shapes_first_slow_step_does_not_price_guessing_out() -> None:
    """A batch shape's first decode does one-time work (a GPU builds its graph): were it the price, two rows
    would look 5x one row here, no guess would ever pay, and nothing would guess again to correct it."""
    c = StepCosts()
    for _ in range(3):
        c.observe(1, 1.0)
    c.observe(2, 5.0)
    assert not c.measured(2) and could_pay(c, 8, 1, 0.0)
    assert draft_length(acceptance(9, 1), c, 8, 1, False) > 0
    c.observe(2, 1.1)
    c.observe(2, 30.0)  # a step slowed by a neighbour: one of several, and the median holds
    c.observe(2, 1.2)
    assert abs(c.relative(2, 1) - 1.2) < 1e-9


@pytest.mark.unit
def test_on_a_cpu_where_rows_cost_nearly_a_decode_each_only_near_certain_guesses_pay() -> None:
    cpu = costs({1: 10.0, 2: 16.0, 4: 25.2, 8: 45.2, 16: 83.2})  # scripts/bench_verify.py on this machine
    assert draft_length(acceptance(36, 64), cpu, 15, 1, False) == 0  # the copy set's 36%: verifying is slower
    assert draft_length(acceptance(71, 29), cpu, 15, 1, False) == 2  # 1.075x: a short draft, barely
    assert draft_length(acceptance(97, 3), cpu, 15, 1, False) >= 7


@pytest.mark.unit
def test_on_a_gpu_where_rows_are_nearly_free_long_drafts_pay() -> None:
    # the H200, 27B-class: docs/log/2026-12-03-h200-verify-cost.md
    gpu = costs({1: 9.6, 2: 10.8, 4: 15.5, 8: 23.7, 16: 19.9})
    assert draft_length(acceptance(36, 64), gpu, 15, 1, False) >= 1
    assert draft_length(acceptance(90, 10), gpu, 15, 1, False) == 15
    assert draft_length(acceptance(90, 10), gpu, 3, 1, False) == 3  # no more than offered


@pytest.mark.unit
def test_a_request_that_stopped_guessing_probes_again() -> None:
    """A probe bets that the text turned predictable and verifies what would then pay best."""
    cpu = costs({1: 10.0, 2: 16.0, 3: 22.0, 4: 28.0, 5: 34.0})  # a row 0.6 of a step: at p = 0.9 two guesses pay
    steady = acceptance(1, 9)
    lengths = [draft_length(steady, cpu, 4, 1, probe_backoff=False) for _ in range(3 * PROBE_EVERY)]
    assert [i + 1 for i, k in enumerate(lengths) if k] == [PROBE_EVERY, 2 * PROBE_EVERY, 3 * PROBE_EVERY]
    assert set(lengths) == {0, 2}
    low = acceptance(1, 9)  # a draft model's probes back off: twice as far apart after each that found nothing
    lengths = [draft_length(low, cpu, 4, 1, probe_backoff=True) for _ in range(3 * PROBE_EVERY)]
    assert [i + 1 for i, k in enumerate(lengths) if k] == [PROBE_EVERY, 3 * PROBE_EVERY]
    low.record(2, missed=False)  # the probe held: counted, and the idle count starts again
    assert low.idle_steps == 0 and low.p > 0.1


@pytest.mark.unit
def test_a_costly_first_verify_does_not_price_longer_drafts_out() -> None:
    """Only one and two rows measured, two at 4.5x one (the H200 with the 135M model): a line through them
    would price 17 rows at ~75x and no draft could ever pay; priced optimistically, a long one is tried."""
    first = costs({1: 1.2, 2: 5.4})
    assert could_pay(first, 16, 1, 0.0)
    assert draft_length(acceptance(95, 5), first, 16, 1, False) >= 8


@pytest.mark.unit
def test_where_one_guess_costs_what_many_do_a_probe_guesses_many() -> None:
    """The H200 running the 135M model: one row decodes from a captured CUDA graph, more rows do not, so any
    verify costs ~4.5 steps, and a one-guess probe could never show a run worth that price."""
    # engine step ms by rows, the H200: docs/log/2026-12-04-spec-greedy-ceiling-h200.md
    small = costs({1: 1.2, 2: 5.5, 8: 5.8, 16: 6.5})
    low = acceptance(1, 9)
    lengths = [draft_length(low, small, 15, 1, probe_backoff=False) for _ in range(PROBE_EVERY)]
    assert lengths[-1] >= 8 and set(lengths[:-1]) == {0}
    assert draft_length(acceptance(95, 5), small, 15, 1, False) == 15  # once guesses hold, long drafts pay


@pytest.mark.unit
def test_a_guesser_as_slow_as_the_model_is_never_probed() -> None:
    """A draft model whose guess costs what a decode of the model does cannot pay even if every guess held:
    no probe (each would cost it the catching up); one at a third of the cost is still probed."""
    cpu = costs({1: 10.0, 2: 16.0, 4: 25.2})
    assert not could_pay(cpu, 8, 1, guess_seconds=10.0) and could_pay(cpu, 8, 1, guess_seconds=3.0)
    certain = acceptance(1, 9)
    assert set(draft_length(certain, cpu, 8, 1, True, guess_seconds=10.0) for _ in range(3 * PROBE_EVERY)) == {0}
    assert draft_length(acceptance(99, 1), cpu, 8, 1, True, guess_seconds=10.0) == 0
    slow = acceptance(1, 9)
    assert any(draft_length(slow, cpu, 8, 1, True, guess_seconds=3.0) for _ in range(3 * PROBE_EVERY))


@pytest.mark.unit
def test_a_guesser_not_yet_timed_is_probed_with_three_guesses() -> None:
    """Its first guess comes with the catching up; the second and third are one-row decodes, the first of
    which is a warm-up (StepCosts): the other is timed, what a guess costs."""
    low, cpu = acceptance(1, 9), costs({1: 10.0, 2: 16.0})
    lengths = [draft_length(low, cpu, 8, 1, True, guess_seconds=None) for _ in range(PROBE_EVERY)]
    assert lengths[-1] == UNTIMED_PROBE == 3 and set(lengths[:-1]) == {0}


@pytest.mark.unit
def test_recent_verifies_weigh_most() -> None:
    a = Acceptance()
    for _ in range(10):
        a.record(0, missed=True)
    assert a.p < 0.1
    for _ in range(10):
        a.record(8, missed=False)  # the text turned copyable
    assert a.p > 0.9


# -- the draft model's drafter, against a fake draft context -----------------------------------------------
import math  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from serving.engine.speculate import ModelDrafter  # noqa: E402


class FakeDraft:
    """A draft "model" whose next token after t is NEXT[t] with probability SURE[t] (default 0.9); it keeps
    its own record of each sequence's cells and checks every batch against it."""

    NEXT = {1: 2, 2: 3, 3: 4, 4: 1}
    SURE: dict[int, float] = {}
    n_ctx_seq = 64
    batch_capacity = 4

    def __init__(self) -> None:
        self.cells: dict[int, list[int]] = {}
        self.rows: list[tuple[int, int, int]] = []
        self.decodes = 0

    def clear_batch(self) -> None:
        self.rows = []

    def add_to_batch(self, tokens, start_pos, seq_id, want_logits, all_logits=False) -> int:  # noqa: ANN001
        assert len(self.rows) + len(tokens) <= self.batch_capacity
        self.rows += [(t, start_pos + i, seq_id) for i, t in enumerate(tokens)]
        return len(self.rows) - 1

    def decode(self) -> int:
        self.decodes += 1
        for token, pos, seq in self.rows:
            cells = self.cells.setdefault(seq, [])
            assert pos == len(cells), f"draft seq {seq}: position {pos} after {len(cells)} cells"
            cells.append(token)
        return 0

    def greedy(self, row: int) -> int:
        return self.NEXT.get(self.rows[row][0], 1)

    def logprobs(self, row: int, token: int, top_n: int) -> SimpleNamespace:
        return SimpleNamespace(logprob=math.log(self.SURE.get(self.rows[row][0], 0.9)))

    def forget(self, seq_id: int, from_pos: int = 0) -> bool:
        del self.cells.setdefault(seq_id, [])[from_pos:]
        return True


@pytest.mark.unit
def test_the_draft_model_guesses_ahead_and_keeps_its_cells_in_step_with_the_slot() -> None:
    ctx = FakeDraft()
    drafter = ModelDrafter(ctx, n_seqs=2, p_min=0.5).for_slot(1)
    prompt = [7, 7, 7, 7, 7, 1]  # longer than a batch: fed in chunks
    assert drafter.propose(prompt, 3) == [2, 3, 4]
    assert ctx.cells[1] == [*prompt, 2, 3]  # the last guess is not decoded: nothing asked for its logits
    # the model kept 2 and then said 9: the slot holds prompt + [2] and 9 is next; the draft drops 3 and follows
    assert drafter.propose([*prompt, 2, 9], 2) == [1, 2]
    assert ctx.cells[1] == [*prompt, 2, 9, 1]
    assert ctx.cells.get(0, []) == []  # the other slot's sequence is untouched


@pytest.mark.unit
def test_a_warmed_draft_takes_the_prompt_in_its_step_and_then_only_what_follows() -> None:
    ctx = FakeDraft()
    drafter = ModelDrafter(ctx, n_seqs=1, p_min=0.5).for_slot(0)
    drafter.warm([7, 7, 7, 1])
    assert ctx.cells[0] == [7, 7, 7, 1]
    decodes = ctx.decodes
    assert drafter.propose([7, 7, 7, 1, 2], 2) == [3, 4]
    assert ctx.decodes == decodes + 2  # the next token, then the first guess: the prompt is not decoded again


@pytest.mark.unit
def test_the_draft_model_times_its_one_row_decodes_as_the_cost_of_a_guess() -> None:
    ticks = iter(range(1000))
    drafter = ModelDrafter(FakeDraft(), n_seqs=1, p_min=0.5, clock=lambda: float(next(ticks)))
    slot = drafter.for_slot(0)
    assert slot.guess_seconds is None
    slot.propose([7, 7, 7, 1], 1)  # the catching up only: four rows
    assert slot.guess_seconds is None
    slot.propose([7, 7, 7, 1, 2, 3], 2)  # two rows to catch up, then the first guess decoded alone ...
    assert slot.guess_seconds is None  # ... the first one-row decode: a warm-up, not a price
    slot.propose([7, 7, 7, 1, 2, 3, 4], 2)
    assert slot.guess_seconds == 1.0


@pytest.mark.unit
def test_an_unsure_draft_stops_guessing() -> None:
    class Unsure(FakeDraft):
        SURE = {3: 0.2}  # after 3 the draft is unsure

    ctx = Unsure()
    assert ModelDrafter(ctx, n_seqs=1, p_min=0.5).for_slot(0).propose([1, 2], 8) == [3]
    assert ModelDrafter(Unsure(), n_seqs=1, p_min=0.1).for_slot(0).propose([1, 2], 3) == [3, 4, 1]


@pytest.mark.unit
def test_a_draft_model_that_fails_to_decode_offers_nothing_and_starts_over() -> None:
    class Failing(FakeDraft):
        def decode(self) -> int:
            return 1

    ctx = Failing()
    assert ModelDrafter(ctx, n_seqs=1, p_min=0.0).for_slot(0).propose([1, 2, 3], 4) == []
    assert ctx.cells.get(0, []) == []


@pytest.mark.unit
def test_a_draft_model_as_slow_as_the_model_stops_costing_after_its_first_timed_guess() -> None:
    """By a clock where a draft decode takes as long as a step of the model, guessing cannot pay even if
    every guess held: once a guess is timed, no more guesses, and the next request's prompt is not taken into
    the draft (a probe would then cost it the whole prompt); the tokens are the model's all along."""
    from serving.engine.scheduler import Scheduler
    from tests.test_scheduler import Repeating, flat_clock, req, run, tokens_of

    ctx, draft = Repeating(), FakeDraft()
    s = Scheduler(ctx, 1, default_seed=1, spec=SpecSettings(draft_max=4), clock=flat_clock(), draft=draft)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1]
    first = req(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    s.add([first])
    assert tokens_of(run(s, ctx), first) == [2, 3, 4, 1] * 3
    assert s.counters.spec_drafted > 0 and draft.cells[0][:len(prompt)] == prompt  # warmed, then timed
    drafted, decodes = s.counters.spec_drafted, draft.decodes
    second = req([4, 1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=12, temperature=0.0))
    s.add([second])
    assert tokens_of(run(s, ctx), second) == [3, 4, 1, 2] * 3
    assert s.counters.spec_drafted == drafted and draft.decodes == decodes


@pytest.mark.unit
def test_draft_mode_needs_a_draft_model() -> None:
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(spec_mode="draft")
    config = EngineConfig(spec_mode="draft", draft_model="/models/small.gguf", spec_draft_p_min=0.6)
    assert config.draft is not None and config.draft.model == Path("/models/small.gguf")
    assert config.draft.spec_mode.value == "off" and config.speculation is not None
    assert config.speculation.p_min == 0.6
    assert EngineConfig(spec_mode="ngram", draft_model="/models/small.gguf").draft is None


@pytest.mark.engine
def test_self_drafting_gives_the_same_greedy_text(pair: tuple[Engine, Engine]) -> None:
    """The embedded model as its own draft model: every guess it verifies is what it would have said."""
    from serving.engine.core import Engine

    plain, _ = pair
    model = plain.config.model_path
    drafting = Engine(EngineConfig(n_parallel=2, n_ctx=2048, seed=3, spec_mode="draft", draft_model=model))
    try:
        for text in (COPY, "Write two sentences about autumn."):
            params = SamplingParams(max_tokens=64, temperature=0.0)
            assert collect(drafting.submit(_chat(drafting, text), params)).text == \
                collect(plain.submit(_chat(plain, text), params)).text
        counters = drafting.stats()["counters"]
        assert counters["spec_drafted"] > 0 and counters["spec_accepted"] >= 0.9 * counters["spec_drafted"]
        drafting.reconfigure(drafting.config.model_copy(update={"spec_mode": "ngram"}))  # the draft is freed
        assert collect(drafting.submit(_chat(drafting, COPY), SamplingParams(max_tokens=16, temperature=0.0))).text
    finally:
        drafting.close()


@pytest.mark.engine
def test_a_draft_cut_from_the_model_shares_its_vocabulary(tmp_path: Path) -> None:
    """scripts/make_draft_gguf.py: the first blocks of the embedded model, a draft llama.cpp loads and the
    engine accepts (same vocabulary), with the block count it was asked for."""
    from serving.engine.core import Engine

    import importlib.util
    import sys

    import gguf

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_draft_gguf.py"
    spec = importlib.util.spec_from_file_location("make_draft_gguf", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = tmp_path / "draft-4.gguf"
    assert module.main(["--layers", "4", "--out", str(out)]) == 0
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["llama.block_count"].contents() == 4
    assert not any(t.name.startswith("blk.4.") for t in reader.tensors)
    engine = Engine(EngineConfig(n_parallel=1, n_ctx=512, spec_mode="draft", draft_model=out))
    try:
        assert collect(engine.submit(engine.tokenize_prompt("Hello"), SamplingParams(max_tokens=4,
                                                                                       temperature=0.0))).tokens
    finally:
        engine.close()


def _stats(counters: Any, **more: Any) -> Any:
    """An idle engine's snapshot with these counters (and cache counts, acceptance) for the metrics."""
    from serving.engine.config import EngineConfig
    from serving.engine.stats import EngineStats

    return EngineStats(config=EngineConfig(), n_ctx_slot=1, weight_loads=1, slots=[], slots_busy=0, queue_depth=0,
                       counters=counters, **more)


@pytest.mark.engine
def test_speculation_counters_reach_the_metrics_as_deltas() -> None:
    """/metrics: the engine's totals become counters that grow by what was counted since the last snapshot
    (an engine restart starts its totals again), and the acceptance rate a gauge."""
    from serving.engine.scheduler import Counters
    from serving.replica.metrics import ReplicaMetrics

    def lines(text: bytes) -> dict[str, float]:
        return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.decode().splitlines()
                if ln.startswith("llm_spec_") and "_created" not in ln}

    metrics = ReplicaMetrics("r", "m")
    stats = _stats(Counters(spec_drafted=10, spec_accepted=7), spec_acceptance=0.7)
    assert lines(metrics.exposition(stats)) == {"llm_spec_draft_tokens_total": 10.0,
                                                "llm_spec_accepted_tokens_total": 7.0, "llm_spec_acceptance_rate": 0.7}
    restarted = _stats(Counters(spec_drafted=4, spec_accepted=1), spec_acceptance=0.25)
    assert lines(metrics.exposition(restarted)) == {"llm_spec_draft_tokens_total": 14.0,
                                                    "llm_spec_accepted_tokens_total": 8.0,
                                                    "llm_spec_acceptance_rate": 0.25}


@pytest.mark.engine
def test_prompt_cache_counts_reach_the_metrics() -> None:
    """/metrics: the prompt cache's hits, restored tokens, evictions, saves and skipped saves as counters
    growing by the engine's deltas, its bytes and entries as gauges; nothing when the cache is off."""
    from dataclasses import replace

    from serving.engine.prompt_cache import PromptCacheStats
    from serving.engine.scheduler import Counters
    from serving.replica.metrics import ReplicaMetrics

    def lines(text: bytes) -> dict[str, float]:
        return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.decode().splitlines()
                if ln.startswith("llm_prompt_cache_") and "_created" not in ln}

    metrics = ReplicaMetrics("r", "m")
    assert lines(metrics.exposition(_stats(Counters()))) == {}
    cache = PromptCacheStats(limit_bytes=1000, entries=2, bytes=600, tokens=90, hits=3, hit_tokens=75, saves=5,
                             skipped=4, evictions=1)
    assert lines(metrics.exposition(_stats(Counters(), prompt_cache=cache))) == {
        "llm_prompt_cache_hits_total": 3.0, "llm_prompt_cache_hit_tokens_total": 75.0,
        "llm_prompt_cache_evictions_total": 1.0, "llm_prompt_cache_saves_total": 5.0,
        "llm_prompt_cache_skipped_saves_total": 4.0, "llm_prompt_cache_bytes": 600.0,
        "llm_prompt_cache_entries": 2.0}
    later = replace(cache, hits=5, hit_tokens=100, entries=1, bytes=300)
    assert lines(metrics.exposition(_stats(Counters(), prompt_cache=later)))["llm_prompt_cache_hits_total"] == 5.0


@pytest.mark.engine
def test_the_verify_benchmark_caches_a_depth_longer_than_its_batch() -> None:
    """scripts/bench_verify.py at 64k cached tokens put the whole depth in one batch of 512 rows and failed on
    the GPU; the depth is cached a batch at a time, and a decode after it lands where it should."""
    from serving.engine.llama import LlamaContext, LlamaModel  # first: the library load order
    from measure.verify_cost import prefill, timed_decode
    from serving.engine.config import EngineConfig, default_threads

    config = EngineConfig(n_parallel=1, n_ctx=1536, n_batch=512, n_ubatch=512)
    model = LlamaModel(config.model_path, config.n_gpu_layers)
    ctx = LlamaContext(model, config, default_threads())
    try:
        depth = 1100  # two full batches and part of a third
        prefill(ctx, [(17 + 31 * i) % 1000 + 5 for i in range(depth)], config.n_batch)
        assert ctx.pos_min(0) == 0
        assert timed_decode(ctx, [7], depth) > 0
        assert ctx.forget(0, depth) and ctx.pos_min(0) == 0
    finally:
        ctx.free()
        model.free()
