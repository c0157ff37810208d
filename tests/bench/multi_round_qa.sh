#!/usr/bin/env bash
# Multi-round QA benchmark (issue #10): the same workload (tests/bench/multi_round_qa.py)
# through a kvcache router over two workers with placement (a) affinity, (b)
# round_robin, (c) random, and (d) against llama.cpp's OpenAI server
# (llama-cpp-python), on this machine with the same total threads. Writes
# OUTDIR/multi_round_qa.json with per-mode metrics and the ratios
# affinity_vs_{roundrobin,random,llamacpp}_ttft_p50 (baseline p50 / affinity p50).
#
# Tier 0 of each worker holds FRACTION (0.6) of half the workload's working set
# (every user's final history, counted per user; at least two users' longest
# contexts) and tier 1 (host RAM) TIER1_RATIO (1) times that, so a worker holds
# about 1.2x half the histories: affinity keeps each user's history on one
# worker and fits, round-robin and random make each worker see every user, and
# what they cannot hold they evict and recompute.
#
# Usage: tests/bench/multi_round_qa.sh [OUTDIR]     (default: .)
# Environment: KVCACHE_BUILD_DIR (build), KVCACHE_MODEL, USERS (8), ROUNDS (4),
#   QPS (0.5), THINK_TIME (0 s between a user's rounds), ANSWER_TOKENS (32), SYSTEM_TOKENS (400), USER_CONTEXT_TOKENS (1200), THREADS (2, in total),
#   FRACTION (0.6), TIER1_RATIO (1), MODES ("affinity round_robin random llamacpp"), DURATION (240 s per mode).
# Needs: grpcio and grpcio-tools; for llamacpp, `pip install 'llama-cpp-python[server]'`. Its
# server runs with --interrupt_requests False: by default a new request cuts the
# stream of the running one short, which would make its answers shorter than ours.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

OUT=$(mkdir -p "${1:-.}" && cd "${1:-.}" && pwd)
USERS=${USERS:-8}
ROUNDS=${ROUNDS:-4}
QPS=${QPS:-0.5}
THINK_TIME=${THINK_TIME:-0}
ANSWER_TOKENS=${ANSWER_TOKENS:-32}
SYSTEM_TOKENS=${SYSTEM_TOKENS:-400}
USER_CONTEXT_TOKENS=${USER_CONTEXT_TOKENS:-1200}
QUESTION_TOKENS=${QUESTION_TOKENS:-50,100}
THREADS=${THREADS:-2}
FRACTION=${FRACTION:-0.6}
TIER1_RATIO=${TIER1_RATIO:-1}
DURATION=${DURATION:-240}
MODES=${MODES:-affinity round_robin random llamacpp}
# K and V bytes per token of SmolLM2-135M with f16 pages: 2 * 30 layers * 3 KV heads * 64 * 2 bytes.
KV_BYTES_PER_TOKEN=${KV_BYTES_PER_TOKEN:-23040}

WORKER="$KVCACHE_BUILD_DIR/worker/kvcache-worker"
ROUTER="$KVCACHE_BUILD_DIR/router/kvcache-router"
for bin in "$WORKER" "$ROUTER"; do
  [ -x "$bin" ] || { log "missing $bin: build first (cmake --build $KVCACHE_BUILD_DIR)"; exit 1; }
done
[ -s "$KVCACHE_MODEL" ] || { log "missing model $KVCACHE_MODEL: run scripts/setup.sh"; exit 1; }

# Working set: each user's final history (system prompt, every question and
# answer, plus chat-template tokens), in tokens.
qmin=${QUESTION_TOKENS%,*}
qmax=${QUESTION_TOKENS#*,}
ws_tokens=$((USERS * (SYSTEM_TOKENS + USER_CONTEXT_TOKENS + 20 + ROUNDS * ((qmin + qmax) / 2 + ANSWER_TOKENS + 24))))
# At least two users' longest contexts per worker, so that every request fits.
max_context=$((SYSTEM_TOKENS + USER_CONTEXT_TOKENS + 20 + ROUNDS * (qmax + ANSWER_TOKENS + 24)))
tier0=$(python3 -c "print(int(max($FRACTION * $ws_tokens / 2, 2 * $max_context) * $KV_BYTES_PER_TOKEN))")
tier1=$(python3 -c "print(int($tier0 * $TIER1_RATIO))")
worker_threads=$(( THREADS / 2 > 0 ? THREADS / 2 : 1 ))
log "working set ~$ws_tokens tokens ($((ws_tokens * KV_BYTES_PER_TOKEN >> 20)) MiB); tier 0 per worker $((tier0 >> 20)) MiB, tier 1 $((tier1 >> 20)) MiB; $worker_threads thread(s) per worker"

WORK=$(mktemp -d)
PIDS=()
stop_all() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
# shellcheck disable=SC2317  # run by the trap
cleanup() {
  stop_all
  rm -rf "$WORK"
}
trap cleanup EXIT

# start NAME BINARY ARGS...: starts a server on port 0 and sets ADDRESS from its
# "listening grpc=HOST:PORT" line.
start() {
  local name=$1
  shift
  "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  PIDS+=($!)
  local pid=$!
  for _ in $(seq 1 600); do
    ADDRESS=$(sed -n 's/.* listening grpc=\([^ ]*\).*/\1/p' "$WORK/$name.out")
    [ -n "$ADDRESS" ] && return 0
    kill -0 "$pid" 2>/dev/null || { log "$name exited:"; cat "$WORK/$name.err" >&2; exit 1; }
    sleep 0.1
  done
  log "$name did not start"
  exit 1
}

BENCH=(python3 tests/bench/multi_round_qa.py --users="$USERS" --rounds="$ROUNDS" --qps="$QPS" --think_time="$THINK_TIME"
       --answer_tokens="$ANSWER_TOKENS" --system_tokens="$SYSTEM_TOKENS" --question_tokens="$QUESTION_TOKENS"
       --user_context_tokens="$USER_CONTEXT_TOKENS"
       --duration="$DURATION")
failed=0
reports=()
for mode in $MODES; do
  log "mode $mode"
  if [ "$mode" = llamacpp ]; then
    python3 -c 'import llama_cpp.server' 2>/dev/null || {
      log "llama-cpp-python[server] missing: pip install 'llama-cpp-python[server]'"; failed=1; continue; }
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    python3 -m llama_cpp.server --model "$KVCACHE_MODEL" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
      --n_ctx 4096 --interrupt_requests False --host 127.0.0.1 --port "$port" --verbose False >"$WORK/llamacpp.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 1 600); do
      curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && break
      sleep 0.2
    done
    "${BENCH[@]}" --openai_url="http://127.0.0.1:$port/v1" --label=llamacpp --json="$WORK/llamacpp.json" || failed=1
  else
    start w1 "$WORKER" --listen=127.0.0.1:0 --metrics_listen= --worker_id=w1 --model="$KVCACHE_MODEL" \
      --threads="$worker_threads" --tier0_bytes="$tier0" --tier1_bytes="$tier1" --allow_unauthenticated
    w1=$ADDRESS
    start w2 "$WORKER" --listen=127.0.0.1:0 --metrics_listen= --worker_id=w2 --model="$KVCACHE_MODEL" \
      --threads="$worker_threads" --tier0_bytes="$tier0" --tier1_bytes="$tier1" --allow_unauthenticated
    w2=$ADDRESS
    start router "$ROUTER" --listen=127.0.0.1:0 --metrics_listen= --workers="$w1,$w2" --placement="$mode" \
      --allow_unauthenticated
    "${BENCH[@]}" --address="$ADDRESS" --target=router --label="$mode" --json="$WORK/$mode.json" || failed=1
  fi
  stop_all
  [ -s "$WORK/$mode.json" ] && reports+=("$mode=$WORK/$mode.json")
done

if [ ${#reports[@]} -gt 0 ]; then
  python3 tests/bench/multi_round_qa.py --combine "${reports[@]}" --json "$OUT/multi_round_qa.json"
fi
exit $failed
