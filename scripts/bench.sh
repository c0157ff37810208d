#!/usr/bin/env bash
# Runs every benchmark and writes one <benchmark>.json per benchmark into OUTDIR.
# Usage: scripts/bench.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
if [ $# -ne 1 ]; then
  echo "usage: scripts/bench.sh OUTDIR" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
scripts/setup.sh
# engine_bench compares with llama.cpp's own llama-bench, built from the source the
# llama-cpp-python sdist vendors for this machine and, on an AVX-512 machine, also
# without AVX-512 (about 20 minutes each on 2 cores the first time; cached).
# KVCACHE_BENCH_LLAMACPP=0 leaves llama.cpp out.
engine_args=()
if [ "${KVCACHE_BENCH_LLAMACPP:-1}" != 0 ]; then
  engine_args+=(--llama_bench="$(tests/bench/build_llamacpp.sh native | tail -n 1)/llama-bench")
  if grep -qw avx512f /proc/cpuinfo; then
    engine_args+=(--llama_bench_avx2="$(tests/bench/build_llamacpp.sh avx2 | tail -n 1)/llama-bench")
  fi
fi
list="$KVCACHE_BUILD_DIR/benchmarks.txt"
failed=0
while read -r bench; do
  [ -n "$bench" ] || continue
  if [ "$bench" = gpu_bench ] && [ ! -e /dev/nvidiactl ]; then
    log "gpu_bench needs an NVIDIA GPU: run tests/gpu/run.sh on a machine with one"
    continue
  fi
  bin=$(find "$KVCACHE_BUILD_DIR" -type f -name "$bench" -perm -u+x | head -n 1)
  if [ -z "$bin" ]; then
    log "benchmark $bench not built"
    failed=1
    continue
  fi
  # The file name is the report's own "benchmark" field; pass a temporary path
  # and rename so that one benchmark binary may write a report of another name.
  tmp="$out/.$bench.json"
  log "running $bench"
  args=()
  if [ "$bench" = engine_bench ]; then args=("${engine_args[@]}"); fi
  if "$bin" --json "$tmp" "${args[@]}"; then
    name=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["benchmark"])' "$tmp")
    mv "$tmp" "$out/$name.json"
  else
    log "benchmark $bench failed"
    failed=1
  fi
done < "$list"
log "reports in $out: $(cd "$out" && ls ./*.json 2>/dev/null | tr '\n' ' ')"
exit $failed
