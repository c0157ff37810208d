#include "common/block_hash.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvcache {
namespace {

TEST(BlockHashTest, KnownAnswerMatchesTheDocumentedLayout) {
  // sha256(zeros32 | le64(1) "m" | le64(1) "t" | le64(2) | le32(1) le32(2)), via Python hashlib.
  const std::vector<int32_t> tokens = {1, 2};
  EXPECT_EQ(ComputeBlockHash(BlockHash::Zero(), "m", "t", tokens).ToHex(),
            "44b3743682fd3b9a457635d614a355dc7b0b35457eeef316bf23be0ebec4eb81");
}

TEST(BlockHashTest, EveryInputChangesTheHash) {
  const std::vector<int32_t> a = {1, 2, 3, 4};
  const std::vector<int32_t> b = {1, 2, 3, 5};
  const BlockHash base = ComputeBlockHash(BlockHash::Zero(), "model", "tenant", a);
  EXPECT_EQ(base, ComputeBlockHash(BlockHash::Zero(), "model", "tenant", a));
  EXPECT_NE(base, ComputeBlockHash(BlockHash::Zero(), "model", "tenant", b));
  EXPECT_NE(base, ComputeBlockHash(BlockHash::Zero(), "model2", "tenant", a));
  EXPECT_NE(base, ComputeBlockHash(BlockHash::Zero(), "model", "tenant2", a));
  EXPECT_NE(base, ComputeBlockHash(base, "model", "tenant", a));
  // Length prefixes: moving a byte between model id and salt changes the hash.
  EXPECT_NE(ComputeBlockHash(BlockHash::Zero(), "ab", "c", a),
            ComputeBlockHash(BlockHash::Zero(), "a", "bc", a));
}

TEST(BlockHashTest, ChainCoversFullPagesOnlyAndIsChained) {
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<BlockHash> chain = ChainBlockHashes(tokens, 4, "m", "t");
  ASSERT_EQ(chain.size(), 2u);
  const std::vector<int32_t> p0(tokens.begin(), tokens.begin() + 4);
  const std::vector<int32_t> p1(tokens.begin() + 4, tokens.begin() + 8);
  EXPECT_EQ(chain[0], ComputeBlockHash(BlockHash::Zero(), "m", "t", p0));
  EXPECT_EQ(chain[1], ComputeBlockHash(chain[0], "m", "t", p1));
  // Same second page after a different first page: different hash.
  std::vector<int32_t> other = tokens;
  other[0] = 99;
  EXPECT_NE(ChainBlockHashes(other, 4, "m", "t")[1], chain[1]);
}

TEST(BlockHashTest, HexRoundTrip) {
  const std::vector<int32_t> t = {7};
  const BlockHash h = ComputeBlockHash(BlockHash::Zero(), "m", "t", t);
  BlockHash back;
  ASSERT_TRUE(BlockHash::FromHex(h.ToHex(), &back));
  EXPECT_EQ(back, h);
  EXPECT_FALSE(BlockHash::FromHex("xyz", &back));
  EXPECT_FALSE(BlockHash::FromHex(std::string(64, 'g'), &back));
  EXPECT_TRUE(BlockHash::Zero().IsZero());
}

}  // namespace
}  // namespace kvcache
