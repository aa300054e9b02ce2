"""The memory model (serving/engine/memory.py) term by term against what llama.cpp says it allocated, on this machine.

Why: the tuner refuses a config predicted over the budget without loading it, so the prediction decides which
placements are tried at all; a term that over-predicts leaves layers off the GPU, one that under-predicts lets
a config through that does not fit. This loads our engine at each config and reads llama.cpp's own buffer
sizes from its load log (serving/engine/buffers.py: weights, K/V, compute), beside the prediction of each, and prints
their ratios. On a CPU-only build the GPU terms are not exercised; scripts/bench_device.py records the same
buffers for every placement it loads on a GPU.

Configs are `ROWS/SLOTS/CONTEXT/FLASH[/unified]` (n_ubatch = n_batch, n_parallel, n_ctx, flash_attn
on|off|auto; `unified`: kv_unified on), e.g.

    python scripts/bench_memory.py --config 512/2/2048/on --config 128/1/2048/off --json-out /tmp/mem.json
    python scripts/make_synthetic_gguf.py --preset qwen7b --layers 2 --hidden 256 --heads 4 --kv-heads 2 \\
        --ffn 32768 --vocab 49152 --out /tmp/wide.gguf    # a feed-forward wider than the logits
    python scripts/bench_memory.py --model /tmp/wide.gguf --config 512/2/2048/on
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from serving.engine import llama as _llama  # noqa: E402,F401  (first: the library load order, see serving/engine/llama.py)
from measure.provenance import provenance, write_report  # noqa: E402
from serving.engine.buffers import llama_buffers  # noqa: E402
from serving.engine.config import CpuRepack, EngineConfig, FlashAttn, embedded_model_path  # noqa: E402
from serving.engine.core import Engine  # noqa: E402
from serving.engine.memory import MiB, ModelShape, predict  # noqa: E402

DEFAULT_CONFIGS = ("32/1/2048/on", "128/1/2048/on", "512/1/2048/on", "512/2/2048/on", "256/1/8192/on",
                   "512/4/4096/off", "1024/1/16384/on", "128/1/2048/off", "512/1/8192/off")


@dataclass(frozen=True)
class TermRow:
    """One config: llama.cpp's MiB and the model's, per term."""

    config: str
    weights_mib: float
    weights_predicted_mib: float
    kv_mib: float
    kv_predicted_mib: float
    compute_mib: float
    compute_predicted_mib: float

    @property
    def compute_ratio(self) -> float:
        return self.compute_predicted_mib / self.compute_mib


def parse_config(text: str, model: Path, threads: int | None) -> EngineConfig:
    """`ROWS/SLOTS/CONTEXT/FLASH[/unified]` as an engine config (weights in one mapped buffer: cpu_repack off;
    `unified`: kv_unified on)."""
    try:
        rows, slots, context, flash, *rest = text.split("/")
        if rest not in ([], ["unified"]):
            raise ValueError(f"after FLASH only 'unified' may follow, not {'/'.join(rest)!r}")
        return EngineConfig(model=model, n_batch=int(rows), n_ubatch=int(rows), n_parallel=int(slots),
                            n_ctx=int(context), flash_attn=FlashAttn(flash), cpu_repack=CpuRepack.off,
                            n_threads=threads, kv_unified=bool(rest))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: write ROWS/SLOTS/CONTEXT/FLASH[/unified], e.g. 512/2/2048/on "
                                         f"({exc})") from None


def measure(shape: ModelShape, name: str, config: EngineConfig) -> TermRow:
    """Load the engine at `config` and read llama.cpp's buffer sizes for it."""
    predicted = predict(shape, config, on_gpu=False)
    with llama_buffers() as buffers:
        engine = Engine(config)
    engine.close()
    mib = {kind: sum(by_type.values()) for kind, by_type in buffers.items()}
    return TermRow(name, mib.get("model", 0.0), predicted.weights / MiB, mib.get("KV", 0.0),
                   predicted.kv_cache / MiB, mib.get("compute", 0.0), predicted.compute / MiB)


def table(rows: Sequence[TermRow]) -> str:
    lines = ["| config (rows/slots/ctx/FA) | weights MiB (pred) | K/V MiB (pred) | compute MiB (pred) "
             "| compute pred/meas |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r.config} | {r.weights_mib:.1f} ({r.weights_predicted_mib:.1f}) | {r.kv_mib:.1f} "
              f"({r.kv_predicted_mib:.1f}) | {r.compute_mib:.2f} ({r.compute_predicted_mib:.2f}) | "
              f"{r.compute_ratio:.4f} |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="GGUF file (default: the embedded model)")
    p.add_argument("--config", action="append",
                   help="ROWS/SLOTS/CONTEXT/FLASH[/unified] (repeat; default: nine configs)")
    p.add_argument("--threads", type=int, default=1, help="n_threads of each engine (default 1: loading only)")
    p.add_argument("--json-out", type=Path, help="write the rows and provenance here")
    args = p.parse_args(argv)
    model = args.model or embedded_model_path()
    configs = {text: parse_config(text, model, args.threads) for text in args.config or DEFAULT_CONFIGS}
    shape = ModelShape.from_gguf(model)
    rows = [measure(shape, name, config) for name, config in configs.items()]
    report: dict[str, Any] = {"provenance": provenance(), "model": str(model),
                              "rows": [{**asdict(r), "compute_ratio": r.compute_ratio} for r in rows]}
    print(table(rows))
    if args.json_out:
        write_report(args.json_out, report)
    return 0

