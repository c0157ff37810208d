// Turns a stream of token ids into text deltas that are always valid UTF-8:
// bytes of a character split across tokens are held back until the character
// is complete, and bytes that can never form a character become U+FFFD.
//
//   StreamingDetokenizer d(tokenizer);
//   for (int32_t id : generated) send(d.Add(id).value());
//   send(d.Finish());
//
// Thread-safety: not thread-safe (one per generation stream). The Tokenizer
// must outlive it.
#ifndef KVCACHE_COMMON_TOKENIZER_STREAMING_DETOKENIZER_H_
#define KVCACHE_COMMON_TOKENIZER_STREAMING_DETOKENIZER_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"

namespace kvcache {
namespace tok {

class StreamingDetokenizer {
 public:
  // `special`: control tokens render as their text (see Tokenizer::TokenToPiece).
  explicit StreamingDetokenizer(const Tokenizer* tokenizer, bool special = false)
      : tokenizer_(tokenizer), special_(special) {}

  // The newly completed text after token `id` (possibly empty). OUT_OF_RANGE
  // for an invalid id (the stream is unchanged).
  absl::StatusOr<std::string> Add(int32_t id);
  // Raw bytes variant, for callers that produce pieces themselves.
  std::string AddBytes(absl::string_view bytes);
  // Ends the stream: an incomplete trailing character becomes U+FFFD.
  std::string Finish();
  // Bytes held back, waiting for the rest of a character (0..3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool special_;
  std::string pending_;
};

// Replaces every ill-formed sequence in `bytes` by U+FFFD (strict UTF-8: no
// overlongs, surrogates or code points above U+10FFFF). If `keep_tail`, an
// incomplete but so-far valid sequence at the end is left in *tail instead.
std::string SanitizeUtf8(absl::string_view bytes, bool keep_tail, std::string* tail);

}  // namespace tok
}  // namespace kvcache

#endif  // KVCACHE_COMMON_TOKENIZER_STREAMING_DETOKENIZER_H_
