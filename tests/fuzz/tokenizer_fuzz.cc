// libFuzzer harness: arbitrary bytes through the tokenizer (built once from
// the tiny test vocabulary), the streaming detokenizer and back. Encoding
// valid UTF-8 must round-trip exactly.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "common/gguf/gguf_reader.h"
#include "common/gguf/tiny_llama.h"
#include "common/tokenizer/streaming_detokenizer.h"
#include "common/tokenizer/tokenizer.h"

namespace {
const kvcache::tok::Tokenizer* GetTokenizer() {
  static const kvcache::tok::Tokenizer* tok = [] {
    kvcache::gguf::TinyLlamaOptions o;
    o.n_layer = 1;
    auto file = kvcache::gguf::GgufFile::OpenFromBuffer(*kvcache::gguf::BuildTinyLlama(o));
    return kvcache::tok::Tokenizer::FromGguf(**file)->release();
  }();
  return tok;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* tok = GetTokenizer();
  const std::string text(reinterpret_cast<const char*>(data), size);
  kvcache::tok::EncodeOptions opts;
  opts.parse_special = size > 0 && (data[0] & 1);
  const std::vector<int32_t> ids = tok->Encode(text, opts);
  kvcache::tok::StreamingDetokenizer stream(tok, /*special=*/true);
  std::string streamed;
  for (int32_t id : ids) streamed += stream.Add(id).value();
  streamed += stream.Finish();
  const std::string decoded = tok->Decode(ids, true).value();
  std::string tail;
  if (kvcache::tok::SanitizeUtf8(text, false, &tail) == text && decoded != text) abort();
  if (kvcache::tok::SanitizeUtf8(decoded, false, &tail) != streamed) abort();
  return 0;
}
