#!/usr/bin/env python3
"""A draft model for speculative decoding made from the model itself: a copy of a GGUF keeping only its first
N transformer blocks (plus the embeddings, the final norm and the output head), so it shares the vocabulary by
construction. An early-exit ("layer-skip") draft: untrained for exiting early, so its guesses are worse than a
trained small model's, but it is a real model's guess, which random weights are not, and it is here when no
model hub is.

    python scripts/make_draft_gguf.py --layers 8 --out results/draft-8.gguf        # from the embedded model
    python scripts/make_draft_gguf.py --model big.gguf --layers 12 --out draft.gguf
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import gguf

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from serving.engine.config import embedded_model_path  # noqa: E402

BLOCK = re.compile(r"^blk\.(\d+)\.")


def block_of(tensor_name: str) -> int | None:
    match = BLOCK.match(tensor_name)
    return int(match.group(1)) if match else None


def truncate(source: Path, out: Path, layers: int) -> int:
    """Write `out`: `source` with its first `layers` blocks; the bytes written."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    count_key = f"{arch}.block_count"
    total = int(reader.fields[count_key].contents())
    if not 1 <= layers < total:
        raise SystemExit(f"error: --layers must be in 1..{total - 1} for {source.name} ({total} blocks)")
    writer = gguf.GGUFWriter(str(out), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        if field.name == gguf.Keys.General.NAME:
            value = f"{value} (first {layers} of {total} blocks)"
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    kept = [t for t in reader.tensors if (block := block_of(t.name)) is None or block < layers]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return out.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="the GGUF to cut (default: the embedded SmolLM2-135M)")
    parser.add_argument("--layers", type=int, required=True, help="blocks to keep, from the first")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    source = args.model or embedded_model_path()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    size = truncate(source, args.out, args.layers)
    print(f"wrote {args.out}: {size:,} B, the first {args.layers} blocks of {source.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
