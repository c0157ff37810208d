// The `tekken` pre-tokenizer (Mistral Nemo, Mistral Small 3, Pixtral) against
// llama.cpp. No tekken vocabulary ships with llama.cpp, so the test makes the
// one tests/data/record_tekken_reference.py recorded llama.cpp on: every key
// of models/ggml-vocab-llama-bpe.gguf, copied with the project's GGUF writer,
// with tokenizer.ggml.pre = "tekken". A missing llama.cpp source FAILS the
// test with a message naming the script that fetches it; it never skips.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/gguf_writer.h"
#include "common/status_macros.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/unicode.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/reference_data.h"
#include "tests/common/tokenizer/llamacpp_vocab.h"

namespace kvcache {
namespace tok {
namespace {

// The llama-bpe vocabulary file with tokenizer.ggml.pre = "tekken".
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTekken() {
  auto src = gguf::GgufFile::Open(testing::LlamaCppVocabPath("llama-bpe"));
  if (!src.ok())
    return absl::NotFoundError(absl::StrCat(src.status().message(), testing::kLlamaCppVocabHint));
  gguf::GgufWriter w;
  bool replaced = false;
  for (const auto& [key, value] : (*src)->metadata()) {
    if (key == "tokenizer.ggml.pre") {
      w.AddString(key, "tekken");
      replaced = true;
      continue;
    }
    KVCACHE_RETURN_IF_ERROR(w.CopyValue(key, value));
  }
  if (!replaced) return absl::InvalidArgumentError("the llama-bpe vocabulary has no tokenizer.ggml.pre");
  KVCACHE_ASSIGN_OR_RETURN(std::string bytes, w.Serialize());
  KVCACHE_ASSIGN_OR_RETURN(auto file, gguf::GgufFile::OpenFromBuffer(std::move(bytes)));
  return Tokenizer::FromGguf(*file);
}

// Whether decoding can give `s` back: well-formed, shortest-form UTF-8 (an
// invalid byte decodes as U+FFFD, an overlong form as its code point).
bool RoundTripsAsUtf8(const std::string& s) {
  std::string again;
  for (uint32_t cp : DecodeUtf8All(s)) AppendUtf8(cp, &again);
  return again == s;
}

// tests/data/tokenizer_tekken_reference.json: llama_tokenize with
// (add_special, parse_special) = (0, 0) and (1, 1) on the llama-bpe corpus plus
// texts aimed at tekken's regex, llama_detokenize of both, and token pieces.
TEST(LlamaCppTekken, MatchesLlamaTokenize) {
  auto ref = testing::LoadReference("tokenizer_tekken_reference.json");
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto tok = LoadTekken();
  ASSERT_TRUE(tok.ok()) << tok.status();
  const Tokenizer& t = **tok;
  const auto& f = ref->fields();
  const auto& vocab = f.at("vocab").struct_value().fields();
  // The same vocabulary llama.cpp was given.
  ASSERT_EQ(t.n_vocab(), static_cast<int32_t>(vocab.at("n_tokens").number_value()));
  ASSERT_EQ(t.bos_id(), static_cast<int32_t>(vocab.at("bos_token_id").number_value()));
  ASSERT_EQ(t.spec().pre, vocab.at("tokenizer.ggml.pre").string_value());

  std::vector<std::string> texts;
  for (const auto& x : f.at("texts_hex").list_value().values()) texts.push_back(testing::Hex(x));
  ASSERT_GE(texts.size(), 240u);
  std::vector<EncodeOptions> modes;
  for (const auto& m : f.at("modes").list_value().values()) {
    const auto& v = m.list_value().values();
    modes.push_back({.add_special = v[0].number_value() != 0, .parse_special = v[1].number_value() != 0});
  }
  ASSERT_EQ(modes.size(), 2u);
  ASSERT_FALSE(modes[0].add_special || modes[0].parse_special);
  ASSERT_TRUE(modes[1].add_special && modes[1].parse_special);
  const auto& ids = f.at("ids").list_value().values();
  ASSERT_EQ(ids.size(), static_cast<int>(texts.size() * modes.size()));
  int matched = 0;
  for (int i = 0; i < ids.size(); ++i) {
    const EncodeOptions& opts = modes[i % modes.size()];
    const std::string& text = texts[i / modes.size()];
    const std::vector<int32_t> want = testing::Ints(ids[i]);
    const std::vector<int32_t> got = t.Encode(text, opts);
    if (got == want) {
      ++matched;
    } else {
      ADD_FAILURE() << "add_special=" << opts.add_special << " parse_special=" << opts.parse_special << " '"
                    << text << "'\n got: " << absl::StrJoin(got, " ")
                    << "\nwant: " << absl::StrJoin(want, " ");
    }
  }
  printf("tekken: %d of %d llama_tokenize results match (%zu texts x %zu modes)\n", matched, ids.size(),
         texts.size(), modes.size());
  EXPECT_EQ(matched, ids.size());

  // Detokenisation: llama_detokenize (clean_spaces is off for tekken, so it
  // is the concatenation of pieces) of the (1, 1) ids with special tokens
  // rendered and of the (0, 0) ids without; and the round trip to the text.
  const auto& detok = f.at("detok_hex").list_value().values();
  ASSERT_EQ(detok.size(), static_cast<int>(texts.size()));
  int round_trips = 0, detok_matched = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto& d = detok[i].list_value().values();
    const std::vector<int32_t> special = testing::Ints(ids[i * modes.size() + 1]);
    const std::vector<int32_t> plain = testing::Ints(ids[i * modes.size()]);
    auto special_text = t.Decode(special, /*special=*/true);
    auto plain_text = t.Decode(plain, /*special=*/false);
    ASSERT_TRUE(special_text.ok() && plain_text.ok());
    EXPECT_EQ(*special_text, testing::Hex(d[0])) << "'" << texts[i] << "'";
    EXPECT_EQ(*plain_text, testing::Hex(d[1])) << "'" << texts[i] << "'";
    detok_matched += (*special_text == testing::Hex(d[0])) + (*plain_text == testing::Hex(d[1]));
    if (RoundTripsAsUtf8(texts[i])) {
      EXPECT_EQ(*plain_text, texts[i]);
      EXPECT_EQ(*special_text, "<|begin_of_text|>" + texts[i]);
      ++round_trips;
    }
  }
  printf("tekken: %d of %zu detokenisations match llama_detokenize; %d valid UTF-8 texts round-trip\n",
         detok_matched, texts.size() * 2, round_trips);
  EXPECT_GE(round_trips, 200);

  int pieces = 0;
  for (const auto& pv : f.at("pieces").list_value().values()) {
    const auto& p = pv.list_value().values();
    const int32_t id = static_cast<int32_t>(p[0].number_value());
    EXPECT_EQ(*t.TokenToPiece(id, true), testing::Hex(p[1])) << id;
    EXPECT_EQ(*t.TokenToPiece(id, false), testing::Hex(p[2])) << id;
    ++pieces;
  }
  EXPECT_GE(pieces, 50);
}

// What tekken does differently from llama-bpe on the same vocabulary, as
// token pieces (these texts are in the recorded corpus too).
TEST(LlamaCppTekken, DiffersFromLlama3WhereLlamaCppDoes) {
  auto tok = LoadTekken();
  ASSERT_TRUE(tok.ok()) << tok.status();
  const Tokenizer& t = **tok;
  auto llama3_file = gguf::GgufFile::Open(testing::LlamaCppVocabPath("llama-bpe"));
  ASSERT_TRUE(llama3_file.ok()) << llama3_file.status() << testing::kLlamaCppVocabHint;
  auto llama3 = Tokenizer::FromGguf(**llama3_file);
  ASSERT_TRUE(llama3.ok()) << llama3.status();
  EXPECT_TRUE(t.spec().add_bos);  // llama.cpp's tekken default; the file has no add_bos_token key
  EXPECT_EQ(t.Encode("Hi", {.add_special = true}).front(), 128000);
  auto pieces = [](const Tokenizer& tk, const std::string& text) {
    std::vector<std::string> out;
    for (int32_t id : tk.Encode(text, {.add_special = false})) out.push_back(*tk.TokenToPiece(id, false));
    return absl::StrJoin(out, "|");
  };
  struct Case {
    std::string text, tekken, llama3;
  };
  const Case cases[] = {
      {"2024", "2|0|2|4", "202|4"},                               // one digit per word
      {"iPhone", "i|Phone", "iPhone"},                            // a word ends where lower turns upper
      {"XMLHttpRequest", "XML|Http|Request", "XML|HttpRequest"},  // ... and capitals start one
      // A non-ASCII letter counts as both cases: "NACIÓ|N" (Hugging Face: one word).
      {"NACI\xc3\x93N", "N|AC|I|\xc3\x93|N", "N|ACI\xc3\x93N"},
      {".\n/x", ".\n|/|x", ".\n|/x"},  // [\r\n/]* after punctuation
  };
  for (const Case& c : cases) {
    EXPECT_EQ(pieces(t, c.text), c.tekken);
    EXPECT_EQ(pieces(**llama3, c.text), c.llama3);
  }
}

}  // namespace
}  // namespace tok
}  // namespace kvcache
