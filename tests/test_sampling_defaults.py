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
def test_what_the_client_sends_wins_off_values_included() -> None:
    from serving.openai.anthropic_requests import MessagesRequest
    from serving.openai.requests import ChatCompletionRequest

    sent = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **sent})
    assert samplers(chat.sampling_params()) == sent
    messages = MessagesRequest.model_validate({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                                               "temperature": 1.0, "top_k": 0, "top_p": 1.0})
    assert samplers(messages.sampling_params(8, None)) == {**sent, "min_p": 0.05}  # the API has no min_p
