#!/usr/bin/env bash
# Build the reference peers `llama-server` and `llama-bench` from the llama.cpp that is VENDORED in the
# llama-cpp-python sdist of the installed version.
#
# Why the vendored copy: our engine drives llama.cpp through llama-cpp-python's ctypes bindings, whose struct
# layouts are fixed per llama.cpp commit. Comparing against a llama-server from any other commit would mix
# engine differences with llama.cpp version differences; building from the same sdist keeps the peer honest.
#
# Usage:
#   scripts/build_llama_server.sh                      # CPU build into .llama-build/ (binaries in .llama-build/bin)
#   scripts/build_llama_server.sh --cuda 90            # CUDA build for H200 (sm_90) into .llama-build/cuda-90/
#   scripts/build_llama_server.sh --cuda 70            # V100 (sm_70): needs a CUDA 12.x toolkit; CUDA 13 dropped
#                                                      # sm_70 (and its prebuilt wheels are sm_75+)
#   scripts/build_llama_server.sh --sdist-dir /tmp/sdist/llama_cpp_python-0.3.36   # no download
#
# Options:
#   --cuda ARCHS       CUDA build; ARCHS goes to CMAKE_CUDA_ARCHITECTURES (e.g. 90, "70;90")
#   --out DIR          build tree (default: <repo>/.llama-build, or <repo>/.llama-build/cuda-<ARCHS> with --cuda)
#   --sdist-dir DIR    an unpacked llama-cpp-python sdist to build from instead of downloading one
#   --version VER      llama-cpp-python version to download (default: the installed one)
#   -j, --jobs N       parallel compile jobs (default: nproc)
#   --force            rebuild even when both binaries already exist
#
# Idempotent: exits early (printing the paths) when both binaries already exist in <out>/bin.
set -euo pipefail

die() { echo "build_llama_server: error: $*" >&2; exit 1; }
log() { echo "build_llama_server: $*" >&2; }

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
CUDA_ARCHS=""
OUT_DIR=""
SDIST_DIR=""
VERSION=""
JOBS="$(nproc 2>/dev/null || echo 2)"
FORCE=0

while [[ $# -gt 0 ]]; do
    case "$1" in
        --cuda) CUDA_ARCHS="${2:?--cuda needs ARCHS}"; shift 2 ;;
        --out) OUT_DIR="${2:?--out needs DIR}"; shift 2 ;;
        --sdist-dir) SDIST_DIR="${2:?--sdist-dir needs DIR}"; shift 2 ;;
        --version) VERSION="${2:?--version needs VER}"; shift 2 ;;
        -j|--jobs) JOBS="${2:?--jobs needs N}"; shift 2 ;;
        -j*) JOBS="${1#-j}"; shift ;;
        --force) FORCE=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

BASE_DIR="$REPO_ROOT/.llama-build"
if [[ -z "$OUT_DIR" ]]; then
    if [[ -n "$CUDA_ARCHS" ]]; then OUT_DIR="$BASE_DIR/cuda-${CUDA_ARCHS//;/-}"; else OUT_DIR="$BASE_DIR"; fi
fi
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
BIN_DIR="$OUT_DIR/bin"

print_result() {
    echo "llama-server: $BIN_DIR/llama-server"
    echo "llama-bench:  $BIN_DIR/llama-bench"
    "$BIN_DIR/llama-server" --version 2>&1 | grep -i -m1 version || true
}

if [[ $FORCE -eq 0 && -x "$BIN_DIR/llama-server" && -x "$BIN_DIR/llama-bench" ]]; then
    log "binaries already built (use --force to rebuild)"
    print_result
    exit 0
fi

installed_version() {
    # importlib.metadata, not `pip show`: it answers for the interpreter we run, without pip's slow startup.
    "$PYTHON" - <<'EOF'
import importlib.metadata as md
try:
    print(md.version("llama-cpp-python"))
except md.PackageNotFoundError:
    pass
EOF
}

fetch_sdist() {
    # Download the exact sdist of the installed version (no wheel: only the sdist carries vendor/llama.cpp).
    local ver="$1" src_dir="$BASE_DIR/sdist"  # not src/: that is a directory of the CMake build tree
    local unpacked="$src_dir/llama_cpp_python-$ver"
    if [[ -f "$unpacked/vendor/llama.cpp/CMakeLists.txt" ]]; then echo "$unpacked"; return; fi
    mkdir -p "$src_dir"
    log "downloading llama-cpp-python==$ver sdist into $src_dir"
    "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$src_dir" \
        "llama-cpp-python==$ver" >&2 || die "pip download of llama-cpp-python==$ver failed"
    local tarball
    tarball="$(ls "$src_dir"/llama_cpp_python-"$ver".tar.gz 2>/dev/null || true)"
    [[ -n "$tarball" ]] || die "sdist tarball not found in $src_dir"
    tar -xzf "$tarball" -C "$src_dir"
    [[ -f "$unpacked/vendor/llama.cpp/CMakeLists.txt" ]] || die "no vendor/llama.cpp in $unpacked"
    echo "$unpacked"
}

if [[ -n "$SDIST_DIR" ]]; then
    SDIST_DIR="$(cd "$SDIST_DIR" && pwd)"
    INSTALLED="$(installed_version)"
    SDIST_VER="$(sed -n 's/^Version: //p' "$SDIST_DIR/PKG-INFO" 2>/dev/null | head -1)"
    if [[ -n "$INSTALLED" && -n "$SDIST_VER" && "$INSTALLED" != "$SDIST_VER" ]]; then
        log "WARNING: sdist is $SDIST_VER but llama-cpp-python $INSTALLED is installed (ctypes layouts may differ)"
    fi
else
    [[ -n "$VERSION" ]] || VERSION="$(installed_version)"
    [[ -n "$VERSION" ]] || die "llama-cpp-python is not installed for $PYTHON; pass --version VER or --sdist-dir DIR"
    SDIST_DIR="$(fetch_sdist "$VERSION")"
fi
LLAMA_SRC="$SDIST_DIR/vendor/llama.cpp"
[[ -f "$LLAMA_SRC/CMakeLists.txt" ]] || die "$LLAMA_SRC/CMakeLists.txt not found"

# Ninja if present (faster no-op rebuilds); otherwise try pip's ninja, else fall back to make.
GENERATOR=()
if ! command -v ninja >/dev/null 2>&1; then
    log "ninja not found; trying 'pip install ninja'"
    "$PYTHON" -m pip install --quiet ninja >&2 || log "pip install ninja failed; using make"
    hash -r
fi
if command -v ninja >/dev/null 2>&1; then GENERATOR=(-G Ninja); fi
# An existing tree configured with another generator cannot be reconfigured with a new one.
if [[ -f "$OUT_DIR/CMakeCache.txt" ]]; then
    CACHED_GEN="$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$OUT_DIR/CMakeCache.txt")"
    if [[ "$CACHED_GEN" == "Ninja" ]]; then GENERATOR=(-G Ninja); else GENERATOR=(); fi
fi

CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DLLAMA_CURL=OFF                 # no model downloads: we pass local .gguf paths
    -DLLAMA_OPENSSL=OFF              # loopback HTTP only
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_USE_PREBUILT_UI=OFF      # the prebuilt web UI is fetched from the network at configure time
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
)
if [[ -n "$CUDA_ARCHS" ]]; then
    # sm_70 (V100) needs a CUDA 12.x toolkit: CUDA 13 cannot target compute capability 7.0.
    command -v nvcc >/dev/null 2>&1 || log "WARNING: nvcc not on PATH; CMake may not find the CUDA toolkit"
    CMAKE_ARGS+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS")
fi

START=$(date +%s)
log "configuring $LLAMA_SRC -> $OUT_DIR (${CUDA_ARCHS:+CUDA $CUDA_ARCHS}${CUDA_ARCHS:-CPU})"
cmake -S "$LLAMA_SRC" -B "$OUT_DIR" "${GENERATOR[@]}" "${CMAKE_ARGS[@]}" >&2
log "building llama-server llama-bench with $JOBS jobs"
cmake --build "$OUT_DIR" --target llama-server llama-bench -j "$JOBS" >&2
END=$(date +%s)

[[ -x "$BIN_DIR/llama-server" && -x "$BIN_DIR/llama-bench" ]] || die "build finished but binaries missing in $BIN_DIR"
{
    echo "sdist=$SDIST_DIR"
    echo "commit=$(git -C "$LLAMA_SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "cuda_archs=${CUDA_ARCHS:-none}"
    echo "cmake_args=${CMAKE_ARGS[*]}"
    echo "build_seconds=$((END - START))"
    echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$OUT_DIR/BUILD_INFO"
log "built in $((END - START)) s"
print_result
