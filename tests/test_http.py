"""The HTTP layer. Most tests go through the whole stack (Ray Serve -> FastAPI routes -> engine) with the
official openai client or httpx; the route-level tests at the end drive the same FastAPI app in-process
with a scripted engine, for failures a real engine cannot be made to produce on demand (a queue-full
answer, an error chunk in the middle of a stream, an exception inside a route) and for a fast sweep of
bad bodies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import (
    FINISHED, N_PARALLEL, assert_generated, assert_stream_finished, sse_events, wait_healthy, wait_idle,
)

if TYPE_CHECKING:
    import openai


def chat(client: openai.OpenAI, model: str, content: str, **kw) -> str:
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=kw.pop("max_tokens", 24), **kw)
    assert resp.choices[0].finish_reason in FINISHED, resp
    return resp.choices[0].message.content


@pytest.mark.serve
def test_models_lists_the_served_model(client: openai.OpenAI, model: str) -> None:
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    meta = client.models.list().model_dump()["data"][0]["meta"]
    assert meta["n_vocab"] > 1000 and meta["n_ctx_slot"] == 1024 and meta["n_ctx_train"] > 0


@pytest.mark.serve
def test_chat_and_completion_with_usage(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                          temperature=0, max_tokens=8)
    assert resp.choices[0].finish_reason in FINISHED
    assert resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 5
    comp = client.completions.create(model=model, prompt="The sky is", temperature=0, max_tokens=6)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 6


@pytest.mark.serve
def test_streaming_matches_non_streaming_including_chinese(client: openai.OpenAI, model: str) -> None:
    prompt = "请用中文介绍一下长城。"
    whole = chat(client, model, prompt, max_tokens=48)
    stream = client.chat.completions.create(  # the openai client raises on an error event
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
    assert usage is not None and usage.completion_tokens > 0 and reasons[-1] in FINISHED


@pytest.mark.serve
def test_raw_stream_ends_with_done_and_carries_no_error(serve_url: str) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 12, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{serve_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert assert_stream_finished(events[:-1])
    assert events[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.serve
def test_concurrent_greedy_requests_match_each_alone(client: openai.OpenAI, model: str) -> None:
    import openai

    prompts = ["Name a fruit.", "What is 2+2?", "Describe the sea.", "Say something about cats.",
               "Why is the sky blue?"]
    alone = [chat(client, model, p) for p in prompts]

    async def together() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0)
        rs = await asyncio.gather(*(aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=24) for p in prompts))
        assert all(r.choices[0].finish_reason in FINISHED for r in rs)
        return [r.choices[0].message.content for r in rs]

    assert asyncio.run(together()) == alone


def _slots(serve_url: str) -> dict:
    return httpx.get(f"{serve_url}/slots", timeout=30).json()


@pytest.mark.serve
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


@pytest.mark.serve
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
                            assert "error" not in json.loads(line[len("data: "):]), line
                            return  # got the first token: drop the connection
            await asyncio.gather(*(one() for _ in range(N_PARALLEL)))

    before = _slots(serve_url)["counters"]["requests_cancelled"]
    asyncio.run(start_and_drop())
    stats = wait_idle(serve_url, timeout=30)
    assert stats["counters"]["requests_cancelled"] - before >= N_PARALLEL




# -- control routes never wait; a full engine answers 503 ---------------------------------------------
QUEUED = 64
LONG_STREAM = {"prompt": "Count from one to a thousand:", "max_tokens": 4000, "stream": True, "temperature": 0,
               "ignore_eos": True}


@pytest.fixture(scope="module")
def busy(ray_session: None, serve_url: str) -> AsyncIterator[str]:
    """One slot and the default engine queue (64): a small config that a burst can fill."""
    from ray import serve

    from serving.app import main

    serve.run(main({"n_parallel": 1, "n_ctx": 4096, "max_queued_requests": QUEUED, "cpus_per_replica": 0.5}),
              name="busy", route_prefix="/busy")
    base = f"{serve_url}/busy"
    try:
        wait_healthy(base)
        yield base
    finally:
        serve.delete("busy")


@contextlib.asynccontextmanager
async def backlog(base: str, queued: int) -> AsyncIterator[httpx.AsyncClient]:
    """One long stream on the slot and `queued` more waiting in the engine, held open while the body runs;
    then every connection is dropped (which must cancel them all)."""
    limits = httpx.Limits(max_connections=queued + 32, max_keepalive_connections=queued + 32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=30), limits=limits) as http:
        statuses: list[int] = []

        async def hold() -> None:
            async with http.stream("POST", f"{base}/v1/completions", json=LONG_STREAM) as resp:
                statuses.append(resp.status_code)
                async for line in resp.aiter_lines():
                    assert "error" not in line, line

        streams = [asyncio.create_task(hold()) for _ in range(queued + 1)]
        try:
            deadline = time.monotonic() + 180
            while True:
                stats = (await http.get(f"{base}/slots")).json()
                if stats["slots_busy"] == 1 and stats["queue_depth"] >= queued:
                    break
                failed = [t for t in streams if t.done()]
                assert not failed, f"a held stream ended early: {failed[0].exception() or 'finished'}"
                assert time.monotonic() < deadline, f"the backlog did not build: {stats['queue_depth']} queued"
                await asyncio.sleep(0.1)
            assert statuses == [200] * len(statuses), statuses  # every one of them was admitted
            yield http
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)


@pytest.mark.serve
def test_control_routes_answer_while_64_requests_are_queued(busy: str) -> None:
    async def probe() -> dict[str, httpx.Response]:
        async with backlog(busy, QUEUED) as http:
            return {path: await asyncio.wait_for(http.get(f"{busy}{path}"), timeout=60)
                    for path in ("/health", "/slots", "/metrics")}

    answers = asyncio.run(probe())
    assert {p: r.status_code for p, r in answers.items()} == {"/health": 200, "/slots": 200, "/metrics": 200}
    assert answers["/slots"].json()["queue_depth"] >= QUEUED - 1  # the one on the slot may have finished
    metrics = answers["/metrics"].text
    queue_gauge = re.search(r"^llm_queue_depth\{[^}]*\} (\S+)$", metrics, re.M)
    assert queue_gauge and float(queue_gauge.group(1)) >= QUEUED - 1, metrics
    assert re.search(r"^llm_slots_busy\{[^}]*\} 1\.0$", metrics, re.M), metrics
    stats = wait_idle(busy)  # dropping the connections cancelled all of them, queued ones included
    assert stats["counters"]["requests_cancelled"] >= QUEUED


@pytest.mark.serve
def test_full_engine_queue_answers_503_with_retry_after_and_the_app_keeps_serving(busy: str) -> None:
    async def overflow() -> list[httpx.Response]:
        async with backlog(busy, QUEUED) as http:
            whole = await http.post(f"{busy}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            streamed = await http.post(f"{busy}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})
            return [whole, streamed]

    for resp in asyncio.run(overflow()):
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["retry-after"]) >= 1
        assert resp.headers["content-type"] == "application/json"  # the engine's answer, not Serve's
        err = resp.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "server_overloaded" and err["message"]
    wait_idle(busy)
    ok = httpx.post(f"{busy}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and assert_generated(ok.json())["usage"]["completion_tokens"] == 3
    metrics = httpx.get(f"{busy}/metrics", timeout=30).text
    assert re.search(r'^llm_requests_rejected_total\{cause="queue_full"[^}]*\} [2-9]', metrics, re.M), metrics


@pytest.mark.serve
def test_metrics_count_requests_by_finish_reason_and_ttft(serve_url: str) -> None:
    def count(text: str, name: str, **labels: str) -> float:
        pattern = "".join(f'(?=[^}}]*{k}="{v}")' for k, v in labels.items())
        found = re.search(rf"^{name}\{{{pattern}[^}}]*\}} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    before = httpx.get(f"{serve_url}/metrics", timeout=30)
    ok = httpx.post(f"{serve_url}/v1/completions", json={"prompt": "The sea", "max_tokens": 4, "temperature": 0},
                    timeout=60)
    assert assert_generated(ok.json())["choices"][0]["finish_reason"] == "length"
    after = httpx.get(f"{serve_url}/metrics", timeout=30)
    assert after.headers["content-type"].startswith("text/plain")
    b, a = before.text, after.text
    assert count(a, "llm_requests_total", reason="length") == count(b, "llm_requests_total", reason="length") + 1
    assert count(a, "llm_generated_tokens_total") == count(b, "llm_generated_tokens_total") + 4
    ttft = "llm_time_to_first_token_seconds_count"
    assert count(a, ttft) == count(b, ttft) + 1
    assert count(a, "llm_prompt_tokens_total") > count(b, "llm_prompt_tokens_total")


@pytest.mark.serve
def test_stream_cut_by_an_engine_error_ends_with_an_error_event_then_done(ray_session: None, serve_url: str) -> None:
    """A real engine failure: a prompt waiting for the slot that no longer fits it after a live config change
    (2048 -> 1024 tokens a slot) ends with an error. Its stream, already under way (200, headers out),
    must end with OpenAI's error JSON as an event and then [DONE]; the request on the slot is unaffected."""
    from ray import serve

    from serving.app import main
    from serving.replica.control import CHANNEL_NAME

    serve.run(main({"n_parallel": 1, "n_ctx": 2048, "cpus_per_replica": 0.5, "config_poll_s": 0.2}),
              name="shrink", route_prefix="/shrink")
    base = f"{serve_url}/shrink"
    try:
        wait_healthy(base)
        running = {**LONG_STREAM, "max_tokens": 120}
        waiting = {"prompt": "word " * 1500, "max_tokens": 4, "stream": True}

        async def run() -> tuple[list[str], list[str]]:
            async with httpx.AsyncClient(timeout=180) as http:
                async def lines(body: dict) -> list[str]:
                    async with http.stream("POST", f"{base}/v1/completions", json=body) as resp:
                        assert resp.status_code == 200
                        return [line async for line in resp.aiter_lines()]

                async def until(key: str) -> None:
                    for _ in range(1200):
                        if (await http.get(f"{base}/slots")).json()[key] == 1:
                            return
                        await asyncio.sleep(0.05)
                    raise TimeoutError(key)

                first = asyncio.create_task(lines(running))
                await until("slots_busy")
                second = asyncio.create_task(lines(waiting))
                await until("queue_depth")
                channel = serve.get_deployment_handle(CHANNEL_NAME, app_name="shrink")
                await channel.publish.remote({"n_parallel": 1, "n_ctx": 1024})
                return await first, await second

        on_slot, cut = asyncio.run(run())
        assert assert_stream_finished(sse_events(on_slot))
        events = sse_events(cut, allow_error=True)
        assert "error" in events[-1], events  # the error is the last event; sse_events checked [DONE] follows
        err = events[-1]["error"]
        assert err["type"] == "server_error" and "no longer fits" in err["message"]
        ok = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200 and assert_generated(ok.json())
        assert httpx.get(f"{base}/slots", timeout=30).json()["n_ctx_slot"] == 1024
    finally:
        serve.delete("shrink")


# -- bad input: 4xx with OpenAI's error JSON, never a 5xx, and the server keeps serving ---------------
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "x"}]
RAW = "raw"  # body given as bytes, with a content type

BAD_REQUESTS = [
    ("malformed JSON", CHAT, (RAW, b'{"messages": [', "application/json"), 400, "invalid_json"),
    ("wrong type", CHAT, {"messages": "hello"}, 400, None),
    ("empty messages", CHAT, {"messages": []}, 400, None),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("temperature out of range", CHAT, {"messages": MSG, "temperature": 5}, 400, None),
    ("NaN temperature", CHAT, (RAW, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
                               "application/json"), 400, None),
    ("infinite repeat_penalty", COMP, (RAW, b'{"prompt": "x", "repeat_penalty": Infinity}', "application/json"),
     400, None),
    ("string temperature", CHAT, {"messages": MSG, "temperature": "hot"}, 400, None),
    ("null messages", CHAT, {"messages": None}, 400, None),
    ("negative max_tokens", COMP, {"prompt": "x", "max_tokens": -3}, 400, None),
    ("huge max_tokens", COMP, {"prompt": "x", "max_tokens": 10**30}, 400, "context_length_exceeded"),
    ("negative top_k", COMP, {"prompt": "x", "top_k": -1}, 400, None),
    ("huge top_k", COMP, {"prompt": "x", "top_k": 2**40}, 400, None),
    ("seed above uint32", COMP, {"prompt": "x", "seed": 2**32}, 400, None),
    ("seed below -1", COMP, {"prompt": "x", "seed": -5}, 400, None),
    ("huge repeat_last_n", COMP, {"prompt": "x", "repeat_last_n": 2**40}, 400, None),
    ("stop string too long", COMP, {"prompt": "x", "stop": "s" * 5000}, 400, None),
    ("too many stop strings", COMP, {"prompt": "x", "stop": ["a"] * 40}, 400, None),
    ("top_p zero", COMP, {"prompt": "x", "top_p": 0}, 400, None),
    ("n above the slots", COMP, {"prompt": "x", "n": 300}, 400, None),
    ("unimplemented field", COMP, {"prompt": "x", "frobnicate": [1]}, 400, "unsupported_parameter"),
    ("n_predict zero", COMP, {"prompt": "x", "n_predict": 0}, 400, None),
    ("n_predict and max_tokens both", CHAT, {"messages": MSG, "n_predict": 3, "max_tokens": 4}, 400, None),
    ("logit_bias key not a token id", COMP, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, None),
    ("bad json schema", CHAT, {"messages": [{"role": "user", "content": "x"}],
                               "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, 400, None),
    ("tool_choice names no tool", CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                          "function": {"name": "g"}}}, 400, None),
    ("empty prompt", COMP, {"prompt": ""}, 400, None),
    ("nested token lists", COMP, {"prompt": [[[1, 2]]]}, 400, None),
    ("token id out of vocabulary", COMP, {"prompt": [10**9]}, 400, None),
    ("negative token id", COMP, {"prompt": [-1]}, 400, None),
    ("lone surrogate", COMP, (RAW, b'{"prompt": "\\ud800"}', "application/json"), 400, None),
    ("lone surrogate model", CHAT, (RAW, b'{"model": "\\udfff", "messages": [{"role": "user", "content": "x"}]}',
                                    "application/json"), 400, None),
    ("invalid UTF-8", COMP, (RAW, b'{"prompt": "\xff\xfe"}', "application/json"), 400, None),
    ("JSON array body", CHAT, [1, 2], 400, None),
    ("JSON string body", COMP, "just a string", 400, None),
    ("JSON null body", COMP, (RAW, b"null", "application/json"), 400, None),
    ("text/plain body", COMP, (RAW, b'{"prompt": "x"}', "text/plain"), 400, None),
    ("form body", COMP, (RAW, b"prompt=x", "application/x-www-form-urlencoded"), 400, None),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("prompt longer than a slot", COMP, {"prompt": "word " * 3000}, 400, "context_length_exceeded"),
    ("prompt + max_tokens over a slot", CHAT, {"messages": MSG, "max_tokens": 100000}, 400, "context_length_exceeded"),
    ("unknown model", CHAT, {"model": "gpt-17", "messages": MSG}, 404, "model_not_found"),
    ("unknown route", "/v1/embeddingz", {}, 404, "not_found"),
]
ODD_BUT_VALID = [
    ("content None", CHAT, {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]}),
    ("content parts", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
    ("logit_bias, and fields that change nothing", COMP, {"prompt": "Hi", "logit_bias": {"50": -100}, "user": "u",
                                                          "metadata": {"a": "b"}, "suffix": None, "echo": False}),
    ("empty and absent stops", COMP, {"prompt": "Hi", "stop": ["", "\n\n\n"]}),
    ("null optionals", COMP, {"prompt": "Hi", "stop": None, "seed": None, "max_tokens": None,
                              "stream_options": None}),
    ("seed -1 and the whole slot as penalty window", COMP, {"prompt": "Hi", "seed": -1, "repeat_last_n": -1,
                                                            "repeat_penalty": 1.1, "temperature": 0.7}),
    ("largest seed and top_k", COMP, {"prompt": "Hi", "seed": 2**32 - 1, "top_k": 2**31 - 1}),
    ("NUL and specials in text", COMP, {"prompt": "a\u0000b <|im_start|> \U0001f600"}),
]


def _send(base: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    if isinstance(body, tuple) and body[0] == RAW:
        return httpx.post(f"{base}{path}", content=body[1], headers={"content-type": body[2]}, timeout=60, **kw)
    return httpx.post(f"{base}{path}", json=body, timeout=60, **kw)


def _check_error(resp: httpx.Response, status: int, code: str | None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code


ENGINE_BAD_REQUESTS = BAD_REQUESTS + [  # checked by the engine itself (the scripted one does not)
    ("grammar that does not parse", COMP, {"prompt": "x", "grammar": "root ::= ("}, 400, None),
]


@pytest.mark.serve
@pytest.mark.parametrize("name,path,body,status,code", ENGINE_BAD_REQUESTS, ids=[b[0] for b in ENGINE_BAD_REQUESTS])
def test_bad_input_gets_openai_error_and_server_keeps_serving(serve_url: str, name: str, path: str, body: Any,
                                                              status: int, code: str | None) -> None:
    _check_error(_send(serve_url, path, body), status, code)
    ok = httpx.post(f"{serve_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and assert_generated(ok.json())["usage"]["completion_tokens"] == 2


@pytest.mark.serve
@pytest.mark.parametrize("name,path,body", ODD_BUT_VALID, ids=[b[0] for b in ODD_BUT_VALID])
def test_odd_but_valid_requests_are_served(serve_url: str, name: str, path: str, body: dict) -> None:
    resp = _send(serve_url, path, {**body, "max_tokens": body.get("max_tokens") or 4})
    assert resp.status_code == 200, resp.text
    assert_generated(resp.json())


@pytest.mark.serve
def test_what_llama_server_clients_send_and_read(serve_url: str) -> None:
    """llama-server's names: the /chat/completions and /models aliases, n_predict for max_tokens, its
    `timings` object (also on a stream's usage chunk), its numbers on a context overflow, the seed in /props."""
    whole = httpx.post(f"{serve_url}/chat/completions", json={"messages": MSG, "n_predict": 5, "temperature": 0,
                                                              "ignore_eos": True}, timeout=60)
    assert whole.status_code == 200, whole.text
    body = assert_generated(whole.json())
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    t = body["timings"]
    assert t["predicted_n"] == 5 and t["cache_n"] + t["prompt_n"] == body["usage"]["prompt_tokens"]
    assert 0 < t["prompt_ms"] <= t["ttft_ms"] and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    with httpx.stream("POST", f"{serve_url}/v1/completions", timeout=60, json={
            "prompt": "Hello", "n_predict": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        events = sse_events(resp.iter_lines())
    assert_stream_finished(events[:-1])
    assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["timings"]["predicted_n"] == 3
    unlimited = httpx.post(f"{serve_url}/v1/completions", json={"prompt": "word " * 1000, "n_predict": -1},
                           timeout=60)  # -1: until the slot is full (here the prompt nearly fills it)
    assert unlimited.status_code == 200 and assert_generated(unlimited.json())["choices"][0]["finish_reason"]
    models = httpx.get(f"{serve_url}/models", timeout=30)
    assert models.status_code == 200 and models.json() == httpx.get(f"{serve_url}/v1/models", timeout=30).json()
    over = httpx.post(f"{serve_url}/v1/completions", json={"prompt": "word " * 3000}, timeout=60)
    err = over.json()["error"]
    assert over.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "exceeds the available context size" in err["message"]
    assert err["n_ctx"] == 1024 and err["n_prompt_tokens"] > 1024
    props = httpx.get(f"{serve_url}/props", timeout=30).json()
    params = props["default_generation_settings"]["params"]
    assert isinstance(params["seed"], int)
    # what an unsent setting samples as (the embedded GGUF has no general.sampling keys: llama-server's defaults)
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"], params["repeat_last_n"]) \
        == (0.8, 40, 0.95, 0.05, 64)


@pytest.mark.serve
def test_system_fingerprint_names_the_running_config(serve_url: str) -> None:
    """Every answer, whole or streamed, carries the fingerprint of the engine config that produced it; another
    config has another (a live switch shows in the answers)."""
    from serving.engine.config import EngineConfig

    running = EngineConfig.model_validate(httpx.get(f"{serve_url}/props", timeout=30).json()["config"])
    whole = httpx.post(f"{serve_url}{CHAT}", json={"messages": MSG, "max_tokens": 2}, timeout=60).json()
    assert assert_generated(whole)["system_fingerprint"] == running.fingerprint()
    with httpx.stream("POST", f"{serve_url}{COMP}", timeout=60, json={"prompt": "Hi", "max_tokens": 2,
                                                                        "stream": True}) as resp:
        events = sse_events(resp.iter_lines())
    assert_stream_finished(events)
    assert {e["system_fingerprint"] for e in events} == {running.fingerprint()}
    assert running.model_copy(update={"n_batch": running.n_batch // 2}).fingerprint() != running.fingerprint()


@pytest.mark.serve
def test_wrong_method_is_a_json_405(serve_url: str) -> None:
    resp = httpx.get(f"{serve_url}/v1/completions", timeout=30)
    assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.serve
def test_streaming_error_is_sent_as_error_status_before_the_stream(serve_url: str) -> None:
    resp = httpx.post(f"{serve_url}/v1/completions", json={"prompt": "word " * 3000, "stream": True}, timeout=60)
    assert resp.status_code == 400 and json.loads(resp.text)["error"]["code"] == "context_length_exceeded"


@pytest.mark.serve
def test_openapi_schema_documents_openai_errors_not_422(serve_url: str) -> None:
    schema = httpx.get(f"{serve_url}/openapi.json", timeout=30).json()
    post = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in post and {"400", "401", "404", "503"} <= set(post)
    assert "ErrorBody" in schema["components"]["schemas"]


@pytest.mark.serve
def test_api_key_is_enforced_when_set(ray_session: None, serve_url: str) -> None:
    from ray import serve

    from serving.app import main

    serve.run(main({"n_parallel": 1, "n_ctx": 1024, "api_key": "sekrit", "cpus_per_replica": 0.5,
                    "cors_origins": "https://app.example"}), name="auth", route_prefix="/auth")
    try:
        wait_healthy(f"{serve_url}/auth")  # /health needs no key
        body = {"prompt": "Hi", "max_tokens": 2}
        base = f"{serve_url}/auth"

        def post(**headers: Any) -> httpx.Response:
            return httpx.post(f"{base}/v1/completions", json=body, timeout=60, headers=headers)

        for denied in (post(), post(Authorization="Bearer nope"), post(Authorization="sekrit"),
                       post(Authorization="Bearer sekrit2"), post(Authorization=b"Bearer \xffsekrit"),
                       httpx.get(f"{base}/slots", timeout=30), httpx.get(f"{base}/metrics", timeout=30),
                       httpx.post(f"{base}/v1/completions", content=b"{bad json", timeout=30)):
            assert denied.status_code == 401, denied.text  # before the body is even read
            assert denied.json()["error"]["code"] == "invalid_api_key"
            assert denied.headers["www-authenticate"] == "Bearer"
        for denied in (post(**{"X-Api-Key": "nope"}), post(Authorization="Bearer nope", **{"X-Api-Key": "sekrit"})):
            assert denied.status_code == 401, denied.text  # llama-server's header, read only without Authorization
        for right in (post(Authorization="Bearer sekrit"), post(Authorization="bearer sekrit"),
                      post(**{"X-Api-Key": "sekrit"})):
            assert right.status_code == 200 and assert_generated(right.json())
        assert httpx.get(f"{base}/openapi.json", timeout=30).status_code == 200
        # CORS (cors_origins): a browser's preflight from the allowed origin is answered without a key; the
        # actual request still needs one; another origin gets no CORS headers
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = httpx.options(f"{base}/v1/completions", timeout=30, headers={"Origin": "https://app.example",
                                                                          **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(f"{base}/v1/completions", timeout=30, headers={"Origin": "https://evil.example",
                                                                             **preflight})
        assert "access-control-allow-origin" not in other.headers
        cross = post(Authorization="Bearer sekrit", Origin="https://app.example")
        assert cross.status_code == 200 and cross.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        serve.delete("auth")


# -- route level: the same FastAPI app in-process, with a scripted engine ---------------------------
class ScriptedEngine:
    """Stands in for Engine through its public API; `submit` raises `fail` or replays `chunks`."""

    def __init__(self) -> None:
        from serving.engine.config import EngineConfig
        from serving.engine.request import FinishReason, GenerationChunk, Usage
        from serving.engine.sampler_defaults import LLAMA_SERVER

        self.config = EngineConfig(model_alias="scripted", n_ctx=1024, n_parallel=1)
        self.sampler_defaults = LLAMA_SERVER
        self.fingerprint = self.config.fingerprint()
        self.n_ctx_slot, self.n_vocab, self.n_ctx_train = 1024, 1000, 2048
        self.fail: Exception | None = None
        self.chunks = [GenerationChunk("Hello", [1]),
                       GenerationChunk(" world", [2], FinishReason.length, Usage(prompt_tokens=3, completion_tokens=2))]
        self.handle_class: type | None = None
        self.params: list[Any] = []
        self.handles: list[Any] = []

    def tokenize_prompt(self, text: str) -> list[int]:
        return [b % 1000 for b in text.encode()]

    def render_chat(self, messages: list[dict[str, Any]], tools: Any = None, **_: Any) -> str:
        return "".join(m["content"] for m in messages)

    @property
    def chat_template(self) -> Any:
        return SimpleNamespace(knows_tools=False)

    def token_piece(self, token: int) -> bytes:
        return str(token).encode()

    def submit_choices(self, tokens: list[int], params: Any, n: int, traffic: Any = None) -> list[Any]:
        return [self.submit(tokens, params) for _ in range(n)]

    def submit(self, tokens: list[int], params: Any) -> Any:
        from serving.engine.request import Request, RequestHandle

        if not tokens:
            raise ValueError("the prompt is empty: send at least one token of text")
        if any(not 0 <= t < self.n_vocab for t in tokens):  # as Engine.submit checks
            raise ValueError(f"token ids must be integers in [0, {self.n_vocab})")
        if self.fail is not None:
            raise self.fail
        self.params.append(params)
        handle = (self.handle_class or RequestHandle)(Request(len(self.params), tokens, params), threading.Event())
        for chunk in self.chunks:
            handle.push(chunk)
        self.handles.append(handle)
        return handle


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The app's FastAPI routes served by a host holding a ScriptedEngine (no Ray, no model)."""
    import contextlib

    from starlette.testclient import TestClient

    from serving.openai.routes import OpenAIRoutes, build_api
    from serving.replica.metrics import ReplicaMetrics

    class Host:
        def __init__(self) -> None:
            self.engine = ScriptedEngine()
            self.metrics = ReplicaMetrics("scripted-replica", "scripted")
            self.api = build_api(OpenAIRoutes(self).router())

        def ready_engine(self) -> Any:
            return self.engine

        @contextlib.asynccontextmanager
        async def engine_turn(self) -> Any:
            yield self.engine

        def stream_spacing(self) -> float:
            return 0.0

    host = Host()
    with TestClient(host.api, raise_server_exceptions=False) as http:
        host.http = http
        yield host


def _events(resp: Any) -> list[dict[str, Any]]:
    return sse_events(resp.text.splitlines(), allow_error=True)


@pytest.mark.engine
@pytest.mark.parametrize("path,body", [(COMP, {"prompt": "Hi"}), (CHAT, {"messages": MSG})])
def test_scripted_stream_cut_by_engine_error_ends_with_error_event_then_done(scripted: Any, path: str,
                                                                             body: dict) -> None:
    from serving.engine.request import FinishReason, GenerationChunk

    scripted.engine.chunks = [GenerationChunk("Hello", [1]),
                              GenerationChunk(" wor", [2], FinishReason.error, error="llama_decode failed; retry it")]
    resp = scripted.http.post(path, json={**body, "stream": True})
    assert resp.status_code == 200
    events = _events(resp)  # checks that [DONE] ends it
    text = assert_text(events[:-1])
    assert text == "Hello wor"  # what was generated before the error still reaches the client
    err = events[-1]["error"]
    assert err == {"message": "llama_decode failed; retry it", "type": "server_error", "param": None,
                   "code": "generation_failed"}
    assert "error" not in "".join(json.dumps(e) for e in events[:-1])


@pytest.mark.engine
def test_scripted_responses_stream_cut_by_engine_error_ends_with_a_typed_error_event(scripted: Any) -> None:
    from serving.engine.request import FinishReason, GenerationChunk

    scripted.engine.chunks = [GenerationChunk("Hello", [1]),
                              GenerationChunk("", [], FinishReason.error, error="llama_decode failed")]
    resp = scripted.http.post("/v1/responses", json={"input": "Hi", "stream": True})
    assert resp.status_code == 200
    last = resp.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\n")
    event = json.loads(last.split("data: ", 1)[1])
    assert event["type"] == "error" and event["code"] == "generation_failed"
    assert event["message"] == "llama_decode failed" and isinstance(event["sequence_number"], int)


def assert_text(events: list[dict[str, Any]]) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for e in events for c in e["choices"])


@pytest.mark.engine
def test_scripted_engine_error_without_stream_is_a_500_with_the_engine_message(scripted: Any) -> None:
    from serving.engine.request import FinishReason, GenerationChunk

    scripted.engine.chunks = [GenerationChunk("", [], FinishReason.error, error="sampling failed for this request")]
    resp = scripted.http.post(COMP, json={"prompt": "Hi"})
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "sampling failed for this request"


@pytest.mark.engine
def test_scripted_queue_full_is_503_with_retry_after(scripted: Any) -> None:
    from serving.engine.errors import QueueFullError

    scripted.engine.fail = QueueFullError(queued=64, limit=64, retry_after_s=7)
    for path, body in ((COMP, {"prompt": "Hi"}), (CHAT, {"messages": MSG, "stream": True})):
        resp = scripted.http.post(path, json=body)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "7"
        assert resp.json()["error"]["code"] == "server_overloaded"
    scripted.engine.fail = None
    ok = scripted.http.post(COMP, json={"prompt": "Hi"})
    assert ok.status_code == 200 and assert_generated(ok.json())["choices"][0]["text"] == "Hello world"
    assert 'llm_requests_rejected_total{cause="queue_full"' in scripted.metrics.exposition().decode()


@pytest.mark.engine
def test_scripted_a_small_body_is_tokenised_on_the_loop_a_large_one_in_a_worker_thread(scripted: Any) -> None:
    """Tokenising a small body inline costs less than a hop to a worker thread; a large one must not stall the
    event loop that streams every other request's tokens. Either way the answer is the same."""
    from serving.openai.routes import INLINE_BODY_BYTES

    engine = scripted.engine
    on_loop: list[bool] = []
    tokenize = engine.tokenize_prompt

    def noting(text: str) -> list[int]:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return tokenize(text)

    engine.tokenize_prompt = noting
    for path, body in ((COMP, {"prompt": "Hi"}), (CHAT, {"messages": MSG})):
        small = scripted.http.post(path, json=body)
        large = scripted.http.post(path, json={**body, "user": "x" * INLINE_BODY_BYTES})
        assert small.status_code == large.status_code == 200, (small.text, large.text)
        assert assert_generated(small.json()) and assert_generated(large.json())
    assert on_loop == [True, False, True, False]


@pytest.mark.engine
def test_scripted_stopped_engine_is_503(scripted: Any) -> None:
    from serving.engine.errors import EngineStoppedError

    scripted.engine.fail = EngineStoppedError("the engine is not running")
    resp = scripted.http.post(COMP, json={"prompt": "Hi"})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "engine_unavailable"


@pytest.mark.engine
def test_scripted_internal_error_is_generic_and_names_the_request_id(scripted: Any,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    scripted.engine.fail = RuntimeError("secret detail at /srv/models/x.gguf")
    resp = scripted.http.post(COMP, json={"prompt": "Hi"}, headers={"x-request-id": "req-1234"})
    assert resp.status_code == 500
    err = resp.json()["error"]
    assert "secret" not in resp.text and "gguf" not in resp.text
    assert "req-1234" in err["message"] and err["type"] == "server_error"
    logged = [r for r in caplog.records if "req-1234" in r.getMessage()]
    assert logged and "secret detail" in (logged[0].exc_text or "")


@pytest.mark.engine
def test_scripted_exception_inside_a_stream_is_an_error_event_and_done(scripted: Any) -> None:
    from serving.engine.request import GenerationChunk, RequestHandle

    class Exploding(RequestHandle):
        async def next_chunk(self, not_before: float | None = 0.0) -> GenerationChunk:  # what the routes read
            if self.request.id and not getattr(self, "_sent", False):
                self._sent = True
                return GenerationChunk("Hel", [1])
            raise RuntimeError("secret internals")

    scripted.engine.handle_class = Exploding
    resp = scripted.http.post(COMP, json={"prompt": "Hi", "stream": True}, headers={"x-request-id": "req-77"})
    events = _events(resp)
    assert assert_text(events[:-1]) == "Hel"
    assert "req-77" in events[-1]["error"]["message"] and "secret" not in resp.text
    assert scripted.engine.handles[-1].request.cancelled  # the engine was told to free the slot


@pytest.mark.engine
def test_scripted_sampling_params_are_bounded_by_the_slot(scripted: Any) -> None:
    for last_n, expected in ((-1, 1024), (10**6, 1024), (0, 0), (32, 32)):
        resp = scripted.http.post(COMP, json={"prompt": "Hi", "repeat_last_n": last_n})
        assert resp.status_code == 200, resp.text
        assert scripted.engine.params[-1].penalty_last_n == expected
    assert scripted.engine.params[-1].max_tokens is None  # no max_tokens: the engine bounds it by the slot


@pytest.mark.engine
def test_scripted_body_over_the_limit_is_a_json_413(scripted: Any) -> None:
    from serving.front.http import MAX_BODY_BYTES

    resp = scripted.http.post(COMP, content=b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}',
                              headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


@pytest.mark.engine
@pytest.mark.parametrize("name,path,body,status,code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_scripted_bad_input_is_4xx_json(scripted: Any, name: str, path: str, body: Any, status: int,
                                        code: str | None) -> None:
    if code == "context_length_exceeded":
        pytest.skip("the scripted engine does not check lengths")
    if isinstance(body, tuple) and body[0] == RAW:
        resp = scripted.http.post(path, content=body[1], headers={"content-type": body[2]})
    else:
        resp = scripted.http.post(path, json=body)
    _check_error(resp, status, code)


@pytest.mark.unit
def test_api_key_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    from serving.front import http as routes

    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(routes.hmac, "compare_digest", spy)
    assert routes.api_key_matches("Bearer sekrit", "sekrit") and routes.api_key_matches("bearer  sekrit ", "sekrit")
    assert not routes.api_key_matches("Bearer sekri", "sekrit")
    assert not routes.api_key_matches("Bearer sekrit-and-more", "sekrit")
    assert len(calls) == 4 and all(len(a) == len(b) == 32 for a, b in calls)  # digests: equal lengths always
    for header in (None, "", "sekrit", "Basic sekrit", "Bearer", "Bearer \u0100sekrit"):
        assert not routes.api_key_matches(header, "sekrit")
    assert routes.api_key_matches("Bearer " + "ключ".encode().decode("latin-1"), "ключ")  # raw UTF-8 bytes
    assert routes.api_key_matches(None, "sekrit", " sekrit") and not routes.api_key_matches(None, "sekrit", "sekri")
    assert not routes.api_key_matches("Bearer nope", "sekrit", "sekrit")  # X-Api-Key only without Authorization


@pytest.mark.engine
def test_scripted_chunked_body_over_the_limit_is_a_json_413(scripted: Any) -> None:
    from serving.front.http import MAX_BODY_BYTES

    def chunks() -> Any:  # no Content-Length: the limit is found while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 1):
            yield b"a" * 65536
        yield b'"}'

    resp = scripted.http.post(COMP, content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


@pytest.mark.engine
def test_scripted_responses_ids_are_spelled_as_openai_spells_them(scripted: Any) -> None:
    body = scripted.http.post("/v1/responses", json={"input": "Hi"}).json()
    assert body["id"].startswith("resp_") and body["output"][0]["id"].startswith("msg_")
    events = [json.loads(line[6:]) for line in scripted.http.post("/v1/responses", json={
        "input": "Hi", "stream": True}).text.splitlines() if line.startswith("data: ")]
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1 and ids.pop().startswith("resp_")


# -- tool calls as the routes answer them, over a scripted generation ---------------------------------
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FORCED = {"messages": MSG, "tools": [WEATHER_TOOL], "tool_choice": "required"}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _script(scripted: Any, text: str, reason: Any) -> None:
    """The engine 'generates' `text` four characters a token, ending with `reason`."""
    from serving.engine.request import GenerationChunk, Usage

    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    scripted.engine.chunks = [GenerationChunk(p, [i]) for i, p in enumerate(pieces[:-1])] + [
        GenerationChunk(pieces[-1], [len(pieces)], reason, Usage(prompt_tokens=3, completion_tokens=len(pieces)))]


def _streamed_calls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool_calls deltas of a chat stream, in order."""
    return [call for e in events for c in e["choices"] for call in (c["delta"].get("tool_calls") or [])]


@pytest.mark.engine
def test_scripted_forced_calls_cut_by_max_tokens_keep_the_complete_ones(scripted: Any) -> None:
    """The reported bug: a forced call, then the same call again until max_tokens cut it. The complete calls
    are the answer (finish_reason length says the rest was cut); no markup is content, whole or streamed."""
    from serving.engine.request import FinishReason

    _script(scripted, (CALL_TEXT + "\n") * 2 + CALL_TEXT[:30], FinishReason.length)
    whole = assert_generated(scripted.http.post(CHAT, json=FORCED).json())["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris"})] * 2
    events = sse_events(scripted.http.post(CHAT, json={**FORCED, "stream": True}).text.splitlines())
    assert assert_stream_finished(events) == "" and events[-1]["choices"][0]["finish_reason"] == "length"
    streamed = _streamed_calls(events)
    args = {i: "".join(d["function"]["arguments"] for d in streamed if d["index"] == i) for i in (0, 1)}
    assert [json.loads(a) for a in args.values()] == [{"city": "Paris"}] * 2


@pytest.mark.engine
def test_scripted_streamed_call_sends_its_arguments_as_they_come(scripted: Any) -> None:
    """OpenAI's framing: a call's first delta carries index, id, type, name and the start of its arguments;
    the later ones only index and more arguments (an event per token: logprobs are asked for)."""
    from serving.engine.request import FinishReason

    _script(scripted, CALL_TEXT, FinishReason.stop)
    events = sse_events(scripted.http.post(CHAT, json={**FORCED, "stream": True, "logprobs": True}).text.splitlines())
    assert assert_stream_finished(events) == "" and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    first, *rest = _streamed_calls(events)
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather" and '{"city": "Paris"}'.startswith(first["function"]["arguments"])
    assert len(rest) >= 3 and all(d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"}
                                  for d in rest)
    assert first["function"]["arguments"] + "".join(d["function"]["arguments"] for d in rest) == '{"city": "Paris"}'


@pytest.mark.engine
@pytest.mark.parametrize("parallel,repeats", [(None, False), (False, False), (True, True)])
def test_scripted_forced_calls_repeat_only_when_parallel_calls_are_asked_for(scripted: Any, parallel: bool | None,
                                                                              repeats: bool) -> None:
    """tool_choice required: one call unless parallel_tool_calls is true (see plan_tools for why)."""
    body = {**FORCED, **({} if parallel is None else {"parallel_tool_calls": parallel})}
    assert scripted.http.post(CHAT, json=body).status_code == 200
    guide = scripted.engine.params[-1].constraint.text
    assert guide.startswith("start: block") and ('("\\n" block)' in guide) == repeats


@pytest.mark.serve
def test_slot_files_over_http_save_erase_restore_and_refuse_bad_input(serve_url: str, model: str,
                                                                      slot_dir) -> None:  # noqa: ANN001
    """POST /slots/{id}?action=save|erase|restore as llama-server answers it (id_slot, n_saved, n_restored,
    n_erased, timings); a bad filename, an unknown slot or action, a missing or foreign file: OpenAI's error
    JSON with a 4xx, and the server keeps serving."""
    prompt = "Slot files over HTTP. " + "The lighthouse keeper counted the ships that passed. " * 12
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=serve_url, timeout=120) as http:
        wait_idle(serve_url)
        before = {s["id"]: s["n_cached"] for s in http.get("/slots").json()["slots"]}
        first = http.post("/v1/completions", json=body)
        assert first.status_code == 200
        usage = first.json()["usage"]
        held = usage["prompt_tokens"] + usage["completion_tokens"] - 1  # the last token is never decoded
        # the slot this prompt went to (earlier tests leave longer caches in the others)
        source, = (s["id"] for s in http.get("/slots").json()["slots"]
                   if s["n_cached"] == held and before[s["id"]] != held)
        saved = http.post(f"/slots/{source}", params={"action": "save"}, json={"filename": "lh.bin"})
        assert saved.status_code == 200, saved.text
        done = saved.json()
        assert done["id_slot"] == source and done["n_saved"] > 100 and done["n_written"] > 0
        assert (slot_dir / "lh.bin").stat().st_size == done["n_written"] and "save_ms" in done["timings"]
        erased = http.post(f"/slots/{source}", params={"action": "erase"}).json()
        assert erased == {"id_slot": source, "n_erased": done["n_saved"]}
        target = (source + 1) % N_PARALLEL
        restored = http.post(f"/slots/{target}", params={"action": "restore"}, json={"filename": "lh.bin"}).json()
        assert restored["id_slot"] == target and restored["n_restored"] == done["n_saved"]
        again = http.post("/v1/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 2
        (slot_dir / "junk.bin").write_bytes(b"junk" * 100)
        refusals = [
            (f"/slots/{target}", {"action": "save"}, {"filename": "../x.bin"}, 400),
            (f"/slots/{target}", {"action": "restore"}, {"filename": "nothere.bin"}, 404),
            (f"/slots/{target}", {"action": "restore"}, {"filename": "junk.bin"}, 400),
            (f"/slots/{N_PARALLEL}", {"action": "erase"}, None, 400),
            (f"/slots/{target}", {"action": "explode"}, None, 400),
            (f"/slots/{target}", {"action": "save"}, None, 400),
        ]
        for path, params, payload, status in refusals:
            resp = http.post(path, params=params, json=payload)
            assert resp.status_code == status, (path, params, payload, resp.text)
            assert resp.json()["error"]["message"], resp.text
        assert http.post("/v1/completions", json=body).status_code == 200


async def _body_writes(app: Any, path: str, body: dict[str, Any]) -> list[bytes]:
    """The bodies of the ASGI messages `app` sends for one POST: each is one write to the client's socket."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
             "http_version": "1.1", "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    received = False
    writes: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            writes.append(message["body"])

    await app(scope, receive, send)
    return writes


@pytest.mark.engine
def test_scripted_stream_sends_the_role_with_the_first_token_in_one_write(scripted: Any) -> None:
    """A chat stream's opening frame (the role) goes out with its first token, not as a write of its own: each
    write is another trip through the HTTP stack while other requests wait for their first token."""
    writes = asyncio.run(_body_writes(scripted.api, CHAT, {"messages": MSG, "stream": True}))
    first = [json.loads(line[len("data: "):]) for line in writes[0].decode().splitlines() if line.startswith("data: ")]
    deltas = [e["choices"][0]["delta"] for e in first]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1]["content"].startswith("Hello")
    events = sse_events(b"".join(writes).decode().splitlines())  # the whole stream, ended by [DONE]
    assert assert_text(events) == "Hello world"
