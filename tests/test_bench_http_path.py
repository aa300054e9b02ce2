"""scripts/bench_http_path.py's variant words (the rest needs a Serve app: run the script)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module("bench_http_path")
    finally:
        sys.path.remove(str(SCRIPTS))


def test_a_variant_is_a_name_serve_run_words_and_replica_environment(bench) -> None:  # noqa: ANN001
    v = bench.Variant.parse("fast:n_threads=1,stream_interval_ms=100:env:RAY_SERVE_X=0,Y=1")
    assert (v.name, v.args, v.env) == ("fast", {"n_threads": "1", "stream_interval_ms": "100"},
                                       {"RAY_SERVE_X": "0", "Y": "1"})
    assert bench.Variant.parse("default") == bench.Variant("default")
    for bad in ("", "in-process", "x:n_threads", ":a=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.Variant.parse(bad)
