#!/usr/bin/env bash
# Splits the model (KVCACHE_MODEL, default the bundled SmolLM2 Q4_1, 98 MB) into
# parts under .gpu_carry/ with its SHA-256 and name: one device call carries at
# most 64 MiB with the working tree (3.9 MB), and files a call leaves on the
# machine stay there while it is warm (30 s after each call).
#   FIRST_PART_BYTES set: two parts, the first that many bytes. With the 16.9 MB
#     bundle from tests/gpu/pack.sh, FIRST_PART_BYTES=45000000 fits two
#     back-to-back calls:
#       1. carry .gpu_carry/bundle.tar.xz, .gpu_carry/model.gguf.part-aa and the
#          .sha256 and .name files; run `nvidia-smi` (anything short)
#       2. carry .gpu_carry/model.gguf.part-ab; run tests/gpu/run.sh, which joins
#          the parts, checks the hash and runs everything on the real model
#   otherwise PARTS (default 3) equal parts, for three such calls (the last runs
#     tests/gpu/run.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/common.sh
source scripts/common.sh
mkdir -p .gpu_carry
grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null || echo '/.gpu_carry/' >>.git/info/exclude
rm -f .gpu_carry/model.gguf.*
if [[ -n "${FIRST_PART_BYTES:-}" ]]; then
  head -c "$FIRST_PART_BYTES" "$KVCACHE_MODEL" >.gpu_carry/model.gguf.part-aa
  tail -c +"$((FIRST_PART_BYTES + 1))" "$KVCACHE_MODEL" >.gpu_carry/model.gguf.part-ab
else
  split -n "${PARTS:-3}" -a 2 "$KVCACHE_MODEL" .gpu_carry/model.gguf.part-
fi
sha256sum "$KVCACHE_MODEL" | awk '{print $1}' >.gpu_carry/model.gguf.sha256
basename "$KVCACHE_MODEL" >.gpu_carry/model.gguf.name
ls -la .gpu_carry/model.gguf.*
