"""The whole stack over HTTP: Ray Serve -> FastAPI routes -> engine, with the official openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.conftest import N_PARALLEL

pytestmark = pytest.mark.usefixtures("serve_url")


@pytest.fixture(scope="module")
def client(serve_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client: openai.OpenAI, model: str, content: str, **kw) -> str:
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=kw.pop("max_tokens", 24), **kw)
    return resp.choices[0].message.content


def test_models_lists_the_served_model(client: openai.OpenAI, model: str) -> None:
    assert model == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_and_completion_with_usage(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                          temperature=0, max_tokens=8)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 5
    comp = client.completions.create(model=model, prompt="The sky is", temperature=0, max_tokens=6)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 6


def test_streaming_matches_non_streaming_including_chinese(client: openai.OpenAI, model: str) -> None:
    prompt = "请用中文介绍一下长城。"
    whole = chat(client, model, prompt, max_tokens=48)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=48,
        stream=True, stream_options={"include_usage": True})
    parts, usage, reasons = [], None, []
    for event in stream:
        if event.usage:
            usage = event.usage
        for choice in event.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(parts) == whole
    assert all("\ufffd" not in p for p in parts)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in whole)  # it did produce Chinese
    assert usage is not None and usage.completion_tokens > 0 and reasons[-1] in ("stop", "length")


def test_concurrent_greedy_requests_match_each_alone(client: openai.OpenAI, model: str) -> None:
    prompts = ["Name a fruit.", "What is 2+2?", "Describe the sea.", "Say something about cats.", "Why is the sky blue?"]
    alone = [chat(client, model, p) for p in prompts]

    async def together() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0)
        rs = await asyncio.gather(*(aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=24) for p in prompts))
        return [r.choices[0].message.content for r in rs]

    assert asyncio.run(together()) == alone


def _slots(serve_url: str) -> dict:
    return httpx.get(f"{serve_url}/slots", timeout=30).json()


def test_follow_up_turn_prefills_fewer_tokens(serve_url: str, client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Write two sentences about a quiet harbour town at dawn."}]
    first = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now describe it at night."}]
    before = _slots(serve_url)["counters"]["prompt_tokens_evaluated"]
    second = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
    evaluated = _slots(serve_url)["counters"]["prompt_tokens_evaluated"] - before
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert evaluated < second.usage.prompt_tokens / 2
    # the same conversation with no cache to reuse (cache_prompt only changes speed, not the answer):
    # fill every slot with other prompts first so nothing of this conversation is left cached
    for i in range(N_PARALLEL * 2):
        chat(client, model, f"Filler request number {i}: say ok.", max_tokens=2)
    again = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
    assert again.choices[0].message.content == second.choices[0].message.content


def test_cancelled_streams_leave_every_slot_free(serve_url: str) -> None:
    body = {"prompt": "Count slowly from one to a thousand:", "max_tokens": 900, "stream": True,
            "temperature": 0, "ignore_eos": True}

    async def start_and_drop() -> None:
        async with httpx.AsyncClient(timeout=60) as ac:
            async def one() -> None:
                async with ac.stream("POST", f"{serve_url}/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            return  # got the first token: drop the connection
            await asyncio.gather(*(one() for _ in range(N_PARALLEL)))

    asyncio.run(start_and_drop())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _slots(serve_url)["slots_busy"]:
        time.sleep(0.2)
    stats = _slots(serve_url)
    assert stats["slots_busy"] == 0 and stats["queue_depth"] == 0
    assert stats["counters"]["requests_cancelled"] >= N_PARALLEL


def test_health_answers_while_every_slot_is_busy(serve_url: str) -> None:
    body = {"prompt": "Tell a very long story:", "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def run() -> tuple[list[int], int, int]:
        async with httpx.AsyncClient(timeout=120) as ac:
            busy = [asyncio.create_task(ac.post(f"{serve_url}/v1/completions", json=body)) for _ in range(N_PARALLEL)]
            for _ in range(200):
                if (await ac.get(f"{serve_url}/slots")).json()["slots_busy"] == N_PARALLEL:
                    break
                await asyncio.sleep(0.05)
            slots_busy = (await ac.get(f"{serve_url}/slots")).json()["slots_busy"]
            health = await asyncio.wait_for(ac.get(f"{serve_url}/health"), timeout=5)
            done = await asyncio.gather(*busy)
            return [r.status_code for r in done], health.status_code, slots_busy

    codes, health, slots_busy = asyncio.run(run())
    assert slots_busy == N_PARALLEL and health == 200 and codes == [200] * N_PARALLEL


BAD_REQUESTS = [
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
    ("wrong type", "/v1/chat/completions", {"messages": "hello"}, 400, None),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, None),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("temperature out of range", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, None),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, None),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, None),
    ("n > 1", "/v1/completions", {"prompt": "x", "n": 3}, 400, None),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, None),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [10**9]}, 400, None),
    ("prompt longer than a slot", "/v1/completions", {"prompt": "word " * 3000}, 400, "context_length_exceeded"),
    ("prompt + max_tokens over a slot", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "context_length_exceeded"),
    ("unknown model", "/v1/chat/completions",
     {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
    ("unknown route", "/v1/embeddingz", {}, 404, "not_found"),
]


@pytest.mark.parametrize("name,path,body,status,code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_error_and_server_keeps_serving(serve_url: str, name: str, path: str, body,
                                                              status: int, code: str | None) -> None:
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(f"{serve_url}{path}", timeout=60, **kw)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    if code:
        assert err["code"] == code
    ok = httpx.post(f"{serve_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_streaming_error_is_sent_as_error_status_before_the_stream(serve_url: str) -> None:
    resp = httpx.post(f"{serve_url}/v1/completions", json={"prompt": "word " * 3000, "stream": True}, timeout=60)
    assert resp.status_code == 400 and json.loads(resp.text)["error"]["code"] == "context_length_exceeded"


def test_api_key_is_enforced_when_set(ray_session: None, serve_url: str) -> None:
    from ray import serve

    from serving.app import main
    from tests.conftest import wait_healthy

    serve.run(main({"n_parallel": 1, "n_ctx": 1024, "api_key": "sekrit"}), name="auth", route_prefix="/auth")
    try:
        wait_healthy(f"{serve_url}/auth")
        body = {"prompt": "Hi", "max_tokens": 2}
        missing = httpx.post(f"{serve_url}/auth/v1/completions", json=body, timeout=60)
        wrong = httpx.post(f"{serve_url}/auth/v1/completions", json=body, timeout=60,
                           headers={"Authorization": "Bearer nope"})
        right = httpx.post(f"{serve_url}/auth/v1/completions", json=body, timeout=60,
                           headers={"Authorization": "Bearer sekrit"})
        assert missing.status_code == 401 and wrong.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert right.status_code == 200
    finally:
        serve.delete("auth")


def test_full_queue_answers_503_and_the_app_keeps_serving(ray_session: None, serve_url: str) -> None:
    """One slot, one request of headroom, one queued in Serve: the rest of a burst is turned away with 503."""
    from ray import serve

    from serving.app import main
    from tests.conftest import wait_healthy

    serve.run(main({"n_parallel": 1, "n_ctx": 1024, "control_headroom": 1, "max_queued_requests": 1,
                    "cpus_per_replica": 0.5}), name="tiny", route_prefix="/tiny")
    try:
        wait_healthy(f"{serve_url}/tiny")
        body = {"prompt": "Tell a story:", "max_tokens": 48, "temperature": 0, "ignore_eos": True}

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as ac:
                rs = await asyncio.gather(*(ac.post(f"{serve_url}/tiny/v1/completions", json=body) for _ in range(8)))
                return [r.status_code for r in rs]

        codes = asyncio.run(burst())
        assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 2
        ok = httpx.post(f"{serve_url}/tiny/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
    finally:
        serve.delete("tiny")
