"""The `chat_template` setting: a llama.cpp built-in format by name, or a Jinja file, over the GGUF's own
template; ChatML with a warning when there is neither. Pure parts first, then the real Gemma 3 270M GGUF,
which carries no template (tests/models.py): the base model, not an instruction-tuned one."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from serving.engine.chat_template import SpecialTokens
from tests.models import gemma3_270m_path

if TYPE_CHECKING:
    from serving.engine.core import Engine

NAMES = ("chatml", "gemma", "llama3")
JINJA = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
         "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
         "{% if add_generation_prompt %}<bot>{% endif %}")
TOKENS = SpecialTokens("<s>", "</s>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _formatter(calls: list[tuple[str, list[tuple[str, str]], bool]]):  # type: ignore[no-untyped-def]
    def format_chat(name: str, messages: Sequence[tuple[str, str]], add_assistant: bool) -> str:
        calls.append((name, list(messages), add_assistant))
        return f"{name}:" + "|".join(f"{r}={c}" for r, c in messages)
    return format_chat


# -- the setting, as EngineConfig reads it -------------------------------------------------------------
@pytest.mark.unit
def test_a_bare_word_is_a_name_and_a_path_an_absolute_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.engine.config import EngineConfig

    assert EngineConfig().chat_template is None and EngineConfig(chat_template="  ").chat_template is None
    assert EngineConfig(chat_template="gemma").chat_template == "gemma"
    assert EngineConfig(chat_template="granite-4.0").chat_template == "granite-4.0"  # a dot is no path
    (tmp_path / "mine.jinja").write_text(JINJA)
    monkeypatch.chdir(tmp_path)
    for given in ("mine.jinja", "./mine.jinja", str(tmp_path / "mine.jinja"), tmp_path / "mine.jinja"):
        assert EngineConfig(chat_template=given).chat_template == str(tmp_path / "mine.jinja")


@pytest.mark.unit
def test_a_missing_file_is_refused_when_the_config_is_read(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from serving.engine.config import EngineConfig, load_engine_config

    with pytest.raises(ValidationError, match="no such file"):
        EngineConfig(chat_template=str(tmp_path / "nowhere.jinja"))
    config = tmp_path / "engine.yaml"
    config.write_text("engine:\n  chat_template: gemma\n")
    assert load_engine_config(config).chat_template == "gemma"  # what `serve run ... config=FILE` reads
    # `serve run serving.app:main chat_template=llama3`: the app's arguments pass engine keys as these overrides
    assert load_engine_config(config, {"chat_template": "llama3"}).chat_template == "llama3"


# -- choosing and rendering, with a stand-in for llama.cpp's formatter -----------------------------------
@pytest.mark.unit
def test_a_builtin_name_renders_through_llama_cpps_formatter() -> None:
    from serving.engine.chat_template import TemplateOrigin, chat_template_for

    calls: list[tuple[str, list[tuple[str, str]], bool]] = []
    template = chat_template_for("m.gguf", "gemma", "{{ gguf }}", TOKENS, NAMES, _formatter(calls))
    assert template.origin is TemplateOrigin.builtin and template.source == "gemma" and not template.knows_tools
    out = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": None}], tools=TOOLS, template_kwargs={"x": 1})
    assert out == "gemma:system=Be brief.|user=hi|assistant="
    assert calls == [("gemma", [("system", "Be brief."), ("user", "hi"), ("assistant", "")], True)]


@pytest.mark.unit
def test_a_formatter_refusal_is_a_template_error() -> None:
    from serving.engine.chat_template import ChatTemplateError, chat_template_for

    def refuse(name: str, messages: Sequence[tuple[str, str]], add_assistant: bool) -> str:
        raise ValueError("llama.cpp's chat format 'gemma' cannot format these messages")

    template = chat_template_for("m.gguf", "gemma", None, TOKENS, NAMES, refuse)
    with pytest.raises(ChatTemplateError, match="cannot format"):
        template.render([{"role": "user", "content": "hi"}])


@pytest.mark.unit
def test_an_unknown_name_is_an_error_listing_the_names() -> None:
    from serving.engine.chat_template import chat_template_for
    from serving.engine.errors import EngineError

    with pytest.raises(EngineError, match="'gema' is not one of llama.cpp's built-in chat templates "
                                          r"\(chatml, gemma, llama3\)"):
        chat_template_for("m.gguf", "gema", None, TOKENS, NAMES, _formatter([]))


@pytest.mark.unit
def test_a_jinja_file_renders_tools_and_wins_over_the_gguf(tmp_path: Path) -> None:
    from serving.engine.chat_template import TemplateOrigin, chat_template_for
    from serving.engine.errors import EngineError

    path = tmp_path / "t.jinja"
    path.write_text(JINJA)
    template = chat_template_for("m.gguf", str(path), "{{ 'gguf' }}", TOKENS, NAMES, _formatter([]))
    assert template.origin is TemplateOrigin.file and template.knows_tools
    assert template.render([{"role": "user", "content": "hi"}], tools=TOOLS) == "[get_weather]<user>hi<bot>"
    for bad, why in (("", "empty"), ("{% for %}", "not a Jinja template")):
        path.write_text(bad)
        with pytest.raises(EngineError, match=why):
            chat_template_for("m.gguf", str(path), None, TOKENS, NAMES, _formatter([]))
    with pytest.raises(EngineError, match="cannot read"):
        chat_template_for("m.gguf", str(tmp_path / "gone.jinja"), None, TOKENS, NAMES, _formatter([]))


@pytest.mark.unit
def test_the_gguf_template_serves_unless_set_and_chatml_falls_back_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    from serving.engine.chat_template import CHATML, TemplateOrigin, chat_template_for

    own = chat_template_for("m.gguf", None, JINJA, TOKENS, NAMES, _formatter([]))
    assert own.origin is TemplateOrigin.gguf and own.source == JINJA
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="serving"):
        fallback = chat_template_for("bare.gguf", None, None, TOKENS, NAMES, _formatter([]))
    assert fallback.origin is TemplateOrigin.fallback and fallback.source == CHATML
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "bare.gguf" in caplog.text and "falling back to ChatML" in caplog.text and "chat_template" in caplog.text


@pytest.mark.unit
def test_a_jinja_templates_bos_is_dropped_where_tokenising_adds_one(tmp_path: Path) -> None:
    """As llama-server's --jinja: the template's `{{ bos_token }}` and the tokenizer's BOS would make two."""
    from serving.engine.chat_template import chat_template_for

    source = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "bos.jinja"
    path.write_text(source)
    hi = [{"role": "user", "content": "hi"}]
    adds = SpecialTokens("<s>", "</s>", adds_bos=True)
    for setting, gguf in ((None, source), (str(path), None)):
        assert chat_template_for("m.gguf", setting, gguf, adds, NAMES, _formatter([])).render(hi) == "hi"
        assert chat_template_for("m.gguf", setting, gguf, TOKENS, NAMES, _formatter([])).render(hi) == "<s>hi"
    plain = chat_template_for("m.gguf", None, "{{ messages[0].content }}<s>", adds, NAMES, _formatter([]))
    assert plain.render(hi) == "hi<s>"  # only a leading one


# -- llama.cpp's own list and formatter ---------------------------------------------------------------
@pytest.mark.engine
def test_llama_cpp_names_its_formats_and_writes_gemmas() -> None:
    from serving.engine.llama import builtin_chat_templates, format_builtin_chat

    names = builtin_chat_templates()
    assert {"chatml", "gemma", "llama3", "mistral-v7", "phi4"} <= set(names) and list(names) == sorted(names)
    prompt = format_builtin_chat("gemma", [("system", "Be brief."), ("user", "Hi ü"), ("assistant", "Hello"),
                                           ("user", "Bye")], True)
    assert prompt == ("<start_of_turn>user\nBe brief.\n\nHi ü<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                      "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert format_builtin_chat("chatml", [("user", "x" * 5000)], False) == f"<|im_start|>user\n{'x' * 5000}<|im_end|>\n"
    with pytest.raises(ValueError, match="cannot format"):
        format_builtin_chat("no-such-format", [("user", "hi")], True)


# -- the real Gemma 3 270M GGUF, which carries no template -------------------------------------------
@pytest.fixture(scope="module")
def gemma() -> Path:
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def gemma_engine(gemma: Path) -> Iterator[Engine]:
    from serving.engine.config import EngineConfig
    from serving.engine.core import Engine

    engine = Engine(EngineConfig(model=gemma, chat_template="gemma", n_ctx=1024, n_parallel=1, seed=7))
    yield engine
    engine.close()


@pytest.mark.engine
def test_gemma_with_its_format_answers_without_chatml_tokens(gemma_engine: Engine) -> None:
    from serving.engine.request import SamplingParams
    from tests.helpers import collect

    assert gemma_engine.chat_template.origin.value == "builtin"
    prompt = gemma_engine.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt == "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    tokens = gemma_engine.tokenize_prompt(prompt)
    assert gemma_engine.detokenize(tokens[:1]) == "" and len(tokens) < 20  # BOS, and the turn markers as tokens
    # the base (not instruction-tuned) model: it may talk until max_tokens, but never in ChatML's markers
    answer = collect(gemma_engine.submit(tokens, SamplingParams(max_tokens=48, temperature=0.0)))
    assert answer.text.strip() and "<|im_end|>" not in answer.text and "<|im_start|>" not in answer.text
    assert "<start_of_turn>" not in answer.text and "<end_of_turn>" not in answer.text


@pytest.mark.engine
def test_gemma_from_a_jinja_file_starts_with_one_bos(gemma_engine: Engine, tmp_path: Path) -> None:
    """A Jinja file written as Gemma's own templates are (`{{ bos_token }}` first): one BOS, as llama-server."""
    path = tmp_path / "gemma.jinja"
    path.write_text("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
                    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    config = gemma_engine.config
    try:
        gemma_engine.reconfigure(config.model_copy(update={"chat_template": str(path)}), timeout=60)
        assert gemma_engine.chat_template.origin.value == "file"
        from_file = gemma_engine.tokenize_prompt(gemma_engine.render_chat([{"role": "user", "content": "hi"}]))
    finally:
        gemma_engine.reconfigure(config, timeout=60)
    builtin = gemma_engine.tokenize_prompt(gemma_engine.render_chat([{"role": "user", "content": "hi"}]))
    assert from_file == builtin and from_file[1] != from_file[0]  # the same prompt: one BOS, then the turn


@pytest.mark.engine
def test_gemma_is_told_about_tools_inside_its_format(gemma_engine: Engine) -> None:
    """Tools go to a built-in format as the routes send them to any template that renders none: a system
    message (which Gemma's format folds into the first user turn) and tool turns as text."""
    from serving.openai.tools import messages_for_plain_template

    assert not gemma_engine.chat_template.knows_tools
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    prompt = gemma_engine.render_chat(messages_for_plain_template(messages, TOOLS))
    assert prompt.startswith("<start_of_turn>user\nYou may call one or more functions") and "get_weather" in prompt
    assert "<start_of_turn>model\n<tool_call>" in prompt and "<tool_response>\n18 C\n</tool_response>" in prompt
    assert prompt.endswith("<start_of_turn>model\n")


@pytest.mark.engine
def test_gemma_without_a_setting_falls_back_to_chatml_with_a_warning(gemma: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from serving.engine.config import EngineConfig
    from serving.engine.core import Engine

    with caplog.at_level(logging.WARNING, logger="serving"):
        engine = Engine(EngineConfig(model=gemma, n_ctx=256, n_parallel=1))
    try:
        assert engine.chat_template.origin.value == "fallback"
        assert engine.render_chat([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi<|im_end|>")
    finally:
        engine.close()
    assert "falling back to ChatML" in caplog.text and gemma.name in caplog.text


@pytest.mark.engine
def test_an_unknown_name_stops_the_engine_at_start_naming_the_valid_ones(gemma: Path) -> None:
    from serving.engine.config import EngineConfig
    from serving.engine.core import Engine
    from serving.engine.errors import EngineError

    with pytest.raises(EngineError, match=r"'gema' is not one of llama.cpp's built-in chat templates \(.*gemma.*\)"):
        Engine(EngineConfig(model=gemma, chat_template="gema", n_ctx=256, n_parallel=1))



@pytest.mark.engine
def test_a_reconfigure_swaps_the_template_without_reloading_weights(gemma_engine: Engine) -> None:
    config = gemma_engine.config
    loads = gemma_engine.weight_loads
    try:
        gemma_engine.reconfigure(config.model_copy(update={"chat_template": "chatml"}), timeout=60)
        assert gemma_engine.render_chat([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi")
        assert gemma_engine.fingerprint != config.fingerprint()  # an answer names the format it came from
    finally:
        gemma_engine.reconfigure(config, timeout=60)
    assert gemma_engine.render_chat([{"role": "user", "content": "hi"}]).startswith("<start_of_turn>user\nhi")
    assert gemma_engine.weight_loads == loads


@pytest.mark.engine  # the app's module loads Ray's libraries and libllama; nothing is deployed
def test_serve_run_with_an_unknown_name_fails_before_deploying_naming_the_valid_ones() -> None:
    """`serve run serving.app:main chat_template=gema`: the builder refuses it at once, not a replica later."""
    from serving.app import main
    from serving.engine.errors import EngineError

    with pytest.raises(EngineError, match=r"'gema' is not one of llama.cpp's built-in chat templates \(.*gemma"):
        main({"chat_template": "gema"})
