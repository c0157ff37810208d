// Tokenisation against llama.cpp's own tokenizer test vectors
// (models/ggml-vocab-*.gguf with .gguf.inp / .gguf.out in the llama.cpp source
// that the llama-cpp-python 0.3.36 sdist vendors). scripts/setup.sh fetches
// that source (scripts/fetch_llamacpp_src.sh); a missing file FAILS the test
// with a message naming the script, it never skips.
//
// The vectors are read as llama.cpp's tests/test-tokenizer-0.cpp reads them:
// inputs separated by "\n__ggml_vocab_test__\n", one line of expected ids per
// input, tokenised with add_special = false and parse_special = false.
#include "tests/common/tokenizer/llamacpp_vocab.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/gguf/gguf_reader.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/unicode.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "tests/common/tokenizer/plain_spans_checks.h"

namespace kvcache {
namespace tok {
namespace {

using ::kvcache::testing::ReadFileBytes;

struct VocabCase {
  std::string text;
  std::vector<int32_t> ids;
};

struct Vocab {
  std::unique_ptr<gguf::GgufFile> file;
  std::unique_ptr<Tokenizer> tok;
  std::vector<VocabCase> cases;
};

absl::StatusOr<Vocab> LoadVocab(const std::string& name) {
  const std::string base = testing::LlamaCppVocabPath(name);
  const std::string hint = testing::kLlamaCppVocabHint;
  Vocab v;
  auto file = gguf::GgufFile::Open(base);
  if (!file.ok()) return absl::NotFoundError(absl::StrCat(file.status().message(), hint));
  v.file = std::move(*file);
  auto tok = Tokenizer::FromGguf(*v.file);
  if (!tok.ok()) return tok.status();
  v.tok = std::move(*tok);
  auto inp = ReadFileBytes(base + ".inp");
  auto outp = ReadFileBytes(base + ".out");
  if (!inp.ok() || !outp.ok()) {
    return absl::NotFoundError(absl::StrCat("cannot read ", base, ".inp/.out", hint));
  }
  std::vector<std::string> texts = absl::StrSplit(*inp, "\n__ggml_vocab_test__\n");
  // As llama.cpp reads it: a trailing separator does not open another input.
  if (!texts.empty() && texts.back().empty()) texts.pop_back();
  std::vector<std::string> lines = absl::StrSplit(*outp, '\n');
  // getline() semantics: a final newline does not start another line.
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  if (texts.size() != lines.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(base, ": ", texts.size(), " inputs but ", lines.size(), " outputs"));
  }
  // llama.cpp keys its cases by text (a std::map), so duplicates count once.
  std::map<std::string, std::vector<int32_t>> unique;
  for (size_t i = 0; i < texts.size(); ++i) {
    std::vector<int32_t> ids;
    for (absl::string_view t : absl::StrSplit(absl::StripAsciiWhitespace(lines[i]), ' ', absl::SkipEmpty())) {
      int32_t id;
      if (!absl::SimpleAtoi(t, &id)) return absl::InvalidArgumentError(absl::StrCat("bad id '", t, "'"));
      ids.push_back(id);
    }
    unique[texts[i]] = std::move(ids);
  }
  for (auto& [text, ids] : unique) v.cases.push_back({text, std::move(ids)});
  return v;
}

// Every vector must match; returns how many did, for the log line.
int ExpectAllMatch(const Vocab& v, const std::string& name) {
  int matched = 0;
  for (const VocabCase& c : v.cases) {
    const std::vector<int32_t> got = v.tok->Encode(c.text, {.add_special = false, .parse_special = false});
    if (got == c.ids) {
      ++matched;
    } else {
      ADD_FAILURE() << name << ": '" << c.text << "'\n got: " << absl::StrJoin(got, " ")
                    << "\nwant: " << absl::StrJoin(c.ids, " ");
    }
  }
  printf("%s: %d of %zu llama.cpp test strings match\n", name.c_str(), matched, v.cases.size());
  return matched;
}

class LlamaCppVocabTest : public ::testing::TestWithParam<const char*> {};

TEST_P(LlamaCppVocabTest, MatchesTestVectors) {
  auto v = LoadVocab(GetParam());
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_GE(v->cases.size(), 30u);
  EXPECT_EQ(ExpectAllMatch(*v, GetParam()), static_cast<int>(v->cases.size()));
  // Decoding the expected ids gives the text back (SentencePiece: after the
  // space it prefixed).
  const bool spm = v->tok->spec().model == "llama";
  for (const VocabCase& c : v->cases) {
    auto text = v->tok->Decode(c.ids, /*special=*/true);
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_EQ(*text, (spm && !c.text.empty() ? " " : "") + c.text) << GetParam();
  }
}

// EncodeOptions::plain_spans on every vocabulary kind, over the test vectors
// and the wider corpus: control tokens overlapping a span are text, and text
// without control tokens encodes exactly as without spans.
TEST_P(LlamaCppVocabTest, PlainSpansOnlyStopControlTokens) {
  auto v = LoadVocab(GetParam());
  ASSERT_TRUE(v.ok()) << v.status();
  auto ref = testing::LoadReference("tokenizer_llamacpp_corpus.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  std::vector<std::string> texts;
  for (const VocabCase& c : v->cases) texts.push_back(c.text);
  for (const auto& t : ref->fields().at("texts_hex").list_value().values()) texts.push_back(testing::Hex(t));
  const int compared = testing::CheckPlainSpans(*v->tok, texts, GetParam());
  printf("%s: %d plain-span encodings checked\n", GetParam(), compared);
  EXPECT_GE(compared, 200);
}

INSTANTIATE_TEST_SUITE_P(Vocabs, LlamaCppVocabTest,
                         ::testing::Values("llama-bpe", "qwen2", "llama-spm", "gpt-2"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string n = info.param;
                           for (char& c : n) {
                             if (c == '-') c = '_';
                           }
                           return n;
                         });

// A wider corpus (edge cases, seeded random mixes, invalid UTF-8) tokenised
// by llama.cpp's llama_tokenize itself, with and without special handling,
// and llama_token_to_piece on sampled ids (tests/data/record_tokenizer_corpus.py).
TEST(LlamaCppCorpus, MatchesLlamaTokenize) {
  auto ref = testing::LoadReference("tokenizer_llamacpp_corpus.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto& f = ref->fields();
  std::vector<std::string> texts;
  for (const auto& t : f.at("texts_hex").list_value().values()) texts.push_back(testing::Hex(t));
  const auto& modes = f.at("modes").list_value().values();
  ASSERT_GE(texts.size(), 80u);
  for (const auto& vv : f.at("vocabs").list_value().values()) {
    const auto& v = vv.struct_value().fields();
    const std::string name = v.at("name").string_value();
    auto vocab = LoadVocab(name);
    ASSERT_TRUE(vocab.ok()) << vocab.status();
    const auto& ids = v.at("ids").list_value().values();
    const int n_modes = modes.size();
    ASSERT_EQ(ids.size(), static_cast<int>(texts.size()) * n_modes) << name;
    int matched = 0;
    for (int i = 0; i < ids.size(); ++i) {
      const auto& mode = modes[i % n_modes].list_value().values();
      EncodeOptions opts;
      opts.add_special = mode[0].number_value() != 0;
      opts.parse_special = mode[1].number_value() != 0;
      const std::string& text = texts[i / n_modes];
      const std::vector<int32_t> want = testing::Ints(ids[i]);
      const std::vector<int32_t> got = vocab->tok->Encode(text, opts);
      if (got == want) {
        ++matched;
      } else {
        ADD_FAILURE() << name << " add_special=" << opts.add_special
                      << " parse_special=" << opts.parse_special << " '" << text
                      << "'\n got: " << absl::StrJoin(got, " ") << "\nwant: " << absl::StrJoin(want, " ");
      }
    }
    int pieces = 0;
    for (const auto& pv : v.at("pieces").list_value().values()) {
      const auto& p = pv.list_value().values();
      const int32_t id = static_cast<int32_t>(p[0].number_value());
      EXPECT_EQ(*vocab->tok->TokenToPiece(id, true), testing::Hex(p[1])) << name << " " << id;
      EXPECT_EQ(*vocab->tok->TokenToPiece(id, false), testing::Hex(p[2])) << name << " " << id;
      ++pieces;
    }
    printf("%s: %d of %d llama_tokenize results match; %d pieces checked\n", name.c_str(), matched,
           ids.size(), pieces);
    EXPECT_EQ(matched, ids.size()) << name;
  }
}

// The letter / number / whitespace classes the pre-tokenizers use equal
// llama.cpp's (src/unicode-data.cpp) for every code point: a table from
// another Unicode version splits text in newer scripts differently.
TEST(LlamaCppUnicode, ClassesMatchEveryCodePoint) {
  const std::string path = testing::LlamaCppSourceDir() + "/src/unicode-data.cpp";
  auto src = ReadFileBytes(path);
  ASSERT_TRUE(src.ok()) << src.status() << testing::kLlamaCppVocabHint;
  // {start, flags} pairs; a range lasts until the next start. Flags: 0x2
  // number, 0x4 letter.
  const size_t table = src->find("unicode_ranges_flags");
  ASSERT_NE(table, std::string::npos);
  const size_t end = src->find("};", table);
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  for (size_t pos = src->find("{0x", table); pos < end; pos = src->find("{0x", pos + 1)) {
    uint32_t start = 0, flags = 0;
    ASSERT_EQ(sscanf(src->c_str() + pos, "{0x%x, 0x%x}", &start, &flags), 2);
    ranges.push_back({start, flags});
  }
  ASSERT_GT(ranges.size(), 1000u);
  std::vector<uint32_t> whitespace;
  const size_t ws = src->find("unicode_set_whitespace");
  ASSERT_NE(ws, std::string::npos);
  const size_t ws_end = src->find("};", ws);
  for (size_t pos = src->find("0x", ws); pos < ws_end; pos = src->find("0x", pos + 1)) {
    uint32_t cp = 0;
    ASSERT_EQ(sscanf(src->c_str() + pos, "0x%x", &cp), 1);
    whitespace.push_back(cp);
  }
  ASSERT_GE(whitespace.size(), 20u);
  int mismatches = 0;
  size_t r = 0;
  for (uint32_t cp = 0; cp < 0x110000; ++cp) {
    while (r + 1 < ranges.size() && ranges[r + 1].first <= cp) ++r;
    const uint32_t f = ranges[r].second;
    const uint8_t want =
        ((f & 0x4) ? kLetter : 0) | ((f & 0x2) ? kNumber : 0) |
        (std::find(whitespace.begin(), whitespace.end(), cp) != whitespace.end() ? kWhitespace : 0);
    if (CodepointFlags(cp) != want && ++mismatches <= 5) {
      ADD_FAILURE() << "U+" << std::hex << cp << ": flags " << int(CodepointFlags(cp)) << ", llama.cpp "
                    << int(want);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(LlamaCppVocabFacts, Llama3) {
  auto v = LoadVocab("llama-bpe");
  ASSERT_TRUE(v.ok()) << v.status();
  const Tokenizer& t = *v->tok;
  EXPECT_EQ(t.spec().pre, "llama-bpe");
  // llama-bpe adds BOS by default (no add_bos_token key in this file).
  EXPECT_TRUE(t.spec().add_bos);
  EXPECT_EQ(t.bos_id(), 128000);
  EXPECT_EQ(t.Encode("Hello", {.add_special = true}), (std::vector<int32_t>{128000, 9906}));
  // Control tokens: parsed only with parse_special.
  EXPECT_EQ(t.Encode("<|eot_id|>", {.add_special = false, .parse_special = true}),
            (std::vector<int32_t>{128009}));
  EXPECT_NE(t.Encode("<|eot_id|>", {.add_special = false, .parse_special = false}),
            (std::vector<int32_t>{128009}));
  EXPECT_TRUE(t.IsEndOfGeneration(128001));  // <|end_of_text|>
  // (This is the Llama 3.0 vocabulary: 128008 is a reserved token, not <|eom_id|>.)
  EXPECT_FALSE(t.IsEndOfGeneration(128008));
  EXPECT_TRUE(t.IsEndOfGeneration(128009));   // <|eot_id|>
  EXPECT_FALSE(t.IsEndOfGeneration(128006));  // <|start_header_id|>
  // What a generation stops on (the engine's stop list): both, nothing else.
  EXPECT_EQ(t.eog_ids(), (std::vector<int32_t>{128001, 128009}));
  EXPECT_EQ(*t.TokenToPiece(128009, true), "<|eot_id|>");
  EXPECT_EQ(*t.TokenToPiece(128009, false), "");
  // ignore_merges: a pre-tokenized word that is a token is emitted whole.
  EXPECT_EQ(t.Encode(" Hello", {.add_special = false}), (std::vector<int32_t>{22691}));
}

TEST(LlamaCppVocabFacts, Qwen2) {
  auto v = LoadVocab("qwen2");
  ASSERT_TRUE(v.ok()) << v.status();
  const Tokenizer& t = *v->tok;
  EXPECT_FALSE(t.spec().add_bos);
  const int32_t im_end = t.FindToken("<|im_end|>");
  ASSERT_GE(im_end, 0);
  EXPECT_TRUE(t.IsEndOfGeneration(im_end));
  EXPECT_TRUE(t.IsEndOfGeneration(t.FindToken("<|endoftext|>")));
  EXPECT_FALSE(t.IsEndOfGeneration(t.FindToken("<|im_start|>")));
  // Digits are split one by one (\p{N}, not \p{N}{1,3}).
  const std::vector<int32_t> digits = t.Encode("12345", {.add_special = false});
  EXPECT_EQ(digits.size(), 5u);
  EXPECT_EQ(t.Encode("<|im_start|>user", {.add_special = true, .parse_special = true}).front(),
            t.FindToken("<|im_start|>"));
}

TEST(LlamaCppVocabFacts, SentencePiece) {
  auto v = LoadVocab("llama-spm");
  ASSERT_TRUE(v.ok()) << v.status();
  const Tokenizer& t = *v->tok;
  EXPECT_TRUE(t.spec().add_bos);
  EXPECT_TRUE(t.spec().add_space_prefix);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_TRUE(t.IsEndOfGeneration(2));
  EXPECT_EQ(t.token_type(3), TokenType::kByte);  // <0x00>
  // BOS, then the text with its space prefix.
  const std::vector<int32_t> hello = t.Encode("Hello world", {.add_special = true});
  ASSERT_FALSE(hello.empty());
  EXPECT_EQ(hello.front(), 1);
  EXPECT_EQ(*t.Decode(hello, false), " Hello world");
  // Byte fallback: a character with no token is spelled as <0xNN> tokens.
  const std::vector<int32_t> rare = t.Encode("\xf0\x9f\xa6\x99", {.add_special = false});  // U+1F999
  EXPECT_EQ(*t.Decode(rare, false), " \xf0\x9f\xa6\x99");
  int bytes = 0;
  for (int32_t id : rare) bytes += t.token_type(id) == TokenType::kByte;
  EXPECT_EQ(bytes, 4);
  EXPECT_EQ(*t.TokenToPiece(t.FindToken("<0x0A>"), false), "\n");
  // A special token in the text is parsed with parse_special, and the text
  // after it gets a space prefix again.
  const std::vector<int32_t> s = t.Encode("a</s>b", {.add_special = false, .parse_special = true});
  ASSERT_EQ(s.size(), 3u) << absl::StrJoin(s, ",");
  EXPECT_EQ(s[1], 2);
  EXPECT_EQ(*t.TokenToPiece(s[2], false), " b");
}

}  // namespace
}  // namespace tok
}  // namespace kvcache
