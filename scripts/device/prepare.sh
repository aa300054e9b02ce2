#!/bin/bash
# prepare.sh [DIR]   (run HERE, on a machine with PyPI access; default DIR=.devwork, git-ignored)
# Everything a GPU machine without a package index needs, in one folder to carry (device tool: carry DIR):
#   DIR/lcpp_trim.tgz   the llama-cpp-python sdist of the installed version, trimmed to what builds libllama,
#                       llama-server and llama-bench (~6 MB)
#   DIR/bundle/         cp312 manylinux wheels of Ray Serve/Tune, Optuna, gguf, ... the image lacks (~56 MB)
#   DIR/tokenizer.gguf  the embedded model's tokenizer alone (~2 MB), for make_synthetic_gguf.py --tokenizer-from
# Then on the device: bash scripts/device/setup.sh DIR
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
[ -d "$DIR/bundle" ] || bash "$HERE/make-bundle.sh" "$DIR/bundle"
[ -f "$DIR/tokenizer.gguf" ] || python3 "$HERE/../make_synthetic_gguf.py" --tokenizer-only --out "$DIR/tokenizer.gguf"
du -sh "$DIR"/*
