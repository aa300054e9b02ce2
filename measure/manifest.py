"""Checks a RayService manifest against KubeRay's own CRD, as `kubectl apply` with strict field validation would.

The tests check deploy/kuberay/rayservice.yaml against a hand-written subset of the CRD's schema (no package
here ships the CRD). Where the CRD is at hand (a cluster with KubeRay installed, or its release's
`ray.io_rayservices.yaml`), this checks a manifest against the real thing:

    kubectl get crd rayservices.ray.io -o yaml > crd.yaml
    python scripts/check_manifest.py --crd crd.yaml [--manifest deploy/kuberay/rayservice.yaml]

Kubernetes refuses a field its structural schema does not name (strict validation; the API server prunes it
otherwise), so every object schema that lists properties and does not preserve unknown fields is closed here
(`additionalProperties: false`) before validating. Exit 0: no error; 1: the errors, one per line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESERVE = "x-kubernetes-preserve-unknown-fields"


def closed(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema with every object that names its properties closed to others, unless it
    says it keeps unknown fields (as the API server's pruning reads it)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if "properties" in out and not out.get(PRESERVE) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def crd_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    """The served version's openAPIV3Schema, closed; metadata left to the API server (its schema is not in it)."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            schema = closed(entry["schema"]["openAPIV3Schema"])
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}
            return schema
    raise SystemExit(f"the CRD has no version {version!r}: {[v['name'] for v in crd['spec']['versions']]}")


def errors(schema: dict[str, Any], docs: Iterable[Any], kind: str) -> list[str]:
    """Every validation error of the manifest's documents of `kind`, as 'path: message'."""
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    found = [doc for doc in docs if isinstance(doc, dict) and doc.get("kind") == kind]
    if not found:
        return [f"no {kind} in the manifest"]
    return [f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for doc in found
            for e in validator.iter_errors(doc)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crd", type=Path, required=True, help="the RayService CRD (YAML, as kubectl prints it)")
    parser.add_argument("--manifest", type=Path, default=REPO_ROOT / "deploy" / "kuberay" / "rayservice.yaml")
    parser.add_argument("--version", default="v1", help="the CRD version the manifest uses")
    args = parser.parse_args(argv)
    crd = yaml.safe_load(args.crd.read_text())
    kind = crd["spec"]["names"]["kind"]
    problems = errors(crd_schema(crd, args.version), yaml.safe_load_all(args.manifest.read_text()), kind)
    for line in problems:
        print(line)
    print(f"{args.manifest}: {len(problems)} error(s) against {kind} {args.version} of {args.crd}", file=sys.stderr)
    return 1 if problems else 0

