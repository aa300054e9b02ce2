#!/usr/bin/env python3
"""pick-settings.py TUNED_YAML: the tuner's pick as bench_device.py's `--placement` settings (KEY=VALUE,...),
the settings a study searches and the placement it chose; prints nothing and fails if the file has no pick.

Every setting the search can set is passed on (tests/test_device_scripts.py checks the list against the search
space): one left out is benched at the article's value, so the bench would measure another config than the pick
(`cpu_moe_start` left out moved a pick of the last layers' experts to the first layers')."""

import sys

import yaml

SEARCHED = ("n_parallel", "n_ctx", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn", "kv_unified",
            "n_gpu_layers", "n_cpu_moe", "cpu_moe_start", "n_threads", "spec_mode", "spec_draft_max", "spec_max_busy",
            "split_mode")


def settings(engine: dict) -> str:
    """The pick's searched settings, as --placement's KEY=VALUE,... (those the file has)."""
    return ",".join(f"{key}={engine[key]}" for key in SEARCHED if key in engine)


def main(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        engine = (yaml.safe_load(f) or {}).get("engine")
    if not engine:
        return 1
    print(settings(engine))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
