"""Per-request sampling parameters and the llama.cpp sampler chain built from them.

The chain follows llama-server's order (penalties -> top-k -> top-p -> min-p -> temperature -> dist) so a
request gives the same distribution here as there. Plain greedy decoding (temperature 0, no penalties)
needs no chain at all: the scheduler takes the argmax of the logits directly, which skips building
llama.cpp's n_vocab-sized candidate array for every token (measurable with a 152k vocabulary).
"""

from __future__ import annotations

import ctypes
import random

from serving.llama import llama_cpp as ll
from serving.request import SamplingParams


class SamplerChain:
    """Owns one llama.cpp sampler chain for one request; freed when the request leaves its slot."""

    def __init__(self, params: SamplingParams, default_seed: int) -> None:
        self._ptr = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        for sampler in _samplers_for(params, default_seed):
            ll.llama_sampler_chain_add(self._ptr, sampler)  # the chain takes ownership

    def accept_prompt(self, tokens: list[int], last_n: int) -> None:
        """Feed the prompt's tail to the penalty sampler, as llama-server does, so penalties see it."""
        for token in tokens[-last_n:] if last_n > 0 else tokens:
            ll.llama_sampler_accept(self._ptr, ctypes.c_int32(token))

    def sample(self, ctx: ll.llama_context_p, batch_index: int) -> int:
        """Sample (and accept) the next token from the logits of batch row `batch_index`."""
        return ll.llama_sampler_sample(self._ptr, ctx, batch_index)

    def free(self) -> None:
        if self._ptr is not None:
            ll.llama_sampler_free(self._ptr)
            self._ptr = None


def _samplers_for(params: SamplingParams, default_seed: int) -> list[ll.llama_sampler_p]:
    samplers = []
    if params.has_penalties:
        samplers.append(
            ll.llama_sampler_init_penalties(
                params.penalty_last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty
            )
        )
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
