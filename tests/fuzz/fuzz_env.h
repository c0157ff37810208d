// What the request fuzzers share: the tiny test model's tokenizer with the ChatML
// template (built once, never freed: libFuzzer never returns), and an invariant
// check that aborts with what was violated.
#ifndef KVCACHE_TESTS_FUZZ_FUZZ_ENV_H_
#define KVCACHE_TESTS_FUZZ_FUZZ_ENV_H_

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>

#include "common/gguf/gguf_reader.h"
#include "common/gguf/tiny_llama.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"

namespace kvcache::fuzz {

struct Env {
  std::unique_ptr<tok::Tokenizer> tokenizer;
  tok::ChatTemplate chat = tok::ChatTemplate::ChatMl();
};

inline const Env& GetEnv() {
  static const Env* env = [] {
    auto* e = new Env;
    gguf::TinyLlamaOptions o;
    o.n_layer = 1;
    auto file = gguf::GgufFile::OpenFromBuffer(*gguf::BuildTinyLlama(o));
    e->tokenizer = std::move(*tok::Tokenizer::FromGguf(**file));
    return e;
  }();
  return *env;
}

inline void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "violated: %s\n", what);
    std::abort();
  }
}

}  // namespace kvcache::fuzz

#endif  // KVCACHE_TESTS_FUZZ_FUZZ_ENV_H_
