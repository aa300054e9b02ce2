"""CPU tests for scripts/make_synthetic_gguf.py: tiny random-weight models must be valid GGUF files
that llama.cpp loads and evaluates to finite logits, with the embedded tokenizer padded correctly.

The presets (15 GB) are checked by arithmetic only; the files written here are ~16 MB each.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest

from serving.engine.request import SamplingParams

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_synthetic_gguf.py"
TINY_FLAGS = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512"]
EXTRA_VOCAB = 128  # the q4_k variant pads the tokenizer by this many UNUSED fillers


def load_script() -> ModuleType:
    """Import the script by path (scripts/ is not a package); dataclasses need it in sys.modules."""
    spec = importlib.util.spec_from_file_location("make_synthetic_gguf", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Written:
    """A tiny model written by the fixture, with what it was asked to be."""

    path: Path
    shape: object
    summary: object


@pytest.fixture(scope="module")
def msg() -> ModuleType:
    return load_script()


@pytest.fixture(scope="module")
def embedded(msg: ModuleType) -> object:
    """The embedded tokenizer, parsed once (GGUFReader takes seconds on 49k tokens)."""
    return msg.read_tokenizer(msg.embedded_gguf_path())


@pytest.fixture(scope="module")
def tiny_models(msg: ModuleType, embedded: object, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    """Two 2-layer models: llama/q8_0/tied with the embedded vocab, qwen2/q4_k/untied/biases padded."""
    out = tmp_path_factory.mktemp("synthetic")
    n_tok = len(embedded.tokens)
    variants = {
        "q8_0": ["--preset", "smollm2", *TINY_FLAGS, "--qtype", "q8_0"],
        "q4_k": ["--preset", "qwen27b", *TINY_FLAGS, "--qtype", "q4_k", "--vocab", str(n_tok + EXTRA_VOCAB)],
    }
    written = {}
    for key, argv in variants.items():
        args = msg.build_parser().parse_args([*argv, "--out", str(out / f"{key}.gguf")])
        shape = msg.shape_from_args(args)
        summary = msg.write_model(shape, args.out, seed=1, tokenizer=embedded, log=lambda _: None)
        print(f"{key}: {summary.file_bytes:,} B in {summary.seconds:.2f} s")
        written[key] = Written(args.out, shape, summary)
    return written


@pytest.mark.unit
@pytest.mark.parametrize("qtype", ["q4_k", "q8_0", "q4_0", "q4_1", "f16"])
def test_blocks_dequantise_to_small_finite_weights(msg: ModuleType, qtype: str) -> None:
    spec = msg.QTYPES[qtype]
    blocks = spec.make_blocks(64, np.random.default_rng(0))
    assert blocks.dtype == np.uint8 and blocks.shape == (64, spec.block_bytes)
    weights = gguf.quants.dequantize(blocks.reshape(-1), spec.ggml_type)
    assert weights.size == 64 * spec.block_weights
    assert np.isfinite(weights).all()
    assert np.abs(weights).max() <= 0.13
    assert weights.std() > 0.005
    assert abs(weights.mean()) < 0.02


@pytest.mark.unit
def test_q4_k_block_header(msg: ModuleType) -> None:
    block = msg.make_q4_k_blocks(1, np.random.default_rng(0))[0]
    d, dmin = block[:4].view("<f2").astype(np.float32)
    assert d == pytest.approx(0.002, rel=1e-3) and dmin == pytest.approx(0.015, rel=1e-3)


@pytest.mark.unit
def test_preset_sizes(msg: ModuleType) -> None:
    """The 27B-class preset must match the size measured on the GPU machine (15.32 GB)."""
    sizes = {}
    for name, shape in msg.PRESETS.items():
        msg.validate_shape(shape)
        spec = msg.QTYPES[shape.qtype]
        plan = msg.plan_tensors(shape)
        sizes[name] = (len(plan), sum(msg.tensor_nbytes(p, spec) for p in plan), msg.bytes_per_token(plan, spec, shape))
    n_tensors, total, per_token = sizes["qwen27b"]
    assert n_tensors == 3 + 48 * 12
    assert 15.30e9 < total < 15.34e9
    embd = 152064 * 5120 // 256 * 144
    assert per_token == total - embd  # the token embedding is a lookup
    assert 4.2e9 < sizes["qwen7b"][1] < 4.4e9
    assert sizes["smollm2"][0] == 272  # same tensor count as the real SmolLM2 GGUF
    assert sizes["smollm2"][2] == sizes["smollm2"][1]  # tied: token_embd is read as the output matrix


@pytest.mark.unit
def test_q4_k_rejects_width_not_multiple_of_256(msg: ModuleType) -> None:
    shape = msg.shape_from_args(msg.build_parser().parse_args(["--preset", "smollm2", "--qtype", "q4_k", "--out", "x"]))
    with pytest.raises(ValueError, match="multiple"):
        msg.validate_shape(shape)


@pytest.mark.unit
def test_pad_vocab_rejects_smaller_vocab(msg: ModuleType) -> None:
    with pytest.raises(ValueError):
        msg.pad_vocab([b"a", b"b"], [1, 1], 1)


def _reader_value(reader: object, key: str) -> object:
    return reader.fields[key].contents()


@pytest.mark.engine
@pytest.mark.parametrize("key", ["q8_0", "q4_k"])
def test_reader_metadata_and_shapes(msg: ModuleType, embedded: object, tiny_models: dict, key: str) -> None:
    model = tiny_models[key]
    shape = model.shape
    reader = gguf.GGUFReader(model.path)
    arch = shape.arch
    assert _reader_value(reader, "general.architecture") == arch
    assert _reader_value(reader, f"{arch}.block_count") == 2
    assert _reader_value(reader, f"{arch}.embedding_length") == 256
    assert _reader_value(reader, f"{arch}.feed_forward_length") == 512
    assert _reader_value(reader, f"{arch}.attention.head_count") == 4
    assert _reader_value(reader, f"{arch}.attention.head_count_kv") == 2
    assert _reader_value(reader, "general.file_type") == int(msg.QTYPES[key].file_type)

    n_tok = len(embedded.tokens)
    tokens = _reader_value(reader, "tokenizer.ggml.tokens")
    types = _reader_value(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == shape.vocab
    assert len(set(tokens)) == shape.vocab
    assert tokens[:n_tok] == [t.decode() for t in embedded.tokens]
    assert set(types[n_tok:]) <= {int(gguf.TokenType.UNUSED)}
    assert len(types[n_tok:]) == (EXTRA_VOCAB if key == "q4_k" else 0)
    embedded_kvs = {k: v for k, v, _, _ in embedded.kvs}
    assert _reader_value(reader, "tokenizer.chat_template").encode() == embedded_kvs["tokenizer.chat_template"]
    for special in ("bos", "eos"):
        special_key = f"tokenizer.ggml.{special}_token_id"
        assert _reader_value(reader, special_key) == embedded_kvs[special_key]

    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == model.summary.n_tensors
    assert ("output.weight" in tensors) is (key == "q4_k")
    assert ("blk.1.attn_q.bias" in tensors) is (key == "q4_k")
    ffn_down = tensors["blk.1.ffn_down.weight"]
    assert ffn_down.tensor_type == msg.QTYPES[key].ggml_type
    assert list(ffn_down.shape) == [512, 256]  # ggml order: ne0 = input width
    assert list(tensors["blk.0.attn_k.weight"].shape) == [256, 2 * 64]
    assert list(tensors["token_embd.weight"].shape) == [256, shape.vocab]
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    weights = gguf.quants.dequantize(ffn_down.data, ffn_down.tensor_type)
    assert np.isfinite(weights).all() and weights.std() > 0.005
    assert model.path.stat().st_size == model.summary.file_bytes


@pytest.mark.engine
@pytest.mark.parametrize("key", ["q8_0", "q4_k"])
def test_llama_cpp_loads_and_evaluates(embedded: object, tiny_models: dict, key: str) -> None:
    """llama.cpp must accept the file through our engine (the one loading path): load, tokenise with the copied
    tokenizer, render its chat template, score the prompt and generate."""
    from serving.engine.config import EngineConfig
    from serving.engine.core import Engine

    model = tiny_models[key]
    engine = Engine(EngineConfig(model=model.path, n_ctx=256, n_parallel=1, n_batch=64, n_ubatch=64, n_threads=2,
                                 seed=1))
    try:
        assert engine.n_vocab == model.shape.vocab
        assert "<|im_start|>user" in engine.render_chat([{"role": "user", "content": "hi"}])
        tokens = engine.tokenize_prompt("Hello synthetic world, tokenised")
        assert 2 <= len(tokens) and max(tokens) < len(embedded.tokens)  # fillers are never produced
        nll = engine.score(tokens)
        assert math.isfinite(nll)
        assert abs(nll - math.log(model.shape.vocab)) > 1e-3  # not uniform: the random weights went through the graph
        assert engine.score(tokens[::-1]) != pytest.approx(nll, abs=1e-6)  # and the logits depend on the input
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        generated = [t for chunk in engine.submit(tokens, params) for t in chunk.token_ids]
        assert len(generated) == 4 and max(generated) < model.shape.vocab
    finally:
        engine.close()


@pytest.mark.engine
def test_a_draft_model_must_share_the_vocabulary_and_its_wrong_guesses_change_nothing(tiny_models: dict) -> None:
    """spec_mode draft with tiny random-weight draft models: one with a padded vocabulary is refused with the
    reason; one with the embedded vocabulary guesses (p_min 0: always) and is nearly always wrong, and the
    embedded model's greedy text is still its own (every rejected guess rolled back)."""
    from tests.helpers import collect

    from serving.engine.config import EngineConfig, embedded_model_path
    from serving.engine.core import Engine, EngineError

    base = EngineConfig(n_ctx=1024, n_parallel=1, seed=1)
    with pytest.raises(EngineError, match="does not share the vocabulary"):
        Engine(base.model_copy(update={"spec_mode": "draft", "draft_model": tiny_models["q4_k"].path}))
    drafting = Engine(base.model_copy(update={"spec_mode": "draft", "draft_model": tiny_models["q8_0"].path,
                                              "spec_draft_p_min": 0.0}))
    plain = Engine(base)
    try:
        assert drafting.config.model_path == embedded_model_path()
        prompt = plain.tokenize_prompt("The three primary colours are")
        params = SamplingParams(max_tokens=40, temperature=0.0)
        assert collect(drafting.submit(prompt, params)).text == collect(plain.submit(prompt, params)).text
        counters = drafting.stats()["counters"]
        assert counters["spec_drafted"] > 0 and counters["spec_accepted"] < counters["spec_drafted"]
    finally:
        drafting.close()
        plain.close()
