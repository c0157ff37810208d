#!/usr/bin/env bash
# Downloads the llama-cpp-python sdist from PyPI (it vendors llama.cpp) and
# unpacks only its llama.cpp source into $KVCACHE_CACHE_DIR/llama.cpp/src-<version>
# (no build). The tokenizer tests read llama.cpp's vocabulary test vectors
# (models/ggml-vocab-*.gguf{,.inp,.out}) from there. Prints the directory;
# does nothing when it is already there.
# Environment: LLAMACPP_PY_VERSION (0.3.36).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

VERSION=${LLAMACPP_PY_VERSION:-0.3.36}
ROOT="$KVCACHE_CACHE_DIR/llama.cpp"
SRC="$ROOT/src-$VERSION"

if [ -f "$SRC/CMakeLists.txt" ] && [ -f "$SRC/models/ggml-vocab-llama-spm.gguf.out" ]; then
  echo "$SRC"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log "downloading the llama-cpp-python $VERSION sdist from PyPI (it vendors llama.cpp)"
python3 -m pip download --quiet --no-deps --no-binary :all: --dest "$tmp" "llama-cpp-python==$VERSION"
tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
mkdir -p "$ROOT"
rm -rf "$SRC.partial"
mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC.partial"
rm -rf "$SRC"
mv "$SRC.partial" "$SRC"
log "llama.cpp source saved: $SRC"
echo "$SRC"
