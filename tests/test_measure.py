"""measure/ without a server: SSE parsing on recorded streams of both servers, the metric arithmetic and the
prompts every target gets (the one measurement definition the tuner and the benchmarks share)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from measure.design import ratios, round_order
from measure.metrics import RoundFigures, StreamFigures, StreamRecord, percentile, stream_figures
from measure.sse import StreamError, interpret_chunk, iter_sse_data
from measure.targets import check_loopback_url, check_server_args, llama_server_flags
from measure.workload import COPY_TASKS, PLAIN_PROMPTS, Prompts, PromptSet, Workload
from serving.engine.config import EngineConfig, load_engine_config

pytestmark = pytest.mark.unit


def _event(obj: dict) -> list[str]:
    return [f"data: {json.dumps(obj)}", ""]


def completions_stream() -> list[str]:
    """llama-server's /v1/completions: three content chunks (the 2nd holds two tokens' text: UTF-8 held
    back), a ping, then the final chunk with usage."""
    base = {"object": "text_completion", "model": "m", "id": "cmpl-1", "system_fingerprint": "b1-0c1e570"}
    lines: list[str] = []
    for text in ("Hello", " wörld", "!"):
        lines += _event({**base, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}]})
    lines += [":", ""]
    lines += _event({**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
                     "usage": {"completion_tokens": 4, "prompt_tokens": 9, "total_tokens": 13,
                               "prompt_tokens_details": {"cached_tokens": 3}}})
    return lines + ["data: [DONE]", ""]


def chat_stream() -> list[str]:
    """A chat stream: a role-only opening delta, content, a finish chunk, a usage chunk without choices."""
    base = {"object": "chat.completion.chunk", "model": "m", "id": "chatcmpl-1"}
    lines = _event({**base, "choices": [{"index": 0, "finish_reason": None,
                                         "delta": {"role": "assistant", "content": None}}]})
    for text in ("A", "B"):
        lines += _event({**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"content": text}}]})
    lines += _event({**base, "choices": [{"index": 0, "finish_reason": "length", "delta": {}}]})
    lines += _event({**base, "choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}})
    return lines + ["data: [DONE]", ""]


def test_sse_decoder_handles_comments_multiline_and_missing_final_blank() -> None:
    lines = [": ping", "", "event: x", "data: {\"a\":", "data: 1}", "", "data:no-space"]
    assert list(iter_sse_data(lines)) == ['{"a":\n1}', "no-space"]


def test_completions_stream_parsing() -> None:
    payloads = list(iter_sse_data(completions_stream()))
    assert payloads[-1] == "[DONE]"
    chunks = [interpret_chunk(p, chat=False) for p in payloads[:-1]]
    assert [c.text for c in chunks] == ["Hello", " wörld", "!", ""]
    assert [c.has_output for c in chunks] == [True, True, True, False]
    final = chunks[-1]
    assert final.finish_reason == "length" and final.usage is not None
    assert (final.usage.completion_tokens, final.usage.prompt_tokens, final.usage.cached_tokens) == (4, 9, 3)
    assert chunks[0].fingerprint == "b1-0c1e570"


def test_a_completions_token_without_text_is_output() -> None:
    """llama-server sends a /v1/completions chunk per token, text or not: a stream of tokens that print
    nothing (a random-weight model stuck on a filler token) still has a first token and a decode rate."""
    base = {"object": "text_completion", "model": "m", "id": "cmpl-2"}
    lines: list[str] = []
    for _ in range(3):
        lines += _event({**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": None}]})
    lines += _event({**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
                     "usage": {"completion_tokens": 3, "prompt_tokens": 5}})
    record = StreamRecord(t_start=0.0)
    for t, payload in zip((0.5, 0.6, 0.8, 0.9), list(iter_sse_data(lines)), strict=True):
        record.absorb(interpret_chunk(payload, chat=False), t)
    f = stream_figures(record)
    assert (f.completion_tokens, f.ttft_s) == (3, pytest.approx(0.5))
    assert f.decode_tok_s == pytest.approx(2 / 0.3)


def test_chat_stream_role_delta_is_not_output_and_usage_chunk_has_no_choices() -> None:
    chunks = [interpret_chunk(p, chat=True) for p in list(iter_sse_data(chat_stream()))[:-1]]
    assert [c.has_output for c in chunks] == [False, True, True, False, False]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    assert chunks[-2].finish_reason == "length"


def test_an_error_event_or_a_non_object_is_a_stream_error() -> None:
    with pytest.raises(StreamError, match="boom"):
        interpret_chunk(json.dumps({"error": {"code": 500, "message": "boom"}}), chat=False)
    with pytest.raises(StreamError):
        interpret_chunk("[1, 2]", chat=True)


def test_figures_from_a_recorded_completions_stream() -> None:
    """Usage says 4 tokens in 3 output chunks: each chunk weighs the average 4/3."""
    record = StreamRecord(t_start=10.0)
    times = iter([10.5, 10.6, 10.9, 11.0])
    for payload in list(iter_sse_data(completions_stream()))[:-1]:
        record.absorb(interpret_chunk(payload, chat=False), next(times))
    f = stream_figures(record)
    assert (f.completion_tokens, f.prompt_tokens, f.cached_tokens) == (4, 9, 3)
    assert f.ttft_s == pytest.approx(0.5)
    assert f.decode_tok_s == pytest.approx(3 / 0.4)  # (4 - 1) / (10.9 - 10.5)
    assert f.itl_s == pytest.approx((0.1 * 3 / 4, 0.3 * 3 / 4))
    assert f.prefill_tok_s == pytest.approx((9 - 3) / 0.5)
    assert record.finish_reason == "length" and record.text == "Hello wörld!"


def test_figures_with_explicit_token_counts_and_no_usage() -> None:
    record = StreamRecord(t_start=0.0)
    for t, n in ((0.2, 1), (0.3, 1), (0.5, 4)):  # an engine that sends 4 tokens in one chunk
        record.add_output(t, n, "x" * n)
    f = stream_figures(record)
    assert f.completion_tokens == 6
    assert f.itl_s == pytest.approx((0.1, 0.05))
    assert f.decode_tok_s == pytest.approx(5 / 0.3)
    assert f.prefill_tok_s is None


def test_figures_fall_back_to_counting_chunks() -> None:
    record = StreamRecord(t_start=0.0)
    for t in (1.0, 1.5, 2.0):
        record.add_output(t, None, "y")
    f = stream_figures(record)
    assert f.completion_tokens == 3 and f.decode_tok_s == pytest.approx(2.0) and f.itl_s == pytest.approx((0.5, 0.5))


def test_a_stream_without_output_is_an_error_unless_it_ended_at_once() -> None:
    with pytest.raises(StreamError):
        stream_figures(StreamRecord(t_start=0.0))
    eos_first = stream_figures(StreamRecord(t_start=1.0, t_end=1.25, finish_reason="stop", completion_tokens=0))
    assert (eos_first.completion_tokens, eos_first.decode_tok_s, eos_first.ttft_s) == (0, None, 0.25)


def test_round_figures_and_their_median() -> None:
    s1 = StreamFigures(0.1, 10.0, 8, 5, 0, (0.1, 0.2, 0.3))
    s2 = StreamFigures(0.3, 20.0, 6, 5, None, (0.4,))
    r = RoundFigures.of([s1, s2], wall_s=2.0, requested_tokens=8)
    assert r.aggregate_tok_s == pytest.approx(7.0)
    assert r.decode_tok_s == pytest.approx(15.0) and r.slowest_decode_tok_s == 10.0
    assert r.ttft_ms == pytest.approx(200.0) and r.ttft_ms_max == pytest.approx(300.0)
    assert r.itl_ms_p50 == pytest.approx(250.0)
    assert r.short_streams == 1
    assert r.prefill_tok_s == pytest.approx((50 + 5 / 0.3) / 2)
    rounds = [RoundFigures.of([s1], 1.0, 8), RoundFigures.of([s1], 2.0, 8), RoundFigures.of([s1], 4.0, 8)]
    assert RoundFigures.median(rounds).aggregate_tok_s == pytest.approx(4.0)
    no_itl = RoundFigures.of([StreamFigures(0.1, None, 1, None, None, ())], 1.0, 8)
    assert RoundFigures.median([no_itl, r]).itl_ms_p50 is None  # missing in one round: missing
    with pytest.raises(ValueError):
        RoundFigures.median([])


def test_a_round_says_when_its_last_request_had_left_the_client() -> None:
    sent = [StreamFigures(0.1, 10.0, 8, 5, 0, (), send_s=0.002), StreamFigures(0.2, 10.0, 8, 5, 0, (), send_s=0.009)]
    assert RoundFigures.of(sent, 1.0, 8).send_ms_max == pytest.approx(9.0)
    in_process = [sent[0], StreamFigures(0.1, 10.0, 8, 5, 0, ())]
    assert RoundFigures.of(in_process, 1.0, 8).send_ms_max is None
    record = StreamRecord(t_start=1.0, t_end=2.0, t_sent=1.004, output_times=[1.1, 1.2], output_tokens=[1, 1])
    assert stream_figures(record).send_s == pytest.approx(0.004)


def test_a_round_carries_the_engines_own_ttft_from_either_servers_timings() -> None:
    """Ours reports `timings.ttft_ms` (queue included), llama-server `timings.prompt_ms`: either is the engine's
    own TTFT, so the client's TTFT minus it is the path; a round has it only when every stream does."""
    ours = {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5},
            "timings": {"ttft_ms": 12.5, "prompt_ms": 9.0}}
    theirs = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "timings": {"prompt_ms": 7.0}}
    assert interpret_chunk(json.dumps(ours), chat=True).engine_ttft_ms == 12.5
    assert interpret_chunk(json.dumps(theirs), chat=False).engine_ttft_ms == 7.0
    assert interpret_chunk(json.dumps({"choices": [], "timings": {"ttft_ms": None}}), chat=True).engine_ttft_ms is None
    record = StreamRecord(t_start=1.0, t_end=2.0, output_times=[1.02, 1.03], output_tokens=[1, 1])
    record.absorb(interpret_chunk(json.dumps(ours), chat=True), 1.04)
    one = stream_figures(record)
    assert one.engine_ttft_s == pytest.approx(0.0125)
    other = StreamFigures(0.1, 10.0, 8, 5, 0, (), engine_ttft_s=0.0075)
    assert RoundFigures.of([one, other], 1.0, 2).engine_ttft_ms == pytest.approx(10.0)
    assert RoundFigures.of([one, StreamFigures(0.1, 10.0, 8, 5, 0, ())], 1.0, 2).engine_ttft_ms is None


def http_reply(body: str | bytes, status: str = "200 OK", content_type: str = "text/event-stream") -> bytes:
    """A whole HTTP/1.1 response, as the fake servers below write it."""
    data = body.encode() if isinstance(body, str) else body
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(data)}\r\n\r\n"
            ).encode() + data


MODELS = http_reply(b'{"data": [{"id": "fake-model"}]}', content_type="application/json")  # GET /models


def test_an_http_target_times_when_its_request_left() -> None:
    """The client's own share of TTFT: HttpTarget stamps the moment the request's last byte was written
    (httpcore's trace), between its start and its first token."""
    import asyncio

    from measure.metrics import StreamRecord as Record
    from measure.targets import HttpTarget
    from measure.workload import Prompt

    events = ('data: {"choices": [{"index": 0, "text": "Hi", "finish_reason": null}]}\n\n'
              'data: {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n')
    reply = http_reply(events)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        await asyncio.sleep(0.05)  # the "server" thinks: the request left well before the answer
        writer.write(reply)
        await writer.drain()
        writer.close()

    async def run() -> Record:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        target = HttpTarget("fake", f"http://127.0.0.1:{port}/v1")
        try:
            return await target.run_stream(Prompt("Hello", chat=False), 2, ignore_eos=True)
        finally:
            await target.aclose()
            server.close()

    record = asyncio.run(run())
    assert record.t_start < record.t_sent < record.output_times[0]
    assert record.output_times[0] - record.t_sent >= 0.04


def test_ratios() -> None:
    a = RoundFigures.of([StreamFigures(0.05, 9.0, 90, None, None, ())], 1.0, 90)
    b = RoundFigures.of([StreamFigures(0.025, 10.0, 100, None, None, (0.002,))], 1.0, 100)
    r = ratios(a, b)
    assert r["aggregate_tok_s"] == pytest.approx(0.9) and r["decode_tok_s"] == pytest.approx(0.9)
    assert r["ttft_ms"] == pytest.approx(2.0) and r["itl_ms_p50"] is None


def test_paired_ratios_take_each_round_against_its_neighbour() -> None:
    from measure.design import paired_ratios

    def round_at(tok_s: float) -> RoundFigures:
        return RoundFigures.of([StreamFigures(0.05, tok_s, 100, None, None, ())], 100 / tok_s, 100)

    ours = [round_at(x) for x in (90, 45, 180)]
    reference = [round_at(x) for x in (100, 50, 200)]  # the machine's speed drifted; every pair is 0.9
    assert paired_ratios(ours, reference)["aggregate_tok_s"] == pytest.approx(0.9)
    assert paired_ratios(ours, reference)["itl_ms_p50"] is None
    with pytest.raises(ValueError):
        paired_ratios(ours[:2], reference)


def test_the_paired_ttft_gap_is_each_round_minus_its_neighbour_with_quartiles() -> None:
    """A latency bar in milliseconds: round-by-round differences, so a slow stretch of the machine that moves
    both targets cancels (the medians here differ by 20 ms; every pair by 5-15)."""
    from measure.design import paired_gap

    ours, reference = [105.0, 210.0, 315.0, 150.0], [100.0, 200.0, 300.0, 140.0]
    gap = paired_gap(ours, reference)
    assert gap is not None and gap.rounds == 4
    assert (gap.median, gap.q1, gap.q3) == pytest.approx((10.0, 8.75, 11.25))
    assert gap.text() == "+10.0 [+8.8, +11.2]"
    assert paired_gap([], []) is None
    with pytest.raises(ValueError):
        paired_gap(ours[:2], reference)


@pytest.mark.parametrize(("n", "ranks"), [(5, None), (6, (1, 6)), (10, (2, 9)), (16, (4, 13)), (100, (40, 61))])
def test_the_medians_confidence_interval_is_the_binomial_order_statistics(n: int,
                                                                          ranks: tuple[int, int] | None) -> None:
    """The distribution-free 95% interval of a median (the standard table's ranks: n=100 -> 40th and 61st);
    too few rounds for one give None, and the gap then prints its quartiles alone."""
    from measure.design import median_interval, paired_gap

    values = [float(i) for i in range(1, n + 1)]
    assert median_interval(values) == ranks
    gap = paired_gap([v + 3.0 for v in values], values)
    assert gap is not None and (gap.ci_low, gap.ci_high) == ((3.0, 3.0) if ranks else (None, None))
    assert gap.text().endswith("(95%: +3.0 to +3.0)") if ranks else gap.text() == "+3.0 [+3.0, +3.0]"


def test_the_medians_interval_holds_the_median_about_95_times_in_100() -> None:
    """Over skewed noise (exponential, the shape of a TTFT's tail), seeded: the interval's coverage."""
    import random

    from measure.design import median_interval

    rng, true_median, hits = random.Random(7), math.log(2), 0
    for _ in range(2000):
        interval = median_interval(sorted(rng.expovariate(1.0) for _ in range(30)))
        assert interval is not None
        hits += interval[0] <= true_median <= interval[1]
    assert 0.93 <= hits / 2000 <= 0.99


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (50, 2.5), (95, 3.85), (100, 4.0), (25, 1.75)])
def test_percentile_matches_linear_interpolation(q: float, expected: float) -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_edge_cases() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_prompts_are_fresh_and_every_round_gets_the_same_mix() -> None:
    prompts = Prompts(PromptSet.plain, first=7)
    first, second = prompts.round(4), prompts.round(4)
    texts = [p.text for p in first + second]
    assert len(set(texts)) == 8 and texts[0].startswith("Request 7. ") and texts[4].startswith("Request 11. ")
    assert [p.text.split(". ", 1)[1] for p in first] == [p.text.split(". ", 1)[1] for p in second] \
        == list(PLAIN_PROMPTS[:4])
    assert not any(p.chat for p in first) and prompts.next_number == 15
    copy = Prompts(PromptSet.copy).round(2)
    assert all(p.chat for p in copy) and "class IncrementalDetokenizer" in copy[0].text
    assert copy[1].text.startswith("Request 2. " + COPY_TASKS[1].split("{text}")[0])


def test_the_plain_set_ignores_eos_and_the_copy_set_honours_it() -> None:
    assert Workload().ignore_eos and not Workload(prompt_set=PromptSet.copy).ignore_eos
    assert Workload(levels=(1, 2, 8)).concurrency == 8


def test_loopback_only() -> None:
    assert check_loopback_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    assert check_loopback_url("http://localhost:8000/v1") == "http://localhost:8000/v1"
    for bad in ("http://10.0.0.1:8000/v1", "ftp://127.0.0.1/v1", "127.0.0.1:8000"):
        with pytest.raises(ValueError):
            check_loopback_url(bad)


def test_llama_server_flags_mean_the_engine_config() -> None:
    """The article's line: llama-server -ngl 99 -c 4096 -fa on -ctk q8_0 -ctv q8_0 -np 2 -b 512."""
    article = load_engine_config(Path(__file__).resolve().parents[1] / "configs" / "article.yaml",
                                 {"cpu_repack": "on", "n_threads": 3})
    flags = llama_server_flags(article)
    flag = {flags[i]: flags[i + 1] for i in range(0, len(flags), 2)}
    assert flag == {"-ngl": "999", "-c": "4096", "-np": "2", "-b": "512", "-ub": "512", "-ctk": "q8_0",
                    "-ctv": "q8_0", "-fa": "on", "-t": "3"}
    assert llama_server_flags(EngineConfig(cpu_repack="off"))[-1] == "--no-repack"
    assert "-kvu" in llama_server_flags(EngineConfig(kv_unified=True, cpu_repack="off")) and "-kvu" not in flags
    with pytest.raises(ValueError, match="--port"):
        check_server_args(["-np", "4", "--port", "1"])


@pytest.mark.parametrize("text_only", [False, True])
def test_in_process_output_is_every_token_or_only_text_as_our_stream_shows_it(text_only: bool) -> None:
    """A first token that renders as nothing (a special token, half a UTF-8 character) is output for the
    engine's view; with text_only it is shown with the next text, as our server's SSE stream shows it (no event
    for a token without text), so the HTTP path is compared with the same first token. Tokens still without
    text at the end are output there."""
    import asyncio

    from measure.targets import EngineTarget
    from serving.engine.request import FinishReason, GenerationChunk, Usage

    chunks = [GenerationChunk("", [2]), GenerationChunk("\n", [198]), GenerationChunk("Hi", [5]),
              GenerationChunk("", [7], FinishReason.length, Usage(prompt_tokens=4, completion_tokens=4))]

    async def stream():  # noqa: ANN202
        for chunk in chunks:
            await asyncio.sleep(0.01)
            yield chunk

    target = EngineTarget(None, text_only=text_only)  # type: ignore[arg-type]
    record = asyncio.run(target._read(stream(), StreamRecord(t_start=0.0)))
    if text_only:
        assert (record.output_tokens, record.parts) == ([2, 1, 1], ["\n", "Hi", ""])
    else:
        assert (record.output_tokens, record.parts) == ([1, 1, 1, 1], ["", "\n", "Hi", ""])
    assert record.completion_tokens == 4 and len(record.output_times) == len(record.output_tokens)


def test_process_clients_run_streams_at_once_each_timed_in_its_own_process() -> None:
    """Four streams from four client processes: the fake server answers none until all four requests are in
    (one client running them in turn would never get there), their records come back timed on the parent's
    clock, and a server's error reaches the round that asked, as a StreamError."""
    import asyncio
    import time

    from measure.clients import ProcessClients
    from measure.workload import Prompt

    events = ('data: {"choices": [{"index": 0, "text": "Hi", "finish_reason": "length"}]}\n\n'
              'data: [DONE]\n\n')
    ok = http_reply(events)
    refused = http_reply(b'{"error": {"message": "no", "type": "invalid_request_error"}}', "400 Bad Request",
                         "application/json")

    async def run() -> tuple[list[StreamRecord], float, float, str]:
        arrived: list[asyncio.Event] = []
        all_in = asyncio.Event()

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while not reader.at_eof():
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                body = await reader.readexactly(length)
                if head.startswith(b"GET"):
                    writer.write(MODELS)
                elif b"refuse me" in body:
                    writer.write(refused)
                else:
                    arrived.append(asyncio.Event())
                    if len(arrived) == 4:
                        all_in.set()
                    await asyncio.wait_for(all_in.wait(), 60)
                    writer.write(ok)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        clients = ProcessClients("fake", f"http://127.0.0.1:{port}/v1", workers=4)
        try:
            await clients.start()
            before = time.perf_counter()
            records = await asyncio.gather(*(clients.run_stream(Prompt(f"Hello {i}", chat=False), 1, True)
                                             for i in range(4)))
            after = time.perf_counter()
            with pytest.raises(StreamError, match="HTTP 400"):
                await clients.run_stream(Prompt("refuse me", chat=False), 1, True)
            return list(records), before, after, clients.model_name
        finally:
            await clients.aclose()
            server.close()

    records, before, after, model = asyncio.run(run())
    assert model == "fake-model"
    for record in records:
        assert before <= record.t_start < record.t_sent < record.output_times[0] <= record.t_end <= after
        assert record.text == "Hi" and record.finish_reason == "length"


def test_a_client_process_that_dies_mid_stream_fails_its_round_clearly() -> None:
    """The server never answers; the one client process is killed while it waits: the round gets a StreamError
    naming what happened, not a bare EOFError from the pipe, and closing the clients does not hang."""
    import asyncio

    from measure.clients import ProcessClients
    from measure.workload import Prompt

    async def run() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET"):
                writer.write(MODELS)
                await writer.drain()
            await asyncio.sleep(60)  # the completion is never answered

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        clients = ProcessClients("fake", f"http://127.0.0.1:{port}/v1", workers=1)
        try:
            await clients.start()
            stream = asyncio.ensure_future(clients.run_stream(Prompt("Hello", chat=False), 1, True))
            await asyncio.sleep(0.5)
            clients._processes[0].kill()
            with pytest.raises(StreamError, match="exited mid-stream"):
                await asyncio.wait_for(stream, 30)
        finally:
            await asyncio.wait_for(clients.aclose(), 30)
            server.close()

    asyncio.run(run())


def test_round_order_alternates_two_and_gives_every_target_each_predecessor_as_often() -> None:
    assert [round_order(["a", "b"], i) for i in range(4)] == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    three = ["in-process", "first", "second"]
    follows = {name: [] for name in three}  # what ran just before each target, within a round
    for i in range(6):
        order = round_order(three, i)
        assert sorted(order) == sorted(three)
        for before, after in itertools.pairwise(order):
            follows[after].append(before)
    # reversing alone put "first" after the in-process engine in every other round and "second" never
    assert follows["first"].count("in-process") == follows["second"].count("in-process") == 2
