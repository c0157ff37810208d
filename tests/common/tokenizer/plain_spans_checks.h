// Test helper: the properties EncodeOptions::plain_spans must have on any
// vocabulary, checked over a corpus of texts (the llama.cpp vectors, the
// SmolLM2 reference corpus).
//
// Thread-safety: free functions, no shared state.
#ifndef KVCACHE_TESTS_COMMON_TOKENIZER_PLAIN_SPANS_CHECKS_H_
#define KVCACHE_TESTS_COMMON_TOKENIZER_PLAIN_SPANS_CHECKS_H_

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace kvcache {
namespace testing {

// Whether `text` holds the text of a token that parse_special governs.
inline bool HasControlText(const tok::Tokenizer& t, const std::string& text) {
  for (int32_t id = 0; id < t.n_vocab(); ++id) {
    const tok::TokenType type = t.token_type(id);
    if ((type == tok::TokenType::kControl || type == tok::TokenType::kUnknown) && !t.TokenText(id).empty() &&
        absl::StrContains(text, t.TokenText(id))) {
      return true;
    }
  }
  return false;
}

// For every text of `texts`, with and without add_special:
//  - a plain span over the whole text encodes it as parse_special = false;
//  - a text without control-token text encodes exactly as before whatever
//    spans it carries (spans do not split the raw text);
//  - two such texts joined by control tokens, the texts marked plain, encode
//    as with parse_special alone; marking a control token plain drops it.
// Returns how many comparisons were made.
inline int CheckPlainSpans(const tok::Tokenizer& t, const std::vector<std::string>& texts,
                           const std::string& name) {
  using Spans = std::vector<std::pair<size_t, size_t>>;
  std::vector<std::string> controls;  // control texts to join with
  for (int32_t id : {t.eos_id(), t.bos_id()}) {
    if (t.IsValid(id) && t.token_type(id) == tok::TokenType::kControl) controls.emplace_back(t.TokenText(id));
  }
  EXPECT_FALSE(controls.empty()) << name;
  if (controls.empty()) return 0;
  const std::string& c0 = controls.front();
  const std::string& c1 = controls.back();
  const int32_t c0_id = t.FindToken(c0), c1_id = t.FindToken(c1);
  auto count = [&](const std::vector<int32_t>& ids) {
    return std::count(ids.begin(), ids.end(), c0_id) +
           (c1_id != c0_id ? std::count(ids.begin(), ids.end(), c1_id) : 0);
  };
  int compared = 0;
  std::vector<const std::string*> clean;
  for (const std::string& text : texts) {
    const bool has_control = HasControlText(t, text);
    if (!has_control) clean.push_back(&text);
    for (bool add_special : {false, true}) {
      const tok::EncodeOptions special{.add_special = add_special, .parse_special = true};
      const tok::EncodeOptions plain{.add_special = add_special, .parse_special = false};
      const std::vector<int32_t> want_special = t.Encode(text, special);
      const Spans whole = {{0, text.size()}};
      tok::EncodeOptions o = special;
      o.plain_spans = whole;
      EXPECT_EQ(t.Encode(text, o), t.Encode(text, plain)) << name << " whole span: '" << text << "'";
      ++compared;
      if (has_control) continue;
      // Spans that start and end anywhere, even inside a UTF-8 sequence.
      Spans grid = {{text.size() / 2, text.size()}};
      for (size_t b = 1; b < text.size(); b += 7) grid.push_back({b, std::min(b + 3, text.size())});
      o.plain_spans = grid;
      EXPECT_EQ(t.Encode(text, o), want_special) << name << " grid spans: '" << text << "'";
      ++compared;
    }
  }
  EXPECT_GE(clean.size(), 2u) << name;
  for (size_t i = 0; i + 1 < clean.size(); ++i) {
    const std::string& a = *clean[i];
    const std::string& b = *clean[i + 1];
    const std::string joined = a + c0 + b + c1;
    const tok::EncodeOptions special{.add_special = false, .parse_special = true};
    const std::vector<int32_t> want = t.Encode(joined, special);
    EXPECT_EQ(count(want), 2) << name << ": '" << joined << "'";
    const Spans texts_plain = {{0, a.size()}, {a.size() + c0.size(), a.size() + c0.size() + b.size()}};
    tok::EncodeOptions o = special;
    o.plain_spans = texts_plain;
    EXPECT_EQ(t.Encode(joined, o), want) << name << ": '" << joined << "'";
    // One byte of the first control token in a span: that token is text.
    const Spans first_plain = {{a.size() + c0.size() - 1, a.size() + c0.size()}};
    o.plain_spans = first_plain;
    const std::vector<int32_t> got = t.Encode(joined, o);
    EXPECT_EQ(count(got), 1) << name << ": '" << joined << "' " << absl::StrJoin(got, ",");
    compared += 2;
  }
  return compared;
}

}  // namespace testing
}  // namespace kvcache

#endif  // KVCACHE_TESTS_COMMON_TOKENIZER_PLAIN_SPANS_CHECKS_H_
