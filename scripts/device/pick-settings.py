#!/usr/bin/env python3
"""pick-settings.py TUNED_YAML: the tuner's pick as bench_device.py's `--placement` settings (KEY=VALUE,...),
the settings a study searches and the placement it chose; prints nothing and fails if the file has no pick."""

import sys

import yaml

SEARCHED = ("n_parallel", "n_ctx", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn", "n_gpu_layers",
            "n_cpu_moe", "n_threads")

engine = (yaml.safe_load(open(sys.argv[1], encoding="utf-8")) or {}).get("engine") or sys.exit(1)
print(",".join(f"{key}={engine[key]}" for key in SEARCHED if key in engine))
