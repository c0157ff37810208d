#include "worker/kv/page_pool.h"

#include <cstring>
#include <numeric>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "worker/kv/kv_shape.h"
#include "worker/kv/tier_storage.h"

namespace kvcache::kv {
namespace {

TEST(KvShapeTest, BytesPerTokenForMhaGqaMqa) {
  // 2 * layers * kv_heads * head_dim * dtype; MHA/GQA/MQA differ only in kv_heads.
  KvShape mha{32, 32, 128, KvDtype::kF16};
  KvShape gqa{32, 8, 128, KvDtype::kBF16};
  KvShape mqa{32, 1, 128, KvDtype::kF32};
  EXPECT_EQ(mha.bytes_per_token(), 2 * 32 * 32 * 128 * 2);
  EXPECT_EQ(gqa.bytes_per_token(), 2 * 32 * 8 * 128 * 2);
  EXPECT_EQ(mqa.bytes_per_token(), 2 * 32 * 1 * 128 * 4);
  KvShape smol{30, 3, 64, KvDtype::kF16, 16};
  EXPECT_EQ(smol.page_bytes(), 368640);
  EXPECT_TRUE(ValidateShape(smol).ok());
  EXPECT_EQ(ValidateShape(KvShape{0, 1, 1}).code(), absl::StatusCode::kInvalidArgument);
  KvShape bad_window = smol;
  bad_window.sliding_window = -1;
  EXPECT_FALSE(ValidateShape(bad_window).ok());
}

TEST(KvShapeTest, KAndVOffsetsTileThePageExactly) {
  const KvShape s{3, 2, 8, KvDtype::kF16, 4};
  std::set<int64_t> starts;
  for (int l = 0; l < s.layers; ++l) {
    for (int slot = 0; slot < s.page_tokens; ++slot) {
      starts.insert(KOffset(s, l, slot));
      starts.insert(VOffset(s, l, slot));
      EXPECT_EQ(VOffset(s, l, slot) - KOffset(s, l, slot), s.page_tokens * s.row_bytes());
    }
  }
  // Every row distinct, rows are row_bytes apart, last row ends at the page end.
  ASSERT_EQ(static_cast<int64_t>(starts.size()), 2 * s.layers * s.page_tokens);
  int64_t expect = 0;
  for (int64_t o : starts) {
    EXPECT_EQ(o, expect);
    expect += s.row_bytes();
  }
  EXPECT_EQ(expect, s.page_bytes());
}

TEST(CpuTierStorageTest, CopyReadWriteChecksum) {
  auto a = CreateCpuTierStorage(8, 64);
  auto b = CreateCpuTierStorage(8, 64);
  ASSERT_TRUE(a.ok() && b.ok());
  for (PageId p = 0; p < 8; ++p) std::memset((*a)->PageData(p), p + 1, 64);
  // A coalescable run (0,1,2 -> 5,6,7) and a scattered page (4 -> 0).
  const std::vector<PageId> src = {0, 1, 2, 4};
  const std::vector<PageId> dst = {5, 6, 7, 0};
  ASSERT_TRUE((*b)->CopyPages(**a, src, dst).ok());
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_EQ(std::memcmp((*a)->PageData(src[i]), (*b)->PageData(dst[i]), 64), 0);
    EXPECT_EQ(*(*a)->Checksum(src[i]), *(*b)->Checksum(dst[i]));
  }
  EXPECT_NE(*(*a)->Checksum(0), *(*a)->Checksum(1));
  std::vector<uint8_t> buf(16, 0xAB);
  ASSERT_TRUE((*b)->WritePage(3, 48, buf).ok());
  std::vector<uint8_t> back(16);
  ASSERT_TRUE((*b)->ReadPage(3, 48, absl::MakeSpan(back)).ok());
  EXPECT_EQ(back, buf);
  // Out of range is a status, not a crash.
  EXPECT_EQ((*b)->ReadPage(3, 56, absl::MakeSpan(back)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*b)->WritePage(8, 0, buf).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<PageId> bad = {9};
  EXPECT_EQ((*b)->CopyPages(**a, bad, std::vector<PageId>{0}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*b)->CopyPages(**a, src, std::vector<PageId>{0}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*b)->PageData(8), nullptr);
  EXPECT_FALSE((*b)->Checksum(-1).ok());
  EXPECT_FALSE(CreateCpuTierStorage(4, 0).ok());
}

TEST(PagePoolTest, AllocateFreeRefAndEviction) {
  PagePool pool(*CreateCpuTierStorage(4, 32));
  EXPECT_EQ(pool.capacity(), 4);
  std::vector<PageId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(pool.Allocate());
  EXPECT_EQ(ids, (std::vector<PageId>{0, 1, 2, 3}));
  EXPECT_EQ(pool.Allocate(), kNoPage);
  EXPECT_EQ(pool.num_free(), 0);

  pool.IncRef(0);
  EXPECT_EQ(pool.ref(0), 2);
  pool.DecRef(0);
  pool.DecRef(0);  // uncached: back to the free list
  EXPECT_TRUE(pool.IsFree(0));

  // Cached pages become evictable (LRU by release order) instead of free.
  pool.SetCached(1, true);
  pool.SetCached(2, true);
  pool.DecRef(2);
  pool.DecRef(1);
  EXPECT_EQ(pool.num_evictable(), 2);
  EXPECT_EQ(pool.OldestEvictable(), 2);
  pool.IncRef(2);  // a prefix hit revives it
  EXPECT_EQ(pool.OldestEvictable(), 1);
  pool.SetCached(1, false);  // evicted: freed
  EXPECT_TRUE(pool.IsFree(1));
  EXPECT_EQ(pool.num_evictable(), 0);

  const PageId st = pool.Allocate(/*staging=*/true);
  EXPECT_TRUE(pool.IsStaging(st));
  EXPECT_EQ(pool.ref(st), 0);
  EXPECT_TRUE(pool.CheckConsistency().ok());
  pool.FreeStaging(st);
  EXPECT_TRUE(pool.IsFree(st));
  EXPECT_TRUE(pool.CheckConsistency().ok()) << pool.CheckConsistency();
}

}  // namespace
}  // namespace kvcache::kv
