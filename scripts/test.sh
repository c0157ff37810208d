#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite with ctest.
# Extra arguments go to ctest (e.g. -L unit, -R kv_).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
scripts/setup.sh
cd "$KVCACHE_BUILD_DIR"
# Twice the cores: most tests wait on servers they start (a ctest run at one
# test a core kept this machine's two cores 36% busy).
ctest --output-on-failure --parallel "$(( $(nproc) * 2 ))" "$@"
