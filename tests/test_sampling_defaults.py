"""What a request that sends no sampler settings samples as: llama-server's defaults on every route, so a model
answers as it does there; whatever the client sends wins, 0 and 1.0 included."""

from __future__ import annotations

from typing import Any

import pytest

LLAMA_SERVER = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # its common/common.h


def samplers(params: Any) -> dict[str, float]:
    return {k: getattr(params, k) for k in LLAMA_SERVER}


@pytest.mark.unit
def test_unsent_settings_sample_as_llama_server_does_on_every_route() -> None:
    from serving.openai.anthropic_requests import MessagesRequest
    from serving.openai.requests import ChatCompletionRequest, CompletionRequest, ResponsesRequest

    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}]})
    completion = CompletionRequest.model_validate({"prompt": "Hi"})
    responses = ResponsesRequest.model_validate({"input": "Hi"})
    messages = MessagesRequest.model_validate({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
    assert samplers(chat.sampling_params()) == LLAMA_SERVER
    assert samplers(completion.sampling_params()) == LLAMA_SERVER
    assert samplers(responses.sampling_params()) == LLAMA_SERVER
    assert samplers(messages.sampling_params(8, None)) == LLAMA_SERVER


@pytest.mark.unit
def test_null_is_unsent_as_in_openais_spec() -> None:
    """OpenAI's spec types the sampler fields "number or null": null samples as if the field were not sent."""
    from serving.openai.requests import ChatCompletionRequest

    nulls = {k: None for k in LLAMA_SERVER}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **nulls})
    assert samplers(chat.sampling_params()) == LLAMA_SERVER


@pytest.mark.unit
def test_what_the_client_sends_wins_off_values_included() -> None:
    from serving.openai.anthropic_requests import MessagesRequest
    from serving.openai.requests import ChatCompletionRequest

    sent = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **sent})
    assert samplers(chat.sampling_params()) == sent
    messages = MessagesRequest.model_validate({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                                               "temperature": 1.0, "top_k": 0, "top_p": 1.0})
    assert samplers(messages.sampling_params(8, None)) == {**sent, "min_p": 0.05}  # the API has no min_p


def _reader(keys: dict[str, str]):  # type: ignore[no-untyped-def]
    return lambda key: keys.get(key)


@pytest.mark.unit
def test_a_models_sampling_keys_replace_llama_servers_where_usable(caplog: pytest.LogCaptureFixture) -> None:
    from serving.engine.sampler_defaults import LLAMA_SERVER, SamplerDefaults

    assert SamplerDefaults.of_model("m", _reader({})) == LLAMA_SERVER
    keys = {"general.sampling.temp": "0.600000", "general.sampling.top_k": "20", "general.sampling.top_p": "0.9",
            "general.sampling.min_p": "0.000000", "general.sampling.penalty_repeat": "1.05",
            "general.sampling.penalty_last_n": "-1"}
    assert SamplerDefaults.of_model("m", _reader(keys)) == SamplerDefaults(
        temperature=0.6, top_k=20, top_p=0.9, min_p=0.0, repeat_penalty=1.05, repeat_last_n=-1)
    bad = {"general.sampling.temp": "7.0", "general.sampling.top_k": "2.5", "general.sampling.top_p": "nan",
           "general.sampling.min_p": "lots", "general.sampling.mirostat": "2"}
    with caplog.at_level("WARNING"):
        assert SamplerDefaults.of_model("m", _reader(bad)) == LLAMA_SERVER  # nothing a request could not send
    logged = caplog.text
    assert all(f"general.sampling.{k}" in logged for k in ("temp", "top_k", "top_p", "min_p", "mirostat"))


@pytest.mark.unit
def test_unsent_settings_take_the_models_defaults_and_sent_ones_win() -> None:
    from serving.engine.sampler_defaults import SamplerDefaults
    from serving.openai.anthropic_requests import MessagesRequest
    from serving.openai.requests import ChatCompletionRequest, ResponsesRequest

    model = SamplerDefaults(temperature=0.6, top_k=20, top_p=0.9, min_p=0.0, repeat_penalty=1.1, repeat_last_n=32)
    own = {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "min_p": 0.0}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "top_k": 5})
    params = chat.sampling_params(defaults=model)
    assert samplers(params) == {**own, "top_k": 5}
    assert (params.repeat_penalty, params.penalty_last_n) == (1.1, 32)
    assert samplers(ResponsesRequest.model_validate({"input": "Hi", "top_p": 1.0}).sampling_params(model)) == {
        **own, "top_p": 1.0}
    messages = MessagesRequest.model_validate({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                                               "temperature": 0.0})
    assert samplers(messages.sampling_params(8, None, model)) == {**own, "temperature": 0.0}


@pytest.mark.engine
def test_the_engine_reads_the_gguf_sampling_keys(tmp_path: Any) -> None:
    """The embedded GGUF copied with `general.sampling.*` keys, as llama.cpp's converter writes them from a
    model's generation_config: the engine serves with them (and the embedded GGUF, which has none, with
    llama-server's)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    from serving.engine.config import EngineConfig, embedded_model_path
    from serving.engine.core import Engine
    from serving.engine.sampler_defaults import LLAMA_SERVER, SamplerDefaults
    from serving.openai.requests import ChatCompletionRequest

    source = embedded_model_path()
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    path = tmp_path / "recommends.gguf"
    added = {"general.sampling.temp": MetadataDetails(gguf.GGUFValueType.FLOAT32, 0.6),
             "general.sampling.top_k": MetadataDetails(gguf.GGUFValueType.INT32, 20),
             "general.sampling.top_p": MetadataDetails(gguf.GGUFValueType.FLOAT32, 0.9)}
    copy_with_new_metadata(reader, gguf.GGUFWriter(path, arch=arch, endianess=reader.endianess), added, [])
    own = Engine(EngineConfig(model=path, n_parallel=1, n_ctx=512))
    try:
        defaults = own.sampler_defaults
        params = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "Hi"}]}).sampling_params(own.n_ctx_slot, None, defaults)
    finally:
        own.close()
    assert defaults == SamplerDefaults(temperature=pytest.approx(0.6), top_k=20, top_p=pytest.approx(0.9))
    assert (params.temperature, params.top_k, params.min_p) == (pytest.approx(0.6), 20, LLAMA_SERVER.min_p)
    stock = Engine(EngineConfig(n_parallel=1, n_ctx=512))
    try:
        assert stock.sampler_defaults == LLAMA_SERVER
    finally:
        stock.close()
