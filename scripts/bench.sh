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
  if "$bin" --json "$tmp"; then
    name=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["benchmark"])' "$tmp")
    mv "$tmp" "$out/$name.json"
  else
    log "benchmark $bench failed"
    failed=1
  fi
done < "$list"
log "reports in $out: $(cd "$out" && ls ./*.json 2>/dev/null | tr '\n' ' ')"
exit $failed
