// Chat prompt rendering. The GGUF's `tokenizer.chat_template` (a Jinja
// template) is recognised by its text, not executed, and rendered by a C++
// renderer that reproduces what that Jinja renders (checked against Python's
// jinja2 on the real template strings in tests/data/chat_templates). Families:
//
//   kChatMl          <|im_start|>role\n...<|im_end|>\n, optionally with the
//                    default system prompt the template inserts when the
//                    conversation has none (SmolLM2, Qwen2.5, Qwen2 GGUFs)
//   kQwen3           ChatML; <think> blocks of assistant turns before the last
//                    user query are dropped, later ones normalised
//   kLlama3          Llama 3 / 3.0: <|start_header_id|>role<|end_header_id|>\n\n
//                    content|trim <|eot_id|>, BOS text first
//   kLlama31         Llama 3.1 / 3.2 / 3.3: as kLlama3 plus the system block
//                    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024"
//                    (the date the templates fall back to without strftime_now;
//                    a fixed date keeps prompts, and so prefix pages, stable)
//   kMistralV0       Mistral 7B v0.1/v0.2: "[INST] u [/INST]a</s>", no system role
//   kMistralV1       " [INST] sys\n\nu [/INST] a</s>"
//   kMistralV3       Mistral Large 2407 / 7B v0.3: "[INST] u[/INST] a|trim</s>",
//                    system prefixed to the last user message
//   kMistralV3Tekken Mistral Nemo: "[INST]u[/INST]a</s>", system as in V3
//   kMistralV7       Mistral Large 2411: "[SYSTEM_PROMPT] s[/SYSTEM_PROMPT][INST] u[/INST] a</s>"
//
// Messages a template cannot express (a system message for kMistralV0,
// non-alternating user/assistant turns for Mistral V0/V1/V3, where the Jinja
// calls raise_exception) are INVALID_ARGUMENT. An unrecognised template is
// FAILED_PRECONDITION: the worker then refuses chat input (raw text and token
// input still work) rather than guess a format the model was not trained on.
//
// Thread-safety: immutable value type; const methods are thread-safe.
#ifndef KVCACHE_COMMON_TOKENIZER_CHAT_TEMPLATE_H_
#define KVCACHE_COMMON_TOKENIZER_CHAT_TEMPLATE_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/gguf/gguf_reader.h"

namespace kvcache {
namespace tok {

// Byte ranges [begin, end) of a rendered prompt.
using ContentSpans = std::vector<std::pair<size_t, size_t>>;

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" (ChatML renders any [a-z_]+ role)
  std::string content;
};

class ChatTemplate {
 public:
  enum class Kind {
    kChatMl,
    kQwen3,
    kLlama3,
    kLlama31,
    kMistralV0,
    kMistralV1,
    kMistralV3,
    kMistralV3Tekken,
    kMistralV7,
  };
  static const char* KindName(Kind kind);

  // From `tokenizer.chat_template`, with the BOS/EOS token texts of the
  // file's vocabulary. FAILED_PRECONDITION when the file has no template or
  // an unrecognised one.
  static absl::StatusOr<ChatTemplate> FromGguf(const gguf::GgufFile& file);
  // `bos_token` / `eos_token`: the texts the Jinja variables of the same
  // names hold.
  static absl::StatusOr<ChatTemplate> FromTemplateText(absl::string_view jinja, std::string bos_token = "",
                                                       std::string eos_token = "");
  // Plain ChatML without a default system prompt.
  static ChatTemplate ChatMl();

  Kind kind() const { return kind_; }
  // Inserted as the first message when messages[0] is not a system message;
  // empty when the template has none.
  const std::string& default_system_prompt() const { return default_system_; }
  // The text the template writes for `bos_token` (may be empty). Callers that
  // also add BOS while tokenising strip it from the rendered text once.
  const std::string& bos_token() const { return bos_; }

  // The whole conversation, as the template's Jinja renders it with
  // `messages` and `add_generation_prompt` (no tools). INVALID_ARGUMENT for an
  // empty conversation, a role that is not [a-z_]+, or messages the template
  // refuses. Content is copied verbatim: callers that must not let users
  // inject control tokens tokenize it with parse_special = false, e.g. by
  // passing `content_spans` as EncodeOptions::plain_spans. `content_spans`,
  // when not null, is set to the byte ranges [begin, end) of the result that
  // hold text taken from messages' content (as the template writes it:
  // trimmed, Qwen3's reasoning split off), ascending and disjoint; template
  // text, roles and the default system prompt are outside them.
  absl::StatusOr<std::string> Render(absl::Span<const ChatMessage> messages, bool add_generation_prompt,
                                     ContentSpans* content_spans = nullptr) const;

  // `messages` as they continue a conversation whose last assistant turn
  // ended with the template's end-of-turn token (<|im_end|>, <|eot_id|>, EOS),
  // which the session already holds: exactly the text the template renders
  // after that token when the earlier turns and `messages` are rendered
  // together (e.g. "\n<|im_start|>user\n..." for ChatML). Errors and
  // `content_spans` as Render.
  absl::StatusOr<std::string> RenderAppend(absl::Span<const ChatMessage> messages, bool add_generation_prompt,
                                           ContentSpans* content_spans = nullptr) const;

  // The text that ends an assistant turn in this template (<|im_end|>,
  // <|eot_id|>, EOS): what RenderAppend takes the session to hold before its
  // text, and what a reply that stopped without it (max_tokens, a stop string,
  // a cancel) is closed with before an APPEND chat turn.
  std::string EndOfTurn() const;

 private:
  ChatTemplate(Kind kind, std::string default_system, std::string bos, std::string eos)
      : kind_(kind), default_system_(std::move(default_system)), bos_(std::move(bos)), eos_(std::move(eos)) {}

  Kind kind_;
  std::string default_system_;
  std::string bos_;
  std::string eos_;
  // kLlama3 variant without an add_generation_prompt test: always prompts.
  bool always_prompt_ = false;
};

}  // namespace tok
}  // namespace kvcache

#endif  // KVCACHE_COMMON_TOKENIZER_CHAT_TEMPLATE_H_
