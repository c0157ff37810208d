// TokenizeInput with chat messages on real vocabularies (llama.cpp's Llama 3
// BPE and Llama 2 SentencePiece test vocabularies) and real templates: one
// BOS, APPEND rendered in the model's template, refusals as INVALID_ARGUMENT.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "common/gguf/gguf_reader.h"
#include "common/input_tokens.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "tests/common/tokenizer/llamacpp_vocab.h"

namespace kvcache {
namespace {

struct Model {
  std::unique_ptr<gguf::GgufFile> file;
  std::unique_ptr<tok::Tokenizer> tok;
  std::unique_ptr<tok::ChatTemplate> chat;
};

// A llama.cpp test vocabulary with one of the recorded real templates.
absl::StatusOr<Model> Load(const std::string& vocab, const std::string& template_file, const std::string& bos,
                           const std::string& eos) {
  Model m;
  auto f = gguf::GgufFile::Open(testing::LlamaCppVocabPath(vocab));
  if (!f.ok()) return absl::NotFoundError(absl::StrCat(f.status().message(), testing::kLlamaCppVocabHint));
  m.file = std::move(*f);
  auto t = tok::Tokenizer::FromGguf(*m.file);
  if (!t.ok()) return t.status();
  m.tok = std::move(*t);
  auto jinja = testing::ReadFileBytes(testing::SourceDir() + "/tests/data/chat_templates/" + template_file);
  if (!jinja.ok()) return jinja.status();
  auto c = tok::ChatTemplate::FromTemplateText(*jinja, bos, eos);
  if (!c.ok()) return c.status();
  m.chat = std::make_unique<tok::ChatTemplate>(*c);
  return m;
}

v1::Input Chat(std::vector<std::pair<std::string, std::string>> messages) {
  v1::Input in;
  for (const auto& [role, content] : messages) {
    auto* msg = in.mutable_chat()->add_messages();
    msg->set_role(role);
    msg->set_content(content);
  }
  return in;
}

TEST(ChatInputTest, Llama31HasOneBosAndAppendsInItsTemplate) {
  auto m = Load("llama-bpe", "llama-3.1-8b-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>");
  ASSERT_TRUE(m.ok()) << m.status();
  const int32_t bos = 128000, header = 128006, eot = 128009;
  auto full = TokenizeInput(Chat({{"user", "Hi"}}), /*append=*/false, *m->tok, m->chat.get());
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_GE(full->size(), 3u);
  EXPECT_EQ((*full)[0], bos);
  EXPECT_EQ((*full)[1], header) << absl::StrJoin(*full, ",");
  EXPECT_EQ(std::count(full->begin(), full->end(), bos), 1);
  // The rendered text, tokenised as llama.cpp does (BOS from the text).
  auto text = m->chat->Render({{"user", "Hi"}}, true);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*full, m->tok->Encode(*text, {.add_special = false, .parse_special = true}));

  auto next = TokenizeInput(Chat({{"user", "And then?"}}), /*append=*/true, *m->tok, m->chat.get());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->front(), header);  // straight after the <|eot_id|> the session holds
  EXPECT_EQ(std::count(next->begin(), next->end(), bos), 0);
  EXPECT_EQ(std::count(next->begin(), next->end(), eot), 1);
}

TEST(ChatInputTest, MistralOnSentencePiece) {
  auto m = Load("llama-spm", "mistral-7b-instruct-v0.2-pre-v1.jinja", "<s>", "</s>");
  ASSERT_TRUE(m.ok()) << m.status();
  auto full = TokenizeInput(Chat({{"user", "Hi"}}), false, *m->tok, m->chat.get());
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->front(), 1);
  EXPECT_EQ(std::count(full->begin(), full->end(), 1), 1);
  EXPECT_EQ(*m->tok->Decode(*full, false), " [INST] Hi [/INST]");
  // This template has no system role, and turns must alternate.
  auto sys = TokenizeInput(Chat({{"system", "S"}, {"user", "Hi"}}), false, *m->tok, m->chat.get());
  EXPECT_EQ(sys.status().code(), absl::StatusCode::kInvalidArgument);
  auto twice = TokenizeInput(Chat({{"user", "a"}, {"user", "b"}}), false, *m->tok, m->chat.get());
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  auto append = TokenizeInput(Chat({{"user", "More"}}), true, *m->tok, m->chat.get());
  ASSERT_TRUE(append.ok()) << append.status();
  EXPECT_EQ(*m->tok->Decode(*append, false), " [INST] More [/INST]");
}

TEST(ChatInputTest, Qwen25FromTheVocabularyFile) {
  Model m;
  auto f = gguf::GgufFile::Open(testing::LlamaCppVocabPath("qwen2"));
  ASSERT_TRUE(f.ok()) << f.status() << testing::kLlamaCppVocabHint;
  m.file = std::move(*f);
  auto t = tok::Tokenizer::FromGguf(*m.file);
  ASSERT_TRUE(t.ok()) << t.status();
  auto c = tok::ChatTemplate::FromGguf(*m.file);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kind(), tok::ChatTemplate::Kind::kChatMl);
  EXPECT_EQ(c->default_system_prompt(), "You are a helpful assistant");
  EXPECT_EQ(c->bos_token(), "<|endoftext|>");  // tokenizer.ggml.bos_token_id 151643
  auto ids = TokenizeInput(Chat({{"user", "Hi"}}), false, **t, &*c);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*(*t)->Decode(*ids, true),
            "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
}

}  // namespace
}  // namespace kvcache
