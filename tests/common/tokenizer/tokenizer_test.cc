// Tokenisation of the real SmolLM2 vocabulary against llama.cpp's, recorded
// by tests/data/record_model_reference.py. A missing model fails with a
// message naming scripts/setup.sh.
#include "common/tokenizer/tokenizer.h"

#include <chrono>
#include <cstdio>
#include <memory>

#include "absl/strings/str_join.h"
#include "common/gguf/model_path.h"
#include "common/gguf/tiny_llama.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/unicode.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "tests/common/tokenizer/plain_spans_checks.h"

namespace kvcache {
namespace tok {
namespace {

using ::kvcache::testing::Hex;
using ::kvcache::testing::Ints;
using ::kvcache::testing::LoadReference;

class SmolLmTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto f = gguf::OpenModelFile(gguf::DefaultModelPath());
    if (!f.ok()) {
      error_ = new std::string(f.status().ToString());
      return;
    }
    file_ = f->release();
    auto t = Tokenizer::FromGguf(*file_);
    if (!t.ok()) {
      error_ = new std::string(t.status().ToString());
      return;
    }
    tok_ = t->release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    delete file_;
  }
  void SetUp() override { ASSERT_NE(tok_, nullptr) << *error_; }
  static gguf::GgufFile* file_;
  static Tokenizer* tok_;
  static std::string* error_;
};
gguf::GgufFile* SmolLmTokenizerTest::file_ = nullptr;
Tokenizer* SmolLmTokenizerTest::tok_ = nullptr;
std::string* SmolLmTokenizerTest::error_ = nullptr;

TEST_F(SmolLmTokenizerTest, VocabularyFacts) {
  EXPECT_EQ(tok_->n_vocab(), 49152);
  EXPECT_EQ(tok_->bos_id(), 1);
  EXPECT_EQ(tok_->eos_id(), 2);
  EXPECT_FALSE(tok_->spec().add_bos);
  EXPECT_EQ(tok_->FindToken("<|im_start|>"), 1);
  EXPECT_EQ(tok_->token_type(1), TokenType::kControl);
  EXPECT_TRUE(tok_->IsEndOfGeneration(2));  // <|im_end|>
  EXPECT_TRUE(tok_->IsEndOfGeneration(0));  // <|endoftext|>
  EXPECT_FALSE(tok_->IsEndOfGeneration(1));
  EXPECT_EQ(tok_->eog_ids(), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(tok_->TokenToPiece(49152, true).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(tok_->Decode({5, -1}, true).status().code(), absl::StatusCode::kOutOfRange);
}

TEST_F(SmolLmTokenizerTest, MatchesLlamaCppOnCorpus) {
  auto ref = LoadReference("tokenizer_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& cases = ref->fields().at("cases").list_value().values();
  ASSERT_GE(cases.size(), 60);
  for (const auto& c : cases) {
    const auto& f = c.struct_value().fields();
    const std::string text = Hex(f.at("text_hex"));
    EncodeOptions opts;
    opts.add_special = f.at("add_special").bool_value();
    opts.parse_special = f.at("parse_special").bool_value();
    const std::string label =
        f.at("name").string_value() + (opts.parse_special ? " (parse_special)" : " (plain)");
    const std::vector<int32_t> want = Ints(f.at("ids"));
    const std::vector<int32_t> got = tok_->Encode(text, opts);
    EXPECT_EQ(got, want) << label << "\n got: " << absl::StrJoin(got, ",")
                         << "\nwant: " << absl::StrJoin(want, ",");
    EXPECT_EQ(*tok_->Decode(want, true), Hex(f.at("detok_special_hex"))) << label;
    EXPECT_EQ(*tok_->Decode(want, false), Hex(f.at("detok_plain_hex"))) << label;
  }
}

TEST_F(SmolLmTokenizerTest, PiecesMatchLlamaCpp) {
  auto ref = LoadReference("tokenizer_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& pieces = ref->fields().at("pieces").list_value().values();
  ASSERT_GE(pieces.size(), 300);
  for (const auto& p : pieces) {
    const auto& f = p.struct_value().fields();
    const int32_t id = static_cast<int32_t>(f.at("id").number_value());
    EXPECT_EQ(*tok_->TokenToPiece(id, true), Hex(f.at("special_hex"))) << id;
    EXPECT_EQ(*tok_->TokenToPiece(id, false), Hex(f.at("plain_hex"))) << id;
  }
}

TEST_F(SmolLmTokenizerTest, ChatTemplateMatchesJinjaRendering) {
  auto ref = LoadReference("tokenizer_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto tmpl = ChatTemplate::FromGguf(*file_);
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  EXPECT_EQ(tmpl->default_system_prompt(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  const auto& chats = ref->fields().at("chats").list_value().values();
  ASSERT_GE(chats.size(), 4);
  for (const auto& c : chats) {
    const auto& f = c.struct_value().fields();
    std::vector<ChatMessage> messages;
    for (const auto& m : f.at("messages").list_value().values()) {
      messages.push_back({m.struct_value().fields().at("role").string_value(),
                          m.struct_value().fields().at("content").string_value()});
    }
    auto got = tmpl->Render(messages, f.at("add_generation_prompt").bool_value());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, Hex(f.at("rendered_hex"))) << f.at("name").string_value();
  }
}

// plain_spans on the smollm pre-tokenizer, over the llama.cpp reference corpus
// (its texts include ChatML markers and partial markers).
TEST_F(SmolLmTokenizerTest, PlainSpansOnlyStopControlTokens) {
  auto ref = LoadReference("tokenizer_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  std::vector<std::string> texts;
  for (const auto& c : ref->fields().at("cases").list_value().values()) {
    texts.push_back(Hex(c.struct_value().fields().at("text_hex")));
  }
  EXPECT_GE(testing::CheckPlainSpans(*tok_, texts, "smollm"), 100);
}

TEST_F(SmolLmTokenizerTest, RoundTripsArbitraryValidText) {
  const std::string text =
      "Mixed: caf\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x8D\x95 1234   tabs\t\tand\nnew lines ";
  EXPECT_EQ(*tok_->Decode(tok_->Encode(text, {}), true), text);
}

// Speed is printed, not asserted (this machine is shared; sanitizer builds run
// it too): the round trip is what must hold.
TEST_F(SmolLmTokenizerTest, TenKilobytesOfEnglishRoundTrip) {
  const std::string para =
      "The quick brown fox jumps over the lazy dog. In 2024, researchers found that "
      "large language models can cache key and value tensors between turns, which "
      "saves recomputation; however, memory is limited, so pages are offloaded. ";
  std::string text;
  while (text.size() < 10 * 1024) text += para;
  text.resize(10 * 1024);
  tok_->Encode(text, {});  // warm up
  const int kIters = 20;
  const auto start = std::chrono::steady_clock::now();
  size_t n = 0;
  std::vector<int32_t> ids;
  for (int i = 0; i < kIters; ++i) {
    ids = tok_->Encode(text, {});
    n += ids.size();
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / kIters;
  printf("tokenize 10 KiB English: %.3f ms, %zu tokens\n", ms, n / kIters);
  RecordProperty("tokenize_10k_ms", std::to_string(ms));
  EXPECT_GT(ids.size(), text.size() / 8);  // words, not bytes or whole lines
  auto back = tok_->Decode(ids, /*special=*/false);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, text);
}

// ---- Behaviour on a hand-made vocabulary ----

VocabSpec TinySpec() {
  VocabSpec s;
  s.tokens = {"<|end|>", "<|im_start|>"};
  s.token_types = {TokenType::kControl, TokenType::kUserDefined};
  for (int b = 0; b < 256; ++b) {
    std::string t;
    AppendUtf8(ByteToCodepoint(static_cast<uint8_t>(b)), &t);
    s.tokens.push_back(t);
    s.token_types.push_back(TokenType::kNormal);
  }
  s.tokens.push_back("ab");
  s.token_types.push_back(TokenType::kNormal);
  s.tokens.push_back("abc");
  s.token_types.push_back(TokenType::kNormal);
  s.merges = {"b c", "a b", "ab c", "x y"};  // "bc" and "xy" are not tokens
  s.eos_id = 0;
  return s;
}

TEST(TokenizerSpecTest, MergeRanksAndNonTokenSymbols) {
  auto t = Tokenizer::Create(TinySpec());
  ASSERT_TRUE(t.ok()) << t.status();
  const int32_t a = 2 + 'a', b = 2 + 'b', c = 2 + 'c', x = 2 + 'x', y = 2 + 'y';
  // "b c" ranks first, so "abc" becomes a + "bc"; "bc" is not a token, so
  // llama.cpp falls back to the single-byte tokens of the symbol.
  EXPECT_EQ((*t)->Encode("abc", {}), (std::vector<int32_t>{a, b, c}));
  EXPECT_EQ((*t)->Encode("ab", {}), (std::vector<int32_t>{258}));
  EXPECT_EQ((*t)->Encode("xy", {}), (std::vector<int32_t>{x, y}));
}

TEST(TokenizerSpecTest, SpecialTokenParsing) {
  auto t = Tokenizer::Create(TinySpec());
  ASSERT_TRUE(t.ok());
  EncodeOptions special;
  special.parse_special = true;
  // Control tokens only with parse_special; user-defined tokens always.
  EXPECT_EQ((*t)->Encode("<|end|>", special), (std::vector<int32_t>{0}));
  EXPECT_GT((*t)->Encode("<|end|>", {}).size(), 1u);
  EXPECT_EQ((*t)->Encode("<|im_start|>", {}), (std::vector<int32_t>{1}));
  EXPECT_EQ(*(*t)->TokenToPiece(0, false), "");
  EXPECT_EQ(*(*t)->TokenToPiece(0, true), "<|end|>");
  EXPECT_EQ(*(*t)->TokenToPiece(1, false), "<|im_start|>");
}

TEST(TokenizerSpecTest, PlainSpansStopControlTokensThatOverlapThem) {
  auto t = Tokenizer::Create(TinySpec());
  ASSERT_TRUE(t.ok());
  const int32_t kEnd = 0, kImStart = 1;
  auto encode = [&](absl::string_view text, std::vector<std::pair<size_t, size_t>> spans) {
    EncodeOptions o{.add_special = false, .parse_special = true};
    o.plain_spans = spans;
    return (*t)->Encode(text, o);
  };
  auto count = [](const std::vector<int32_t>& ids, int32_t id) {
    return std::count(ids.begin(), ids.end(), id);
  };
  const std::string text = "a<|end|>b<|end|>c";  // the tokens at [1, 8) and [9, 16)
  EXPECT_EQ(count(encode(text, {}), kEnd), 2);
  EXPECT_EQ(count(encode(text, {{0, 1}, {8, 9}, {16, 17}}), kEnd), 2);  // touching, not overlapping
  EXPECT_EQ(count(encode(text, {{7, 8}}), kEnd), 1);                    // last byte of the first
  EXPECT_EQ(count(encode(text, {{9, 10}}), kEnd), 1);                   // first byte of the second
  EXPECT_EQ(count(encode(text, {{4, 12}}), kEnd), 0);
  // Any order, overlapping, empty: the union counts.
  EXPECT_EQ(count(encode(text, {{12, 13}, {3, 3}, {2, 5}, {4, 6}}), kEnd), 0);
  // Inside a span the text is encoded as with parse_special = false, where
  // user-defined tokens are still matched (llama.cpp's rule).
  EXPECT_EQ(encode(text, {{0, text.size()}}), (*t)->Encode(text, {.add_special = false}));
  EXPECT_EQ(encode("<|im_start|>", {{0, 12}}), (std::vector<int32_t>{kImStart}));
  // A match skipped for its span does not hide an overlapping one after it.
  VocabSpec s = TinySpec();
  s.tokens.push_back("xx");
  s.token_types.push_back(TokenType::kControl);
  auto xx = Tokenizer::Create(s);
  ASSERT_TRUE(xx.ok()) << xx.status();
  const int32_t kXx = static_cast<int32_t>(s.tokens.size()) - 1;
  EncodeOptions o{.add_special = false, .parse_special = true};
  EXPECT_EQ((*xx)->Encode("xxx", o), (std::vector<int32_t>{kXx, 2 + 'x'}));
  const std::vector<std::pair<size_t, size_t>> first = {{0, 1}};
  o.plain_spans = first;
  EXPECT_EQ((*xx)->Encode("xxx", o), (std::vector<int32_t>{2 + 'x', kXx}));
}

TEST(TokenizerSpecTest, BosEosFlags) {
  VocabSpec s = TinySpec();
  s.bos_id = 1;
  s.add_bos = true;
  s.add_eos = true;
  auto t = Tokenizer::Create(s);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->Encode("ab", {}), (std::vector<int32_t>{1, 258, 0}));
  EncodeOptions none;
  none.add_special = false;
  EXPECT_EQ((*t)->Encode("ab", none), (std::vector<int32_t>{258}));
}

TEST(TokenizerSpecTest, UnsupportedVocabulariesAreClearErrors) {
  VocabSpec s = TinySpec();
  s.model = "bert";
  auto t = Tokenizer::Create(s);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(t.status().message().find("'bert'"), std::string::npos);
  s = TinySpec();
  s.pre = "deepseek-llm";
  t = Tokenizer::Create(s);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(t.status().message().find("deepseek-llm"), std::string::npos);
  // A SentencePiece vocabulary with BPE merges is inconsistent.
  s = TinySpec();
  s.model = "llama";
  EXPECT_EQ(Tokenizer::Create(s).status().code(), absl::StatusCode::kInvalidArgument);
  s = TinySpec();
  s.scores = {1.0f};
  EXPECT_EQ(Tokenizer::Create(s).status().code(), absl::StatusCode::kInvalidArgument);
  s = TinySpec();
  s.merges.push_back("nospace");
  EXPECT_EQ(Tokenizer::Create(s).status().code(), absl::StatusCode::kInvalidArgument);
  s = TinySpec();
  s.eos_id = 999;
  EXPECT_EQ(Tokenizer::Create(s).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerSpecTest, TinyLlamaVocabularyRoundTrips) {
  auto bytes = gguf::BuildTinyLlama({});
  ASSERT_TRUE(bytes.ok());
  auto f = gguf::GgufFile::OpenFromBuffer(*bytes);
  ASSERT_TRUE(f.ok());
  auto t = Tokenizer::FromGguf(**f);
  ASSERT_TRUE(t.ok()) << t.status();
  EncodeOptions special;
  special.parse_special = true;
  const std::string text = "<|im_start|>user\nHello the world, what is 42?<|im_end|>\n";
  const std::vector<int32_t> ids = (*t)->Encode(text, special);
  EXPECT_EQ(ids.front(), gguf::kTinyImStart);
  EXPECT_LT(ids.size(), text.size() - 10);  // merges applied
  EXPECT_EQ(*(*t)->Decode(ids, true), text);
}

TEST(UnicodeTest, Classes) {
  EXPECT_EQ(CodepointFlags('a'), kLetter);
  EXPECT_EQ(CodepointFlags('7'), kNumber);
  EXPECT_EQ(CodepointFlags(' '), kWhitespace);
  EXPECT_EQ(CodepointFlags(0x4F60), kLetter);  // CJK
  EXPECT_EQ(CodepointFlags(0x00BD), kNumber);  // ½
  EXPECT_EQ(CodepointFlags(0x3000), kWhitespace);
  EXPECT_EQ(CodepointFlags(0x1F355), 0);        // emoji: symbol
  EXPECT_EQ(CodepointFlags(0x20000), kLetter);  // CJK extension B
  EXPECT_EQ(CodepointFlags('!'), 0);
  for (int b = 0; b < 256; ++b) {
    EXPECT_EQ(CodepointToByte(ByteToCodepoint(static_cast<uint8_t>(b))), b);
  }
  EXPECT_EQ(ByteToCodepoint(' '), 0x120u);  // 'Ġ'
}

}  // namespace
}  // namespace tok
}  // namespace kvcache
