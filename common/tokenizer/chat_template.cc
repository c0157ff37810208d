#include "common/tokenizer/chat_template.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvcache {
namespace tok {
namespace {

constexpr absl::string_view kImStart = "<|im_start|>";
constexpr absl::string_view kImEnd = "<|im_end|>";

// Finds the literal default system prompt of a ChatML template of the form
//   {% if loop.first and messages[0]['role'] != 'system' %}
//   {{ '<|im_start|>system\n<PROMPT><|im_end|>\n' }}{% endif %}
// Jinja string escapes in the prompt (\n, \', \\) are decoded.
std::string ExtractDefaultSystem(absl::string_view t) {
  if (!absl::StrContains(t, "!= 'system'") && !absl::StrContains(t, "!= \"system\"")) return "";
  // The newline is either a Jinja escape (backslash, n) or a raw newline.
  const std::string open = absl::StrCat(kImStart, "system");
  const size_t b = t.find(open);
  if (b == absl::string_view::npos) return "";
  size_t start = b + open.size();
  if (t.substr(start, 2) == "\\n") {
    start += 2;
  } else if (t.substr(start, 1) == "\n") {
    start += 1;
  } else {
    return "";
  }
  const size_t e = t.find(kImEnd, start);
  if (e == absl::string_view::npos) return "";
  absl::string_view raw = t.substr(start, e - start);
  std::string out;
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] == '\\' && i + 1 < raw.size()) {
      const char c = raw[++i];
      out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c);
    } else {
      out.push_back(raw[i]);
    }
  }
  return out;
}

bool ValidRole(absl::string_view role) {
  if (role.empty() || role.size() > 64) return false;
  for (char c : role) {
    if (!((c >= 'a' && c <= 'z') || c == '_')) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::FromGguf(const gguf::GgufFile& file) {
  const gguf::GgufValue* v = file.FindValue("tokenizer.chat_template");
  if (v == nullptr) {
    return absl::FailedPreconditionError(
        "model has no tokenizer.chat_template; send raw text instead of chat messages");
  }
  auto text = v->AsString();
  if (!text.ok()) {
    return absl::FailedPreconditionError("tokenizer.chat_template is not a string");
  }
  return FromTemplateText(*text);
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromTemplateText(absl::string_view jinja) {
  if (absl::StrContains(jinja, kImStart) && absl::StrContains(jinja, kImEnd)) {
    return ChatTemplate(Kind::kChatMl, ExtractDefaultSystem(jinja));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("unrecognised chat template (only ChatML is supported): '", jinja.substr(0, 60),
                   jinja.size() > 60 ? "...'" : "'", "; send raw text instead of chat messages"));
}

ChatTemplate ChatTemplate::ChatMl() { return ChatTemplate(Kind::kChatMl, ""); }

absl::StatusOr<std::string> ChatTemplate::Render(absl::Span<const ChatMessage> messages,
                                                 bool add_generation_prompt) const {
  if (messages.empty()) return absl::InvalidArgumentError("chat has no messages");
  std::string out;
  if (!default_system_.empty() && messages[0].role != "system") {
    absl::StrAppend(&out, kImStart, "system\n", default_system_, kImEnd, "\n");
  }
  for (const ChatMessage& m : messages) {
    if (!ValidRole(m.role)) {
      return absl::InvalidArgumentError(
          absl::StrCat("chat role '", m.role.substr(0, 64), "' is not [a-z_]+"));
    }
    absl::StrAppend(&out, kImStart, m.role, "\n", m.content, kImEnd, "\n");
  }
  if (add_generation_prompt) absl::StrAppend(&out, kImStart, "assistant\n");
  return out;
}

}  // namespace tok
}  // namespace kvcache
