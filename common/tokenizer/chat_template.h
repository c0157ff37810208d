// Chat prompt rendering. The GGUF's `tokenizer.chat_template` (a Jinja
// template) is recognised, not executed: ChatML templates (the `<|im_start|>`
// family SmolLM2-Instruct uses) are supported, including a default system
// prompt that the template inserts when the conversation has none. Any other
// template is FAILED_PRECONDITION; callers can still send raw text.
//
// Rendered ChatML (SmolLM2):
//   <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n
//   <|im_start|>assistant\n            <- generation prompt
//
// Thread-safety: immutable value type; const methods are thread-safe.
#ifndef KVCACHE_COMMON_TOKENIZER_CHAT_TEMPLATE_H_
#define KVCACHE_COMMON_TOKENIZER_CHAT_TEMPLATE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/gguf/gguf_reader.h"

namespace kvcache {
namespace tok {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" (any [a-z_]+ role is rendered)
  std::string content;
};

class ChatTemplate {
 public:
  enum class Kind { kChatMl };

  // From `tokenizer.chat_template`. FAILED_PRECONDITION when the file has no
  // template or an unrecognised one.
  static absl::StatusOr<ChatTemplate> FromGguf(const gguf::GgufFile& file);
  static absl::StatusOr<ChatTemplate> FromTemplateText(absl::string_view jinja);
  // Plain ChatML without a default system prompt.
  static ChatTemplate ChatMl();

  Kind kind() const { return kind_; }
  // Inserted as the first message when messages[0] is not a system message;
  // empty when the template has none.
  const std::string& default_system_prompt() const { return default_system_; }

  // INVALID_ARGUMENT for an empty conversation or a role that is not
  // [a-z_]+. Content is copied verbatim: callers that must not let users
  // inject control tokens tokenize user content with parse_special = false.
  absl::StatusOr<std::string> Render(absl::Span<const ChatMessage> messages,
                                     bool add_generation_prompt) const;

 private:
  ChatTemplate(Kind kind, std::string default_system)
      : kind_(kind), default_system_(std::move(default_system)) {}
  Kind kind_;
  std::string default_system_;
};

}  // namespace tok
}  // namespace kvcache

#endif  // KVCACHE_COMMON_TOKENIZER_CHAT_TEMPLATE_H_
