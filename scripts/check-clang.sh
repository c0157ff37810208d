#!/usr/bin/env bash
# Builds everything once with clang and -Wthread-safety (lock annotations are
# checked at compile time), then runs each libFuzzer harness for a bounded time.
# Usage: scripts/check-clang.sh [fuzz seconds per harness, default 30]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
FUZZ_SECONDS=${1:-30}
BUILD=${KVCACHE_CLANG_BUILD_DIR:-$PWD/build-clang}
if ! command -v clang++ >/dev/null; then
  log "clang++ not found: run scripts/setup.sh first"
  exit 1
fi
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DKVCACHE_THREAD_SAFETY=ON -DKVCACHE_FUZZERS=ON -DKVCACHE_CUDA=OFF >/dev/null
cmake --build "$BUILD" --parallel "$(nproc)"
log "clang -Wthread-safety build passed"

shopt -s nullglob
for fuzzer in "$BUILD"/tests/fuzz/*_fuzz; do
  name=$(basename "$fuzzer")
  corpus_seed="tests/fuzz/corpus/${name%%_*}"
  work=$(mktemp -d)
  seeds=()
  [ -d "$corpus_seed" ] && seeds=("$corpus_seed")
  log "fuzzing $name for ${FUZZ_SECONDS}s"
  "$fuzzer" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -timeout=10 \
    -artifact_prefix="$work/" "$work" "${seeds[@]}" 2>&1 | tail -n 3
  rm -rf "$work"
done
