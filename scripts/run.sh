#!/usr/bin/env bash
# The main job: sets up, starts one router and two CPU workers on loopback with
# the bundled SmolLM2, runs a scripted multi-user, multi-turn chat through the
# router (printing, per turn, the worker, cached tokens, time to first token and
# tokens/s), squeezes memory and migrates a session mid-conversation, checks the
# conversation continues with identical output, and stops everything it started.
#
# Workers get a small tier-0 budget (KVCACHE_DEMO_TIER0_BYTES, default 12 MiB =
# 34 SmolLM2 pages of 16 tokens) so that the six conversations do not all fit and
# cold pages are offloaded to host RAM and restored.
#
# KVCACHE_DEMO_DEVICE (default cpu) is the workers' --device: cuda:0 runs the
# same conversation on two GPU workers sharing GPU 0 (tier 0 in device memory,
# tier 1 pinned). KVCACHE_SKIP_SETUP=1 skips scripts/setup.sh, for a machine that
# has prebuilt binaries in KVCACHE_BUILD_DIR and the model at KVCACHE_MODEL but
# no package registry (tests/gpu/run.sh on a GPU machine).
#
# The router also serves its OpenAI-compatible HTTP API (--http_listen); the
# script prints its address and token and sends it one chat request. With
# --serve it keeps everything running after the demo, until Ctrl-C, for the
# README's curl and openai examples.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
SERVE=0
if [ "${1:-}" = "--serve" ]; then SERVE=1; fi
if [ "${KVCACHE_SKIP_SETUP:-0}" != 1 ]; then scripts/setup.sh; fi
DEVICE=${KVCACHE_DEMO_DEVICE:-cpu}

TIER0=${KVCACHE_DEMO_TIER0_BYTES:-$((12 << 20))}
THREADS=${KVCACHE_DEMO_THREADS:-$(nproc)}
RUN_DIR=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT INT TERM

# start NAME BINARY ARGS...: runs a server on port 0 and waits for its
# "listening grpc=HOST:PORT metrics=HOST:PORT" line; sets ADDR_<NAME>, METRICS_<NAME>.
start() {
  local name=$1 bin=$2
  shift 2
  "$KVCACHE_BUILD_DIR/$bin" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 "$@" \
    >"$RUN_DIR/$name.out" 2>"$RUN_DIR/$name.log" &
  pids+=($!)
  local line=""
  for _ in $(seq 600); do
    line=$(grep -m1 ' listening ' "$RUN_DIR/$name.out" 2>/dev/null || true)
    [ -n "$line" ] && break
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$RUN_DIR/$name.log" >&2; log "$name exited"; exit 1; }
    sleep 0.1
  done
  [ -n "$line" ] || { cat "$RUN_DIR/$name.log" >&2; log "$name did not start"; exit 1; }
  local grpc=${line#*grpc=}; grpc=${grpc%% *}
  local metrics=${line#*metrics=}; metrics=${metrics%% *}
  printf -v "ADDR_$name" '%s' "$grpc"
  printf -v "METRICS_$name" '%s' "$metrics"
  if [[ $line == *" http="* ]]; then
    local http=${line#* http=}
    printf -v "HTTP_$name" '%s' "${http%% *}"
  fi
  log "$name serving on $grpc (metrics http://$metrics/metrics)"
}

# Authentication as in production: a cluster token that workers require of
# every caller (the router, and each other when migrating), and a client token
# with admin rights for the demo (it forks and migrates sessions).
umask 077
openssl rand -hex 32 >"$RUN_DIR/cluster-token"
DEMO_TOKEN=$(openssl rand -hex 16)
echo "$DEMO_TOKEN default admin" >"$RUN_DIR/client-tokens"

log "starting two workers (--device=$DEVICE, tier 0: $((TIER0 >> 20)) MiB each, $THREADS threads) and a router"
start w0 worker/kvcache-worker --worker_id=w0 --device="$DEVICE" --tier0_bytes="$TIER0" --threads="$THREADS" \
  --model="$KVCACHE_MODEL" --cluster_token_file="$RUN_DIR/cluster-token"
start w1 worker/kvcache-worker --worker_id=w1 --device="$DEVICE" --tier0_bytes="$TIER0" --threads="$THREADS" \
  --model="$KVCACHE_MODEL" --cluster_token_file="$RUN_DIR/cluster-token"
start router router/kvcache-router --workers="$ADDR_w0,$ADDR_w1" --min_ready_workers=2 \
  --rebalance_interval=0s --model="$KVCACHE_MODEL" --http_listen=127.0.0.1:0 \
  --cluster_token_file="$RUN_DIR/cluster-token" --auth_tokens_file="$RUN_DIR/client-tokens"

status=0
"$KVCACHE_BUILD_DIR/router/kvcache-demo" --router="$ADDR_router" --token="$DEMO_TOKEN" || status=$?

echo
log "cache counters from the workers' /metrics:"
for w in w0 w1; do
  var="METRICS_$w"
  curl -s "http://${!var}/metrics" | grep -E '^kvcache_(offload|restore|migration)_bytes_total|^kvcache_prefix_(hit|query)_tokens_total|^kvcache_preemptions_total' \
    | sed "s/^/  $w  /"
done

MODEL_NAME=$(basename "$KVCACHE_MODEL" .gguf)
log "OpenAI-compatible HTTP API of the router: http://$HTTP_router/v1 (model $MODEL_NAME)"
echo "  export KVCACHE_HTTP=http://$HTTP_router KVCACHE_TOKEN=$DEMO_TOKEN"
echo "  curl -s \$KVCACHE_HTTP/v1/chat/completions -H \"Authorization: Bearer \$KVCACHE_TOKEN\" \\"
echo "    -H 'Content-Type: application/json' -d '{\"model\": \"$MODEL_NAME\", \"max_tokens\": 24,"
echo "    \"messages\": [{\"role\": \"user\", \"content\": \"What is a KV cache?\"}]}'"
curl -sf "http://$HTTP_router/v1/chat/completions" -H "Authorization: Bearer $DEMO_TOKEN" \
  -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL_NAME\", \"max_tokens\": 24, \"messages\": [{\"role\": \"user\", \"content\": \"What is a KV cache?\"}]}" \
  | sed 's/^/  -> /' || status=1
echo
if [ "$SERVE" = 1 ]; then
  log "serving until Ctrl-C (--serve)"
  wait "${pids[@]}" || true
fi
log "stopping everything this script started"
exit $status
