"""The serving rooms keep their rules: what a module may load is checked in a fresh interpreter (an import
made by another test would hide it here)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

LIBLLAMA = ("llama_cpp", "serving.engine.llama", "serving.engine.core", "serving.openai.structured")
SERVING = Path(__file__).resolve().parents[1] / "serving"
PARTS = ("engine", "openai", "front", "replica")
ENGINE_PUBLIC = frozenset({"core", "config", "request", "errors", "chat_template", "traffic",
                           "sampler_defaults"})  # what openai/ may use


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["serving.front.http", "serving.front.ingress", "serving.front.relay",
                                    "serving.front.errors", "serving.openai.requests", "serving.openai.errors",
                                    "serving.openai.slot_files", "serving.openai.anthropic_requests",
                                    "serving.openai.anthropic_responses", "serving.engine.prompt_cache",
                                    "serving.engine.buffers"])
def test_the_rooms_without_a_model_load_no_libllama(module: str) -> None:
    """The ingress holds no model: importing it (or the HTTP room, the request shapes, the relay) must not
    load libllama, the engine or the grammar compiler."""
    loaded = _loaded_after(module)
    assert not loaded & set(LIBLLAMA), f"{module} loads {sorted(loaded & set(LIBLLAMA))}"


def _modules() -> list[Path]:
    """Every module of serving/, every package walked (a new subpackage is checked without being listed)."""
    return sorted(SERVING.rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports, at the top or inside a function (a lazy import counts), as dotted names;
    `from serving.engine import llama` yields serving.engine.llama."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _part(path: Path) -> str | None:
    rel = path.relative_to(SERVING).parts
    return rel[0] if len(rel) > 1 else None


def _part_of(name: str) -> str | None:
    """The part of serving/ a dotted import names (None: outside serving, or the root's modules)."""
    bits = name.split(".")
    return bits[1] if len(bits) > 2 and bits[0] == "serving" and bits[1] in PARTS else (
        "app" if bits[:2] == ["serving", "app"] else None)


def _offenders(paths: list[Path], refused: set[str]) -> list[str]:
    return [f"{p.relative_to(SERVING)}:{line} imports {name}" for p in paths for line, name in _imports(p)
            if _part_of(name) in refused]


def test_serving_is_four_parts_and_the_composition_root() -> None:
    """serving/ holds engine/, openai/, front/ and replica/ beside app.py; no module lies loose beside them."""
    loose = sorted(p.name for p in SERVING.glob("*.py") if p.name not in ("__init__.py", "app.py"))
    assert loose == [] and sorted(p.name for p in SERVING.iterdir() if (p / "__init__.py").exists()) == sorted(PARTS)


def test_the_engine_imports_no_other_part_of_serving() -> None:
    """engine/ knows no HTTP, no Serve, no OpenAI: the tuner and the replica build on it, never the reverse."""
    engine = [p for p in _modules() if _part(p) == "engine"]
    assert engine and _offenders(engine, {"openai", "front", "replica", "app"}) == []


def test_the_front_door_holds_no_engine() -> None:
    """front/ is what a request meets first, on the head node too: it imports nothing of engine/ (nor of the
    parts that hold one)."""
    front = [p for p in _modules() if _part(p) == "front"]
    assert front and _offenders(front, {"engine", "openai", "replica", "app"}) == []


def test_the_host_knows_no_http() -> None:
    """The replica's host raises engine-level errors; the routes map them to HTTP. It imports neither front/
    nor openai/ (its trials, which it imports, neither)."""
    host = [SERVING / "replica" / "host.py", SERVING / "replica" / "trials.py"]
    assert _offenders(host, {"front", "openai", "app"}) == []


def test_the_openai_layer_uses_the_engines_public_modules_only() -> None:
    """openai/ reaches the engine through its public modules (the Engine, its config, requests, errors,
    templates, traffic tags), never its scheduler, caches or bindings; and never the replica or the app."""
    offenders = _offenders([p for p in _modules() if _part(p) == "openai"], {"replica", "app"})
    for path in (p for p in _modules() if _part(p) == "openai"):
        for line, name in _imports(path):
            bits = name.split(".")
            if bits[:2] == ["serving", "engine"] and len(bits) > 2 and bits[2] not in ENGINE_PUBLIC:
                if not (len(bits) > 3 and bits[2] in ENGINE_PUBLIC):
                    offenders.append(f"{path.relative_to(SERVING)}:{line} imports {name}")
    assert offenders == []


def test_only_the_composition_root_sees_every_part() -> None:
    """No part imports the app module: it composes them, they do not reach back."""
    assert _offenders([p for p in _modules() if _part(p)], {"app"}) == []


def test_binding_calls_live_in_serving_engine_llama_alone() -> None:
    """Every llama.cpp binding call goes through serving/engine/llama.py (checked there against the vendored
    llama.h): no other module of serving/ imports the bindings, from llama_cpp or through serving.engine.llama."""
    offenders = []
    for path in _modules():
        if path == SERVING / "engine" / "llama.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "llama_cpp" or n.startswith("llama_cpp.") for n in names):
                offenders.append(f"{path.relative_to(SERVING)}:{node.lineno} imports {names}")
            if isinstance(node, ast.ImportFrom) and node.module == "serving.engine.llama" and any(
                    a.name in ("llama_cpp", "ll") for a in node.names):
                offenders.append(f"{path.relative_to(SERVING)}:{node.lineno} takes the raw bindings")
    assert offenders == []


def _front(rules: object) -> object:
    """An ASGI app behind `rules` that echoes the body it read (the ingress's relay stands in)."""
    from starlette.responses import JSONResponse

    from serving.front.http import HttpRules

    assert isinstance(rules, HttpRules)

    async def echo(scope, receive, send):  # type: ignore[no-untyped-def]
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        await JSONResponse({"bytes": len(body)})(scope, receive, send)

    return rules.around(echo)


def test_the_front_door_keeps_the_key_cors_and_body_limit_it_was_built_with() -> None:
    """HttpRules, bound when the app is built, around the ingress: the key on every route but /health, a
    preflight answered without it, CORS headers on answers and refusals alike, the body limit as JSON 413
    even when no Content-Length announced it."""
    from starlette.testclient import TestClient

    from serving.front.http import MAX_BODY_BYTES, HttpRules

    client = TestClient(_front(HttpRules("sekrit", ("https://app.example",))))  # type: ignore[arg-type]
    assert client.get("/health").status_code == 200
    denied = client.post("/v1/completions", json={}, headers={"Origin": "https://app.example"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert denied.headers["access-control-allow-origin"] == "https://app.example"  # a browser can read why
    ok = client.post("/v1/completions", content=b"abc", headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200 and ok.json() == {"bytes": 3} and "access-control-allow-origin" not in ok.headers
    preflight = client.options("/v1/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://app.example"
    other = client.options("/v1/completions", headers={"Origin": "https://evil.example",
                                                       "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"x" * (1 << 20)

    big = client.post("/v1/completions", content=chunks(), headers={"Authorization": "Bearer sekrit"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    open_door = TestClient(_front(HttpRules()))  # type: ignore[arg-type]
    assert open_door.post("/v1/completions", content=b"{}").json() == {"bytes": 2}


def test_a_traced_front_door_writes_each_requests_stamps_in_order(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With $LLAMA_SERVE_TUNE_HTTP_TRACE set, every request (answered, refused or failed) leaves one JSON line
    under its request id: reached the app <= handed to the engine <= first body bytes <= done; a route that
    hands nothing over leaves `submitted` null. A front door built without it writes nothing."""
    import json
    import os

    from starlette.responses import StreamingResponse
    from starlette.testclient import TestClient

    from serving.front.http import TRACE_ENV, HttpRules, mark_submitted

    async def streamed(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["path"] == "/v1/completions":
            mark_submitted(scope)

        async def parts():  # type: ignore[no-untyped-def]
            yield b"data: a\n\n"
            yield b"data: [DONE]\n\n"

        await StreamingResponse(parts(), media_type="text/event-stream")(scope, receive, send)

    monkeypatch.delenv(TRACE_ENV, raising=False)
    untraced = TestClient(HttpRules().around(streamed))  # type: ignore[arg-type]
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace"))  # read when the front door is built, not per request
    assert untraced.post("/v1/completions", content=b"{}").status_code == 200
    assert not (tmp_path / "trace").exists()
    client = TestClient(HttpRules("sekrit").around(streamed))  # type: ignore[arg-type]
    ok = client.post("/v1/completions", content=b"{}", headers={"Authorization": "Bearer sekrit",
                                                                 "X-Request-ID": "one"})
    assert ok.status_code == 200 and ok.text.endswith("[DONE]\n\n")
    assert client.get("/health", headers={"X-Request-ID": "two"}).status_code == 200
    assert client.post("/v1/completions", headers={"X-Request-ID": "three"}).status_code == 401
    lines = (tmp_path / "trace" / f"{os.getpid()}.jsonl").read_text().splitlines()
    stamps = {s["request_id"]: s for s in map(json.loads, lines)}
    assert list(stamps) == ["one", "two", "three"]
    one = stamps["one"]
    assert one["path"] == "/v1/completions"
    assert one["received"] <= one["submitted"] <= one["first_body"] <= one["finished"]
    assert stamps["two"]["submitted"] is None and stamps["two"]["first_body"] is not None
    assert stamps["three"]["submitted"] is None  # refused at the door: stamped all the same


def _module_name(path: Path) -> str:
    rel = path.relative_to(SERVING.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_serving_has_no_import_circle_lazy_imports_included() -> None:
    """No module of serving/ reaches itself through imports, counting those inside functions: a lazy import that
    closes a circle hides a knot that the next move of a name breaks."""
    modules = {_module_name(p): p for p in _modules()}
    graph = {name: {imported for _, imported in _imports(path) if imported in modules and imported != name}
             for name, path in modules.items()}
    circles = []

    def visit(name: str, trail: list[str]) -> None:
        for nxt in sorted(graph[name]):
            if nxt in trail:
                circles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in seen:
                seen.add(nxt)
                visit(nxt, trail + [nxt])

    seen: set[str] = set()
    for start in sorted(graph):
        if start not in seen:
            seen.add(start)
            visit(start, [start])
    assert circles == []
