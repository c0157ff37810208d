#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite with ctest.
# Extra arguments go to ctest (e.g. -L unit, -R kv_).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
scripts/setup.sh
cd "$KVCACHE_BUILD_DIR"
ctest --output-on-failure --parallel "$(nproc)" "$@"
