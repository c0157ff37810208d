#!/usr/bin/env bash
# Runs the CUDA backend's GPU checks on a machine with an NVIDIA GPU and the CUDA
# toolkit, in one go (sized for one 10-minute device call: the kernel tests and
# gpu_bench took under 8 minutes on an H200 before the later steps were added;
# GPU_STEPS splits the run over two calls if it does not fit):
#   1. build  - cmake + ninja of the GPU tests, gpu_bench and the plugin
#               (-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}) in ${BUILD_DIR:-build-gpu};
#               when the project's host dependencies (gRPC, abseil, GoogleTest...)
#               are missing there, falls back to a prebuilt bundle made by
#               tests/gpu/pack.sh on a development machine (--prebuilt FILE, or
#               .gpu_carry/bundle.tar.xz when present)
#   2. test   - every `gpu`-labelled test (ctest -L gpu, or the bundle's binaries);
#               then (step "sanitizer") cuda_kernels_test under compute-sanitizer's
#               memcheck, when the toolkit has it
#   3. bench  - gpu_bench --json $OUT_DIR/gpu.json; then (step "peer", with the
#               real model) tests/gpu/hf_peer.py: transformers on the same GGUF
#               with its static KV cache (the machine's torch and transformers;
#               gguf and accelerate from the bundle's wheels if missing) into
#               hf.json, and our decode and cached time to first token against it
#               (decode_vs_hf_batch<B>, ttft_cached_vs_hf_recompute in summary.json)
#   4. service - when the real model is here (KVCACHE_MODEL, or the parts
#               tests/gpu/split_model.sh wrote to .gpu_carry/, carried in
#               back-to-back calls and checked against their SHA-256; the tests
#               and the bench then use it too): scripts/run.sh, the main job, with
#               two GPU workers (--device=cuda:0) and a router, into service.log:
#               a multi-user conversation with forks, offload to pinned memory and
#               restore, a migration between the GPU workers, every twin's replies
#               compared token for token (needs openssl and curl on the machine);
#               then (step "qa") a short multi-round QA load, affinity against
#               round-robin over two GPU workers, through the router's HTTP API
#               (tests/bench/multi_round_qa.sh shape a, 4 users x 3 rounds; Python's
#               standard library only) into multi_round_qa.json
#   5. writes $OUT_DIR/summary.json (mode, per-test results and times, the bench
#      ratios, the service result) and copies the logs there.
# Order: the tests; memcheck in the background beside the service (neither is
# timed); then the timed steps alone on the GPU: bench, peer, qa.
# GPU_STEPS (default "tests sanitizer bench peer service qa") picks steps 2-4 (build and
# summary always run), to rerun one of them alone.
# GPU_STOP_ON_TEST_FAILURE=1 skips the peer and qa steps (the long ones) after a
# failed test, to save device time for a rerun.
# GPU_DEADLINE_S (default 540) bounds the whole run: each step's timeout is cut to
# what is left, and a step that would start with under a minute left is skipped
# (said in run.log), so the results reach $OUT inside one device call.
# SERVICE_DEVICE (default cuda:0) is the service's --device; cpu dry-runs the
# service step's plumbing (bundle, joined model, scripts/run.sh) without a GPU.
# HF_PEER_ARGS adds flags to hf_peer.py (e.g. "--device cpu --dtype float32" for
# a dry run).
# Every file goes to a work folder; at exit the results (summary.json, run.log,
# gpu.json, hf.json, multi_round_qa.json) and logs.tar.xz of everything else go
# to $OUT when set (a device call returns at most 8 files), else
# ${BUILD_DIR}/gpu-out.
# Exit status: 0 all passed; 1 a test or the bench failed; 2 no GPU / cannot build.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-gpu}"
FINAL_DIR="${OUT:-$BUILD_DIR/gpu-out}"
OUT_DIR="$(mktemp -d /tmp/kvcache-gpu-out.XXXXXX)"
finish() {
  mkdir -p "$FINAL_DIR"
  for f in summary.json run.log gpu.json hf.json multi_round_qa.json; do
    [[ -f "$OUT_DIR/$f" ]] && cp "$OUT_DIR/$f" "$FINAL_DIR/"
  done
  tar -cJf "$FINAL_DIR/logs.tar.xz" -C "$OUT_DIR" .
}
trap finish EXIT
CUDA_ARCH="${CUDA_ARCH:-90}"
GPU_STEPS="${GPU_STEPS:-tests sanitizer bench peer service qa}"
step() { [[ " $GPU_STEPS " == *" $1 "* ]]; }
PREBUILT=""
MODE=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prebuilt) PREBUILT="$2"; MODE=prebuilt; shift 2 ;;
    --build) MODE=build; shift ;;
    *) echo "usage: $0 [--build | --prebuilt BUNDLE.tar.xz]" >&2; exit 2 ;;
  esac
done
[[ -z "$PREBUILT" && -f "$ROOT/.gpu_carry/bundle.tar.xz" ]] && PREBUILT="$ROOT/.gpu_carry/bundle.tar.xz"
mkdir -p "$OUT_DIR"
START=$(date +%s)
DEADLINE=$(( START + ${GPU_DEADLINE_S:-540} ))
# left CAP: seconds a step may take, CAP at most, up to 15 s before the deadline.
left() { local l=$(( DEADLINE - $(date +%s) - 15 )); (( l > $1 )) && l=$1; (( l < 1 )) && l=1; echo "$l"; }
# has_time STEP: at least a minute left for STEP, else say it was skipped.
has_time() { (( DEADLINE - $(date +%s) >= 60 )) && return 0; log "$1 skipped: under a minute left of GPU_DEADLINE_S"; return 1; }
log() { echo "[gpu/run.sh +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT_DIR/run.log"; }

# --- 0. A GPU? ------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$OUT_DIR/nvidia-smi.txt" 2>&1; then
  log "no NVIDIA GPU found (nvidia-smi missing or failing): these checks need one; nothing was run"
  exit 2
fi
log "GPU: $(head -1 "$OUT_DIR/nvidia-smi.txt")"
NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
[[ -x "$NVCC" ]] && log "nvcc: $("$NVCC" --version | tail -1)"

# --- 1. Build ---------------------------------------------------------------------
TARGETS=(cuda_kernels_test cuda_tier_storage_test cuda_runner_test gpu_bench kvcache_cuda
  kvcache-worker kvcache-router kvcache-demo)
BIN_DIR=""
if [[ "$MODE" != "prebuilt" ]]; then
  if ! command -v cmake >/dev/null || [[ ! -x "$NVCC" ]]; then
    log "cmake or nvcc missing"
  elif cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" >"$OUT_DIR/cmake.log" 2>&1; then
    log "configured; building ${TARGETS[*]}"
    if ninja -C "$BUILD_DIR" -j"$(nproc)" "${TARGETS[@]}" >"$OUT_DIR/build.log" 2>&1; then
      MODE=build
      BIN_DIR="$BUILD_DIR/tests/worker/backend/cuda"
    else
      log "build failed (see build.log)"; tail -30 "$OUT_DIR/build.log"; exit 2
    fi
  else
    log "cmake configure failed (host dependencies missing?): $(grep -m1 -iE 'could not find|error' "$OUT_DIR/cmake.log")"
  fi
fi
if [[ -z "$BIN_DIR" ]]; then
  if [[ -z "$PREBUILT" || ! -f "$PREBUILT" ]]; then
    log "cannot build here and no prebuilt bundle (make one with tests/gpu/pack.sh)"; exit 2
  fi
  MODE=prebuilt
  STAGE="$(mktemp -d /tmp/kvcache-gpu.XXXXXX)"
  tar -xJf "$PREBUILT" -C "$STAGE" || { log "cannot unpack $PREBUILT"; exit 2; }
  BIN_DIR="$STAGE/bin"
  CUBLAS_DIRS="$(python3 - 2>/dev/null <<'PY'
import glob, os, site
dirs = set()
for base in site.getsitepackages():
    for lib in glob.glob(os.path.join(base, "nvidia", "*", "lib")):
        dirs.add(lib)
print(":".join(sorted(dirs)))
PY
)"
  export LD_LIBRARY_PATH="$STAGE/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${CUBLAS_DIRS}:${LD_LIBRARY_PATH:-}"
  log "prebuilt bundle $(cat "$STAGE/BUILD_INFO" 2>/dev/null)"
  if ldd "$BIN_DIR/gpu_bench" | grep -q "not found"; then
    log "missing libraries:"; ldd "$BIN_DIR/gpu_bench" | grep "not found" | tee -a "$OUT_DIR/run.log"; exit 2
  fi
  # Still prove the device's own toolkit compiles the kernels for this GPU
  # (about half a minute; SKIP_DEVICE_NVCC=1 skips it when device time is short).
  if [[ "${SKIP_DEVICE_NVCC:-0}" != 1 && -x "$NVCC" && -d "$STAGE/src" ]]; then
    ok=1
    for cu in "$ROOT"/worker/backend/cuda/*.cu; do
      "$NVCC" -std=c++17 -arch=sm_"$CUDA_ARCH" -I"$ROOT" -I"$STAGE/src/include" -c "$cu" -o /dev/null \
        >>"$OUT_DIR/build.log" 2>&1 || ok=0
    done
    log "device nvcc compile of worker/backend/cuda/*.cu: $([[ $ok == 1 ]] && echo ok || echo FAILED)"
  fi
fi
log "mode=$MODE, binaries in $BIN_DIR"

# The real model: KVCACHE_MODEL, else the parts split_model.sh wrote, joined.
if [[ -z "${KVCACHE_MODEL:-}" && -f "$ROOT/.gpu_carry/model.gguf.sha256" ]]; then
  joined="/tmp/kvcache-model/$(cat "$ROOT/.gpu_carry/model.gguf.name" 2>/dev/null || echo model.gguf)"
  mkdir -p "$(dirname "$joined")"
  cat "$ROOT"/.gpu_carry/model.gguf.part-* >"$joined" 2>/dev/null
  if [[ "$(sha256sum "$joined" | awk '{print $1}')" == "$(cat "$ROOT/.gpu_carry/model.gguf.sha256")" ]]; then
    export KVCACHE_MODEL="$joined"
  else
    log "model parts in .gpu_carry do not join to the recorded SHA-256 (a part missing?); no real model"
  fi
fi
[[ -n "${KVCACHE_MODEL:-}" && -f "$KVCACHE_MODEL" ]] && log "real model: $KVCACHE_MODEL"

# --- 2. GPU tests -----------------------------------------------------------------
export KVCACHE_SOURCE_DIR="$ROOT"  # tests/data for the reference tests
FAILED=0
TESTS_JSON=""
GPU_TESTS=(cuda_kernels_test cuda_tier_storage_test cuda_runner_test)
step tests || GPU_TESTS=()
for t in "${GPU_TESTS[@]}"; do
  has_time "$t" || { FAILED=1; continue; }
  t0=$(date +%s.%N)
  timeout "$(left 300)" "$BIN_DIR/$t" --gtest_output=json:"$OUT_DIR/$t.json" >"$OUT_DIR/$t.log" 2>&1
  rc=$?
  dt=$(python3 -c "print(round($(date +%s.%N) - $t0, 2))" 2>/dev/null || echo 0)
  result=$([[ $rc == 0 ]] && echo passed || echo failed)
  grep -q "SKIPPED" "$OUT_DIR/$t.log" && result="$result (with skips)"
  [[ $rc != 0 ]] && FAILED=1
  log "$t: $result in ${dt}s"
  grep -E "max \||ops:|attention hd|greedy vs|graphs:|FAILED|Failure" "$OUT_DIR/$t.log" | sed 's/^/    /' | tee -a "$OUT_DIR/run.log"
  TESTS_JSON+="${TESTS_JSON:+,}{\"name\":\"$t\",\"result\":\"$result\",\"rc\":$rc,\"seconds\":$dt}"
done

# Memcheck runs beside the service step (neither is timed) and is waited for
# before the timed steps. Not beside the tests: cuda_tier_storage_test's leak
# check reads the device's free memory, which another process moves.
SANITIZER_RC=-1
SANITIZER_PID=""
SANITIZER="$(command -v compute-sanitizer || echo "$(dirname "$NVCC")/compute-sanitizer")"
if step sanitizer && [[ -x "$SANITIZER" ]] && has_time sanitizer; then
  timeout "$(left "${SANITIZER_TIMEOUT_S:-200}")" "$SANITIZER" --tool memcheck --leak-check full --error-exitcode 9 "$BIN_DIR/cuda_kernels_test" \
    >"$OUT_DIR/memcheck.log" 2>&1 &
  SANITIZER_PID=$!
  log "compute-sanitizer memcheck of cuda_kernels_test started"
elif step sanitizer; then
  log "compute-sanitizer not found; memcheck skipped"
fi
finish_sanitizer() {
  [[ -z "$SANITIZER_PID" ]] && return
  wait "$SANITIZER_PID"
  SANITIZER_RC=$?
  SANITIZER_PID=""
  [[ $SANITIZER_RC != 0 ]] && FAILED=1
  log "compute-sanitizer memcheck of cuda_kernels_test: rc=$SANITIZER_RC," \
    "$(grep -m1 'ERROR SUMMARY' "$OUT_DIR/memcheck.log")"
}

# The long timed steps wait for a build whose tests pass.
if [[ $FAILED != 0 && -n "${GPU_STOP_ON_TEST_FAILURE:-}" ]] && { step peer || step qa; }; then
  GPU_STEPS="${GPU_STEPS//peer/}"
  GPU_STEPS="${GPU_STEPS//qa/}"
  log "a test failed: peer and qa skipped (GPU_STOP_ON_TEST_FAILURE)"
fi

# --- 3. Service -------------------------------------------------------------------
SERVICE_RC=-1
TWINS=0
SERVICE_BUILD="$([[ "$MODE" == prebuilt ]] && echo "$STAGE/build" || echo "$BUILD_DIR")"
if ! step service || ! has_time service; then
  :
elif [[ -n "${KVCACHE_MODEL:-}" && -f "$KVCACHE_MODEL" && -x "$SERVICE_BUILD/worker/kvcache-worker" ]]; then
  KVCACHE_DEMO_DEVICE="${SERVICE_DEVICE:-cuda:0}" KVCACHE_SKIP_SETUP=1 KVCACHE_BUILD_DIR="$SERVICE_BUILD" \
    timeout "$(left 240)" "$ROOT/scripts/run.sh" >"$OUT_DIR/service.log" 2>&1
  SERVICE_RC=$?
  TWINS=$(grep -c "identical to its twin's: yes" "$OUT_DIR/service.log")
  [[ $SERVICE_RC != 0 ]] && FAILED=1
  log "service (scripts/run.sh: two workers --device=${SERVICE_DEVICE:-cuda:0}, a router): rc=$SERVICE_RC," \
    "twins identical: $TWINS"
  grep -E "cache counters|kvcache_(offload|restore|migration)_bytes_total" "$OUT_DIR/service.log" | sed 's/^/    /' |
    tee -a "$OUT_DIR/run.log"
else
  log "service step skipped: no real model here (KVCACHE_MODEL, or tests/gpu/split_model.sh's parts)"
fi

finish_sanitizer

# --- 4. Benchmark -----------------------------------------------------------------
BENCH_RC=-1
if step bench && has_time bench; then
  timeout "$(left 240)" "$BIN_DIR/gpu_bench" --json "$OUT_DIR/gpu.json" >"$OUT_DIR/gpu_bench.log" 2>&1
  BENCH_RC=$?
  [[ $BENCH_RC != 0 ]] && FAILED=1
  log "gpu_bench rc=$BENCH_RC"
  tee -a "$OUT_DIR/run.log" <"$OUT_DIR/gpu_bench.log"
fi

PEER_RC=-1
if step peer && has_time peer && [[ -n "${KVCACHE_MODEL:-}" && -f "$KVCACHE_MODEL" ]]; then
  if ! python3 -c "import gguf, accelerate" 2>/dev/null && [[ -n "${STAGE:-}" && -d "$STAGE/wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/kvcache-py "$STAGE"/wheels/*.whl \
      >>"$OUT_DIR/hf_peer.log" 2>&1
    export PYTHONPATH="/tmp/kvcache-py${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # shellcheck disable=SC2086  # HF_PEER_ARGS: extra flags, split on spaces
  timeout "$(left 300)" python3 "$ROOT/tests/gpu/hf_peer.py" --model "$KVCACHE_MODEL" --json "$OUT_DIR/hf.json" \
    ${HF_PEER_ARGS:-} >>"$OUT_DIR/hf_peer.log" 2>&1
  PEER_RC=$?
  log "transformers peer (hf_peer.py): rc=$PEER_RC"
  grep -vE "it/s\]|^\s*$" "$OUT_DIR/hf_peer.log" | tail -6 | sed 's/^/    /' | tee -a "$OUT_DIR/run.log"
fi

QA_RC=-1
if step qa && has_time qa && [[ -n "${KVCACHE_MODEL:-}" && -f "$KVCACHE_MODEL" && -x "$SERVICE_BUILD/worker/kvcache-worker" ]]; then
  SHAPES=a MODES="affinity_http round_robin_http" TOKEN_BUDGET_SHAPES="" A_USERS=4 A_ROUNDS=3 THREADS=8 DURATION=90 \
    WORKER_FLAGS="--device=${SERVICE_DEVICE:-cuda:0}" KVCACHE_BUILD_DIR="$SERVICE_BUILD" \
    timeout "$(left 300)" "$ROOT/tests/bench/multi_round_qa.sh" "$OUT_DIR/qa" >"$OUT_DIR/qa.log" 2>&1
  QA_RC=$?
  [[ -f "$OUT_DIR/qa/multi_round_qa.json" ]] && cp "$OUT_DIR/qa/multi_round_qa.json" "$OUT_DIR/"
  [[ $QA_RC != 0 ]] && FAILED=1
  log "multi-round QA, affinity vs round-robin on GPU workers: rc=$QA_RC"
  grep -E "affinity_vs_round_robin_http_(ttft|output)" "$OUT_DIR/qa.log" | sed 's/^/    /' | tee -a "$OUT_DIR/run.log"
fi

# --- 5. Summary -------------------------------------------------------------------
# gpu_bench's ratios, and ours against the transformers peer (above 1: we are faster).
RATIOS="$(OUT_DIR="$OUT_DIR" python3 - <<'PY' 2>/dev/null || echo '{}'
import json, os
out = os.environ["OUT_DIR"]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
gpu, hf = load("gpu.json"), load("hf.json").get("metrics", {})
ratio = dict(gpu.get("ratio", {}))
ours = gpu.get("metrics", {})
for b in (1, 16, 64):
    theirs = hf.get(f"hf_decode_tokens_per_s_batch{b}")
    if theirs and ours.get(f"decode_tokens_per_s_batch{b}"):
        ratio[f"decode_vs_hf_batch{b}"] = ours[f"decode_tokens_per_s_batch{b}"] / theirs
if hf.get("hf_ttft_recompute_2000_ms") and ours.get("ttft_cached_history2000_ms"):
    ratio["ttft_cached_vs_hf_recompute"] = hf["hf_ttft_recompute_2000_ms"] / ours["ttft_cached_history2000_ms"]
print(json.dumps(ratio))
PY
)"
cat >"$OUT_DIR/summary.json" <<JSON
{"mode":"$MODE","gpu":"$(head -1 "$OUT_DIR/nvidia-smi.txt" | sed 's/"/ /g')","tests":[${TESTS_JSON}],"bench_rc":$BENCH_RC,"ratio":$RATIOS,"memcheck_rc":$SANITIZER_RC,"peer_rc":$PEER_RC,"service_rc":$SERVICE_RC,"qa_rc":$QA_RC,"service_twins_identical":$TWINS,"seconds":$(( $(date +%s) - START )),"ok":$([[ $FAILED == 0 ]] && echo true || echo false)}
JSON
log "summary: $(cat "$OUT_DIR/summary.json")"
exit $FAILED
