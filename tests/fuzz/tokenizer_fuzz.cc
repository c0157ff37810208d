// libFuzzer harness: arbitrary bytes through the tokenizers (built once from
// the tiny test vocabulary with each BPE pre-tokenizer, and from a tiny
// SentencePiece vocabulary), the streaming detokenizer and back, and through
// every chat template family. Encoding valid UTF-8 must round-trip exactly
// (SentencePiece: after the space it prefixes).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/tiny_llama.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/streaming_detokenizer.h"
#include "common/tokenizer/tokenizer.h"

namespace {
// [0]: smollm, [1]: llama-bpe, [2]: qwen2, [3]: gpt-2, [4]: SentencePiece.
const std::vector<const kvcache::tok::Tokenizer*>& GetTokenizers() {
  static const auto* toks = [] {
    auto* out = new std::vector<const kvcache::tok::Tokenizer*>;
    kvcache::gguf::TinyLlamaOptions o;
    o.n_layer = 1;
    auto file = kvcache::gguf::GgufFile::OpenFromBuffer(*kvcache::gguf::BuildTinyLlama(o));
    const kvcache::tok::Tokenizer* base = kvcache::tok::Tokenizer::FromGguf(**file)->release();
    out->push_back(base);
    for (const char* pre : {"llama-bpe", "qwen2", "gpt-2"}) {
      kvcache::tok::VocabSpec spec = base->spec();
      spec.pre = pre;
      out->push_back(kvcache::tok::Tokenizer::Create(spec)->release());
    }
    kvcache::tok::VocabSpec spm;
    spm.model = "llama";
    spm.tokens = {"<unk>", "<s>", "</s>"};
    spm.token_types = {kvcache::tok::TokenType::kUnknown, kvcache::tok::TokenType::kControl,
                       kvcache::tok::TokenType::kControl};
    for (int b = 0; b < 256; ++b) {
      spm.tokens.push_back(absl::StrFormat("<0x%02X>", b));
      spm.token_types.push_back(kvcache::tok::TokenType::kByte);
    }
    for (const char* piece :
         {"\xe2\x96\x81", "\xe2\x96\x81t", "he", "\xe2\x96\x81the", "a", "b", "ab", "abc", "\xc3\xa9"}) {
      spm.tokens.push_back(piece);
      spm.token_types.push_back(kvcache::tok::TokenType::kNormal);
    }
    spm.scores.assign(spm.tokens.size(), 0.0f);
    for (size_t i = 259; i < spm.scores.size(); ++i) spm.scores[i] = -static_cast<float>(i % 5);
    spm.bos_id = 1;
    spm.eos_id = 2;
    spm.unk_id = 0;
    spm.add_bos = true;
    spm.add_space_prefix = true;
    out->push_back(kvcache::tok::Tokenizer::Create(spm)->release());
    return out;
  }();
  return *toks;
}

// One recognised template per family (the recognised spellings).
const std::vector<kvcache::tok::ChatTemplate>& GetTemplates() {
  static const auto* templates = [] {
    auto* out = new std::vector<kvcache::tok::ChatTemplate>;
    for (const char* jinja : {
             "<|im_start|><|im_end|>",
             "<think><|im_start|><|im_end|>last_query_index",
             "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
             "+ "
             "'<|eot_id|>' add_generation_prompt",
             "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
             "+ "
             "'<|eot_id|>' Cutting Knowledge Date: December 2023\\n 26 Jul 2024",
             "[INST] '[INST] ' + message['content'] + ' [/INST]' Only user and assistant roles are "
             "supported!",
             "[INST] ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]'",
             "[INST] '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]'",
             "[INST] '[INST]' + system_message + '\\n\\n' + message['content'] + '[/INST]'",
             "[INST] '[SYSTEM_PROMPT] ' + message['content'] + '[/SYSTEM_PROMPT]' '[INST] ' + "
             "message['content'] + "
             "'[/INST]'",
         }) {
      out->push_back(*kvcache::tok::ChatTemplate::FromTemplateText(jinja, "<s>", "</s>"));
    }
    return out;
  }();
  return *templates;
}

// Chat messages from the fuzz input: the text split at '|', roles cycling
// through system/user/assistant by the first byte.
void FuzzTemplates(const std::string& text, uint8_t selector) {
  static const char* kRoles[] = {"system", "user", "assistant"};
  std::vector<kvcache::tok::ChatMessage> messages;
  size_t start = 0;
  for (size_t i = 0; i <= text.size() && messages.size() < 6; ++i) {
    if (i == text.size() || text[i] == '|') {
      messages.push_back({kRoles[(selector + messages.size()) % 3], text.substr(start, i - start)});
      start = i + 1;
    }
  }
  for (const auto& t : GetTemplates()) {
    for (bool prompt : {false, true}) {
      auto full = t.Render(messages, prompt);
      if (!full.ok() && full.status().code() != absl::StatusCode::kInvalidArgument) abort();
      auto tail = t.RenderAppend(messages, prompt);
      if (!tail.ok() && tail.status().code() != absl::StatusCode::kInvalidArgument) abort();
    }
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& toks = GetTokenizers();
  const uint8_t selector = size > 0 ? data[0] : 0;
  const auto* tok = toks[(selector >> 1) % toks.size()];
  const bool spm = tok->spec().model == "llama";
  const std::string text(reinterpret_cast<const char*>(data), size);
  kvcache::tok::EncodeOptions opts;
  opts.parse_special = (selector & 1) != 0;
  opts.add_special = false;
  const std::vector<int32_t> ids = tok->Encode(text, opts);
  kvcache::tok::StreamingDetokenizer stream(tok, /*special=*/true);
  std::string streamed;
  for (int32_t id : ids) streamed += stream.Add(id).value();
  streamed += stream.Finish();
  const std::string decoded = tok->Decode(ids, true).value();
  std::string tail;
  const bool valid = kvcache::tok::SanitizeUtf8(text, false, &tail) == text;
  if (!spm && valid && decoded != text) abort();
  // SentencePiece: one space in front, and U+2581 in the text reads back as a
  // space; special tokens parsed out of the text each get a space after them.
  if (spm && valid && !opts.parse_special && !text.empty() && !absl::StrContains(text, "\xe2\x96\x81") &&
      decoded != " " + text) {
    abort();
  }
  if (kvcache::tok::SanitizeUtf8(decoded, false, &tail) != streamed) abort();
  FuzzTemplates(text, selector);
  return 0;
}
