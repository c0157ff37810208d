// Small Unicode helpers for the tokenizer: UTF-8 decoding with llama.cpp's
// error rule, code point classes (\p{L}, \p{N}, \s) and GPT-2's byte <-> code
// point mapping.
//
// Thread-safety: pure functions over immutable tables.
#ifndef KVCACHE_COMMON_TOKENIZER_UNICODE_H_
#define KVCACHE_COMMON_TOKENIZER_UNICODE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace kvcache {
namespace tok {

constexpr uint32_t kReplacementChar = 0xFFFD;

// Decodes the code point at s[*pos] and advances *pos. A byte that does not
// start a well-formed sequence (bad lead byte, missing continuation bytes)
// decodes as U+FFFD and advances by one byte, as llama.cpp does.
// REQUIRES: *pos < s.size().
uint32_t DecodeUtf8(absl::string_view s, size_t* pos);
std::vector<uint32_t> DecodeUtf8All(absl::string_view s);
void AppendUtf8(uint32_t cp, std::string* out);

// Length of the UTF-8 sequence a lead byte announces (1..4), 0 for a
// continuation or invalid lead byte.
int Utf8SequenceLength(uint8_t lead);

enum CodepointFlag : uint8_t {
  kLetter = 1,      // \p{L}
  kNumber = 2,      // \p{N}
  kWhitespace = 4,  // \s (Unicode White_Space, as llama.cpp)
};
uint8_t CodepointFlags(uint32_t cp);

// GPT-2 byte-level BPE: every byte maps to a printable code point.
uint32_t ByteToCodepoint(uint8_t b);
// -1 when `cp` is not the image of a byte.
int CodepointToByte(uint32_t cp);

}  // namespace tok
}  // namespace kvcache

#endif  // KVCACHE_COMMON_TOKENIZER_UNICODE_H_
