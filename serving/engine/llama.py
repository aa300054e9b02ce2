"""The only room that touches libllama through ctypes: load order, model, context, batch, sampler chain.

Every binding call here was checked against the vendored llama.h of the pinned llama-cpp-python (0.3.36,
llama.cpp 0c1e570): argument count, order and types. That header differs from older llama.cpp in places
(e.g. `llama_sampler_init_penalties` takes `n_vocab` first), so check there, not against memory.

Load order, measured on the H200 machine (2026-12-02, CUDA build): importing `ray` AFTER libllama.so was
loaded aborts the process ("free(): invalid pointer") when ray loads its _raylet.so with RTLD_GLOBAL; ray
first, then libllama, works. A numpy-before-libllama crash reported in shared/device-notes.md did not
reproduce in the same session. So this module imports ray before llama_cpp, and every module of ours that
needs llama.cpp goes through here. `numpy_was_first` is kept for diagnosis.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import random
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

numpy_was_first = "numpy" in sys.modules

import ray  # noqa: E402,F401  (ray's _raylet.so must load before libllama: see above)
import llama_cpp.llama_cpp as ll  # noqa: E402
from llama_cpp import __version__ as BINDINGS_VERSION  # noqa: E402,F401  (an installed package and a source tree have it)
from llguidance import LLMatcher, LLTokenizer  # noqa: E402

import numpy as np  # noqa: E402

from serving.engine.config import CacheType, EngineConfig, FlashAttn, SplitMode, TensorOverride  # noqa: E402
from serving.engine.errors import EngineError  # noqa: E402
from serving.engine.guided import DueMasks, Guided  # noqa: E402
from serving.engine.prompt_cache import StateBuffer  # noqa: E402
from serving.engine.request import Constraint, ConstraintKind, SamplingParams, TokenLogprob  # noqa: E402
from serving.engine.scheduler import MemoryKind  # noqa: E402

llama_cpp = ll  # the bindings module, for the few callers outside serving/ that need a constant

_log = logging.getLogger("llama.cpp")

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}

_GGML_TYPES = {  # enum ggml_type in ggml.h
    CacheType.f32: 0, CacheType.f16: 1, CacheType.bf16: 30, CacheType.q8_0: 8, CacheType.q4_0: 2,
    CacheType.q4_1: 3, CacheType.q5_0: 6, CacheType.q5_1: 7, CacheType.iq4_nl: 20,
}
_FLASH_ATTN = {
    FlashAttn.auto: ll.LLAMA_FLASH_ATTN_TYPE_AUTO,
    FlashAttn.on: ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    FlashAttn.off: ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


_SPLIT_MODES = {SplitMode.none: ll.LLAMA_SPLIT_MODE_NONE, SplitMode.layer: ll.LLAMA_SPLIT_MODE_LAYER,
                SplitMode.row: ll.LLAMA_SPLIT_MODE_ROW}


class _BufferTypeOverride(ctypes.Structure):
    """llama.h: struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }
    (the bindings declare the field as a void pointer and no struct)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(frozen=True)
class Placement:
    """Where a model's weights go beyond n_gpu_layers (EngineConfig's placement settings)."""

    overrides: tuple[TensorOverride, ...] = ()
    split_mode: SplitMode = SplitMode.layer
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()

    @classmethod
    def of(cls, config: EngineConfig) -> Placement:
        return cls(tuple(config.tensor_overrides()), config.split_mode, config.main_gpu, tuple(config.tensor_split))


@functools.cache
def buffer_types() -> dict[str, int]:
    """This build's device buffer types by ggml's names ("CPU", "CUDA0", ...), as llama-server's -ot looks them
    up (ggml-backend.h: ggml_backend_dev_count, ggml_backend_dev_get, ggml_backend_dev_buffer_type,
    ggml_backend_buft_name; the libraries beside libllama, already loaded by it)."""
    lib_dir = Path(ll._lib._name).parent
    registry = ctypes.CDLL(str(lib_dir / "libggml.so"))
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    registry.ggml_backend_dev_count.argtypes, registry.ggml_backend_dev_count.restype = [], ctypes.c_size_t
    registry.ggml_backend_dev_get.argtypes, registry.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    base.ggml_backend_buft_name.argtypes, base.ggml_backend_buft_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    found: dict[str, int] = {}
    for index in range(registry.ggml_backend_dev_count()):
        buft = base.ggml_backend_dev_buffer_type(registry.ggml_backend_dev_get(index))
        if buft:
            found[base.ggml_backend_buft_name(buft).decode()] = buft
    return found


def _overrides_array(overrides: Sequence[TensorOverride]) -> ctypes.Array[_BufferTypeOverride]:
    """The NULL-terminated array llama_model_params.tensor_buft_overrides points to; EngineError naming the
    buffer types this build has when one is not among them."""
    known = buffer_types()
    if len(overrides) > ll.llama_max_tensor_buft_overrides():
        raise EngineError(f"{len(overrides)} tensor overrides: llama.cpp takes at most "
                          f"{ll.llama_max_tensor_buft_overrides()}")
    entries = []
    for override in overrides:
        if override.buffer_type not in known:
            raise EngineError(f"override_tensor {override}: this llama.cpp build has no buffer type "
                              f"{override.buffer_type!r}; it has {sorted(known)}")
        entries.append(_BufferTypeOverride(override.pattern.encode(), known[override.buffer_type]))
    return (_BufferTypeOverride * (len(entries) + 1))(*entries, _BufferTypeOverride(None, None))


@ll.llama_log_callback
def _route_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    """Send llama.cpp's log lines to Python logging (its INFO chatter becomes DEBUG)."""
    py_level = _LEVELS.get(level, logging.DEBUG)
    if py_level == logging.INFO:
        py_level = logging.DEBUG
    if _log.isEnabledFor(py_level):
        _log.log(py_level, text.decode("utf-8", "replace").rstrip())


ll.llama_log_set(_route_log, ctypes.c_void_p())
ll.llama_backend_init()


class Vocabulary:
    """A GGUF's vocabulary alone (`vocab_only`: no weights read), to tokenise text as the model does where no
    engine is loaded: a benchmark's client builds token-id prompts for servers in other processes with it."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise EngineError(f"model file {path} does not exist")
        params = ll.llama_model_default_params()
        params.vocab_only = True
        self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise EngineError(f"llama.cpp could not read the vocabulary of {path}")
        self.vocab = ll.llama_model_get_vocab(self.ptr)

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Text as token ids (default: no BOS, specials as text: pieces of a prompt)."""
        return _tokenize(self.vocab, text, add_special, parse_special)

    def free(self) -> None:
        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None


def _tokenize(vocab: ll.llama_vocab_p, text: str, add_special: bool, parse_special: bool) -> list[int]:
    data = text.encode("utf-8")
    cap = len(data) + 8
    buf = (ll.llama_token * cap)()
    n = ll.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    return list(buf[:n])


class LlamaModel:
    """Weights and vocabulary of one GGUF file, loaded once; thread-safe to tokenise from any thread.

    `extra_bufts` is llama_model_params.use_extra_bufts: CPU weight repacking (and the AMX path on Intel);
    off is llama-server's --no-repack. serving/engine/repack.py decides it, because on some CPUs that path faults.
    """

    def __init__(self, path: Path, n_gpu_layers: int, extra_bufts: bool = True,
                 placement: Placement = Placement()) -> None:
        if not path.is_file():
            raise EngineError(f"model file {path} does not exist: set `model:` to a GGUF file")
        params = ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = extra_bufts
        params.split_mode = _SPLIT_MODES[placement.split_mode]
        params.main_gpu = placement.main_gpu
        overrides = _overrides_array(placement.overrides) if placement.overrides else None  # alive until loaded
        if overrides is not None:
            params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        shares = None
        if placement.tensor_split:
            slots = ll.llama_max_devices()
            if len(placement.tensor_split) > slots:
                raise EngineError(f"tensor_split has {len(placement.tensor_split)} shares; this build takes {slots}")
            shares = (ctypes.c_float * slots)(*placement.tensor_split)
            params.tensor_split = shares
        self.path = path
        self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            hint = " (numpy was imported before libllama: see serving/engine/llama.py)" if numpy_was_first else ""
            raise EngineError(f"llama.cpp could not load {path}: is it a GGUF file this llama.cpp reads?{hint}")
        self.vocab = ll.llama_model_get_vocab(self.ptr)
        self.n_vocab: int = ll.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = ll.llama_model_n_ctx_train(self.ptr)
        self.size_bytes: int = ll.llama_model_size(self.ptr)
        self.bos_text = self.token_text(ll.llama_vocab_bos(self.vocab))
        self.eos_text = self.token_text(ll.llama_vocab_eos(self.vocab))
        self.adds_bos: bool = ll.llama_vocab_get_add_bos(self.vocab)  # tokenize(add_special=True) adds a BOS
        self._pieces: dict[int, bytes] = {}
        self.guides = Guides(self.vocab, self.n_vocab)

    @functools.cached_property
    def memory_kind(self) -> MemoryKind:
        """How this model's memory can go back to an earlier position (llama.h: llama_model_is_hybrid,
        llama_model_is_recurrent, llama_model_n_swa; a hybrid is not also reported recurrent)."""
        if ll.llama_model_is_hybrid(self.ptr):
            return MemoryKind.hybrid
        if ll.llama_model_is_recurrent(self.ptr):
            return MemoryKind.recurrent
        return MemoryKind.swa if ll.llama_model_n_swa(self.ptr) > 0 else MemoryKind.kv

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):  # long value (chat templates can be): ask again with room for all of it
            buf = ctypes.create_string_buffer(n + 1)
            ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Tokenise as llama-server does for a prompt (BOS where the vocabulary wants one, specials parsed)."""
        return _tokenize(self.vocab, text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        """A token's raw bytes (may be part of a UTF-8 character); control tokens render as nothing."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._piece(token, special=False)
            self._pieces[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        return self._piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    def _piece(self, token: int, special: bool) -> bytes:
        return _piece_of(self.vocab, token, special)

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.vocab, token))

    @functools.cached_property
    def eog_tokens(self) -> np.ndarray:
        """Every end-of-generation token id (what `ignore_eos` bans, as llama-server's logit bias does): one
        pass over the vocabulary, the first time a request asks."""
        return np.array([t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self.vocab, t)], dtype=np.int64)

    def check_constraint(self, constraint: Constraint) -> None:
        """ValueError unless this vocabulary can enforce `constraint` (a guide is compiled, and cached, here)."""
        if constraint.kind is ConstraintKind.guide:
            self.guides.matcher(constraint.text)
            return
        sampler = ll.llama_sampler_init_grammar(self.vocab, constraint.text.encode(), b"root")
        if not sampler:
            raise ValueError("the grammar does not parse as GBNF with a 'root' rule")
        ll.llama_sampler_free(sampler)

    def free(self) -> None:
        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None


def _piece_of(vocab: ll.llama_vocab_p, token: int, special: bool) -> bytes:
    """A token's bytes (`special`: control tokens render as their text, else as nothing)."""
    buf = ctypes.create_string_buffer(64)
    n = ll.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = ll.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[:n]


GUIDES_CACHED = 64  # compiled guides kept per model (one per schema or tool set seen lately)
NO_TOKEN = -1  # LLAMA_TOKEN_NULL


class Guides:
    """llguidance matchers for one model's vocabulary. The tokenizer (every token's bytes) is built on the first
    guided request (~0.25 s for 49k tokens on this CPU), and each grammar is compiled once and copied for every
    request that asks for it (a copy costs microseconds, a compile about a millisecond). Thread-safe: the
    routes' submit checks and the step thread's samplers both ask."""

    def __init__(self, vocab: ll.llama_vocab_p, n_vocab: int) -> None:
        self._vocab, self.n_vocab = vocab, n_vocab
        self._lock = threading.Lock()
        self._tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher of `grammar` (an llguidance grammar, serving/openai/structured.py); ValueError if it
        does not compile for this vocabulary."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is None:
                compiled = LLMatcher(self._tokenizer_locked(), grammar, log_level=0)
                if compiled.is_error():
                    raise ValueError(f"the constraint does not compile: {compiled.get_error()}")
                self._compiled[grammar] = compiled
                while len(self._compiled) > GUIDES_CACHED:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
            return compiled.deep_copy()

    def _tokenizer_locked(self) -> LLTokenizer:
        """Every token's bytes for llguidance, as its llama.cpp adapter builds them: a control token (or a
        user-defined one written <like this>) gets a 0xff prefix, so text never matches it; EOS and EOT end
        an answer; tokenizing goes back to this vocabulary's llama_tokenize."""
        if self._tokenizer is None:
            special = ll.LLAMA_TOKEN_ATTR_CONTROL
            pieces = []
            for token in range(self.n_vocab):
                piece = _piece_of(self._vocab, token, special=True)
                attr = ll.llama_vocab_get_attr(self._vocab, token)
                if attr & special or (attr & ll.LLAMA_TOKEN_ATTR_USER_DEFINED and piece[:1] == b"<"
                                      and piece[-1:] == b">"):
                    piece = b"\xff" + piece
                pieces.append(piece)
            ends = [t for t in (ll.llama_vocab_eos(self._vocab), ll.llama_vocab_eot(self._vocab)) if t != NO_TOKEN]
            tokenize = ctypes.cast(ll._lib.llama_tokenize, ctypes.c_void_p).value
            self._tokenizer = LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=self._vocab,  # type: ignore[attr-defined]
                                                        tokenize_fptr=tokenize, eos_token=ends, slices=None)
        return self._tokenizer


@functools.cache
def gpu_offload_supported() -> bool:
    """Whether this llama.cpp build can put layers on a GPU (llama.h: `bool llama_supports_gpu_offload(void)`);
    a property of the build, asked once (streams ask it for their pacing)."""
    return bool(ll.llama_supports_gpu_offload())


@functools.cache
def builtin_chat_templates() -> tuple[str, ...]:
    """The chat formats llama.cpp writes itself, by name (llama.h: `int32_t llama_chat_builtin_templates(const
    char ** output, size_t len)`, which returns how many there are and fills at most `len`): the names
    llama-server's `--chat-template NAME` takes. A property of the build, asked once."""
    count = ll.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * count)()
    ll.llama_chat_builtin_templates(names, count)
    return tuple(sorted(name.decode() for name in names if name))


def format_builtin_chat(name: str, messages: Sequence[tuple[str, str]], add_assistant: bool) -> str:
    """`messages` (role, content) in llama.cpp's built-in chat format `name` (llama.h: `int32_t
    llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg, bool
    add_ass, char * buf, int32_t length)`: the prompt's length in bytes, negative for a format it does not know,
    and the text copied into `buf` only when one is given). ValueError where llama.cpp refuses."""
    chat = (ll.llama_chat_message * len(messages))(
        *(ll.llama_chat_message(role.encode(), content.encode()) for role, content in messages))
    needed = ll.llama_chat_apply_template(name.encode(), chat, len(messages), add_assistant, None, 0)
    if needed < 0:
        raise ValueError(f"llama.cpp's chat format {name!r} cannot format these messages")
    buf = ctypes.create_string_buffer(needed + 1)  # strncpy adds the terminator only where there is room
    ll.llama_chat_apply_template(name.encode(), chat, len(messages), add_assistant, buf, len(buf))
    return buf.raw[:needed].decode("utf-8", "replace")


VOCAB_SAMPLES = 512  # token ids compared between a model and its draft model (spread over the vocabulary)


def check_draft_vocabulary(model: LlamaModel, draft: LlamaModel) -> None:
    """A draft model must share the model's vocabulary, or its guesses are other tokens: the same size, the
    same BOS/EOS, the same bytes for a sample of ids (llama.cpp's common_speculative_are_compatible checks
    alike)."""
    def mismatch(what: str) -> EngineError:
        return EngineError(f"draft model {draft.path} does not share the vocabulary of {model.path} ({what}): "
                           "use a draft model of the same family and tokenizer")

    if draft.n_vocab != model.n_vocab:
        raise mismatch(f"{draft.n_vocab} tokens against {model.n_vocab}")
    for name, get in (("BOS", ll.llama_vocab_bos), ("EOS", ll.llama_vocab_eos)):
        if get(draft.vocab) != get(model.vocab):
            raise mismatch(f"another {name} token")
    step = max(model.n_vocab // VOCAB_SAMPLES, 1)
    for token in range(0, model.n_vocab, step):
        if draft.token_text(token) != model.token_text(token):
            raise mismatch(f"token {token} is {draft.token_text(token)!r}, not {model.token_text(token)!r}")


class Batch:
    """A llama_batch whose arrays are numpy buffers, so filling a prompt chunk is a slice copy, not a loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq_id = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        base = self.seq_id.ctypes.data
        i32p = ctypes.POINTER(ctypes.c_int32)
        self._seq_ptrs = (i32p * capacity)(*(ctypes.cast(base + 4 * i, i32p) for i in range(capacity)))
        self.struct = ll.llama_batch(
            n_tokens=0,
            token=self.tokens.ctypes.data_as(i32p),
            embd=None,
            pos=self.pos.ctypes.data_as(i32p),
            n_seq_id=self.n_seq_id.ctypes.data_as(i32p),
            seq_id=self._seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, tokens: Sequence[int], start_pos: int, seq_id: int, logits_for_last: bool,
            logits_for_all: bool = False) -> int:
        """Append tokens of one sequence; return the batch row of the last one (where its logits land)."""
        i, k = self.n, len(tokens)
        self.tokens[i : i + k] = tokens
        self.pos[i : i + k] = np.arange(start_pos, start_pos + k, dtype=np.int32)
        self.seq_id[i : i + k] = seq_id
        self.logits[i : i + k] = 1 if logits_for_all else 0
        self.logits[i + k - 1] = 1 if logits_for_last or logits_for_all else 0
        self.n += k
        return i + k - 1


# struct llama_token_data {llama_token id; float logit; float p;}: a numpy view llama.cpp can read in place
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Candidates:
    """A reusable llama_token_data_array over the whole vocabulary, filled from one logits row.

    One per context: only the step thread samples, one request at a time. Samplers sort the entries in
    place, may move the array's data pointer and shrink its size (top-k does), so every fill resets all.
    """

    def __init__(self, n_vocab: int) -> None:
        self._data = np.zeros(n_vocab, _TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._one = np.zeros(1, _TOKEN_DATA)
        self._full = ll.llama_token_data_array(size=n_vocab, selected=-1, sorted=False)
        self._single = ll.llama_token_data_array(size=1, selected=-1, sorted=False)

    def fill(self, logits: np.ndarray) -> ll.llama_token_data_array:
        self._data["id"] = self._ids  # samplers sort the entries in place: ids must be laid out again
        self._data["logit"] = logits
        self._data["p"] = 0.0
        arr = self._full
        arr.data = self._data.ctypes.data_as(ll.llama_token_data_p)  # type: ignore[assignment]
        arr.size, arr.selected, arr.sorted = len(self._data), -1, False
        return arr

    def single(self, token: int) -> ll.llama_token_data_array:
        self._one[0] = (token, 0.0, 0.0)
        arr = self._single
        arr.data = self._one.ctypes.data_as(ll.llama_token_data_p)  # type: ignore[assignment]
        arr.size, arr.selected, arr.sorted = 1, -1, False
        return arr


GREEDY_TRIES = 32  # greedy under GBNF checks this many best tokens one by one before a full pass


class SamplerChain:
    """One request's sampling, in llama-server's order: logit bias -> penalties -> top-k -> top-p -> min-p
    -> temperature -> dist (or greedy), so a request gives the same distribution here as there.

    A constraint is applied the way llama-server applies a grammar: sample without it, and only if it rejects
    that token, sample again from what it allows. That draws from the distribution restricted to the
    constraint (rejection sampling) and costs one check on the tokens the model gets right.
    - A guide (llguidance: response_format, forced tool calls) has the mask of allowed tokens computed as the
      decode is launched, before the logits are read (serving/engine/guided.py): the check is one bit of it,
      and a rejected token is sampled again from the masked logits (greedy: the best allowed token).
    - A GBNF grammar (a client's raw `grammar`) goes through llama.cpp's grammar sampler, whose pass over
      the vocabulary costs milliseconds; greedy with nothing else in the chain, once the model's choice is
      refused, checks the next candidates in order of logit (GREEDY_TRIES of them, one single-token check
      each) before that pass.
    """

    def __init__(self, ctx: LlamaContext, params: SamplingParams, default_seed: int) -> None:
        self._ctx = ctx
        self.resamples = 0  # tokens the constraint rejected, sampled again from what it allows
        self._grammar = None
        self._guide: Guided | None = None
        constraint = params.constraint
        if constraint is not None and constraint.kind is ConstraintKind.gbnf:
            self._grammar = ll.llama_sampler_init_grammar(ctx.model.vocab, constraint.text.encode(), b"root")
            if not self._grammar:
                raise ValueError("the grammar does not parse")
        elif constraint is not None:
            self._guide = Guided(ctx.model.guides.matcher(constraint.text), ctx.n_vocab, ctx.masks)
        # ignore_eos bans the end-of-generation tokens, as llama-server's logit bias does; not under a
        # constraint, which once complete allows nothing else
        banned = ctx.model.eog_tokens.tolist() if params.ignore_eos and constraint is None else []
        # greedy alone: the chain is llama.cpp's greedy sampler, which keeps no history to accept tokens into
        self._argmax = params.temperature <= 0.0 and not params.logit_bias and not params.has_penalties and not banned
        self._ptr = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        for sampler in _samplers_for(params, default_seed, ctx.n_vocab, banned):
            ll.llama_sampler_chain_add(self._ptr, sampler)  # the chain takes ownership

    def accept(self, tokens: Sequence[int]) -> None:
        """Feed tokens to the chain's history (the penalty sampler's window), as llama-server does with the
        prompt. Not to the constraint: it constrains what is generated, not the prompt."""
        for token in tokens:
            ll.llama_sampler_accept(self._ptr, token)

    def sample(self, row: int) -> int:
        """Choose the next token from the logits of batch row `row`, and accept it."""
        logits = self._ctx.logits(row)
        guide = self._guide
        if self._argmax and guide is not None:
            token = self._greedy_guided(guide, logits)
        elif guide is not None:
            token = self._guided(guide, logits)
        elif self._argmax and self._grammar is not None:
            token = self._greedy_grammar(logits)
        else:
            token = self._select(logits, grammar_first=False)
            if self._grammar is not None and not self._allows(token):
                self.resamples += 1
                token = self._select(logits, grammar_first=True)
        if not self._argmax:
            ll.llama_sampler_accept(self._ptr, token)
        if self._grammar is not None:
            ll.llama_sampler_accept(self._grammar, token)
        if self._guide is not None:
            self._guide.advance(token)
        return token

    def _guided(self, guide: Guided, logits: np.ndarray) -> int:
        """A sampled token under a guide: drawn without it, and if refused, drawn from the masked logits."""
        token = self._select(logits, grammar_first=False)
        if guide.allows(token):
            return token
        self.resamples += 1
        return self._select(masked_logits(logits, guide.allowed()), grammar_first=False)

    def _greedy_guided(self, guide: Guided, logits: np.ndarray) -> int:
        """Greedy under a guide: the model's choice if the mask allows it, else the best token it allows."""
        token = int(logits.argmax())
        if guide.allows(token):
            return token
        self.resamples += 1
        return guide.best(logits)

    def _greedy_grammar(self, logits: np.ndarray) -> int:
        """Greedy under a GBNF grammar: its single-token check, one candidate at a time, before a full pass."""
        token = int(logits.argmax())
        if self._allows(token):
            return token
        self.resamples += 1
        return self._next_allowed(logits, token, self._allows, lambda: self._select(logits, grammar_first=True))

    def _select(self, logits: np.ndarray, grammar_first: bool) -> int:
        cur = self._ctx.candidates.fill(logits)
        ref = ctypes.byref(cur)
        if grammar_first:
            ll.llama_sampler_apply(self._grammar, ref)
        ll.llama_sampler_apply(self._ptr, ref)
        if cur.selected < 0:
            raise RuntimeError("the sampler chain selected no token")
        return int(cur.data[cur.selected].id)

    @staticmethod
    def _next_allowed(logits: np.ndarray, refused: int, allows: Callable[[int], bool],
                      full_pass: Callable[[], int]) -> int:
        """After the best token was refused: the next best the constraint `allows`, one argmax at a time (most
        rejections end within a few), GREEDY_TRIES of them before `full_pass`, which picks the same token from
        every allowed one (ties: the lowest id, as llama.cpp's greedy sampler over the vocabulary in id order)."""
        rest = logits.copy()
        token = refused
        for _ in range(GREEDY_TRIES):
            rest[token] = -np.inf
            token = int(rest.argmax())
            if allows(token):
                return token
        return full_pass()

    def _allows(self, token: int) -> bool:
        cur = self._ctx.candidates.single(token)
        ll.llama_sampler_apply(self._grammar, ctypes.byref(cur))
        return bool(np.isfinite(cur.data[0].logit))

    def free(self) -> None:
        if self._ptr is not None:
            ll.llama_sampler_free(self._ptr)
            self._ptr = None
        if self._grammar is not None:
            ll.llama_sampler_free(self._grammar)
            self._grammar = None


def _state_flags(partial: bool) -> int:
    """llama_state_seq_flags: the partial state (recurrent and sliding-window parts) or all of a sequence."""
    return ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else ll.LLAMA_STATE_SEQ_FLAGS_NONE


def masked_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """`logits` with every token not `allowed` at -inf."""
    return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)


def _samplers_for(params: SamplingParams, default_seed: int, n_vocab: int,
                  banned: Sequence[int] = ()) -> list[ll.llama_sampler_p]:
    samplers = []
    bias = [*params.logit_bias, *((t, -math.inf) for t in banned)]
    if bias:
        biases = (ll.llama_logit_bias * len(bias))(*(ll.llama_logit_bias(token=t, bias=b) for t, b in bias))
        samplers.append(ll.llama_sampler_init_logit_bias(n_vocab, len(bias), biases))
    if params.has_penalties:
        samplers.append(ll.llama_sampler_init_penalties(
            n_vocab, params.penalty_last_n, params.repeat_penalty, params.frequency_penalty,
            params.presence_penalty))
    if params.temperature <= 0.0:
        samplers.append(ll.llama_sampler_init_greedy())
        return samplers
    if params.top_k > 0:
        samplers.append(ll.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        samplers.append(ll.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        samplers.append(ll.llama_sampler_init_min_p(params.min_p, 1))
    samplers.append(ll.llama_sampler_init_temp(params.temperature))
    samplers.append(ll.llama_sampler_init_dist(_seed(params.seed, default_seed)))
    return samplers


def _seed(request_seed: int | None, default_seed: int) -> int:
    """A request's seed, else the engine's default, else a fresh random one (llama.cpp wants uint32)."""
    if request_seed is not None:
        return request_seed & 0xFFFFFFFF
    if default_seed >= 0:
        return default_seed & 0xFFFFFFFF
    return random.getrandbits(32)


class LlamaContext:
    """One llama.cpp context: the K/V cache for `n_parallel` sequences and the compute buffers.

    Implements serving.engine.scheduler.ModelContext, the small surface the scheduler steps through.
    """

    def __init__(self, model: LlamaModel, config: EngineConfig, n_threads: int) -> None:
        params = ll.llama_context_default_params()
        # a unified cache gets the cells of the per-slot layout (config.n_ctx_cells): the same memory, and
        # every slot its n_ctx_per_slot share of it
        params.n_ctx = config.n_ctx_cells if config.kv_unified else config.n_ctx
        params.n_batch = config.n_batch
        params.n_ubatch = config.n_ubatch
        params.n_seq_max = config.n_parallel
        params.n_threads = config.n_threads or n_threads
        params.n_threads_batch = config.n_threads_batch or params.n_threads
        params.type_k = _GGML_TYPES[config.type_k]
        params.type_v = _GGML_TYPES[config.type_v]
        params.flash_attn_type = _FLASH_ATTN[config.flash_attn]
        params.kv_unified = config.kv_unified  # off: one K/V stream per slot, each attending over its own cells
        # every sliding-window cell kept (llama.cpp's default, set here because the scheduler relies on it): a
        # slot then goes back anywhere, and the memory model counts those layers' cells in full
        params.swa_full = True
        params.offload_kqv = config.kv_offload
        params.no_perf = True
        self.model = model
        self.ptr = ll.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise EngineError(
                f"llama.cpp could not create a context with n_ctx={config.n_ctx}, n_parallel={config.n_parallel}, "
                f"n_batch={config.n_batch}, n_ubatch={config.n_ubatch}, type_k={config.type_k.value}, "
                f"type_v={config.type_v.value}, flash_attn={config.flash_attn.value}: lower n_ctx or n_batch "
                "(out of memory?), or use an f16 V cache if flash attention is unavailable here"
            )
        self.memory = ll.llama_get_memory(self.ptr)
        # unified, llama.cpp's n_ctx_seq is the whole cache: the scheduler keeps each slot to its share
        self.n_ctx_seq: int = config.n_ctx_per_slot if config.kv_unified else ll.llama_n_ctx_seq(self.ptr)
        self.one_stream_per_slot = not config.kv_unified
        self.memory_kind = model.memory_kind
        self.n_swa: int = ll.llama_model_n_swa(model.ptr)  # 0: no sliding window
        self.n_vocab = model.n_vocab
        self.batch = Batch(config.n_batch)
        self.candidates = Candidates(self.n_vocab)
        self.masks = DueMasks()  # guided requests' next masks, computed once a decode is launched

    # -- the scheduler's ModelContext ----------------------------------------------------------------
    @property
    def batch_capacity(self) -> int:
        return self.batch.capacity

    @property
    def batch_size(self) -> int:
        return self.batch.n

    def clear_batch(self) -> None:
        self.batch.clear()

    def add_to_batch(self, tokens: Sequence[int], start_pos: int, seq_id: int, want_logits: bool,
                     all_logits: bool = False) -> int:
        return self.batch.add(tokens, start_pos, seq_id, want_logits, all_logits)

    def decode(self) -> int:
        """Run the current batch through the model (the ctypes call releases the GIL while llama.cpp works), then
        compute the due guide masks: on a GPU llama_decode returns once the work is launched (the logits read
        waits for it), so they are computed while the model decodes (serving/engine/guided.py)."""
        self.batch.struct.n_tokens = self.batch.n
        rc = int(ll.llama_decode(self.ptr, self.batch.struct))
        self.masks.compute()
        return rc

    def greedy(self, row: int) -> int:
        return int(self.logits(row).argmax())

    def greedy_no_eog(self, row: int) -> int:
        """The most likely token that is no end of generation (greedy under `ignore_eos`)."""
        logits = self.logits(row).copy()
        logits[self.model.eog_tokens] = -np.inf
        return int(logits.argmax())

    def new_sampler(self, params: SamplingParams, default_seed: int) -> SamplerChain:
        return SamplerChain(self, params, default_seed)

    def forget(self, seq_id: int, from_pos: int = 0) -> bool:
        """Drop a slot's cached tokens from position `from_pos` on (nothing to drop once freed). False when
        llama.cpp refuses, its cells then unchanged: llama.h's llama_memory_seq_rm "returns false if a partial
        sequence cannot be removed", which a recurrent state (and a hybrid's) does for any `from_pos` inside
        its tokens (llama-memory-recurrent.cpp, with n_rs_seq 0 as here); from 0 it never fails."""
        if not self.ptr:
            return True
        return bool(ll.llama_memory_seq_rm(self.memory, seq_id, from_pos, -1))

    def pos_min(self, seq_id: int) -> int:
        """The smallest position slot `seq_id`'s memory holds, -1 when empty (llama_memory_seq_pos_min): past 0
        where a sliding window's cells were overwritten, the last position for a recurrent state, the larger
        of its two parts' for a hybrid."""
        return int(ll.llama_memory_seq_pos_min(self.memory, seq_id))

    def copy_seq(self, src: int, dst: int) -> None:
        """Give slot `dst` a copy of slot `src`'s cells. With kv_unified off each slot is its own K/V stream,
        and llama.cpp copies a whole stream's buffers at the next decode; it accepts only full-range copies
        across streams (p0 = p1 = -1), which is what sharing a prompt needs. Unified, the cells are shared."""
        ll.llama_memory_seq_cp(self.memory, src, dst, -1, -1)

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def save_seq(self, seq_id: int, buffer_for: Callable[[int], StateBuffer], partial: bool = False) -> memoryview:
        """A slot's K/V cells as llama.cpp's per-sequence state (`llama_state_seq_get_data_ext`), written straight
        into a buffer of at least its size from `buffer_for(size)` (serving/engine/prompt_cache.py recycles them):
        restorable into any slot of this context. `partial`: only what cannot be cut back, a recurrent state
        (a hybrid's attention cells left out; llama.h's LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), for a checkpoint."""
        flags = _state_flags(partial)
        size = int(ll.llama_state_seq_get_size_ext(self.ptr, seq_id, flags))
        buffer = buffer_for(size)
        view = buffer.data  # a memoryview of the array: writable, its `.obj` the array
        written = int(ll.llama_state_seq_get_data_ext(self.ptr, (ctypes.c_uint8 * size).from_buffer(view), size,
                                                      seq_id, flags))
        if written != size:
            raise EngineError(f"llama.cpp wrote {written} of the {size} bytes of slot {seq_id}'s state")
        return view[:size]

    def load_seq(self, seq_id: int, state: memoryview, partial: bool = False) -> bool:
        """Restore a state `save_seq` made into (empty) slot `seq_id`, read in place; False when llama.cpp
        refuses it (it then leaves the slot empty). `partial`: a checkpoint's recurrent state, replacing the
        slot's own and leaving its attention cells as they are (llama_memory_hybrid::state_read)."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer(state)
        return int(ll.llama_state_seq_set_data_ext(self.ptr, buf, len(state), seq_id, _state_flags(partial))) > 0

    def save_seq_file(self, seq_id: int, path: Path, tokens: Sequence[int]) -> int:
        """A slot's state and its tokens to a file (`llama_state_seq_save_file`, llama-server's slot save
        format); the bytes written, 0 when llama.cpp could not write it."""
        array = (ll.llama_token * len(tokens))(*tokens)
        return int(ll.llama_state_seq_save_file(self.ptr, str(path).encode(), seq_id, array, len(tokens)))

    def load_seq_file(self, seq_id: int, path: Path) -> list[int] | None:
        """A state `save_seq_file` wrote, into (empty) slot `seq_id`: the tokens its cells now hold, None when
        llama.cpp refuses the file (not a state file, one of another model or context layout, longer than a
        slot); the slot is then empty."""
        tokens = (ll.llama_token * self.n_ctx_seq)()
        count = ctypes.c_size_t(0)
        read = int(ll.llama_state_seq_load_file(self.ptr, str(path).encode(), seq_id, tokens, self.n_ctx_seq,
                                                ctypes.byref(count)))
        if read == 0:
            ll.llama_memory_seq_rm(self.memory, seq_id, 0, -1)
            return None
        return list(tokens[:count.value])

    def logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob:
        """log-softmax of the raw logits of `row`: the chosen token's value and the `top_n` best."""
        logits = self.logits(row)
        peak = float(logits.max())
        log_z = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
        top: tuple[tuple[int, float], ...] = ()
        if top_n > 0:
            best = np.argpartition(logits, -top_n)[-top_n:]
            best = best[np.argsort(logits[best])[::-1]]
            top = tuple((int(t), float(logits[t]) - log_z) for t in best)
        return TokenLogprob(token, float(logits[token]) - log_z, top)

    # -- for scoring ---------------------------------------------------------------------------------
    def logits(self, row: int) -> np.ndarray:
        """The logits of batch row `row` as a numpy view (no copy)."""
        ptr = ll.llama_get_logits_ith(self.ptr, row)
        if not ptr:
            raise EngineError(f"llama.cpp has no logits for batch row {row}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def all_logits(self, n_rows: int) -> np.ndarray:
        """Logits of the last decode's first `n_rows` output rows, as an (n_rows, n_vocab) view."""
        ptr = ll.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))

    def free(self) -> None:
        if self.ptr:
            ll.llama_free(self.ptr)
            self.ptr = None


@dataclass(frozen=True)
class ProbeFailure:
    """Why probe_decode failed, and the exit code serving/engine/repack.py's child reports it with."""

    message: str
    code: int


def probe_decode(model_path: Path, n_tokens: int, n_threads: int) -> ProbeFailure | None:
    """Load `model_path` on the CPU with the extra buffer types (repack, AMX) on, decode `n_tokens` and then
    one more, and check the logits are finite: the smallest program that reaches those kernels (a fault kills
    the process; serving/engine/repack.py runs this in a child). None when it worked."""
    params = ll.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = True
    model = ll.llama_model_load_from_file(str(model_path).encode(), params)
    if not model:
        return ProbeFailure(f"could not load {model_path}", 2)
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 2 * n_tokens
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.no_perf = True
    ctx = ll.llama_init_from_model(model, cparams)
    if not ctx:
        ll.llama_model_free(model)
        return ProbeFailure("could not create a context", 3)
    try:
        n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        prompt = (ll.llama_token * n_tokens)(*((7 * i + 1) % n_vocab for i in range(n_tokens)))
        if ll.llama_decode(ctx, ll.llama_batch_get_one(prompt, n_tokens)) != 0:
            return ProbeFailure("llama_decode of the prompt failed", 4)
        one = (ll.llama_token * 1)(prompt[-1])
        if ll.llama_decode(ctx, ll.llama_batch_get_one(one, 1)) != 0:
            return ProbeFailure("llama_decode of one token failed", 4)
        logits = ll.llama_get_logits_ith(ctx, -1)
        if not all(math.isfinite(logits[i]) for i in range(min(n_vocab, 4096))):
            return ProbeFailure("non-finite logits", 5)
        return None
    finally:
        ll.llama_free(ctx)
        ll.llama_model_free(model)
