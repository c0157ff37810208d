// Turns a wire Input (text, token ids or chat messages) into token ids: the one
// tokenisation rule the worker (to run the request) and the router (to hash its
// prefix pages for placement) must share, or cache affinity silently breaks.
//
// Thread-safety: pure function over immutable inputs.
#ifndef KVCACHE_COMMON_INPUT_TOKENS_H_
#define KVCACHE_COMMON_INPUT_TOKENS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "kvcache/v1/common.pb.h"

namespace kvcache {

// INVALID_ARGUMENT for an empty input, malformed UTF-8, an unknown chat role or
// an input that tokenises to nothing; FAILED_PRECONDITION for chat input when
// `chat_template` is null. `append`: the input continues a conversation (no
// BOS; chat messages render as a ChatML continuation, without the default
// system prompt and after a newline that ends the previous turn).
absl::StatusOr<std::vector<int32_t>> TokenizeInput(const v1::Input& input, bool append,
                                                   const tok::Tokenizer& tokenizer,
                                                   const tok::ChatTemplate* chat_template);

// INVALID_ARGUMENT naming `what` unless `text` is well-formed UTF-8.
absl::Status ValidateUtf8(absl::string_view text, absl::string_view what);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_INPUT_TOKENS_H_
