"""Predict an engine config's memory from the GGUF header alone, before anything is loaded.

weights + K/V cache + compute buffers + a fixed runtime overhead. The K/V term is exact arithmetic
(2 x layers x kv_heads x head_dim x bytes(type) x cells, with llama.cpp's padding of cells to 256 per slot);
the compute term is an upper-bound estimate of llama.cpp's graph reservation for one micro-batch. The tuner
rejects a config predicted over budget without loading it, and reports predicted next to measured memory
for every trial it does run, so the estimate's error is visible.
"""

from __future__ import annotations

import functools

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from serving.config import CacheType, EngineConfig, FlashAttn

MiB = 1 << 20
GiB = 1 << 30

# bytes per element: quantised types store blocks of 32 values (llama.cpp's ggml block sizes)
CACHE_TYPE_BYTES: dict[CacheType, float] = {
    CacheType.f32: 4.0, CacheType.f16: 2.0, CacheType.bf16: 2.0,
    CacheType.q8_0: 34 / 32, CacheType.q4_0: 18 / 32, CacheType.q4_1: 20 / 32,
    CacheType.q5_0: 22 / 32, CacheType.q5_1: 24 / 32, CacheType.iq4_nl: 18 / 32,
}

# what a GPU process holds before any tensor: CUDA context, cuBLAS workspace, llama.cpp's pools
GPU_RUNTIME_OVERHEAD = 600 * MiB
# a CPU process: the Python interpreter and llama.cpp's host-side state
CPU_RUNTIME_OVERHEAD = 64 * MiB


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs from a GGUF header."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    weight_bytes: int  # every tensor in the file
    token_embd_bytes: int  # the input embedding: a lookup table llama.cpp keeps in host memory
    tied_embeddings: bool = False  # no `output.weight`: the output layer reuses token_embd (e.g. SmolLM2)

    @property
    def kv_bytes_per_token_f16(self) -> int:
        """K and V for one token over all layers at f16 (the seed article's 192 KiB for its 27B)."""
        return 2 * self.n_layer * self.n_head_kv * self.head_dim_k * 2

    @property
    def bytes_read_per_token(self) -> int:
        """Weights streamed from memory for one decoded token: all but the embedding lookup, unless the
        output layer is the token embedding itself (tied), which is then read in full every token (and
        llama.cpp keeps a copy of it on the GPU as the output layer)."""
        if self.tied_embeddings:
            return self.weight_bytes
        return self.weight_bytes - self.token_embd_bytes

    @classmethod
    def from_gguf(cls, path: Path) -> ModelShape:
        """Read the header (tensor data is memory-mapped, not read)."""
        from gguf import GGUFReader  # a base dependency, imported here: it loads numpy, which the CLI's help needs not

        if not path.is_file():
            raise FileNotFoundError(f"model file {path} does not exist: pass --model PATH to a GGUF file")
        reader = GGUFReader(str(path))
        arch = _field(reader, "general.architecture")
        n_embd = int(_field(reader, f"{arch}.embedding_length"))
        n_head = int(_field(reader, f"{arch}.attention.head_count"))
        n_head_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
        head_dim = n_embd // n_head
        tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        return cls(
            arch=arch,
            n_layer=int(_field(reader, f"{arch}.block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=int(_field(reader, f"{arch}.attention.key_length", head_dim)),
            head_dim_v=int(_field(reader, f"{arch}.attention.value_length", head_dim)),
            n_ff=int(_field(reader, f"{arch}.feed_forward_length")),
            n_vocab=len(tokens.data) if tokens is not None else 0,
            n_ctx_train=int(_field(reader, f"{arch}.context_length", 0)),
            weight_bytes=sum(tensors.values()),
            token_embd_bytes=tensors.get("token_embd.weight", 0),
            tied_embeddings="output.weight" not in tensors and "token_embd.weight" in tensors,
        )


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF header has no '{key}': is this a llama.cpp language model?")
        return default
    value = field.contents()
    return value


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes of one engine config, split by what holds them."""

    weights: int  # on the device that runs the layers (GPU, or host on CPU)
    kv_cache: int
    compute: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.overhead

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def kv_cache_bytes(shape: ModelShape, config: EngineConfig) -> int:
    """K/V bytes for all cells llama.cpp allocates: exact, given its padding of cells to 256 per slot."""
    per_cell = shape.n_layer * shape.n_head_kv * (
        shape.head_dim_k * CACHE_TYPE_BYTES[config.type_k] + shape.head_dim_v * CACHE_TYPE_BYTES[config.type_v]
    )
    return int(per_cell * config.n_ctx_cells)


def compute_bytes(shape: ModelShape, config: EngineConfig) -> int:
    """llama.cpp's compute-graph reservation for one micro-batch (worst case: every row outputs logits).

    Logits (n_vocab floats a row) plus the widest activations (FFN); without flash attention, the KQ
    score matrix over a whole slot (heads x cells x rows, f32) is also materialised.
    """
    rows = config.n_ubatch
    activations = rows * 4 * (shape.n_vocab + 3 * shape.n_ff + 4 * shape.n_embd)
    attention = 0
    if config.flash_attn == FlashAttn.off:
        attention = rows * shape.n_head * config.n_ctx_per_slot * 4
    return activations + attention


def predict(shape: ModelShape, config: EngineConfig, on_gpu: bool) -> MemoryEstimate:
    """Memory the engine will hold on its device: GPU memory if `on_gpu`, else process memory (RSS); with a
    draft model (spec_mode draft), its weights, K/V and compute buffers too (its header read here)."""
    own = _one_model(shape, config, on_gpu)
    draft = config.draft
    if draft is None:
        return own
    path = draft.model_path
    extra = _one_model(_shape_of(path, path.stat().st_mtime_ns), draft, on_gpu)
    return MemoryEstimate(weights=own.weights + extra.weights, kv_cache=own.kv_cache + extra.kv_cache,
                          compute=own.compute + extra.compute, overhead=own.overhead)


@functools.lru_cache(maxsize=8)
def _shape_of(path: Path, mtime_ns: int) -> ModelShape:
    """A draft model's header, read once per file version (predict runs for every trial)."""
    return ModelShape.from_gguf(path)


def _one_model(shape: ModelShape, config: EngineConfig, on_gpu: bool) -> MemoryEstimate:
    layers_on_device = shape.n_layer if config.n_gpu_layers < 0 else min(config.n_gpu_layers, shape.n_layer)
    layer_bytes = shape.bytes_read_per_token
    if on_gpu:
        weights = int(layer_bytes * layers_on_device / shape.n_layer)
        overhead = GPU_RUNTIME_OVERHEAD
    else:
        weights = shape.weight_bytes
        overhead = CPU_RUNTIME_OVERHEAD
    return MemoryEstimate(weights=weights, kv_cache=kv_cache_bytes(shape, config),
                          compute=compute_bytes(shape, config), overhead=overhead)


def parse_bytes(text: str) -> int:
    """'32GiB', '16 GB', '900MiB', '123456' -> bytes (GiB/MiB binary, GB/MB decimal)."""
    units = {"kib": 1 << 10, "mib": MiB, "gib": GiB, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1, "": 1}
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("kmgtib")
    unit = cleaned[len(number):]
    error = ValueError(f"cannot read '{text}' as a size: write e.g. 32GiB, 16GB or 900MiB")
    if unit not in units or not number:
        raise error
    try:
        value = float(number)
    except ValueError:
        raise error from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise error
    return int(value * units[unit])
