#!/usr/bin/env python3
"""OpenAPI fuzz of every route of the Serve app with schemathesis: no 5xx, JSON (or SSE) bodies, OpenAI errors.

Starts the app on loopback the way scripts/soak.py does (measure/loopback.py; embedded CPU model by
default), saves /openapi.json, and runs `schemathesis run` against it: positive and negative cases for every
operation (--max-examples each, the whole run bounded by --max-time), with the checks

* not_a_server_error (schemathesis's): no 5xx;
* openai_response (this file's, loaded as a schemathesis hooks module): a non-streamed body is JSON, an
  error (4xx) is OpenAI's error JSON, and a streamed 200 carries no `{"error": ...}` event (a server error
  that arrived after the 200 status line; for /v1/responses an `error` or `response.failed` event).

Generation is capped on the generating routes (max_tokens / max_completion_tokens / max_output_tokens at
most --max-tokens-cap, set when absent) so a generated request cannot hold a slot for a whole context;
everything else is what schemathesis generates.
Every request and response is recorded (HAR, under --out/schemathesis/); the summary lists each 5xx with
its request body. Afterwards the server must still serve: /health 200, a completion with text, every slot
idle. Exit 1 on any 5xx or other failure.

    python scripts/fuzz_api.py                                # results/fuzz/
    python scripts/fuzz_api.py --max-examples 100 --max-time 1200 n_parallel=2
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from measure.api_fuzz import (  # noqa: E402
    INCOMPLETE_STREAM, analyse_har, cap_generation, documented_types, drop_fields, group_problems, response_problem,
)
from measure.cluster import cli  # noqa: E402
from measure.loopback import REPO_ROOT, LoopbackApp, parse_overrides  # noqa: E402
from measure.provenance import git_commit, machine_info  # noqa: E402  (the same fields as the soak's summary)

CAP_ENV = "FUZZ_API_MAX_TOKENS"
DROP_ENV = "FUZZ_API_DROP_FIELDS"


# -- schemathesis hooks (this file is also loaded by schemathesis, through SCHEMATHESIS_HOOKS) ----------
def _schemathesis() -> Any:
    """schemathesis, or None where the `soak` extra is not installed (the command says what to install)."""
    try:
        return importlib.import_module("schemathesis")
    except ImportError:
        return None


if __name__ != "__main__":  # loaded by schemathesis as its hooks module
    schemathesis = _schemathesis()
    if schemathesis is not None and os.environ.get(CAP_ENV):
        _CAP = int(os.environ[CAP_ENV])
        _DROP = [f for f in os.environ.get(DROP_ENV, "").split(",") if f]

        @schemathesis.hook
        def before_call(context, case, kwargs):  # noqa: ANN001, ARG001  (schemathesis's hook signature)
            case.body = cap_generation(drop_fields(case.body, _DROP), _CAP, case.operation.path)

        @schemathesis.check
        def openai_response(ctx, response, case):  # noqa: ANN001, ARG001  (schemathesis's check signature)
            """Non-streamed bodies are JSON, errors are OpenAI's error JSON, a 200 stream has no error event."""
            ctype = (response.headers.get("content-type") or [""])[0]
            paths = {case.operation.path: {case.operation.method.lower(): case.operation.definition.raw}}
            declared = documented_types(paths, case.operation.method, case.operation.path, response.status_code)
            problem = response_problem(response.status_code, ctype, response.text, declared)
            # 5xx: not_a_server_error reports it; an incomplete stream is listed by the summary only
            if problem and response.status_code < 500 and problem != INCOMPLETE_STREAM:
                raise AssertionError(problem)


# -- after the fuzz: does it still serve? -------------------------------------------------------------------
def still_serves(url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as http:
        try:
            out["health"] = http.get(f"{url}/health").status_code
            r = http.post(f"{url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
            out["chat_status"] = r.status_code
            out["chat_text"] = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text[:300]
            deadline = time.monotonic() + 30
            snap: dict[str, Any] = {}
            while time.monotonic() < deadline:
                s = http.get(f"{url}/slots")
                if s.status_code == 200:
                    snap = s.json()
                    if snap["slots_busy"] == 0 and snap["queue_depth"] == 0:
                        break
                time.sleep(0.5)
            out["slots_busy"], out["queue_depth"] = snap.get("slots_busy"), snap.get("queue_depth")
            out["counters"] = snap.get("counters")
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    out["passed"] = (out.get("health") == 200 and out.get("chat_status") == 200 and bool(out.get("chat_text"))
                     and out.get("slots_busy") == 0 and out.get("queue_depth") == 0 and "error" not in out)
    return out


def markdown(doc: dict[str, Any]) -> str:
    a = doc["analysis"]
    lines = [f"Fuzz run {doc['date']} on commit {doc['commit']}, {doc['machine']}; `{doc['command']}`; "
             f"schemathesis {doc['schemathesis_version']} (`{doc['schemathesis_command']}`), exit code "
             f"{doc['schemathesis_rc']}, {doc['fuzz_s']} s; generation capped at {doc['max_tokens_cap']} tokens"
             f"{'; fields dropped from every body: ' + doc['dropped_fields'] if doc['dropped_fields'] else ''}. "
             f"Overall: **{'PASS' if doc['passed'] else 'FAIL'}**.", "",
             f"{a['requests']} requests; {a['server_errors']} with a 5xx; {a['other_problems']} other problems; "
             f"{a.get('incomplete_streams', 0)} streams without [DONE] (listed, not failed: the client may have "
             "closed them).", "",
             "| operation | statuses |", "| --- | --- |"]
    only_405 = {op: c for op, c in a["by_operation"].items() if set(c) == {"405"}}
    for op, counts in a["by_operation"].items():
        if op not in only_405:
            lines.append(f"| `{op}` | {', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))} |")
    if only_405:
        lines.append(f"| {len(only_405)} undocumented method/path pairs (e.g. `{next(iter(only_405))}`) | "
                     f"405: {sum(c['405'] for c in only_405.values())} |")
    if a.get("never_2xx"):
        lines += ["", f"Warning: never answered 2xx, so only their rejection paths were exercised: "
                  f"{', '.join(f'`{op}`' for op in a['never_2xx'])}."]
    s = doc["after"]
    lines += ["", f"After the fuzz: /health {s.get('health')}, a chat completion {s.get('chat_status')} "
              f"({s.get('chat_text', '')[:60]!r}), slots_busy {s.get('slots_busy')}, queue_depth {s.get('queue_depth')}"
              f"{', ' + s['error'] if s.get('error') else ''}: {'ok' if s.get('passed') else 'FAILED'}."]
    if doc.get("error"):
        lines += ["", f"The run stopped early: `{doc['error']}`"]
    if doc["groups"]:
        lines += ["", "Problems (one line per kind; count, then the first request that showed it):", ""]
        for g in doc["groups"][:30]:
            lines.append(f"- {g['count']}x `{g['operation']}` → {g['status']}: {g['problem'][:300]}")
            lines.append(f"  - request body: `{g['request_body'][:600]}`" + (f", query {g['query']}" if g["query"] else ""))
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="passed to serving.app:main, as serve run does")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "fuzz")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--max-examples", type=int, default=40, help="test cases per operation and phase")
    p.add_argument("--max-time", type=int, default=600, help="schemathesis's time budget (s): the fuzzing phase "
                   "repeats until it is spent, so this is also about how long the run takes")
    p.add_argument("--phases", default="examples,coverage,fuzzing", help="schemathesis phases")
    p.add_argument("--mode", default="all", choices=("positive", "negative", "all"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--max-tokens-cap", type=int, default=8)
    p.add_argument("--drop-fields", default="", help="comma-separated body fields removed before sending, to "
                   "look past a known failure (e.g. presence_penalty,frequency_penalty,repeat_penalty)")
    args = p.parse_args(argv)
    try:
        args.app_args = parse_overrides(args.overrides)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    schemathesis = _schemathesis()
    if schemathesis is None:
        print("error: the fuzz needs schemathesis: pip install -e '.[soak]'", file=sys.stderr)
        return 2
    out = args.out.resolve()
    report_dir = out / "schemathesis"
    report_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    doc: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
        "machine": f"{machine['cpu']} ({machine['cpus']} CPUs)",
        "command": " ".join(["python", "scripts/fuzz_api.py", *(argv or sys.argv[1:])]),
        "dropped_fields": args.drop_fields or None, "max_tokens_cap": args.max_tokens_cap,
    }
    doc["schemathesis_version"] = schemathesis.SCHEMATHESIS_VERSION
    app = LoopbackApp(args.app_args, port=args.port, log_copy_dir=out)
    har_path = report_dir / "requests.har"
    try:
        doc["startup_s"] = round(app.start(), 1)
        doc["app_args"] = app.app_args
        schema = httpx.get(f"{app.url}/openapi.json", timeout=30).json()
        (out / "openapi.json").write_text(json.dumps(schema, indent=1))
        schema_paths = schema.get("paths", {})
        doc["operations"] = [f"{m.upper()} {path}" for path, ops in sorted(schema["paths"].items()) for m in ops]
        print(f"app up on {app.url}; operations: {', '.join(doc['operations'])}", flush=True)
        cmd = [cli("schemathesis"), "run", f"{app.url}/openapi.json", "--checks", "not_a_server_error,openai_response",
               "--phases", args.phases, "--mode", args.mode, "--max-examples", str(args.max_examples),
               "--max-time", str(args.max_time), "--workers", "1", "--seed", str(args.seed),
               "--request-timeout", str(args.request_timeout_s), "--generation-database", "none",
               "--continue-on-failure", "--suppress-health-check", "all", "--no-color",
               "--output-sanitize", "false",
               "--report", "har,junit", "--report-dir", str(report_dir), "--report-har-path", str(har_path)]
        doc["schemathesis_command"] = " ".join(["schemathesis", "run", "<url>/openapi.json", *cmd[3:]]).replace(
            str(out), "<out>")
        env = {**os.environ, "SCHEMATHESIS_HOOKS": str(Path(__file__).resolve()),
               CAP_ENV: str(args.max_tokens_cap), DROP_ENV: args.drop_fields, "NO_COLOR": "1"}
        env.pop("RAY_ADDRESS", None)
        t0 = time.monotonic()
        with open(out / "schemathesis.log", "w") as log:
            try:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(out),
                                    timeout=args.max_time + 300).returncode
            except subprocess.TimeoutExpired:
                rc = -9
        doc["fuzz_s"] = round(time.monotonic() - t0, 1)
        doc["schemathesis_rc"] = rc
        tail = (out / "schemathesis.log").read_text(errors="replace").splitlines()[-40:]
        print("\n".join(tail), flush=True)
        har = json.loads(har_path.read_text()) if har_path.exists() else {}
        doc["analysis"] = analyse_har(har, schema_paths)
        doc["after"] = still_serves(app.url)
    except Exception as exc:  # noqa: BLE001  (reported in the summary, exit code 1)
        doc["error"] = f"{type(exc).__name__}: {exc}"
        print(f"fuzz: {doc['error']}", flush=True)
    finally:
        app.stop()
    doc.setdefault("analysis", {"requests": 0, "by_operation": {}, "server_errors": 0, "other_problems": 0,
                                "incomplete_streams": 0, "problems": []})
    doc.setdefault("after", {"passed": False})
    doc.setdefault("schemathesis_rc", None)
    doc.setdefault("fuzz_s", None)
    doc.setdefault("schemathesis_command", "")
    a = doc["analysis"]
    doc["groups"] = group_problems(a.pop("problems"))
    doc["passed"] = (a["requests"] > 0 and a["server_errors"] == 0 and a["other_problems"] == 0
                     and doc["after"]["passed"] and doc["schemathesis_rc"] in (0, 1) and "error" not in doc)
    (out / "summary.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(markdown(doc))
    print(f"fuzz {'PASSED' if doc['passed'] else 'FAILED'}: {a['requests']} requests, {a['server_errors']} 5xx, "
          f"{a['other_problems']} other problems; after: {'ok' if doc['after']['passed'] else 'FAILED'}; "
          f"summary in {out}/summary.md", flush=True)
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
