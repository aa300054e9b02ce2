"""What a request that leaves a sampler setting unsent samples as: the model's own recommendation where its GGUF
carries one (`general.sampling.*`, which llama.cpp's convert script writes from a model's generation_config and
llama-server reads as its defaults), else llama-server's built-in defaults (its common/common.h).

OpenAI's and Anthropic's own default, temperature 1.0 with no cut, leaves a small quantised model's long tail in
(off-topic words mid-answer), and a model family tuned for temperature 0.6 / top_p 0.95 answers worse at
llama-server's 0.8 / 0.95 than at what its authors recommend: the model's keys win over the built-in ones.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PREFIX = "general.sampling."
# The GGUF keys this server samples by, as the field of SamplerDefaults each sets.
_KEYS: dict[str, str] = {
    "temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "penalty_repeat": "repeat_penalty", "penalty_last_n": "repeat_last_n",
}
# llama.cpp's other sampling keys (llama.h's LLAMA_MODEL_META_KEY_SAMPLING_*): samplers this server does not run.
UNUSED_KEYS = ("sequence", "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta")


@dataclass(frozen=True)
class SamplerDefaults:
    """The sampler settings an unsent field takes; the defaults are llama-server's."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64

    def valid(self) -> bool:
        """Whether a request could send every value (so a model's key never widens what a request may)."""
        return (0.0 <= self.temperature <= 2.0 and self.top_k >= 0 and 0.0 < self.top_p <= 1.0
                and 0.0 <= self.min_p <= 1.0 and self.repeat_penalty > 0.0 and self.repeat_last_n >= -1)

    @classmethod
    def of_model(cls, name: str, metadata: Callable[[str], str | None]) -> SamplerDefaults:
        """The defaults for a model whose GGUF metadata `metadata` reads: each `general.sampling.*` key this
        server samples by replaces llama-server's value; a key that does not parse, or is out of the range a
        request may send, is logged and left out, as is a key for a sampler this server does not run."""
        defaults, found = cls(), []
        for key, field in _KEYS.items():
            raw = metadata(_PREFIX + key)
            if raw is None:
                continue
            value = _parsed(raw, int if field in ("top_k", "repeat_last_n") else float)
            candidate = None if value is None else dataclasses.replace(defaults, **{field: value})  # type: ignore[arg-type]
            if candidate is None or not candidate.valid():
                log.warning("%s: %s%s = %r is not a usable value; llama-server's default is kept",
                            name, _PREFIX, key, raw)
                continue
            defaults = candidate
            found.append(f"{field}={value}")
        unused = [key for key in UNUSED_KEYS if metadata(_PREFIX + key) is not None]
        if unused:
            log.warning("%s recommends samplers this server does not run (%s); they are left out", name,
                        ", ".join(_PREFIX + key for key in unused))
        if found:
            log.info("%s: sampler defaults from its GGUF: %s", name, ", ".join(found))
        return defaults


LLAMA_SERVER = SamplerDefaults()


def _parsed(raw: str, kind: type[int] | type[float]) -> float | int | None:
    """A GGUF value as text (llama_model_meta_val_str prints numbers) as `kind`, None if it is not one."""
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    if kind is int:
        return int(value) if value == int(value) else None
    return value
