#include "common/input_tokens.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/streaming_detokenizer.h"

namespace kvcache {

absl::Status ValidateUtf8(absl::string_view text, absl::string_view what) {
  std::string tail;
  if (tok::SanitizeUtf8(text, /*keep_tail=*/false, &tail) != text) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not valid UTF-8"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> TokenizeInput(const v1::Input& input, bool append,
                                                   const tok::Tokenizer& tokenizer,
                                                   const tok::ChatTemplate* chat_template) {
  std::vector<int32_t> tokens;
  tok::EncodeOptions encode;
  encode.add_special = !append;  // BOS only at the start of a conversation
  encode.parse_special = true;
  switch (input.kind_case()) {
    case v1::Input::kText: {
      absl::Status st = ValidateUtf8(input.text(), "input.text");
      if (!st.ok()) return st;
      tokens = tokenizer.Encode(input.text(), encode);
      break;
    }
    case v1::Input::kTokens:
      tokens.assign(input.tokens().ids().begin(), input.tokens().ids().end());
      break;
    case v1::Input::kChat: {
      if (chat_template == nullptr) {
        return absl::FailedPreconditionError(
            "this model has no recognised chat template; send input.text or input.tokens");
      }
      const auto& chat = input.chat();
      if (chat.messages().empty()) return absl::InvalidArgumentError("input.chat has no messages");
      std::vector<tok::ChatMessage> messages;
      for (const auto& m : chat.messages()) {
        if (m.role() != "system" && m.role() != "user" && m.role() != "assistant") {
          return absl::InvalidArgumentError(
              absl::StrCat("chat role '", m.role(), "' is not system, user or assistant"));
        }
        absl::Status st = ValidateUtf8(m.content(), "chat message content");
        if (!st.ok()) return st;
        messages.push_back(tok::ChatMessage{m.role(), m.content()});
      }
      const bool add_prompt = !chat.has_add_generation_prompt() || chat.add_generation_prompt();
      // APPEND continues the conversation after the end-of-turn token the
      // previous turn ended with, in the model's own template.
      tok::ContentSpans content;
      absl::StatusOr<std::string> text = append ? chat_template->RenderAppend(messages, add_prompt, &content)
                                                : chat_template->Render(messages, add_prompt, &content);
      if (!text.ok()) return text.status();
      absl::string_view prompt = *text;
      // Templates that write bos_token themselves (Llama 3, Mistral) would get
      // a second BOS from the tokenizer: keep the tokenizer's.
      const std::string& bos = chat_template->bos_token();
      if (encode.add_special && tokenizer.spec().add_bos && tokenizer.bos_id() >= 0 && !bos.empty() &&
          absl::StartsWith(prompt, bos)) {
        prompt.remove_prefix(bos.size());
        for (auto& [b, e] : content) {
          b = b > bos.size() ? b - bos.size() : 0;
          e = e > bos.size() ? e - bos.size() : 0;
        }
      }
      // Only the template's own text yields control tokens: message content
      // saying "<|im_end|><|im_start|>system" is text, not a forged turn.
      encode.plain_spans = content;
      tokens = tokenizer.Encode(prompt, encode);
      break;
    }
    case v1::Input::KIND_NOT_SET:
      return absl::InvalidArgumentError("input is empty: set text, tokens or chat");
  }
  if (tokens.empty()) return absl::InvalidArgumentError("input tokenises to zero tokens");
  return tokens;
}

}  // namespace kvcache
