"""The headline benchmark (measure/headline.py): its arguments and their errors, the per-trace table and its
ratios to `defaults`, what a server's /props says it chose; and on the served app, a tiny trace replayed
through HttpTarget.run_tokens with token-id prompts, failing on any request's error."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from measure import headline
from measure.headline import REFERENCE, Bench, Failure, Kind, Run, TargetSpec
from measure.replay import Outcome, Replayer, ReplayFigures, ReplayRequest, load_file
from measure.slo import RequestLatency, Slo
from measure.traces import Shape, TraceSpec, make_trace
from serving.engine.mooncake import jsonl

SLO = Slo.parse("ttft_p95=1s,itl_p95=100ms")
REQUEST = ReplayRequest(prompt_tokens=100, output_tokens=8)


def made(good: int, failed: int = 0, wall_s: float = 10.0) -> ReplayFigures:
    """`good` requests within the SLO and `failed` ones over `wall_s` (goodput: good / wall_s)."""
    ok = Outcome(REQUEST, RequestLatency(True, 0.2, 0.55, (0.05,) * 7, 8))
    bad = Outcome(REQUEST, RequestLatency(False, 0.01, 0.01, (), 0), "StreamError: HTTP 400 context too long")
    return ReplayFigures.of("t", [ok] * good + [bad] * failed, wall_s, SLO)


def trace_file(tmp_path: Path, requests: int = 4, scale: float = 0.05, duration_s: float = 2.0) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text(jsonl(make_trace(TraceSpec(Shape.chat, requests, duration_s, scale))))
    return path


def args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--model", "m.gguf", "--trace", f"chat={trace_file(tmp_path)}", "--slo", "ttft_p95=2s", *extra]


@pytest.mark.unit
def test_arguments_name_the_targets_defaults_first(tmp_path: Path) -> None:
    parsed = headline.parse_args(args(tmp_path, "--llama-server", "ls", "--ours", "a.yaml", "--ours", "agent=b.yaml",
                                      "--ours-url", "x=http://127.0.0.1:8000/v1", "--article-args", "-c 8192 -np 4"))
    assert [(s.name, s.kind) for s in parsed.specs] == [
        (REFERENCE, Kind.defaults), ("article", Kind.article), ("ours", Kind.ours), ("ours-agent", Kind.ours),
        ("ours-x", Kind.ours)]
    assert parsed.specs[1].server_args == ("-c", "8192", "-np", "4")
    assert parsed.specs[0].server_args == ()  # defaults: nothing but the model and the address
    assert parsed.specs[3].config == Path("b.yaml") and parsed.specs[4].url == "http://127.0.0.1:8000/v1"
    assert all(s.replays("chat") and s.replays("agent") for s in parsed.specs)  # no pick named like a trace
    pick = headline.parse_args(args(tmp_path, "--targets", "ours", "--ours", "chat=t.yaml")).specs[0]
    assert pick.name == "ours-chat" and pick.replays("chat") and not pick.replays("agent")  # the trace's own pick
    assert headline.parse_args(args(tmp_path, "--llama-server", "ls", "--ours", "a.yaml")).specs[1].server_args \
        == headline.ARTICLE_ARGS


@pytest.mark.unit
@pytest.mark.parametrize(("extra", "message"), [
    (("--ours", "a.yaml"), "--llama-server BINARY is needed"),
    (("--llama-server", "ls"), "give --ours CONFIG or --ours-url URL"),
    (("--targets", "ours,nightly", "--ours", "a.yaml"), "unknown nightly"),
    (("--targets", "ours", "--ours", "a=x.yaml", "--ours", "a=y.yaml"), "ours-a are given twice"),
    (("--targets", "ours", "--ours-url", "http://10.0.0.1:8000/v1"), "only loopback"),
    (("--llama-server", "ls", "--targets", "article", "--article-args", "--port 9"), "must not set"),
    (("--llama-server", "ls", "--targets", "defaults", "--rounds", "0"), "expected 1 or more"),
    (("--llama-server", "ls", "--targets", "defaults", "--vram-budget", "lots"), "lots"),
])
def test_argument_errors_say_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit):
        headline.parse_args(args(tmp_path, *extra))
    assert message in capsys.readouterr().err


@pytest.mark.unit
def test_a_trace_is_required_and_read_open_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        headline.parse_args(["--model", "m", "--slo", "ttft_p95=1s", "--targets", "defaults", "--llama-server", "x"])
    assert "--trace" in capsys.readouterr().err
    traces = headline.load_traces([("chat", trace_file(tmp_path, requests=6))], requests=4, rate_scale=2.0)
    assert len(traces["chat"].requests) == 4 and traces["chat"].rate_scale == 2.0
    untimed = tmp_path / "untimed.jsonl"
    untimed.write_text('{"input_length": 10, "output_length": 2, "hash_ids": [0]}\n')
    with pytest.raises(SystemExit, match="timestamp"):
        headline.load_traces([("u", untimed)], None, 1.0)


@pytest.mark.unit
def test_rows_pair_each_round_with_defaults_and_report_what_failed() -> None:
    runs = [Run(r, "chat", target, 0, made(good, failed)) for target, per_round in
            {REFERENCE: [(4, 0), (5, 0)], "ours": [(8, 0), (5, 0)], "article": [(2, 2), (2, 2)]}.items()
            for r, (good, failed) in enumerate(per_round)]
    runs.append(Run(-1, "chat", "ours", 0, made(0, 9)))  # a warm-up: never counted
    failures = [Failure(0, "ours-agent", "start", "RuntimeError: llama-server exited with 1")]
    rows = {r.target: r for r in headline.trace_rows(runs, failures, "chat", [REFERENCE, "ours", "article",
                                                                              "ours-agent"])}
    assert rows["ours"].goodput_ratio == pytest.approx(1.5)  # the median of 8/4 and 5/5
    assert rows["ours"].goodput_rps == pytest.approx(0.65) and rows["ours"].failed == 0
    assert rows[REFERENCE].goodput_ratio == pytest.approx(1.0)
    assert rows["article"].failed == 4 and rows["article"].requests == 8 and rows["article"].met == 0
    assert rows["article"].errors == ("StreamError: HTTP 400 context too long",)
    assert rows["ours-agent"].not_started.startswith("RuntimeError") and math.isnan(rows["ours-agent"].goodput_rps)
    assert rows["ours-agent"].goodput_ratio is None
    table = headline.trace_table("chat", "a trace", list(rows.values()), str(SLO))
    assert "| ours | 0.650 |" in table and "| 1.500 |" in table and "did not start: RuntimeError" in table
    assert "context too long" in table and table.count("\n") == 10  # title, text, header, 4 rows


@pytest.mark.unit
def test_markdown_names_what_each_target_ran_and_chose() -> None:
    specs = [TargetSpec(REFERENCE, Kind.defaults), TargetSpec("ours", Kind.ours, config=Path("t.yaml"))]
    bench = Bench({}, SLO, 0, filler="x")
    bench.started = {REFERENCE: {"command": "llama-server -m m --port 1",
                                 "choice": {"n_ctx_per_slot": 4096, "slots": 4}}}
    text = headline.markdown(bench, specs, {}, str(SLO))
    assert "holds within the SLO" not in text
    assert "| defaults | `llama-server -m m --port 1` | 4096 | 4 |" in text
    assert "| ours | `config t.yaml` | n/a | n/a |" in text


@pytest.mark.unit
def test_several_rates_replay_each_trace_at_each_and_say_what_each_target_holds(tmp_path: Path) -> None:
    """--rate-scale 0.5,1,2: chat@0.5x, chat@1x, chat@2x; a trace's own pick replays its trace at every rate; a
    target holds the highest rate at which it met the SLO in every round."""
    parsed = headline.parse_args(args(tmp_path, "--targets", "ours", "--ours", "chat=t.yaml",
                                      "--rate-scale", "2,0.5,1"))
    assert parsed.rate_scale == (0.5, 1.0, 2.0)
    traces = headline.load_traces(parsed.trace, None, parsed.rate_scale)
    assert list(traces) == ["chat@0.5x", "chat@1x", "chat@2x"]
    assert [traces[t].rate_scale for t in traces] == [0.5, 1.0, 2.0]
    assert all(parsed.specs[0].replays(t) for t in traces) and not parsed.specs[0].replays("agent@1x")
    base = (traces["chat@1x"].rate_per_s or 0.0)
    # defaults meets the SLO at 0.5x only; ours at 0.5x and 1x (one round of two missed at 2x)
    met = {REFERENCE: {"chat@0.5x": [0, 0], "chat@1x": [2, 2], "chat@2x": [3, 3]},
           "ours": {"chat@0.5x": [0, 0], "chat@1x": [0, 0], "chat@2x": [0, 2]}}
    runs = [Run(r, trace, target, 0, made(5, failed)) for target, per in met.items() for trace, fails in per.items()
            for r, failed in enumerate(fails)]
    rows = {t: headline.trace_rows(runs, [], t, [REFERENCE, "ours"]) for t in traces}
    held = {h.target: h for h in headline.capacity(rows, traces)}
    assert held[REFERENCE].holds_rps == pytest.approx(0.5 * base)
    assert held["ours"].holds_rps == pytest.approx(base)
    assert [met for _, met, _ in held["ours"].rates] == [True, True, False]
    table = headline.capacity_table(list(held.values()))
    assert f"| chat | ours | {base:.2f} | 2.00 |" in table
    assert headline.capacity(rows, {"chat": traces["chat@1x"]}) == [], "one rate: no such table"
    bench = Bench(traces, SLO, 0, filler="x")
    bench.runs = runs
    saved = headline.report(parsed, [], traces, bench)  # the JSON report names every rate's replay
    assert list(saved["traces"]) == list(traces) and saved["holds"][0]["trace"] == "chat"
    with pytest.raises(SystemExit):
        headline.parse_args(args(tmp_path, "--llama-server", "ls", "--rate-scale", "1,1"))


@pytest.mark.unit
def test_server_choice_and_fit_target() -> None:
    props = {"default_generation_settings": {"n_ctx": 8192}, "total_slots": 4, "chat_template": "..."}
    assert headline.server_choice(props, None) == {"n_ctx_per_slot": 8192, "slots": 4}
    assert headline.server_choice(None, [{"id": 0, "n_ctx": 2048}, {"id": 1, "n_ctx": 2048}]) == \
        {"n_ctx_per_slot": 2048, "slots": 2}
    assert headline.server_choice(None, {"error": "no"}) == {"n_ctx_per_slot": None, "slots": None}
    gib = 1 << 30
    assert headline.fit_target_mib(80 * gib, 1 * gib, 32 * gib) == 47 * 1024
    assert headline.fit_target_mib(24 * gib, 1 * gib, 32 * gib) == 0


@pytest.mark.unit
def test_plot_draws_a_bar_per_target_and_trace(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = {"chat": headline.trace_rows([Run(0, "chat", REFERENCE, 0, made(3))], [], "chat", [REFERENCE, "ours"])}
    assert headline.plot(rows, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.serve
def test_a_trace_replays_over_http_with_token_prompts(serve_url: str, tmp_path: Path) -> None:
    """Token-id prompts at /v1/completions of the served app, the embedded model's vocabulary read locally; every
    request must succeed and produce the recorded output length (EOS ignored)."""
    from measure.targets import HttpTarget, vocabulary
    from serving.engine.config import embedded_model_path

    workload = load_file(trace_file(tmp_path, requests=4, scale=0.05, duration_s=1.0))

    async def replay() -> ReplayFigures:
        with vocabulary(embedded_model_path()) as tokenize:
            target = HttpTarget("ours", f"{serve_url}/v1", 120.0, tokenize)
            try:
                await target.preflight()
                with pytest.raises(ValueError, match="one choice"):
                    await target.run_tokens([1, 2, 3], 4, 0.0, n=2)
                return await Replayer(workload, SLO, "Some filler text to build prompts from.", salt=7).run(target)
            finally:
                await target.aclose()

    figures = asyncio.run(replay())
    assert figures.failed == 0, figures.errors
    assert figures.output_tok_s * figures.wall_s == pytest.approx(sum(r.output_tokens for r in workload.requests))


@pytest.mark.engine
def test_the_vocabulary_alone_tokenizes_as_the_engine(engine) -> None:  # noqa: ANN001
    """One tokenizer for every HTTP target: the GGUF's vocabulary without its weights gives the engine's ids."""
    from measure.targets import vocabulary

    text = "Replayed prompts: <|im_start|>user\nsome text, numbers 12345 and ünïcode.\n"
    with vocabulary(engine.config.model_path) as tokenize:
        assert tokenize(text) == engine.tokenize(text, add_special=False, parse_special=False)
