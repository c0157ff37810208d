# Shared settings for the scripts in this folder (sourced, not run).
KVCACHE_BUILD_DIR=${KVCACHE_BUILD_DIR:-$PWD/build}
KVCACHE_CACHE_DIR=${KVCACHE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcache}
KVCACHE_MODEL=${KVCACHE_MODEL:-$KVCACHE_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf}
export KVCACHE_BUILD_DIR KVCACHE_CACHE_DIR KVCACHE_MODEL

log() { printf '[kvcache] %s\n' "$*" >&2; }
