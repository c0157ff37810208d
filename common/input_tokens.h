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

// INVALID_ARGUMENT for an empty input, malformed UTF-8, an unknown chat role,
// messages the model's chat template refuses (e.g. a system message for a
// template without one, non-alternating turns for Mistral) or an input that
// tokenises to nothing; FAILED_PRECONDITION for chat input when
// `chat_template` is null. `append`: the input continues a conversation (no
// BOS; chat messages render with the model's template as the continuation
// after the previous turn's end-of-turn token, ChatTemplate::RenderAppend).
// A rendered chat that starts with the template's BOS text is tokenised
// without it when the tokenizer adds BOS itself, so the prompt has one BOS.
// Control tokens are parsed in input.text and in the chat template's own text,
// never in chat message content (it cannot forge a turn); input.tokens are
// taken as given.
absl::StatusOr<std::vector<int32_t>> TokenizeInput(const v1::Input& input, bool append,
                                                   const tok::Tokenizer& tokenizer,
                                                   const tok::ChatTemplate* chat_template);

// INVALID_ARGUMENT naming `what` unless `text` is well-formed UTF-8.
absl::Status ValidateUtf8(absl::string_view text, absl::string_view what);

}  // namespace kvcache

#endif  // KVCACHE_COMMON_INPUT_TOKENS_H_
