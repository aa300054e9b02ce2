"""Render chat messages with the model's own Jinja template (GGUF `tokenizer.chat_template`).

Models ship their prompt format in the GGUF metadata; rendering it in a sandbox is what llama-server
(--jinja) and vLLM do, so the same messages give the same prompt tokens here as there.
"""

from __future__ import annotations

import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used only when a GGUF carries no template: ChatML, the format of the embedded SmolLM2 and of Qwen.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template rejected the messages (e.g. roles out of order); the message is the template's own."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template plus the special tokens templates refer to."""

    def __init__(self, source: str | None, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.source = source or CHATML
        self._template = env.from_string(self.source)
        self._bos, self._eos = bos_token, eos_token

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
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from exc
