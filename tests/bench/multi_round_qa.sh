#!/usr/bin/env bash
# Multi-round QA load benchmark, one command, one run: every workload shape and
# every mode below run in this one invocation (each report carries the run's id,
# and tests/bench/multi_round_qa.py --combine refuses reports of different runs).
# Writes OUTDIR/multi_round_qa.json (every mode's figures and, per shape, every
# ratio of affinity against the other modes, favourable or not) and the per-mode
# reports beside it.
#
# Shapes (SHAPES, default "a b c a4 b4"; each value below can be overridden with
# <SHAPE>_<VAR>, e.g. B_USERS=4):
#   a  the original workload (README's earlier table): 8 users x 6 rounds, a
#      400-token shared system prompt, 1,200 tokens of private notes per user,
#      questions of 50-100 tokens, 32-token answers, a new user every 4 s, 3 s
#      between a user's rounds; tier 1 = tier 0
#   b  vLLM production-stack's multi-round QA shape scaled to this machine: a
#      ~1,000-token shared system prompt, a long per-user history (2,000 tokens
#      of notes), ~100-token answers: 6 users x 4 rounds, a new user every 4 s,
#      3 s between rounds
#   c  shape a with tier 1 twice tier 0 (TIER1_RATIO=2): made for round-robin
#      to keep most histories in host RAM (it cannot since a session lives on
#      one worker: the copy a moved session leaves behind is closed)
#   a4, b4  shapes a and b on a fleet of four workers (WORKERS=4) of one thread
#      each, oversubscribing THREADS=2 cores twice: a user's turns under
#      round-robin meet each worker once per four turns, not every other turn.
#      Modes affinity and round_robin only (<SHAPE>_MODES).
# Tier 0 of each worker holds FRACTION (0.6) of the shape's working set divided by
# the workers (every user's final history; at least two users' longest contexts)
# and tier 1 TIER1_RATIO times that.
#
# Modes (MODES, default "affinity affinity_http round_robin llama_server"):
#   affinity, round_robin, random   a kvcache router (--placement=...) over two
#                                   workers, driven over gRPC
#   affinity_http (round_robin_http, random_http)
#                                   the same router driven through its OpenAI
#                                   HTTP API (the client path of llama-server;
#                                   needs no grpcio)
#   affinity_token_budget           affinity with --max_step_ms=-1 (prefill chunks
#                                   bounded by --max_batch_tokens only), shape a
#                                   only unless TOKEN_BUDGET_SHAPES says otherwise
#   llama_server                    llama.cpp's own llama-server, built for this
#                                   machine from the source the llama-cpp-python
#                                   sdist vendors (tests/bench/build_llamacpp.sh),
#                                   --parallel = USERS slots, continuous batching,
#                                   prompt cache reuse, THREADS threads
#   llamacpp_py                     llama-cpp-python's server (one slot), if
#                                   installed: `pip install 'llama-cpp-python[server]'`
# The kvcache workers together get THREADS threads (THREADS/WORKERS each, at least
# one), as does llama-server.
#
# Usage: tests/bench/multi_round_qa.sh [OUTDIR]     (default: .)
# Environment: KVCACHE_BUILD_DIR (build), KVCACHE_MODEL, SHAPES, MODES, THREADS (2),
#   DURATION (240 s per mode at most), FRACTION (0.6), TOKEN_BUDGET_SHAPES ("a"; empty: none),
#   WORKER_FLAGS (more kvcache worker flags, e.g. --device=cuda:0 on a GPU),
#   ROUTER_FLAGS (more kvcache router flags, e.g. --session_balance=1).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

OUT=$(mkdir -p "${1:-.}" && cd "${1:-.}" && pwd)
SHAPES=${SHAPES:-a b c a4 b4}
MODES=${MODES:-affinity affinity_http round_robin llama_server}
TOKEN_BUDGET_SHAPES=${TOKEN_BUDGET_SHAPES-a}
THREADS=${THREADS:-2}
DURATION=${DURATION:-240}
FRACTION=${FRACTION:-0.6}
read -r -a WORKER_EXTRA <<<"${WORKER_FLAGS:-}"
read -r -a ROUTER_EXTRA <<<"${ROUTER_FLAGS:-}"
# K and V bytes per token of SmolLM2-135M with f16 pages: 2 * 30 layers * 3 KV heads * 64 * 2 bytes.
KV_BYTES_PER_TOKEN=${KV_BYTES_PER_TOKEN:-23040}
RUN_ID=$(python3 -c 'import uuid; print(uuid.uuid4())')

WORKER="$KVCACHE_BUILD_DIR/worker/kvcache-worker"
ROUTER="$KVCACHE_BUILD_DIR/router/kvcache-router"
for bin in "$WORKER" "$ROUTER"; do
  [ -x "$bin" ] || { log "missing $bin: build first (cmake --build $KVCACHE_BUILD_DIR)"; exit 1; }
done
[ -s "$KVCACHE_MODEL" ] || { log "missing model $KVCACHE_MODEL: run scripts/setup.sh"; exit 1; }
LLAMA_BIN=""
if [[ " $MODES " == *" llama_server "* ]]; then
  LLAMA_BIN=$(tests/bench/build_llamacpp.sh native) || { log "cannot build llama-server"; exit 1; }
fi

# shape_var SHAPE VAR DEFAULT: $<SHAPE>_<VAR> if set, else DEFAULT.
shape_var() {
  local name
  name="$(echo "$1" | tr '[:lower:]' '[:upper:]')_$2"
  echo "${!name:-$3}"
}

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

# start NAME BINARY ARGS...: starts a server on port 0 and sets ADDRESS (and
# HTTP_ADDRESS when it serves HTTP) from its "listening grpc=HOST:PORT" line.
start() {
  local name=$1
  shift
  "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  PIDS+=($!)
  local pid=$!
  for _ in $(seq 1 600); do
    ADDRESS=$(sed -n 's/.* listening grpc=\([^ ]*\).*/\1/p' "$WORK/$name.out")
    HTTP_ADDRESS=$(sed -n 's/.* http=\([^ ]*\).*/\1/p' "$WORK/$name.out")
    [ -n "$ADDRESS" ] && return 0
    kill -0 "$pid" 2>/dev/null || { log "$name exited:"; cat "$WORK/$name.err" >&2; exit 1; }
    sleep 0.1  # an external process's start: no event to wait on
  done
  log "$name did not start"
  exit 1
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_http URL: until it answers 200 (a server loading its model).
wait_http() {
  for _ in $(seq 1 1200); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  log "$1 did not come up"
  return 1
}

failed=0
reports=()
for shape in $SHAPES; do
  shape_modes=$MODES
  case $shape in
    #      users rounds qps answer system notes questions tier1_ratio think workers
    a) d=(8 6 0.25 32 400 1200 "50,100" 1 3 2) ;;
    b) d=(6 4 0.25 100 1000 2000 "50,100" 1 3 2) ;;
    c) d=(8 6 0.25 32 400 1200 "50,100" 2 3 2) ;;
    a4) d=(8 6 0.25 32 400 1200 "50,100" 1 3 4); shape_modes="affinity round_robin" ;;
    b4) d=(6 4 0.25 100 1000 2000 "50,100" 1 3 4); shape_modes="affinity round_robin" ;;
    *) log "unknown shape $shape"; exit 2 ;;
  esac
  USERS=$(shape_var "$shape" USERS "${d[0]}")
  ROUNDS=$(shape_var "$shape" ROUNDS "${d[1]}")
  QPS=$(shape_var "$shape" QPS "${d[2]}")
  ANSWER_TOKENS=$(shape_var "$shape" ANSWER_TOKENS "${d[3]}")
  SYSTEM_TOKENS=$(shape_var "$shape" SYSTEM_TOKENS "${d[4]}")
  USER_CONTEXT_TOKENS=$(shape_var "$shape" USER_CONTEXT_TOKENS "${d[5]}")
  QUESTION_TOKENS=$(shape_var "$shape" QUESTION_TOKENS "${d[6]}")
  TIER1_RATIO=$(shape_var "$shape" TIER1_RATIO "${d[7]}")
  THINK_TIME=$(shape_var "$shape" THINK_TIME "${d[8]}")
  WORKERS=$(shape_var "$shape" WORKERS "${d[9]}")
  worker_threads=$(( THREADS / WORKERS > 0 ? THREADS / WORKERS : 1 ))
  # Working set: each user's final history (system prompt, notes, every question
  # and answer, plus chat-template tokens), in tokens.
  qmin=${QUESTION_TOKENS%,*}
  qmax=${QUESTION_TOKENS#*,}
  ws_tokens=$((USERS * (SYSTEM_TOKENS + USER_CONTEXT_TOKENS + 20 + ROUNDS * ((qmin + qmax) / 2 + ANSWER_TOKENS + 24))))
  max_context=$((SYSTEM_TOKENS + USER_CONTEXT_TOKENS + 20 + ROUNDS * (qmax + ANSWER_TOKENS + 24)))
  tier0=$(python3 -c "print(int(max($FRACTION * $ws_tokens / $WORKERS, 2 * $max_context) * $KV_BYTES_PER_TOKEN))")
  tier1=$(python3 -c "print(int($tier0 * $TIER1_RATIO))")
  log "shape $shape: $USERS users x $ROUNDS rounds, system $SYSTEM_TOKENS, notes $USER_CONTEXT_TOKENS," \
    "answers $ANSWER_TOKENS, qps $QPS; working set ~$ws_tokens tokens; tier 0 per worker $((tier0 >> 20)) MiB," \
    "tier 1 $((tier1 >> 20)) MiB; $WORKERS workers of $worker_threads thread(s)"
  BENCH=(python3 tests/bench/multi_round_qa.py --users="$USERS" --rounds="$ROUNDS" --qps="$QPS" --think_time="$THINK_TIME"
         --answer_tokens="$ANSWER_TOKENS" --system_tokens="$SYSTEM_TOKENS" --question_tokens="$QUESTION_TOKENS"
         --user_context_tokens="$USER_CONTEXT_TOKENS" --duration="$DURATION" --run_id="$RUN_ID")
  modes=$(shape_var "$shape" MODES "$shape_modes")
  if [[ " $TOKEN_BUDGET_SHAPES " == *" $shape "* ]] && [[ " $modes " != *" affinity_token_budget "* ]]; then
    modes="$modes affinity_token_budget"
  fi
  for mode in $modes; do
    log "shape $shape, mode $mode"
    json="$WORK/$shape-$mode.json"
    requests="$OUT/multi_round_qa_$shape-$mode.requests.jsonl"
    case $mode in
      llama_server)
        port=$(free_port)
        # --parallel slots share -c: each slot holds the longest conversation.
        args=(-m "$KVCACHE_MODEL" -t "$THREADS" -tb "$THREADS" --parallel "$USERS"
              -c $(( USERS * (max_context + 256) )) --cont-batching --cache-reuse 256 --host 127.0.0.1 --port "$port")
        started=0
        # Weight repacking picks AMX kernels on CPUs that advertise AMX; on a VM
        # that does not grant AMX they crash at the first matmul (seen: SIGSEGV
        # in ggml_backend_amx_mul_mat). Then run without repacking, and say so.
        for extra in "" --no-repack; do
          # shellcheck disable=SC2086  # $extra is one flag or none
          "$LLAMA_BIN/llama-server" "${args[@]}" $extra >"$WORK/llama-server-$shape.log" 2>&1 &
          pid=$!
          PIDS+=("$pid")
          for _ in $(seq 1 1200); do
            curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && { started=1; break; }
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2  # an external process's start: no event to wait on
          done
          [ $started = 1 ] && break
          log "llama-server ${extra:-(default flags)} did not start: $(tail -c 300 "$WORK/llama-server-$shape.log")"
        done
        [ $started = 1 ] || { failed=1; stop_all; continue; }
        info=$(grep -m1 -o 'system_info:.*' "$WORK/llama-server-$shape.log" || true)
        "${BENCH[@]}" --openai_url="http://127.0.0.1:$port/v1" --openai_ignore_eos --label="$mode" \
          --requests_jsonl="$requests" \
          --server_note="llama-server from the llama-cpp-python ${LLAMACPP_PY_VERSION:-0.3.36} sdist ($("$LLAMA_BIN/llama-server" --version 2>&1 | head -1)), flags: ${args[*]} $extra; $info" \
          --json="$json" || failed=1
        ;;
      llamacpp_py)
        python3 -c 'import llama_cpp.server' 2>/dev/null || {
          log "llama-cpp-python[server] missing: pip install 'llama-cpp-python[server]'"; failed=1; continue; }
        port=$(free_port)
        # --interrupt_requests False: by default a new request cuts the stream
        # of the running one short, which would make its answers shorter.
        python3 -m llama_cpp.server --model "$KVCACHE_MODEL" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
          --n_ctx $(( max_context + 256 )) --interrupt_requests False --host 127.0.0.1 --port "$port" \
          --verbose False >"$WORK/llamacpp-py-$shape.log" 2>&1 &
        PIDS+=($!)
        wait_http "http://127.0.0.1:$port/v1/models" || { failed=1; stop_all; continue; }
        "${BENCH[@]}" --openai_url="http://127.0.0.1:$port/v1" --label="$mode" --json="$json" \
          --requests_jsonl="$requests" || failed=1
        ;;
      affinity | affinity_http | affinity_token_budget | round_robin | round_robin_http | random | random_http)
        placement=${mode%_http}
        step=("${WORKER_EXTRA[@]}")
        case $mode in
          affinity_token_budget) placement=affinity; step+=(--max_step_ms=-1) ;;
        esac
        workers=()
        for i in $(seq 1 "$WORKERS"); do
          start "w$i" "$WORKER" --listen=127.0.0.1:0 --metrics_listen= --worker_id="w$i" --model="$KVCACHE_MODEL" \
            --threads="$worker_threads" --tier0_bytes="$tier0" --tier1_bytes="$tier1" --allow_unauthenticated "${step[@]}"
          workers+=("$ADDRESS")
        done
        start router "$ROUTER" --listen=127.0.0.1:0 --metrics_listen= --http_listen=127.0.0.1:0 \
          --workers="$(IFS=,; echo "${workers[*]}")" \
          --placement="$placement" --model="$KVCACHE_MODEL" --allow_unauthenticated "${ROUTER_EXTRA[@]}"
        if [[ $mode == *_http ]]; then
          wait_http "http://$HTTP_ADDRESS/ready" || { failed=1; stop_all; continue; }
          model=$(curl -sf "http://$HTTP_ADDRESS/v1/models" |
                  python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
          "${BENCH[@]}" --openai_url="http://$HTTP_ADDRESS/v1" --openai_model="$model" --openai_ignore_eos \
            --label="$mode" --json="$json" --requests_jsonl="$requests" || failed=1
        else
          "${BENCH[@]}" --address="$ADDRESS" --target=router --label="$mode" --json="$json" \
            --requests_jsonl="$requests" || failed=1
        fi
        ;;
      *)
        log "unknown mode $mode"
        exit 2
        ;;
    esac
    stop_all
    for log_file in "$WORK"/w[0-9]*.err "$WORK/router.err" "$WORK/llama-server-$shape.log"; do
      [ -s "$log_file" ] && cp "$log_file" "$OUT/$shape-$mode-$(basename "$log_file")"
    done
    rm -f "$WORK"/w[0-9]*.err "$WORK/router.err"
    if [ -s "$json" ]; then
      cp "$json" "$OUT/multi_round_qa_$shape-$mode.json"
      reports+=("$shape/$mode=$json")
    fi
  done
done

if [ ${#reports[@]} -gt 0 ]; then
  python3 tests/bench/multi_round_qa.py --combine "${reports[@]}" --json "$OUT/multi_round_qa.json"
fi
exit $failed
