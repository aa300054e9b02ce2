"""Models by name (serving/engine/model_store.py): names and the files a name means (unit), and against a mock
hub on 127.0.0.1 (engine): resolve and fetch into the cache, the cache without the hub, a dropped download
resumed, a split model fetched whole, and an engine loaded from `owner/repo:Q4_1` answering a prompt."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from serving.engine.config import EngineConfig
from serving.engine.model_store import HubModel, HubSettings, ModelStoreError, parse_name, pick_files

REPO = "owner/repo"
SHA = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token"
SPLIT_Q4_1 = tuple(f"tiny-Q4_1-0000{i}-of-00003.gguf" for i in (1, 2, 3))
Q8_0 = "tiny-Q8_0.gguf"


# -- names (unit) -----------------------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize(("text", "named"), [
    ("owner/repo:Q4_K_M", ("owner/repo", "Q4_K_M", None)),
    ("ggml-org/gemma-3-1b-it-GGUF:q8_0", ("ggml-org/gemma-3-1b-it-GGUF", "q8_0", None)),
    ("unsloth/Qwen3.5-9B-GGUF:UD-Q4_K_XL", ("unsloth/Qwen3.5-9B-GGUF", "UD-Q4_K_XL", None)),
    ("owner/repo", ("owner/repo", None, None)),
    ("owner/repo/model-Q4_0.gguf", ("owner/repo", None, "model-Q4_0.gguf")),
    ("owner/repo/Q4_K_M/big-00001-of-00002.gguf", ("owner/repo", None, "Q4_K_M/big-00001-of-00002.gguf")),
    ("/models/x.gguf", None),
    ("./x.gguf", None),
    ("~/models/x.gguf", None),
    ("models/x.gguf", None),  # DIR/FILE.gguf is a path, as before
    ("model.gguf", None),
    ("owner/repo/readme.md", None),
])
def test_names_and_paths(text: str, named: tuple[str, str | None, str | None] | None) -> None:
    model = parse_name(text)
    assert (None if model is None else (model.repo, model.quant, model.file)) == named
    if model is not None:
        assert str(model) == text  # served under the name as written, as llama-server serves -hf models


@pytest.mark.unit
def test_an_existing_file_is_a_path_even_when_it_reads_as_a_name(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "repo").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert parse_name("owner/repo") is None
    assert EngineConfig(model="owner/repo").model == Path("owner/repo")


@pytest.mark.unit
@pytest.mark.parametrize(("text", "says"), [
    ("owner/repo:Q4 K", "not a quant tag"),
    ("owner/repo:", "not a quant tag"),
    ("own--er/repo:Q4_0", "not a repository name"),
    ("-owner/repo", "not a repository name"),
])
def test_a_bad_name_says_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ModelStoreError, match=says) as caught:
        parse_name(text)
    assert "OWNER/REPO:QUANT" in str(caught.value)


@pytest.mark.unit
def test_a_config_names_a_model_and_carries_it_to_replicas() -> None:
    config = EngineConfig(model="owner/repo:Q4_K_M")
    assert config.model == HubModel(repo=REPO, quant="Q4_K_M")
    assert config.served_name == "owner/repo:Q4_K_M"
    assert EngineConfig(model="owner/repo:Q4_K_M", model_alias="mine").served_name == "mine"
    with pytest.raises(ModelStoreError, match="not resolved to a commit"):
        _ = config.model_path
    pinned = config.model_copy(update={"model": HubModel(repo=REPO, quant="Q4_K_M", revision=SHA,
                                                         files=("x-Q4_K_M.gguf",))})
    again = EngineConfig(**pinned.to_yaml_dict())  # the form user_config and the config channel carry
    assert again == pinned and again.model == pinned.model
    assert EngineConfig(model="/m/x.gguf").served_name == "x"  # a path: unchanged


@pytest.mark.unit
def test_a_resolved_model_lies_in_the_snapshot_of_its_commit(tmp_path: Path) -> None:
    model = HubModel(repo=REPO, quant="Q4_1", revision=SHA, files=SPLIT_Q4_1)
    settings = HubSettings("http://127.0.0.1:9", tmp_path, offline=True)
    assert model.local_path(settings) == tmp_path / "models--owner--repo" / "snapshots" / SHA / SPLIT_Q4_1[0]
    with pytest.raises(ValueError, match="40-hex commit"):
        HubModel(repo=REPO, revision="main", files=("x.gguf",))


# -- which files (unit, on written listings) ----------------------------------------------------------------

LISTING = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-IQ4_NL.gguf", "m-Q4_NL.gguf", "mmproj-m-Q8_0.gguf",
           "m.imatrix.gguf", "big/m-Q2_K-00002-of-00002.gguf", "big/m-Q2_K-00001-of-00002.gguf", "m.F16.gguf"]


def _pick(name: str, listing: list[str] = LISTING) -> tuple[str, ...]:
    model = parse_name(name)
    assert model is not None
    return pick_files(model, listing)


@pytest.mark.unit
def test_a_quant_picks_the_file_tagged_so_in_any_case() -> None:
    assert _pick("o/r:q8_0") == ("m-Q8_0.gguf",)  # not the projector tagged Q8_0 too
    assert _pick("o/r:Q4_NL") == ("m-Q4_NL.gguf",)  # not IQ4_NL: a tag is not part of a longer one
    assert _pick("o/r:f16") == ("m.F16.gguf",)  # a tag after a dot, as llama-server matches it


@pytest.mark.unit
def test_a_split_model_is_all_its_parts_the_first_first() -> None:
    assert _pick("o/r:Q2_K") == ("big/m-Q2_K-00001-of-00002.gguf", "big/m-Q2_K-00002-of-00002.gguf")
    assert _pick("o/r/big/m-q2_k-00002-of-00002.gguf") == _pick("o/r:Q2_K")  # a part named: the whole split
    with pytest.raises(ModelStoreError, match=r"has 2 parts but the repository lacks part\(s\) 2"):
        _pick("o/r:Q2_K", [p for p in LISTING if "00002-of" not in p])


@pytest.mark.unit
def test_no_quant_picks_as_llama_server_does() -> None:
    assert _pick("o/r") == ("m-Q4_K_M.gguf",)
    assert _pick("o/r", [p for p in LISTING if "Q4_K_M" not in p]) == ("m-Q8_0.gguf",)
    assert _pick("o/r", ["b.gguf", "a.gguf", "mmproj.gguf"]) == ("a.gguf",)  # else the first model file


@pytest.mark.unit
def test_no_match_or_several_lists_the_repository_s_ggufs() -> None:
    with pytest.raises(ModelStoreError) as none:
        _pick("o/r:Q5_K_M")
    message = str(none.value)
    assert "no model file with the quant Q5_K_M in o/r" in message
    assert "big/m-Q2_K-00001-of-00002.gguf (2 parts)" in message and "m-Q8_0.gguf" in message
    assert "README.md" not in message and "00002-of" not in message
    with pytest.raises(ModelStoreError, match=r"2 model files with the quant Q8_0 \(a-Q8_0.gguf, b-Q8_0.gguf\): "
                                              r"name one as o/r/FILE.gguf"):
        _pick("o/r:Q8_0", ["a-Q8_0.gguf", "b-Q8_0.gguf"])
    with pytest.raises(ModelStoreError, match="no file 'x.gguf' in o/r"):
        _pick("o/r/x.gguf")
    with pytest.raises(ModelStoreError, match="no model file in o/r; its GGUF files: none"):
        _pick("o/r", ["README.md"])


# -- a mock hub ---------------------------------------------------------------------------------------------

@dataclass
class MockHub:
    """The routes huggingface_hub calls, for one repository: model info (its commit and files) and a file's
    HEAD/GET under resolve/ with the headers the hub sends (X-Repo-Commit, ETag, Content-Length), ranges
    included. `files` are the commit `main` is at (`main`), `commits` every commit's; `move_on` makes a new
    commit. `drop` cuts the next GET of a file halfway through its body; `hold` keeps GETs waiting."""

    files: dict[str, bytes]
    main: str = SHA
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    drop: set[str] = field(default_factory=set)
    hold: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> MockHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
                hub.answer(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                hub.answer(self, body=True)

            def log_message(self, *args: Any) -> None:
                pass

        self.hold.set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def move_on(self, commit: str, files: dict[str, bytes]) -> None:
        self.commits[self.main] = self.files
        self.main, self.files = commit, files

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        self.seen.append((request.command, request.path, {k.lower(): v for k, v in request.headers.items()}))
        path = request.path.split("?")[0]
        if path in (f"/api/models/{REPO}", f"/api/models/{REPO}/revision/main"):
            info = {"id": REPO, "sha": self.main, "siblings": [{"rfilename": name} for name in self.files]}
            return _send(request, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        for commit, files in {**self.commits, self.main: self.files, "main": self.files}.items():
            prefix = f"/{REPO}/resolve/{commit}/"
            if path.startswith(prefix) and path[len(prefix):] in files:
                sha = self.main if commit == "main" else commit
                return self.send_file(request, sha, files[path[len(prefix):]], path[len(prefix):], body)
        code = "EntryNotFound" if path.startswith(f"/{REPO}/") else "RepoNotFound"
        _send(request, 404, b"{}", {"X-Error-Code": code, "X-Repo-Commit": self.main}, body)

    def send_file(self, request: BaseHTTPRequestHandler, commit: str, data: bytes, name: str, body: bool) -> None:
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        start = int(request.headers["Range"].removeprefix("bytes=").split("-")[0]) if "Range" in request.headers \
            else 0
        if not body:
            return _send(request, 200, data, headers, body=False)
        self.hold.wait(60)
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if name in self.drop:  # the whole length promised, half of it sent, the connection closed
            self.drop.discard(name)
            request.send_response(200)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                request.send_header(key, value)
            request.end_headers()
            request.wfile.write(data[:len(data) // 2])
            request.wfile.flush()
            request.close_connection = True
            return
        _send(request, 206 if start else 200, data[start:], headers, body)


def _send(request: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
    request.send_response(status)
    for key, value in {**headers, "Content-Length": str(len(data))}.items():
        request.send_header(key, value)
    request.end_headers()
    if body:
        request.wfile.write(data)


def _split_embedded_model(out: Path) -> list[Path]:
    """The embedded SmolLM2 GGUF rewritten as a split of three parts (gguf's writer names them as llama.cpp's
    gguf-split does: tiny-Q4_1-00001-of-00003.gguf, ...)."""
    import gguf

    reader = gguf.GGUFReader(EngineConfig().model_path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out / "tiny-Q4_1.gguf", arch, split_max_tensors=len(reader.tensors) // 3 + 1)
    for key, value in reader.fields.items():
        if not key.startswith(("GGUF.", "split.")) and key != "general.architecture":
            sub = value.types[-1] if value.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value.contents(), value.types[0], sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out.glob("tiny-Q4_1-*.gguf"))


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    parts = _split_embedded_model(tmp_path_factory.mktemp("split"))
    assert [p.name for p in parts] == list(SPLIT_Q4_1)
    return {"README.md": b"# a tiny model\n", Q8_0: os.urandom(3 << 20), "mmproj-tiny-F16.gguf": b"GGUF-projector",
            **{p.name: p.read_bytes() for p in parts}}


@pytest.fixture
def hub(repo_files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MockHub]:
    """The mock hub, the hub's variables pointing at it and at an empty cache of this test's own."""
    from huggingface_hub import constants

    mock = MockHub(dict(repo_files)).start()
    monkeypatch.setenv("HF_ENDPOINT", mock.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as huggingface_hub read it at import
    yield mock
    mock.stop()


def _resolve(name: str) -> HubModel:
    from serving.engine.model_store import resolve

    model = parse_name(name)
    assert model is not None
    return resolve(model)


# -- against the mock hub (engine) --------------------------------------------------------------------------

@pytest.mark.engine
def test_a_name_resolves_fetches_and_then_needs_no_hub(hub: MockHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.engine.model_store import fetch

    model = _resolve("owner/repo:q8_0")
    assert (model.revision, model.files) == (SHA, (Q8_0,))
    path = fetch(model)
    assert path.read_bytes() == hub.files[Q8_0]
    assert path == Path(os.environ["HF_HUB_CACHE"]) / "models--owner--repo" / "snapshots" / SHA / Q8_0
    asked = [(method, path) for method, path, _ in hub.seen]
    assert ("GET", f"/api/models/{REPO}") in asked and ("GET", f"/{REPO}/resolve/{SHA}/{Q8_0}") in asked
    ours = [headers for _, path, headers in hub.seen if path.startswith((f"/api/models/{REPO}", f"/{REPO}/"))]
    assert ours and all(headers.get("authorization") == f"Bearer {TOKEN}" for headers in ours)  # HF_TOKEN

    hub.stop()  # no hub: the name resolves from the cache, and the file is there
    again = _resolve("owner/repo:Q8_0")
    assert (again.revision, again.files) == (SHA, (Q8_0,))
    assert fetch(model) == path
    with pytest.raises(ModelStoreError, match="could not be reached.*does not hold it"):
        _resolve("owner/repo:Q4_1")  # never fetched
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _resolve("owner/repo/tiny-Q8_0.gguf").files == (Q8_0,)


@pytest.mark.engine
def test_a_replica_fetches_the_commit_resolved_even_after_the_repository_moved_on(hub: MockHub,
                                                                                   tmp_path: Path) -> None:
    """What makes every node of a cluster serve the same bytes: the name is resolved once, and each node (here a
    second cache, as another node's) fetches that commit, not what `main` is at when it gets there."""
    from serving.engine.model_store import fetch

    model = _resolve("owner/repo:Q8_0")
    first = hub.files[Q8_0]
    hub.move_on("f" * 40, {**hub.files, Q8_0: b"GGUF a requantised file"})
    other_node = HubSettings(hub.url, tmp_path / "other-node", offline=False)
    assert fetch(model, other_node).read_bytes() == first
    assert fetch(model).read_bytes() == first
    assert _resolve("owner/repo:Q8_0").revision == "f" * 40  # a new resolve follows main


@pytest.mark.engine
def test_a_download_cut_halfway_resumes_where_it_stopped(hub: MockHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub writes what it read in chunks of 10 MiB and resumes after the last one written; 64 KiB
    here, so that a 3 MiB file cut halfway resumes past its start."""
    from huggingface_hub import constants

    from serving.engine.model_store import fetch

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 << 10)
    hub.drop.add(Q8_0)
    path = fetch(_resolve("owner/repo:Q8_0"))
    assert path.read_bytes() == hub.files[Q8_0]
    gets = [headers.get("range") for method, path, headers in hub.seen if method == "GET" and path.endswith(Q8_0)]
    assert len(gets) == 2 and gets[0] is None and gets[1] is not None, gets
    resumed_at = int(gets[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= len(hub.files[Q8_0]) // 2  # the second GET asked only for the rest


@pytest.mark.engine
def test_a_split_model_is_fetched_whole_and_loads_from_its_first_part(hub: MockHub) -> None:
    """Through the replica's host: the background load fetches the resolved files while /health says loading,
    then the engine loads the split from its first part and answers, under the name as written."""
    from serving.replica import host as engine_host
    from serving.replica.server import health_report

    config = EngineConfig(model=_resolve("owner/repo:Q4_1"), n_parallel=1, n_ctx=512, seed=1)
    assert config.model_path.name == SPLIT_Q4_1[0] and not config.model_path.exists()
    limits = engine_host.HostLimits(max_queued_requests=4, traffic_record=16, tuning_lease_s=60.0,
                                    config_poll_s=600.0)
    host = engine_host.EngineHost("r1", limits, SimpleNamespace())
    hub.hold.clear()

    async def scenario() -> tuple[int, engine_host.HostState]:
        await host.take(config)
        loading = health_report(host.state()).status
        hub.hold.set()
        deadline = time.monotonic() + 240
        while host.state() is engine_host.HostState.loading and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return loading, host.state()

    try:
        loading, state = asyncio.run(scenario())
        assert loading == 503 and state is engine_host.HostState.ok, host.load_error
        snapshot = config.model_path.parent
        assert [(snapshot / name).read_bytes() == hub.files[name] for name in SPLIT_Q4_1] == [True] * 3
        answer = _complete(host.ready_engine(), "The capital of France is")
        assert "Paris" in answer
        assert host.ready_engine().config.served_name == "owner/repo:Q4_1"
    finally:
        host.close()


def _complete(engine: Any, prompt: str) -> str:
    from serving.engine.request import SamplingParams
    from tests.helpers import collect

    return collect(engine.submit(engine.tokenize_prompt(prompt), SamplingParams(max_tokens=8, temperature=0.0))).text


@pytest.mark.engine
def test_the_app_resolves_once_and_hands_replicas_the_hub_s_address(hub: MockHub) -> None:
    from serving.app import engine_env, resolve_model

    named = EngineConfig(model="owner/repo:Q8_0")
    pinned = resolve_model(named)
    assert isinstance(pinned.model, HubModel) and pinned.model.revision == SHA
    assert resolve_model(pinned) is pinned  # already pinned (a tuned config): nothing asked of the hub
    env = engine_env(pinned)["env_vars"]
    assert env["HF_ENDPOINT"] == hub.url and env["HF_TOKEN"] == TOKEN
    assert "HF_ENDPOINT" not in engine_env(EngineConfig(model="/m/x.gguf"))["env_vars"]
    with pytest.raises(ModelStoreError, match="no repository someone/else on"):
        resolve_model(EngineConfig(model="someone/else:Q4_0"))


@pytest.mark.engine
def test_an_offline_study_starts_from_a_model_by_name(hub: MockHub) -> None:
    """The tuner's offline trials load the model on this machine: its base config resolves and fetches it."""
    from tuning.options import parse_options
    from tuning.plan import base_config

    config = base_config(parse_options(["--model", "owner/repo:Q8_0", "--offline"]))
    assert isinstance(config.model, HubModel) and config.model.revision == SHA
    assert config.model_path.read_bytes() == hub.files[Q8_0]
