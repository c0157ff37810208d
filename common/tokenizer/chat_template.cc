#include "common/tokenizer/chat_template.h"

#include <algorithm>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/tokenizer/unicode.h"

namespace kvcache {
namespace tok {
namespace {

constexpr absl::string_view kImStart = "<|im_start|>";
constexpr absl::string_view kImEnd = "<|im_end|>";
constexpr absl::string_view kEotId = "<|eot_id|>";
constexpr absl::string_view kHeaderStart = "<|start_header_id|>";
constexpr absl::string_view kHeaderEnd = "<|end_header_id|>\n\n";
// What the Llama 3.1-3.3 templates write when neither date_string nor
// strftime_now is given.
constexpr absl::string_view kLlama31SystemHead =
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
constexpr absl::string_view kMistralAlternate =
    "After the optional system message, conversation roles must alternate user/assistant/user/assistant/...";
constexpr absl::string_view kMistralRoles =
    "Only user and assistant roles are supported, with the exception of an initial optional system message!";

// Python's str.isspace(), which Jinja's `trim` (str.strip) uses.
bool IsPySpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Jinja `| trim`: strips Python whitespace from both ends.
std::string PyTrim(absl::string_view s) {
  const std::vector<uint32_t> cps = DecodeUtf8All(s);
  size_t b = 0, e = cps.size();
  while (b < e && IsPySpace(cps[b])) ++b;
  while (e > b && IsPySpace(cps[e - 1])) --e;
  if (b == 0 && e == cps.size()) return std::string(s);
  std::string out;
  for (size_t i = b; i < e; ++i) AppendUtf8(cps[i], &out);
  return out;
}

absl::string_view LStripNewlines(absl::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
absl::string_view RStripNewlines(absl::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

// Finds the literal default system prompt of a ChatML template that inserts
//   '<|im_start|>system\n<PROMPT><|im_end|>\n'
// when messages[0] is not a system message (SmolLM2, Qwen2.5). The newline is
// a Jinja escape or a raw newline; escapes in the prompt (\n, \', \\) are
// decoded. A candidate with quotes or braces in it is template code, not a
// literal (Qwen2.5's tools branch opens a system block with an expression).
std::string ExtractDefaultSystem(absl::string_view t) {
  if (!absl::StrContains(t, "'system'") && !absl::StrContains(t, "\"system\"")) return "";
  const std::string open = absl::StrCat(kImStart, "system");
  for (size_t b = t.find(open); b != absl::string_view::npos; b = t.find(open, b + 1)) {
    size_t start = b + open.size();
    if (t.substr(start, 2) == "\\n") {
      start += 2;
    } else if (t.substr(start, 1) == "\n") {
      start += 1;
    } else {
      continue;
    }
    const size_t e = t.find(kImEnd, start);
    if (e == absl::string_view::npos) return "";
    absl::string_view raw = t.substr(start, e - start);
    std::string out;
    bool code = false;
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\\' && i + 1 < raw.size()) {
        const char c = raw[++i];
        out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c);
      } else if (raw[i] == '\'' || raw[i] == '"' || raw[i] == '{' || raw[i] == '}') {
        code = true;
        break;
      } else {
        out.push_back(raw[i]);
      }
    }
    if (!code && !out.empty()) return out;
  }
  return "";
}

bool ValidRole(absl::string_view role) {
  if (role.empty() || role.size() > 64) return false;
  for (char c : role) {
    if (!((c >= 'a' && c <= 'z') || c == '_')) return false;
  }
  return true;
}

absl::Status Refused(absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("the model's chat template refuses these messages: ", why));
}

// Appends text taken from a message's content and records where it landed.
void AppendContent(absl::string_view content, std::string* out, ContentSpans* spans) {
  if (content.empty()) return;
  if (spans != nullptr) spans->emplace_back(out->size(), out->size() + content.size());
  out->append(content.data(), content.size());
}

void AppendChatMl(const ChatMessage& m, std::string* out, ContentSpans* spans) {
  absl::StrAppend(out, kImStart, m.role, "\n");
  AppendContent(m.content, out, spans);
  absl::StrAppend(out, kImEnd, "\n");
}

// Qwen3: the index of the last user message (tool responses do not count);
// n - 1 when there is none.
size_t LastQueryIndex(absl::Span<const ChatMessage> messages) {
  for (size_t i = messages.size(); i-- > 0;) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" &&
        !(absl::StartsWith(m.content, "<tool_response>") && absl::EndsWith(m.content, "</tool_response>"))) {
      return i;
    }
  }
  return messages.size() - 1;
}

void AppendQwen3Assistant(const ChatMessage& m, bool after_last_query, bool last, std::string* out,
                          ContentSpans* spans) {
  absl::string_view content = m.content;
  std::string reasoning;
  if (absl::StrContains(content, "</think>")) {
    // content.split('</think>')[-1].lstrip('\n'), and
    // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
    absl::string_view before = content.substr(0, content.find("</think>"));
    content = LStripNewlines(content.substr(content.rfind("</think>") + 8));
    before = RStripNewlines(before);
    const size_t open = before.rfind("<think>");
    if (open != absl::string_view::npos) before = before.substr(open + 7);
    reasoning = std::string(LStripNewlines(before));
  }
  if (after_last_query && (last || !reasoning.empty())) {
    absl::StrAppend(out, kImStart, m.role, "\n<think>\n");
    AppendContent(RStripNewlines(LStripNewlines(reasoning)), out, spans);
    absl::StrAppend(out, "\n</think>\n\n");
    AppendContent(LStripNewlines(content), out, spans);
  } else {
    absl::StrAppend(out, kImStart, m.role, "\n");
    AppendContent(content, out, spans);
  }
  absl::StrAppend(out, kImEnd, "\n");
}

// The Mistral templates' check: after an optional system message, user and
// assistant alternate, starting with user.
absl::Status CheckAlternation(absl::Span<const ChatMessage> loop, absl::string_view message) {
  for (size_t i = 0; i < loop.size(); ++i) {
    if ((loop[i].role == "user") != (i % 2 == 0)) return Refused(message);
  }
  return absl::OkStatus();
}

}  // namespace

const char* ChatTemplate::KindName(Kind kind) {
  switch (kind) {
    case Kind::kChatMl:
      return "ChatML";
    case Kind::kQwen3:
      return "Qwen3";
    case Kind::kLlama3:
      return "Llama 3";
    case Kind::kLlama31:
      return "Llama 3.1-3.3";
    case Kind::kMistralV0:
      return "Mistral [INST] (v0, no system role)";
    case Kind::kMistralV1:
      return "Mistral [INST] v1";
    case Kind::kMistralV3:
      return "Mistral [INST] v3";
    case Kind::kMistralV3Tekken:
      return "Mistral [INST] v3-tekken";
    case Kind::kMistralV7:
      return "Mistral [INST] v7";
  }
  return "?";
}

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
  // The texts of the BOS / EOS tokens, which the Jinja sees as bos_token and
  // eos_token (SentencePiece files default to ids 1 and 2, as in llama.cpp).
  std::string bos, eos;
  if (const gguf::GgufValue* tokens = file.FindValue("tokenizer.ggml.tokens")) {
    auto views = tokens->AsStringArray();
    auto model = file.GetString("tokenizer.ggml.model");
    const bool spm = model.ok() && *model == "llama";
    auto text_of = [&](const char* key, uint64_t fallback, bool has_fallback) -> std::string {
      uint64_t id = fallback;
      if (file.FindValue(key) != nullptr) {
        auto got = file.GetUint64(key);
        if (!got.ok()) return "";
        id = *got;
      } else if (!has_fallback) {
        return "";
      }
      return views.ok() && id < views->size() ? std::string((*views)[id]) : "";
    };
    bos = text_of("tokenizer.ggml.bos_token_id", 1, spm);
    eos = text_of("tokenizer.ggml.eos_token_id", 2, spm);
  }
  return FromTemplateText(*text, std::move(bos), std::move(eos));
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromTemplateText(absl::string_view jinja, std::string bos_token,
                                                            std::string eos_token) {
  // Recognition works on a normalised copy: Jinja "\n" escapes as newlines and
  // double quotes as single quotes, so GGUF and tokenizer_config spellings of
  // the same template look alike.
  const std::string t = absl::StrReplaceAll(jinja, {{"\\n", "\n"}, {"\"", "'"}});
  auto has = [&](absl::string_view s) { return absl::StrContains(t, s); };
  auto make = [&](Kind kind, std::string default_system = "") {
    return ChatTemplate(kind, std::move(default_system), std::move(bos_token), std::move(eos_token));
  };
  if (has(kImStart) && has(kImEnd)) {
    if (has("<think>") && has("last_query_index")) return make(Kind::kQwen3);
    // Another reasoning template in ChatML's tokens (QwQ, Bielik v3, SmolLM3,
    // Nemotron): its generation prompt or system block differs from ChatML's
    // (QwQ's prompt ends '<think>\n'), and rendering it as ChatML would give the
    // model a prompt it was not trained on. Unrecognised, not guessed.
    if (!has("<think>")) return make(Kind::kChatMl, ExtractDefaultSystem(jinja));
  }
  if (has("'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>'")) {
    if (has("Cutting Knowledge Date: December 2023\n") && has("26 Jul 2024")) return make(Kind::kLlama31);
    ChatTemplate c = make(Kind::kLlama3);
    // A variant some GGUFs carry always ends with the assistant header.
    c.always_prompt_ = !has("add_generation_prompt");
    return c;
  }
  if (has("[INST]")) {
    if (has("'[SYSTEM_PROMPT] ' + message['content'] + '[/SYSTEM_PROMPT]'") &&
        has("'[INST] ' + message['content'] + '[/INST]'") && !has("strftime_now")) {
      return make(Kind::kMistralV7);
    }
    if (has("' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]'")) {
      return make(Kind::kMistralV1);
    }
    if (has("'[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]'")) {
      return make(Kind::kMistralV3);
    }
    if (has("'[INST]' + system_message + '\n\n' + message['content'] + '[/INST]'")) {
      return make(Kind::kMistralV3Tekken);
    }
    if (has("'[INST] ' + message['content'] + ' [/INST]'") &&
        has("Only user and assistant roles are supported!")) {
      return make(Kind::kMistralV0);
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "unrecognised chat template '", jinja.substr(0, 60), jinja.size() > 60 ? "...'" : "'",
      " (supported: ChatML, Qwen2.5, Qwen3, Llama 3, Llama 3.1-3.3, Mistral [INST] v0/v1/v3/v3-tekken/v7); "
      "chat input is refused, send raw text or token ids instead"));
}

ChatTemplate ChatTemplate::ChatMl() { return ChatTemplate(Kind::kChatMl, "", "", ""); }

std::string ChatTemplate::EndOfTurn() const {
  switch (kind_) {
    case Kind::kChatMl:
    case Kind::kQwen3:
      return std::string(kImEnd);
    case Kind::kLlama3:
    case Kind::kLlama31:
      return std::string(kEotId);
    default:
      return eos_;
  }
}

absl::StatusOr<std::string> ChatTemplate::Render(absl::Span<const ChatMessage> messages,
                                                 bool add_generation_prompt, ContentSpans* spans) const {
  if (spans != nullptr) spans->clear();
  if (messages.empty()) return absl::InvalidArgumentError("chat has no messages");
  for (const ChatMessage& m : messages) {
    if (!ValidRole(m.role)) {
      return absl::InvalidArgumentError(
          absl::StrCat("chat role '", m.role.substr(0, 64), "' is not [a-z_]+"));
    }
    // Only ChatML and Llama 3 write any role as-is; the others have no place
    // for roles beyond these three (their Jinja drops or rejects them).
    if (kind_ != Kind::kChatMl && kind_ != Kind::kLlama3 && m.role != "system" && m.role != "user" &&
        m.role != "assistant") {
      return Refused(absl::StrCat(KindName(kind_), " has no '", m.role, "' role"));
    }
  }
  const bool has_system = messages[0].role == "system";
  // Mistral V1/V3: an initial system message is taken out of the turns.
  const absl::Span<const ChatMessage> turns = has_system ? messages.subspan(1) : messages;
  std::string out;
  switch (kind_) {
    case Kind::kChatMl:
      if (!default_system_.empty() && !has_system) {
        absl::StrAppend(&out, kImStart, "system\n", default_system_, kImEnd, "\n");
      }
      for (const ChatMessage& m : messages) AppendChatMl(m, &out, spans);
      if (add_generation_prompt) absl::StrAppend(&out, kImStart, "assistant\n");
      return out;

    case Kind::kQwen3: {
      if (has_system) AppendChatMl(messages[0], &out, spans);
      const size_t last_query = LastQueryIndex(messages);
      for (size_t i = 0; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "user" || (m.role == "system" && i > 0)) {
          AppendChatMl(m, &out, spans);
        } else if (m.role == "assistant") {
          AppendQwen3Assistant(m, i > last_query, i + 1 == messages.size(), &out, spans);
        }
      }
      if (add_generation_prompt) absl::StrAppend(&out, kImStart, "assistant\n");
      return out;
    }

    case Kind::kLlama3:
    case Kind::kLlama31: {
      absl::Span<const ChatMessage> rest = messages;
      if (kind_ == Kind::kLlama31) {
        absl::StrAppend(&out, bos_, kHeaderStart, "system", kHeaderEnd, kLlama31SystemHead);
        if (has_system) AppendContent(PyTrim(messages[0].content), &out, spans);
        absl::StrAppend(&out, kEotId);
        rest = turns;
      }
      for (size_t i = 0; i < rest.size(); ++i) {
        if (kind_ == Kind::kLlama3 && i == 0) out += bos_;
        absl::StrAppend(&out, kHeaderStart, rest[i].role, kHeaderEnd);
        AppendContent(PyTrim(rest[i].content), &out, spans);
        absl::StrAppend(&out, kEotId);
      }
      if (add_generation_prompt || always_prompt_)
        absl::StrAppend(&out, kHeaderStart, "assistant", kHeaderEnd);
      return out;
    }

    case Kind::kMistralV0: {
      // No system role: the alternation check rejects it first, as in the Jinja.
      if (absl::Status st = CheckAlternation(messages,
                                             "Conversation roles must alternate user/assistant/user/"
                                             "assistant/...");
          !st.ok()) {
        return st;
      }
      out = bos_;
      for (const ChatMessage& m : messages) {
        if (m.role == "user") {
          out += "[INST] ";
          AppendContent(m.content, &out, spans);
          out += " [/INST]";
        } else {
          AppendContent(m.content, &out, spans);
          out += eos_;
        }
      }
      return out;  // the template has no generation prompt
    }

    case Kind::kMistralV1:
    case Kind::kMistralV3:
    case Kind::kMistralV3Tekken: {
      if (absl::Status st = CheckAlternation(turns, kMistralAlternate); !st.ok()) return st;
      const bool v1 = kind_ == Kind::kMistralV1;
      const bool tekken = kind_ == Kind::kMistralV3Tekken;
      const absl::string_view open = v1 ? " [INST] " : tekken ? "[INST]" : "[INST] ";
      const absl::string_view close = v1 ? " [/INST]" : "[/INST]";
      out = bos_;
      for (size_t i = 0; i < turns.size(); ++i) {
        const ChatMessage& m = turns[i];
        if (m.role == "user") {
          // V1 puts the system prompt in the first user message, V3 in the
          // last message if that is a user message (else it is dropped).
          const bool with_system = has_system && (v1 ? i == 0 : i + 1 == turns.size());
          absl::StrAppend(&out, open);
          if (with_system) {
            AppendContent(messages[0].content, &out, spans);
            out += "\n\n";
          }
          AppendContent(m.content, &out, spans);
          absl::StrAppend(&out, close);
        } else if (m.role == "assistant") {
          if (!tekken) out += " ";
          AppendContent(v1 || tekken ? m.content : PyTrim(m.content), &out, spans);
          out += eos_;
        } else {
          return Refused(kMistralRoles);
        }
      }
      return out;  // the template has no generation prompt
    }

    case Kind::kMistralV7:
      out = bos_;
      for (const ChatMessage& m : messages) {
        if (m.role == "user") {
          out += "[INST] ";
          AppendContent(m.content, &out, spans);
          out += "[/INST]";
        } else if (m.role == "system") {
          out += "[SYSTEM_PROMPT] ";
          AppendContent(m.content, &out, spans);
          out += "[/SYSTEM_PROMPT]";
        } else {
          out += " ";
          AppendContent(m.content, &out, spans);
          out += eos_;
        }
      }
      return out;  // the template has no generation prompt
  }
  return absl::InternalError("unknown chat template kind");
}

absl::StatusOr<std::string> ChatTemplate::RenderAppend(absl::Span<const ChatMessage> messages,
                                                       bool add_generation_prompt,
                                                       ContentSpans* spans) const {
  if (spans != nullptr) spans->clear();
  if (messages.empty()) return absl::InvalidArgumentError("chat has no messages");
  // Render the new messages after a stand-in earlier exchange and keep what
  // follows the stand-in assistant turn's end-of-turn token: the template
  // decides separators, system placement and the alternation rules.
  constexpr absl::string_view kEarlierUser = "kvcache: earlier user turn";
  constexpr absl::string_view kEarlierAssistant = "kvcache: earlier assistant turn";
  std::vector<ChatMessage> all;
  all.reserve(messages.size() + 2);
  all.push_back({"user", std::string(kEarlierUser)});
  all.push_back({"assistant", std::string(kEarlierAssistant)});
  all.insert(all.end(), messages.begin(), messages.end());
  ContentSpans full_spans;
  auto full = Render(all, add_generation_prompt, &full_spans);
  if (!full.ok()) return full.status();
  const std::string marker = absl::StrCat(kEarlierAssistant, EndOfTurn());
  const size_t at = full->find(marker);
  if (at == std::string::npos) {
    return absl::InternalError(
        absl::StrCat(KindName(kind_), " template: cannot locate the end of the earlier turn"));
  }
  const size_t cut = at + marker.size();
  if (spans != nullptr) {
    // The stand-in turns' content lies before the cut.
    for (const auto& [b, e] : full_spans) {
      if (e > cut) spans->emplace_back(std::max(b, cut) - cut, e - cut);
    }
  }
  return full->substr(cut);
}

}  // namespace tok
}  // namespace kvcache
