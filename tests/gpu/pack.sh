#!/usr/bin/env bash
# Builds the GPU test binaries and gpu_bench here (a development machine with the
# project's dependencies and nvcc, no GPU needed) and packs them with the shared
# libraries a bare CUDA machine may lack into .gpu_carry/bundle.tar.xz, for
# `tests/gpu/run.sh --prebuilt` (run.sh picks the bundle up by itself), together
# with the worker, router and demo for run.sh's service step. The CUDA runtime
# and cuBLAS are not packed: the GPU machine's toolkit provides them.
#   BUILD_DIR (default build-cuda), CUDA_ARCH (default 90), JOBS (default 2)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-cuda}"
CUDA_ARCH="${CUDA_ARCH:-90}"
cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" >/dev/null
ninja -C "$BUILD_DIR" -j"${JOBS:-2}" cuda_kernels_test cuda_tier_storage_test cuda_runner_test gpu_bench kvcache_cuda \
  kvcache-worker kvcache-router kvcache-demo
STAGE="$(mktemp -d)"
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/src/include" "$STAGE/build/worker" "$STAGE/build/router"
for b in cuda_kernels_test cuda_tier_storage_test cuda_runner_test gpu_bench; do
  cp "$BUILD_DIR/tests/worker/backend/cuda/$b" "$STAGE/bin/"
done
cp "$BUILD_DIR/worker/libkvcache_cuda.so" "$STAGE/lib/"
# The service, laid out as a build folder (scripts/run.sh's KVCACHE_BUILD_DIR):
# the worker opens the plugin beside itself.
cp "$BUILD_DIR/worker/kvcache-worker" "$BUILD_DIR/worker/libkvcache_cuda.so" "$STAGE/build/worker/"
cp "$BUILD_DIR/router/kvcache-router" "$BUILD_DIR/router/kvcache-demo" "$STAGE/build/router/"
# Shared libraries, except the C runtime and CUDA's own.
for b in "$STAGE"/bin/* "$STAGE"/build/*/kvcache-*; do ldd "$b"; done | awk '/=>/ {print $3}' | sort -u |
while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*|libcudart*|libcublas*) ;;
    *) cp -L "$lib" "$STAGE/lib/" ;;
  esac
done
# Headers the .cu files include beyond the repository (abseil), so the GPU
# machine's nvcc can compile-check the kernels.
ABSL_INC="$(dirname "$(find /usr/include /usr/local/include -maxdepth 2 -type d -name absl 2>/dev/null | head -1)")"
[[ -n "$ABSL_INC" ]] && cp -r "$ABSL_INC/absl" "$STAGE/src/include/"
# The pure-Python packages transformers needs to read a GGUF (hf_peer.py), in
# case the GPU machine's Python lacks them.
mkdir -p "$STAGE/wheels"
python3 -m pip download -q --no-deps gguf accelerate -d "$STAGE/wheels" || echo "no wheels for hf_peer.py"
echo "built $(date -u +%FT%TZ) on $(hostname) from $(git -C "$ROOT" rev-parse --short HEAD)+worktree, sm_$CUDA_ARCH" >"$STAGE/BUILD_INFO"
mkdir -p "$ROOT/.gpu_carry"
grep -qx '/.gpu_carry/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.gpu_carry/' >>"$ROOT/.git/info/exclude"
tar -cJf "$ROOT/.gpu_carry/bundle.tar.xz" -C "$STAGE" .
rm -rf "$STAGE"
ls -la "$ROOT/.gpu_carry/bundle.tar.xz"
