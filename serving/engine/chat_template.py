"""Render chat messages into a prompt: the model's own Jinja template (GGUF `tokenizer.chat_template`), or the
one the `chat_template` setting names (a Jinja file, or a format llama.cpp writes itself by name).

Models ship their prompt format in the GGUF metadata; rendering it in a sandbox is what llama-server
(--jinja) and vLLM do, so the same messages give the same prompt tokens here as there. A GGUF without one
(Gemma 3 270M's, for one) is served with the `chat_template` setting, as llama-server's `--chat-template NAME`
and `--jinja --chat-template-file PATH`; with neither, ChatML, llama-server's fallback too, with a warning.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serving.engine.errors import EngineError

log = logging.getLogger("serving")

# Used only when a GGUF carries no template and no setting names one: ChatML, the format of the embedded
# SmolLM2 and of Qwen, and llama-server's fallback.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# llama.cpp's formatter of a built-in name: (name, [(role, content)], add_assistant) -> prompt (serving/engine/llama.py)
BuiltinFormatter = Callable[[str, Sequence[tuple[str, str]], bool], str]


class TemplateOrigin(str, Enum):
    """Where a prompt format came from (logged at load, and shown by /props)."""

    gguf = "gguf"  # the model's own: tokenizer.chat_template
    file = "file"  # chat_template=PATH: a Jinja file
    builtin = "builtin"  # chat_template=NAME: llama.cpp's own formatter
    fallback = "fallback"  # none of these: ChatML


@dataclass(frozen=True)
class SpecialTokens:
    """A model's BOS and EOS as templates write them, and whether tokenising a prompt adds the BOS itself."""

    bos: str
    eos: str
    adds_bos: bool = False


class ChatTemplateError(ValueError):
    """The template rejected the messages (e.g. roles out of order); the message is the template's own."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class PromptTemplate(Protocol):
    """What the routes and the engine's callers use of a chat template, whichever kind it is."""

    @property
    def source(self) -> str: ...

    @property
    def origin(self) -> TemplateOrigin: ...

    @property
    def knows_tools(self) -> bool: ...

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str: ...


class ChatTemplate:
    """A compiled Jinja chat template plus the special tokens templates refer to.

    With `strip_bos` (the vocabulary adds a BOS when the prompt is tokenised), a leading BOS the template wrote is
    taken off, as llama-server does for --jinja: Gemma's and Llama 3's templates open with `{{ bos_token }}`, and
    the prompt would otherwise start with two."""

    def __init__(self, source: str | None, bos_token: str, eos_token: str,
                 origin: TemplateOrigin = TemplateOrigin.gguf, strip_bos: bool = False) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.source = source or CHATML
        self.origin = origin if source else TemplateOrigin.fallback
        self._template = env.from_string(self.source)
        self._bos, self._eos = bos_token, eos_token
        self._strip_bos = strip_bos and bool(bos_token)

    @property
    def knows_tools(self) -> bool:
        """Whether the template renders a `tools` list itself (Qwen2.5/3, Llama 3.1+, Hermes do)."""
        return "tools" in self.source

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """Render as Hugging Face's apply_chat_template does: `tools` in OpenAI's shape, `template_kwargs`
        (e.g. `enable_thinking`) visible to the template as variables (they cannot replace messages or tools)."""
        try:
            variables = {**(template_kwargs or {}), "messages": messages, "tools": tools, "bos_token": self._bos,
                         "eos_token": self._eos, "add_generation_prompt": add_generation_prompt}
            prompt = self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from exc
        return prompt.removeprefix(self._bos) if self._strip_bos else prompt


class BuiltinChatTemplate:
    """A prompt format llama.cpp writes itself by name (`gemma`, `llama3`, ...: llama_chat_apply_template, what
    llama-server uses for `--chat-template NAME` without --jinja). Such a format knows roles and text only: it
    renders no tools (the routes tell the model about them in a system message, as for any template that does
    not) and takes no variables (`template_kwargs` are not seen)."""

    knows_tools = False
    origin = TemplateOrigin.builtin

    def __init__(self, name: str, format_chat: BuiltinFormatter) -> None:
        self.source = name
        self._format = format_chat

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        turns = [(str(m["role"]), _text(m.get("content"))) for m in messages]
        try:
            return self._format(self.source, turns, add_generation_prompt)
        except ValueError as exc:
            raise ChatTemplateError(str(exc)) from exc


def _text(content: Any) -> str:
    """A message's content as llama.cpp's formatter takes it: text (an assistant turn of calls only has none)."""
    return "" if content is None else content if isinstance(content, str) else str(content)


def check_name(setting: str | None, builtin_names: Sequence[str]) -> None:
    """EngineError listing llama.cpp's names when `setting` (EngineConfig's chat_template) is a name that is not
    one of them: the app's builder asks before it deploys anything, the engine again when it loads."""
    if setting is not None and not Path(setting).is_absolute() and setting not in builtin_names:
        raise EngineError(f"chat_template {setting!r} is not one of llama.cpp's built-in chat templates "
                          f"({', '.join(builtin_names)}); for a Jinja file, give its path")


def chat_template_for(model: str, setting: str | None, gguf_source: str | None, tokens: SpecialTokens,
                      builtin_names: Sequence[str], format_chat: BuiltinFormatter) -> PromptTemplate:
    """The template `model` is served with: the `chat_template` setting (EngineConfig: a built-in name, or an
    absolute path to a Jinja file) over the GGUF's own; ChatML, with a warning, when there is neither.
    EngineError when the setting names no built-in format and no readable file, listing the names."""
    if setting is None:
        if not gguf_source:
            log.warning("%s carries no chat template (GGUF tokenizer.chat_template) and chat_template is not set: "
                        "falling back to ChatML (<|im_start|>role ... <|im_end|>); if the model was trained on "
                        "another format, set chat_template to one of llama.cpp's names (e.g. gemma, llama3) or "
                        "to a Jinja file", model)
        return ChatTemplate(gguf_source, tokens.bos, tokens.eos, strip_bos=tokens.adds_bos)
    if not Path(setting).is_absolute():  # EngineConfig makes a file's path absolute; anything else is a name
        check_name(setting, builtin_names)
        return BuiltinChatTemplate(setting, format_chat)
    try:
        source = Path(setting).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineError(f"chat_template {setting}: cannot read the Jinja file ({exc})") from exc
    if not source.strip():
        raise EngineError(f"chat_template {setting}: the Jinja file is empty")
    try:
        return ChatTemplate(source, tokens.bos, tokens.eos, origin=TemplateOrigin.file, strip_bos=tokens.adds_bos)
    except jinja2.TemplateSyntaxError as exc:
        raise EngineError(f"chat_template {setting}: not a Jinja template: {exc} (line {exc.lineno})") from exc
