#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-server, llama-bench, llama-quantize) from
# the llama.cpp source that the llama-cpp-python sdist on PyPI vendors, for the
# machine it runs on (GGML_NATIVE=ON), and prints the build's bin directory.
# Cached under $KVCACHE_CACHE_DIR/llama.cpp/<version>-<flavour>; safe to re-run.
#
# Usage: tests/bench/build_llamacpp.sh [native|avx2]
#   native: -DGGML_NATIVE=ON (every instruction set this CPU has)
#   avx2:   -DGGML_NATIVE=OFF with AVX2/FMA/F16C and without AVX-512, to compare
#           kernel levels on an AVX-512 machine
# Environment: LLAMACPP_PY_VERSION (0.3.36), JOBS (nproc).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

FLAVOUR=${1:-native}
VERSION=${LLAMACPP_PY_VERSION:-0.3.36}
JOBS=${JOBS:-$(nproc)}
ROOT="$KVCACHE_CACHE_DIR/llama.cpp"
BUILD="$ROOT/$VERSION-$FLAVOUR"
TOOLS=(llama-server llama-bench llama-quantize)

case "$FLAVOUR" in
  native) FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF) ;;
  *) log "unknown flavour $FLAVOUR (native or avx2)"; exit 2 ;;
esac

built=1
for t in "${TOOLS[@]}"; do [ -x "$BUILD/bin/$t" ] || built=0; done
if [ $built = 1 ]; then
  echo "$BUILD/bin"
  exit 0
fi

SRC=$(LLAMACPP_PY_VERSION=$VERSION scripts/fetch_llamacpp_src.sh)  # the sdist's llama.cpp, fetched once
log "building ${TOOLS[*]} ($FLAVOUR) in $BUILD"
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF "${FLAGS[@]}" >"$BUILD.cmake.log" 2>&1 ||
  { cat "$BUILD.cmake.log" >&2; exit 1; }
cmake --build "$BUILD" -j "$JOBS" --target "${TOOLS[@]}" >"$BUILD.build.log" 2>&1 ||
  { tail -50 "$BUILD.build.log" >&2; exit 1; }
echo "$BUILD/bin"
