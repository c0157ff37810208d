#include "common/tokenizer/streaming_detokenizer.h"

#include <string>
#include <vector>

#include "common/gguf/gguf_reader.h"
#include "common/gguf/model_path.h"
#include "gtest/gtest.h"

namespace kvcache {
namespace tok {
namespace {

bool IsValidUtf8(const std::string& s) {
  std::string tail;
  return SanitizeUtf8(s, false, &tail) == s;
}

TEST(SanitizeUtf8Test, ReplacesIllFormedSequences) {
  EXPECT_EQ(SanitizeUtf8("ok", false, nullptr), "ok");
  EXPECT_EQ(SanitizeUtf8("a\xFF"
                         "b",
                         false, nullptr),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(SanitizeUtf8("\xC0\x80", false, nullptr), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong
  EXPECT_EQ(SanitizeUtf8("\xED\xA0\x80", false, nullptr),
            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  std::string tail;
  EXPECT_EQ(SanitizeUtf8("x\xF0\x9F", true, &tail), "x");
  EXPECT_EQ(tail, "\xF0\x9F");
  EXPECT_EQ(SanitizeUtf8("x\xF0\x9F", false, nullptr), "x\xEF\xBF\xBD");
}

TEST(StreamingDetokenizerTest, HoldsBackSplitCharacters) {
  StreamingDetokenizer d(nullptr);
  const std::string pizza = "\xF0\x9F\x8D\x95";
  EXPECT_EQ(d.AddBytes("I like "), "I like ");
  EXPECT_EQ(d.AddBytes(pizza.substr(0, 1)), "");
  EXPECT_EQ(d.pending_bytes(), 1u);
  EXPECT_EQ(d.AddBytes(pizza.substr(1, 2)), "");
  EXPECT_EQ(d.AddBytes(pizza.substr(3) + "!"), pizza + "!");
  EXPECT_EQ(d.pending_bytes(), 0u);
  EXPECT_EQ(d.AddBytes("\xE4\xBD"), "");
  EXPECT_EQ(d.Finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(d.Finish(), "");
}

TEST(StreamingDetokenizerTest, RealModelStreamsEmojiAndCjk) {
  auto f = gguf::OpenModelFile(gguf::DefaultModelPath());
  ASSERT_TRUE(f.ok()) << f.status();
  auto tok = Tokenizer::FromGguf(**f);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text =
      "Pizza \xF0\x9F\x8D\x95\xF0\x9F\x8D\x95, family \xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9, "
      "\xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C \xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4";
  const std::vector<int32_t> ids = (*tok)->Encode(text, {});
  // At least one token must end inside a character for this test to mean much.
  int split = 0;
  for (int32_t id : ids) split += !IsValidUtf8(*(*tok)->TokenToPiece(id, false));
  EXPECT_GT(split, 3);
  StreamingDetokenizer d(tok->get());
  std::string streamed;
  for (int32_t id : ids) {
    auto delta = d.Add(id);
    ASSERT_TRUE(delta.ok());
    EXPECT_TRUE(IsValidUtf8(*delta));
    streamed += *delta;
  }
  streamed += d.Finish();
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(d.Add(-3).status().code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace tok
}  // namespace kvcache
