// Test helper: locating llama.cpp's vocabulary test files
// (models/ggml-vocab-*.gguf in the llama.cpp source that scripts/setup.sh
// fetches with scripts/fetch_llamacpp_src.sh).
//
// Thread-safety: free functions, no shared state.
#ifndef KVCACHE_TESTS_COMMON_TOKENIZER_LLAMACPP_VOCAB_H_
#define KVCACHE_TESTS_COMMON_TOKENIZER_LLAMACPP_VOCAB_H_

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvcache {
namespace testing {

// The unpacked llama.cpp source: $KVCACHE_LLAMACPP_SRC, else the cache
// directory scripts/fetch_llamacpp_src.sh fills
// ($KVCACHE_CACHE_DIR, else $XDG_CACHE_HOME/kvcache, else ~/.cache/kvcache).
inline std::string LlamaCppSourceDir() {
  if (const char* env = std::getenv("KVCACHE_LLAMACPP_SRC"); env != nullptr && env[0] != '\0') return env;
  std::string cache;
  if (const char* c = std::getenv("KVCACHE_CACHE_DIR"); c != nullptr && c[0] != '\0') {
    cache = c;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && x[0] != '\0') {
    cache = absl::StrCat(x, "/kvcache");
  } else {
    const char* home = std::getenv("HOME");
    cache = absl::StrCat(home != nullptr ? home : ".", "/.cache/kvcache");
  }
  return cache + "/llama.cpp/src-0.3.36";
}

// models/ggml-vocab-<name>.gguf inside it.
inline std::string LlamaCppVocabPath(const std::string& name) {
  return absl::StrCat(LlamaCppSourceDir(), "/models/ggml-vocab-", name, ".gguf");
}

// Appended to "cannot open" errors so a failure says how to fix it.
constexpr const char* kLlamaCppVocabHint =
    " (run scripts/setup.sh or scripts/fetch_llamacpp_src.sh, or set KVCACHE_LLAMACPP_SRC)";

}  // namespace testing
}  // namespace kvcache

#endif  // KVCACHE_TESTS_COMMON_TOKENIZER_LLAMACPP_VOCAB_H_
