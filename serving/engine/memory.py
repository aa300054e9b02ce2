"""Predict an engine config's memory from the GGUF header alone, before anything is loaded.

weights + K/V cache + compute buffers + a fixed runtime overhead, on the GPU and in host memory. Where each
tensor lives follows llama.cpp's rules: n_gpu_layers offloads the last layers (the output layer counts as one
more), the token embedding stays in host memory, a tensor override (`override_tensor`, `n_cpu_moe`) puts the
tensors it matches where it says, and a layer's K/V lives with the layer unless `kv_offload` is off. The K/V
term is exact arithmetic
(2 x layers x kv_heads x head_dim x bytes(type) x cells, with llama.cpp's padding of cells to 256 per slot);
the compute term is the largest stage of llama.cpp's graph for one micro-batch (its allocator reuses memory
between stages), with an allowance for fragmentation; the GPU's runtime share is set from measured runs. The tuner
rejects a config predicted over budget without loading it, and reports predicted next to measured memory
for every trial it does run, so the estimate's error is visible. The engine places a model that does not fit
by it when it loads (serving/engine/fit.py), which is why it lives in serving/engine/ and tuning/ imports it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from serving.engine.config import CacheType, EngineConfig, FlashAttn
from serving.engine.units import MiB


# bytes per element: quantised types store blocks of 32 values (llama.cpp's ggml block sizes)
CACHE_TYPE_BYTES: dict[CacheType, float] = {
    CacheType.f32: 4.0, CacheType.f16: 2.0, CacheType.bf16: 2.0,
    CacheType.q8_0: 34 / 32, CacheType.q4_0: 18 / 32, CacheType.q4_1: 20 / 32,
    CacheType.q5_0: 22 / 32, CacheType.q5_1: 24 / 32, CacheType.iq4_nl: 18 / 32,
}

# what a GPU process holds beyond its tensors once it has served: CUDA context, cuBLAS workspace, llama.cpp's
# memory pool. Set from the H100 and H200 runs (docs/log/2026-12-05-h100-fourth-run.md): a dense model's GPU
# memory after a workload less its weights, K/V and compute buffers came to 574-603 MiB, ours and llama-server's.
GPU_RUNTIME_OVERHEAD = 608 * MiB
# ggml's allocator places a graph's tensors best-fit; what it reserves exceeded the largest stage's live tensors
# by up to 4.3% on the CPU (SmolLM2-135M and a synthetic wide-FFN model, micro-batches of 32 to 2048 rows)
COMPUTE_FRAGMENTATION = 1.0625
# ggml's CUDA backend runs an op on the GPU whose weights live in host memory once a micro-batch has this many
# rows (its op offload), copying what the op reads
OP_OFFLOAD_MIN_ROWS = 32
# a CPU process: the Python interpreter and llama.cpp's host-side state
CPU_RUNTIME_OVERHEAD = 64 * MiB
# a GPU process's host memory beyond its tensors: the CUDA driver and runtime libraries it maps (cuBLAS among
# them), and the interpreter. Set from the H100 run of 2026-12-05 (docs/log/2026-12-05-h100-first-run.md): eight
# placements' RSS over their host tensors, llama-server's and ours, 0.17-0.77 GiB; 64 MiB had predicted 2-8% low.
GPU_PROCESS_HOST_OVERHEAD = 480 * MiB


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
    n_expert: int = 0  # a mixture of experts: experts per layer, `n_expert_used` of them run each token
    n_expert_used: int = 0
    tensors: tuple[tuple[str, int], ...] = field(default=(), repr=False)  # (name, bytes) of every tensor
    attention_layers: int | None = None  # layers with K/V cells where not all have them: a hybrid's (LFM2:
    # head_count_kv 0 in its convolution layers), 0 for a recurrent model (Mamba: no attention heads)

    @property
    def n_layer_kv(self) -> int:
        """Layers that cache K and V for every token (a recurrent layer's state has one fixed size a slot)."""
        return self.n_layer if self.attention_layers is None else self.attention_layers

    @property
    def expert_bytes(self) -> int:
        """The expert tensors' bytes (all experts of all layers): what --n-cpu-moe moves to host memory."""
        return sum(size for name, size in self.tensors if _EXPERTS.search(name))

    @property
    def kv_bytes_per_token_f16(self) -> int:
        """K and V for one token over all layers at f16 (the seed article's 192 KiB for its 27B)."""
        return 2 * self.n_layer_kv * self.n_head_kv * self.head_dim_k * 2

    @property
    def bytes_read_per_token(self) -> int:
        """Weights streamed from memory for one decoded token: all but the embedding lookup, unless the
        output layer is the token embedding itself (tied), which is then read in full every token (and
        llama.cpp keeps a copy of it on the GPU as the output layer)."""
        read = self.weight_bytes - (0 if self.tied_embeddings else self.token_embd_bytes)
        if self.n_expert:  # of each expert tensor, only the experts a token is routed to
            read -= self.expert_bytes * (self.n_expert - self.n_expert_used) // self.n_expert
        return read

    @classmethod
    def from_gguf(cls, path: Path) -> ModelShape:
        """Read the header (tensor data is memory-mapped, not read)."""
        from gguf import GGUFReader  # a base dependency, imported here: it loads numpy, which the CLI's help needs not

        if not path.is_file():
            raise FileNotFoundError(f"model file {path} does not exist: pass --model PATH to a GGUF file")
        reader = GGUFReader(str(path))
        arch = _field(reader, "general.architecture")
        n_embd = int(_field(reader, f"{arch}.embedding_length"))
        n_head = _widest(_field(reader, f"{arch}.attention.head_count"))
        kv_heads = _field(reader, f"{arch}.attention.head_count_kv", n_head)
        n_head_kv = _widest(kv_heads)
        head_dim = n_embd // n_head if n_head else 0
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
            n_ff=_widest(_field(reader, f"{arch}.feed_forward_length")),
            n_vocab=len(tokens.data) if tokens is not None else 0,
            n_ctx_train=int(_field(reader, f"{arch}.context_length", 0)),
            weight_bytes=sum(tensors.values()),
            token_embd_bytes=tensors.get("token_embd.weight", 0),
            tied_embeddings="output.weight" not in tensors and "token_embd.weight" in tensors,
            n_expert=int(_field(reader, f"{arch}.expert_count", 0)),
            n_expert_used=int(_field(reader, f"{arch}.expert_used_count", 0)),
            tensors=tuple(tensors.items()),
            attention_layers=_attention_layers(kv_heads, n_head),
        )


_EXPERTS = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")  # llama.cpp's LLM_FFN_EXPS_REGEX
_LAYER = re.compile(r"^blk\.(\d+)\.")


def _widest(value: Any) -> int:
    """A count llama.cpp reads as one value or one per layer (get_key_or_arr): the largest layer's."""
    return max((int(v) for v in value), default=0) if isinstance(value, list) else int(value)


def _attention_layers(kv_heads: Any, n_head: int) -> int | None:
    """Layers with K/V heads where not every layer has them: per-layer counts with zeros (a hybrid), or no
    heads at all (a recurrent model); None where all do."""
    if isinstance(kv_heads, list):
        attending = sum(1 for heads in kv_heads if int(heads) > 0)
        return attending if attending < len(kv_heads) else None
    return 0 if n_head == 0 else None


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
    host: int = 0  # host memory (RSS): the weights, K/V and compute buffers that stay with the CPU, + overhead

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.overhead

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def kv_cache_bytes(shape: ModelShape, config: EngineConfig) -> int:
    """K/V bytes for all cells llama.cpp allocates: exact, given its padding of cells to 256 per slot."""
    per_cell = shape.n_layer_kv * shape.n_head_kv * (
        shape.head_dim_k * CACHE_TYPE_BYTES[config.type_k] + shape.head_dim_v * CACHE_TYPE_BYTES[config.type_v]
    )
    return int(per_cell * config.n_ctx_cells)


def compute_bytes(shape: ModelShape, config: EngineConfig, on_gpu: bool = False, kv_in_host: bool = False) -> int:
    """llama.cpp's compute-graph reservation for one micro-batch of `n_ubatch` rows, every row outputting logits.

    ggml's allocator reuses memory between the graph's stages, so the reservation is the largest stage, not the
    sum: the output (each row's logits beside two hidden-state rows), a layer's feed-forward (gate, up and their
    product, four hidden-state rows, and the attention mask over the cells a row attends, f16 with flash attention,
    else f32), or without flash attention a layer's attention scores (heads x cells a row): a slot's cells, or
    with kv_unified all of them. Its allocator's
    fragmentation adds up to ~4% (measured on the CPU against llama.cpp's own report: tests/test_tuning.py),
    covered by COMPUTE_FRAGMENTATION. On a GPU (`on_gpu`) flash attention is a stage of its own: CUDA's kernels
    for a micro-batch read K and V as f16, so a layer's cached K and V of any other type are converted into
    the compute buffer, every slot's cells (ggml_cuda_flash_attn_ext_get_alloc_size); and where a layer's K/V
    live in host memory (`kv_in_host`) while the GPU runs the micro-batch (op offload, from 32 rows), that
    layer's K and V are copied in as well.
    """
    rows = _reserved_rows(config)
    cells = config.attended_cells  # a row's slot's cells; with kv_unified every slot's
    flash = config.flash_attn != FlashAttn.off  # auto: llama.cpp turns it on where the backend has it (CPU, CUDA)
    mask = cells * (2 if flash else 4)
    output = 4 * (shape.n_vocab + 2 * shape.n_embd)
    feed_forward = 4 * (3 * shape.n_ff + 4 * shape.n_embd) + mask
    attention = 0 if flash else 4 * (shape.n_head * cells + 4 * shape.n_embd) + mask
    largest = rows * max(output, feed_forward, attention)
    if on_gpu and flash:
        largest = max(largest, rows * (4 * (shape.n_head * shape.head_dim_v + 2 * shape.n_embd) + mask)
                      + _cuda_attention_copies(shape, config, kv_in_host and rows >= OP_OFFLOAD_MIN_ROWS))
    return int(largest * COMPUTE_FRAGMENTATION)


def _reserved_rows(config: EngineConfig) -> int:
    """Rows of the micro-batch llama.cpp reserves its graph for: n_ubatch, or every cell if there are fewer."""
    return min(config.n_ubatch, config.n_ctx_cells)


def _cuda_attention_copies(shape: ModelShape, config: EngineConfig, moved: bool) -> int:
    """One layer's K and V, all slots' cells, as CUDA's flash attention needs them in its compute buffer: f16
    copies of what is cached in another type, and with `moved` the cached K and V themselves (host to GPU)."""
    widths = ((config.type_k, shape.n_head_kv * shape.head_dim_k), (config.type_v, shape.n_head_kv * shape.head_dim_v))
    f16 = sum(width * 2 for kind, width in widths if kind != CacheType.f16)
    cached = sum(width * CACHE_TYPE_BYTES[kind] for kind, width in widths) if moved else 0
    return int(config.n_ctx_cells * (f16 + cached))


def gpu_pool_bytes(shape: ModelShape, config: EngineConfig) -> int:
    """What llama.cpp's CUDA memory pool grows to while serving a mixture of experts, beyond the runtime's
    fixed share: its expert matmul copies each micro-batch's rows per routed expert into pooled scratch. The
    size, rows x experts used x (n_embd + n_ff) f32, is empirical: it matched the growth seen in the recorded
    H100 runs of the 30B-A3B-class model (~130 MiB over a dense model's), one model only. Dense models' pool
    use is inside GPU_RUNTIME_OVERHEAD."""
    if not shape.n_expert:
        return 0
    rows = _reserved_rows(config)
    return rows * shape.n_expert_used * (shape.n_embd + shape.n_ff) * 4


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
                          compute=own.compute + extra.compute, overhead=own.overhead,
                          host=own.host + extra.host - _process_host(on_gpu))


@functools.lru_cache(maxsize=8)
def _shape_of(path: Path, mtime_ns: int) -> ModelShape:
    """A draft model's header, read once per file version (predict runs for every trial)."""
    return ModelShape.from_gguf(path)


@dataclass(frozen=True)
class WeightPlacement:
    """Bytes of weights on the GPU and in host memory, and how many layers' K/V go with the GPU."""

    gpu: int
    host: int
    gpu_layers: int  # repeating layers on the GPU (their K/V too, with kv_offload)


def place_weights(shape: ModelShape, config: EngineConfig) -> WeightPlacement:
    """Where llama.cpp puts each tensor of the file for `config` (llama-model.cpp's rules, see the module)."""
    offloaded = shape.n_layer + 1 if config.n_gpu_layers < 0 else min(config.n_gpu_layers, shape.n_layer + 1)
    first_gpu = shape.n_layer + 1 - offloaded  # layer index; the output layer is index n_layer
    overrides = [(re.compile(o.pattern), o.buffer_type != "CPU") for o in config.tensor_overrides()]
    gpu = host = 0
    for name, size in shape.tensors or (("token_embd.weight", shape.token_embd_bytes),):
        layer = _layer_of(name, shape.n_layer)
        on_gpu = layer is not None and layer >= first_gpu
        on_gpu = next((where for pattern, where in overrides if pattern.search(name)), on_gpu)
        if on_gpu:
            gpu += size
        else:
            host += size
        if name == "token_embd.weight" and shape.tied_embeddings and first_gpu <= shape.n_layer:
            gpu += size  # the output layer's copy of the tied embedding
    gpu_layers = min(max(shape.n_layer - first_gpu, 0), shape.n_layer)
    if not shape.tensors:  # a shape built without its tensor list: the layers' weights pro rata
        gpu = shape.bytes_read_per_token * min(offloaded, shape.n_layer) // shape.n_layer
    return WeightPlacement(gpu, host, gpu_layers)


def _layer_of(name: str, n_layer: int) -> int | None:
    """A tensor's layer for offloading: its block, the output layer (n_layer) for the final norm and output,
    None for the input embedding (always host memory)."""
    found = _LAYER.match(name)
    if found:
        return int(found.group(1))
    return None if name.startswith("token_embd") else n_layer


def _one_model(shape: ModelShape, config: EngineConfig, on_gpu: bool) -> MemoryEstimate:
    kv = kv_cache_bytes(shape, config)
    compute = compute_bytes(shape, config)
    if not on_gpu:
        total_host = shape.weight_bytes + kv + compute + _process_host(on_gpu)
        return MemoryEstimate(weights=shape.weight_bytes, kv_cache=kv, compute=compute,
                              overhead=CPU_RUNTIME_OVERHEAD, host=total_host)
    placed = place_weights(shape, config)
    kv_gpu = kv * placed.gpu_layers // shape.n_layer if config.kv_offload else 0
    gpu_compute = compute_bytes(shape, config, on_gpu=True, kv_in_host=kv_gpu < kv)
    cpu_compute = compute if placed.host > shape.token_embd_bytes or kv_gpu < kv else 0  # the CPU's own graph
    return MemoryEstimate(weights=placed.gpu, kv_cache=kv_gpu, compute=gpu_compute,
                          overhead=GPU_RUNTIME_OVERHEAD + gpu_pool_bytes(shape, config),
                          host=placed.host + (kv - kv_gpu) + cpu_compute + _process_host(on_gpu))


def _process_host(on_gpu: bool) -> int:
    """The engine process's own host memory beyond its tensors (once per process: a draft model adds none)."""
    return GPU_PROCESS_HOST_OVERHEAD if on_gpu else CPU_RUNTIME_OVERHEAD

