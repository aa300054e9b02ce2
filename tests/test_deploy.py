"""deploy/: the KubeRay manifest and the two images, checked without a cluster or a container engine.

The manifest is validated against deploy/kuberay/rayservice.schema.json, a HAND-WRITTEN SUBSET of KubeRay's
RayService CRD schema (ray.io/v1, KubeRay 1.7.0: its types, required fields and property names at the levels
the manifest uses; not the CRD itself, which no package here ships). Its Serve config is read as the app would
read it: the arguments are checked against EngineConfig and ServerOptions (light modules: neither imports Ray
nor libllama, so this stays in the unit lane). The Dockerfiles are linted as text: their stages, the CUDA
architectures reaching CMake, and the versions pinned against pyproject.toml and the manifest. What this cannot
show: that the images build (docs/deploy.md says how to) and that a real operator runs the RayService.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MANIFEST = DEPLOY / "kuberay" / "rayservice.yaml"
SCHEMA = DEPLOY / "kuberay" / "rayservice.schema.json"
PVC = DEPLOY / "kuberay" / "models-pvc.yaml"
DOCKERFILES = {"cuda": DEPLOY / "Dockerfile.cuda", "cpu": DEPLOY / "Dockerfile.cpu"}
ARCHITECTURES = "70;75;80;86;89;90"  # V100 (sm_70) through H100/H200 (sm_90)
MODELS_MOUNT = "/models"


def manifest() -> dict[str, Any]:
    return yaml.safe_load(MANIFEST.read_text())


def schema_errors(doc: dict[str, Any]) -> list[str]:
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def cluster(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["rayClusterConfig"]


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    """The Ray container of a group's pod: KubeRay takes the first."""
    return group["template"]["spec"]["containers"][0]


def serve_config(doc: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def test_the_manifest_is_a_valid_rayservice() -> None:
    """The manifest against the hand-written subset of the CRD schema (deploy/kuberay/rayservice.schema.json)."""
    assert schema_errors(manifest()) == []


@pytest.mark.parametrize(("path", "value", "error"), [
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "rayStartParams"), {"num-gpus": 1}, "is not of type 'string'"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "minReplicas"), None, "'minReplicas' is a required property"),
    (("spec", "rayClusterConfig", "workerGroupSpec"), [], "Additional properties are not allowed"),
    (("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "resources", "limits",
      "nvidia.com/gpu"), "one", "does not match"),
    (("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "env", 0, "valueFrom",
      "secretKeyRef", "key"), None, "'key' is a required property"),
    (("spec", "serveConfigV2"), {"applications": []}, "is not of type 'string'"),
])
def test_the_schema_refuses_what_kubernetes_refuses(path: tuple[str | int, ...], value: Any, error: str) -> None:
    """The subset is not vacuous: a number where Ray's start parameters take strings, a missing required
    field, a misspelt field, a malformed quantity, a Serve config as a map instead of a YAML string."""
    doc = copy.deepcopy(manifest())
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    assert any(error in e for e in schema_errors(doc)), schema_errors(doc)


def test_serve_config_runs_the_app_with_arguments_it_accepts() -> None:
    """serveConfigV2 is YAML naming serving.app:main, and its args are what AppArgs takes (a config file that
    the image holds, EngineConfig fields, ServerOptions fields) with values those models accept."""
    from serving.engine.config import EngineConfig, load_engine_config
    from serving.engine.model_store import HubModel
    from serving.replica.options import ServerOptions

    config = serve_config(manifest())
    assert config["http_options"]["host"] == "0.0.0.0"  # the pods' Serve proxies take traffic from the service
    (app,) = config["applications"]
    assert app["import_path"] == "serving.app:main"
    args = dict(app["args"])
    engine_keys, server_keys = set(EngineConfig.model_fields), set(ServerOptions.model_fields)
    assert set(args) - {"config"} - engine_keys - server_keys == set()
    config_file = ROOT / args.pop("config")  # relative to the project, as serving/app.py resolves it
    assert config_file.is_file()
    engine = load_engine_config(config_file, {k: v for k, v in args.items() if k in engine_keys})
    ServerOptions.model_validate({k: v for k, v in args.items() if k in server_keys})
    assert isinstance(engine.model, HubModel) and engine.model.quant  # by name: OWNER/REPO:QUANT
    on_volume = re.search(r"^\s*#\s*model: (\S+)$", MANIFEST.read_text(), re.M)  # the path form, in a comment
    assert on_volume and on_volume.group(1).startswith(MODELS_MOUNT + "/")
    assert isinstance(load_engine_config(config_file, {"model": on_volume.group(1)}).model, Path)


def test_head_without_gpus_and_one_gpu_per_worker() -> None:
    """The head takes no GPU and no engine replica (no CPUs for Ray tasks) and runs the CPU image; each worker
    group asks for one GPU a pod and runs the CUDA image; both images come from one repository and tag scheme."""
    spec = cluster(manifest())
    head = spec["headGroupSpec"]
    head_container = ray_container(head)
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in head_container["resources"].get("limits", {})
    assert head_container["image"].endswith(":cpu")
    assert spec["workerGroupSpecs"]
    for group in spec["workerGroupSpecs"]:
        container = ray_container(group)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["image"] == head_container["image"].removesuffix(":cpu") + ":cuda"
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_workers_mount_the_models_and_read_the_token_from_a_secret() -> None:
    """Every GPU worker mounts the models volume (the claim models-pvc.yaml makes) at /models, fetches models by
    name into a cache on it, and reads HF_TOKEN from a Secret, as the head does (it resolves names)."""
    doc = manifest()
    claim = yaml.safe_load(PVC.read_text())["metadata"]["name"]
    head = ray_container(cluster(doc)["headGroupSpec"])
    assert "secretKeyRef" in {e["name"]: e for e in head["env"]}["HF_TOKEN"]["valueFrom"]
    for group in cluster(doc)["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        container = ray_container(group)
        volumes = {v["name"]: v for v in pod["volumes"]}
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == MODELS_MOUNT)
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_HUB_CACHE"]["value"].startswith(MODELS_MOUNT + "/")
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True  # public models need none
        assert pod["securityContext"]["fsGroup"] == 1000  # the images' user writes the cache


@dataclass(frozen=True)
class Stage:
    """One FROM stage of a Dockerfile: its base, its name, and its instructions (continuations joined)."""

    base: str
    name: str
    instructions: tuple[tuple[str, str], ...]

    def text(self, keyword: str) -> str:
        return "\n".join(arg for kw, arg in self.instructions if kw == keyword)


@dataclass(frozen=True)
class Dockerfile:
    args: dict[str, str]  # ARG defaults, global and per stage (the names do not collide here)
    stages: tuple[Stage, ...]


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions as (KEYWORD, arguments), comments dropped and backslash continuations joined."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in joined.splitlines():
        if not line.strip():
            continue
        keyword, _, rest = line.strip().partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip(), ()))
        elif stages:
            last = stages[-1]
            stages[-1] = Stage(last.base, last.name, (*last.instructions, (keyword, rest)))
    return Dockerfile(args, tuple(stages))


def pinned(package: str) -> str:
    """The version pyproject.toml pins `package` to (`name==X`)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(rf"{re.escape(package)}\s*==", d)]
    return spec.split("==")[1].split(";")[0].strip()


def test_the_cuda_image_builds_for_the_chosen_architectures_on_cuda_12() -> None:
    """A CUDA 12.x devel stage (CUDA 13 cannot target sm_70) builds llama-cpp-python for CUDA_ARCHITECTURES
    (V100 through H100 by default); a runtime stage of the same CUDA version is the image."""
    cuda = parse_dockerfile(DOCKERFILES["cuda"])
    build, runtime = cuda.stages
    assert cuda.args["CUDA_VERSION"].split(".")[0] == "12"
    assert build.base == "nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION}" and build.name == "build"
    assert runtime.base == "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}"
    assert cuda.args["CUDA_ARCHITECTURES"] == ARCHITECTURES
    (llama_build,) = [run for kw, run in build.instructions if kw == "RUN" and "llama-cpp-python==" in run]
    assert "-DGGML_CUDA=ON" in llama_build
    assert "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}" in llama_build


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_each_image_pins_the_projects_versions_and_suits_kuberay(kind: str) -> None:
    """llama-cpp-python at pyproject's pin, Ray at the manifest's rayVersion (which pyproject allows), the same
    Ubuntu (and so Python) in both images; a portable CPU build; the runtime stage is the image (the last) and
    holds what KubeRay's Ray container runs: bash, wget for its probes, the venv's python and ray on PATH, the
    project installed where serving/app.py finds configs/."""
    from packaging.requirements import Requirement

    dockerfile = parse_dockerfile(DOCKERFILES[kind])
    build, runtime = dockerfile.stages
    ray_version = dockerfile.args["RAY_VERSION"]
    assert dockerfile.args["LLAMA_CPP_PYTHON_VERSION"] == pinned("llama-cpp-python")
    assert ray_version == cluster(manifest())["rayVersion"]
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (ray,) = [Requirement(d) for d in deps if Requirement(d).name == "ray"]
    assert ray.specifier.contains(ray_version)
    assert dockerfile.args["UBUNTU_VERSION"] == parse_dockerfile(DOCKERFILES["cpu"]).args["UBUNTU_VERSION"]
    run = build.text("RUN")
    assert "-DGGML_NATIVE=OFF" in run
    assert '"llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}"' in run and '"ray[serve,tune]==${RAY_VERSION}"' in run
    assert "pip install --no-cache-dir -e /opt/llama-serve-tune" in run
    packages = runtime.text("RUN")
    assert all(re.search(rf"\b{p}\b", packages) for p in ("bash", "wget", "python3", "ca-certificates"))
    assert "--from=build /opt/venv /opt/venv" in runtime.text("COPY")
    assert "--from=build --chown=ray:ray /opt/llama-serve-tune /opt/llama-serve-tune" in runtime.text("COPY")
    assert "PATH=/opt/venv/bin:$PATH" in runtime.text("ENV")
    assert runtime.text("USER") == "ray"


TINY_CRD = {"spec": {"names": {"kind": "RayService"}, "versions": [{"name": "v1", "schema": {"openAPIV3Schema": {
    "type": "object", "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "spec": {
        "type": "object", "required": ["serveConfigV2"], "properties": {
            "serveConfigV2": {"type": "string"},
            "rayClusterConfig": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                 "properties": {"rayVersion": {"type": "string"}}}}}}}}}]}}


@pytest.mark.parametrize(("spec", "problem"), [
    ({"serveConfigV2": "applications: []"}, None),
    ({"serveConfigV2": "applications: []", "rayClusterConfig": {"anything": 1}}, None),  # it keeps unknown fields
    ({"serveConfigV2": "applications: []", "serveConfigV3": "x"}, "'serveConfigV3' was unexpected"),  # misspelt
    ({}, "'serveConfigV2' is a required property"),
])
def test_the_real_crd_check_closes_objects_as_strict_validation_does(tmp_path: Path, spec: dict[str, Any],
                                                                      problem: str | None,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """measure/manifest.py (scripts/check_manifest.py: the check against KubeRay's own CRD, where one is at
    hand): an object schema that names its properties refuses others, one that keeps unknown fields does not."""
    crd, doc = tmp_path / "crd.yaml", tmp_path / "m.yaml"
    crd.write_text(yaml.safe_dump(TINY_CRD))
    doc.write_text(yaml.safe_dump({"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "x"},
                                   "spec": spec}))
    from measure.manifest import main

    rc = main(["--crd", str(crd), "--manifest", str(doc)])
    out = capsys.readouterr().out
    assert (rc, problem is None or problem in out) == (0 if problem is None else 1, True), out
