#!/usr/bin/env python3
"""Does llama.cpp give a position the same logits whatever else is in its batch? Speculation verifies guesses
as more rows of the same sequence, and concurrent streams share a decode with other sequences; plain decoding
of a lone stream is one row. Where the logits differ, greedy text can part at a near-tie: the cause is the
backend's kernels, not the scheduler.

For each cache type and flash-attention setting, and a prompt shorter and longer than 512 cells, decodes the
next token alone, then as the first of k rows of its sequence (k = 2, 8, 16), then beside one row of each of
three other sequences, and prints the largest logit difference from the lone row (0 = bitwise the same).

On CPU (measured, see docs/log/2026-12-04-spec-greedy-ceiling-h200.md): with an f16 K/V cache, flash attention takes a kernel of its own for
a lone row past 512 cells (split over the cache, f32 sums), so a lone stream's logits there differ from the
same position in any larger batch; without flash attention, the attention's matrix products change kernel
from one row to several (in some shapes). With a quantised K cache (q8_0) and flash attention, every row goes through one
kernel: batch-invariant.

    python scripts/batch_numerics.py [--model M.gguf] [--cache f16/f16 --cache q8_0/q8_0 ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine.llama import LlamaContext, LlamaModel  # noqa: E402  (first: the library load order)
from measure.provenance import provenance  # noqa: E402
from measure.workload import source_text  # noqa: E402
from serving.engine.config import EngineConfig  # noqa: E402
from serving.engine.config import default_threads  # noqa: E402
from serving.engine.repack import use_extra_bufts  # noqa: E402

SETTINGS = ("f16/f16:auto", "f16/f16:off", "q8_0/q8_0:on", "q8_0/f16:on")  # type_k/type_v:flash_attn
PROMPT_CELLS = (200, 700)  # below and above the 512 cells where CPU flash attention splits a lone row
OTHER_SEQUENCES = 3


class Probe:
    """One context with four sequences holding prompts of the same length."""

    def __init__(self, model: LlamaModel, config: EngineConfig, prompt: list[int], cells: int) -> None:
        self.ctx = LlamaContext(model, config, default_threads())
        self.prompt, self.cells = prompt, cells
        for seq in range(1 + OTHER_SEQUENCES):
            self._decode([(seq, prompt[seq:seq + cells], 0)], every_row=False)
        self.alone = self._next_logits([(0, [prompt[cells]], cells)], every_row=False)

    def rows_of_its_sequence(self, k: int) -> float:
        return self._difference([(0, self.prompt[self.cells:self.cells + k], self.cells)], every_row=True)

    def beside_other_sequences(self) -> float:
        rows = [(seq, [self.prompt[self.cells + seq]], self.cells) for seq in range(1 + OTHER_SEQUENCES)]
        return self._difference(rows, every_row=False)

    def _difference(self, rows: list[tuple[int, list[int], int]], every_row: bool) -> float:
        logits = self._next_logits(rows, every_row)
        return float(abs(self.alone - logits).max())

    def _next_logits(self, rows: list[tuple[int, list[int], int]], every_row: bool):  # noqa: ANN202 (numpy)
        """Decode `rows`, take the logits of sequence 0's first new row, then drop every new cell."""
        self._decode(rows, every_row)
        logits = self.ctx.logits(0).copy()
        for seq, _, start in rows:
            self.ctx.forget(seq, start)
        return logits

    def _decode(self, rows: list[tuple[int, list[int], int]], every_row: bool) -> None:
        self.ctx.clear_batch()
        for seq, tokens, start in rows:
            self.ctx.add_to_batch(tokens, start, seq, True, every_row)
        if self.ctx.decode() != 0:
            raise SystemExit("llama_decode failed")

    def free(self) -> None:
        self.ctx.free()


def config_of(setting: str, model: Path | None) -> EngineConfig:
    cache, flash_attn = setting.split(":")
    type_k, type_v = cache.split("/")
    return EngineConfig(model=model, n_parallel=1 + OTHER_SEQUENCES, n_ctx=4096 * (1 + OTHER_SEQUENCES),
                        type_k=type_k, type_v=type_v, flash_attn=flash_attn)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--setting", action="append", default=None,
                        help=f"type_k/type_v:flash_attn (repeatable; default {', '.join(SETTINGS)})")
    args = parser.parse_args(argv)
    settings = args.setting or list(SETTINGS)
    first = config_of(settings[0], args.model)
    model = LlamaModel(first.model_path, first.n_gpu_layers, use_extra_bufts(first))
    prompt = model.tokenize("Repeat this code:\n\n" + source_text())
    prov = provenance()
    print(f"# {first.model_path.name}, {prov['cpu']} ({prov['cpus']} CPUs), commit {prov['commit']}")
    print("| K/V cache | flash attn | cells before | max logit difference from a lone row: "
          "first of 2 / 8 / 16 rows of its sequence | beside 3 other sequences |")
    print("| --- | --- | ---: | --- | ---: |")
    for setting in settings:
        config = config_of(setting, args.model)
        for cells in PROMPT_CELLS:
            probe = Probe(model, config, prompt, cells)
            rows = " / ".join(f"{probe.rows_of_its_sequence(k):.3g}" for k in (2, 8, 16))
            print(f"| {config.type_k.value}/{config.type_v.value} | {config.flash_attn.value} | {cells} | {rows} "
                  f"| {probe.beside_other_sequences():.3g} |", flush=True)
            probe.free()
    model.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
