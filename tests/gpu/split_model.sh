#!/usr/bin/env bash
# Splits the model (KVCACHE_MODEL, default the bundled SmolLM2 Q4_1, 98 MB) into
# PARTS (default 3) files under .gpu_carry/ with its SHA-256 and name: one device
# call carries at most 64 MiB with the working tree (3.8 MB), and files a call
# leaves on the machine stay there while it is warm (30 s). With the 16 MB
# bundle from tests/gpu/pack.sh, three back-to-back calls:
#   1. carry .gpu_carry/bundle.tar.xz, .gpu_carry/model.gguf.part-aa and the
#      .sha256 and .name files; run `true`
#   2. carry .gpu_carry/model.gguf.part-ab; run `true`
#   3. carry .gpu_carry/model.gguf.part-ac; run tests/gpu/run.sh, which joins the
#      parts, checks the hash and runs everything on the real model (the GPU
#      greedy test, logits against the CPU, gpu_bench's decode, the service)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/common.sh
source scripts/common.sh
PARTS=${PARTS:-3}
mkdir -p .gpu_carry
grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null || echo '/.gpu_carry/' >>.git/info/exclude
rm -f .gpu_carry/model.gguf.*
split -n "$PARTS" -a 2 "$KVCACHE_MODEL" .gpu_carry/model.gguf.part-
sha256sum "$KVCACHE_MODEL" | awk '{print $1}' >.gpu_carry/model.gguf.sha256
basename "$KVCACHE_MODEL" >.gpu_carry/model.gguf.name
ls -la .gpu_carry/model.gguf.*
