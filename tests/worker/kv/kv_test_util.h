// Helpers shared by the KV cache tests: a small model shape and a K/V byte pattern
// that, like a real model, depends only on (tenant, tokens up to the position), so
// shared prefix pages, forks, offloads and imports can all be checked bit for bit.
#ifndef KVCACHE_TESTS_WORKER_KV_KV_TEST_UTIL_H_
#define KVCACHE_TESTS_WORKER_KV_KV_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "worker/kv/kv_cache_manager.h"

// Status checks the KV tests share.
#define ASSERT_OK(expr) ASSERT_TRUE((expr).ok()) << (expr)
#define EXPECT_INVARIANTS(m) EXPECT_TRUE((m).CheckInvariants().ok()) << (m).CheckInvariants()

namespace kvcache::kv::testing {

// page: [2 layers][K,V][4 tokens][2 heads][4 dims] f32 -> 128 B/token, 512 B/page.
inline KvShape SmallShape(int window = 0) {
  KvShape s;
  s.layers = 2;
  s.kv_heads = 2;
  s.head_dim = 4;
  s.dtype = KvDtype::kF32;
  s.page_tokens = 4;
  s.sliding_window = window;
  return s;
}

inline KvCacheOptions SmallOptions(int64_t tier0_pages, int64_t tier1_pages, int window = 0) {
  KvCacheOptions o;
  o.shape = SmallShape(window);
  o.model_id = "test-model";
  o.tier0_bytes = tier0_pages * o.shape.page_bytes();
  o.tier1_bytes = tier1_pages * o.shape.page_bytes();
  o.max_session_tokens = 4096;
  return o;
}

// A manager over SmallOptions (with `model_id`); fails the test when it cannot
// be built.
inline std::unique_ptr<KvCacheManager> MakeManager(int64_t tier0_pages, int64_t tier1_pages, int window = 0,
                                                   const std::string& model_id = "test-model") {
  KvCacheOptions o = SmallOptions(tier0_pages, tier1_pages, window);
  o.model_id = model_id;
  auto m = KvCacheManager::Create(o);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(m).value();
}

inline uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Per position i, a hash of (tenant, tokens[0..i]).
inline std::vector<uint64_t> PositionHashes(const std::string& tenant, absl::Span<const int32_t> tokens) {
  uint64_t h = std::hash<std::string>{}(tenant);
  std::vector<uint64_t> out;
  out.reserve(tokens.size());
  for (int32_t t : tokens) {
    h = SplitMix(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(t)) * 0x100000001b3ULL));
    out.push_back(h);
  }
  return out;
}

// Fills one K or V row with bytes derived from (position hash, layer, kv).
inline void FillRow(uint8_t* row, int64_t row_bytes, uint64_t h, int layer, int kv) {
  uint64_t x = SplitMix(h ^ (static_cast<uint64_t>(layer) << 32) ^ static_cast<uint64_t>(kv));
  for (int64_t b = 0; b < row_bytes; b += 8) {
    x = SplitMix(x);
    std::memcpy(row + b, &x, std::min<int64_t>(8, row_bytes - b));
  }
}

// Writes the pattern for position `pos` into `page` (host bytes of a page).
inline void WriteSlot(const KvShape& s, uint8_t* page, int64_t pos, uint64_t h) {
  const int slot = static_cast<int>(pos % s.page_tokens);
  for (int l = 0; l < s.layers; ++l) {
    FillRow(page + KOffset(s, l, slot), s.row_bytes(), h, l, 0);
    FillRow(page + VOffset(s, l, slot), s.row_bytes(), h, l, 1);
  }
}

inline bool SlotMatches(const KvShape& s, const uint8_t* page, int64_t pos, uint64_t h) {
  std::vector<uint8_t> want(static_cast<size_t>(s.row_bytes()));
  const int slot = static_cast<int>(pos % s.page_tokens);
  for (int l = 0; l < s.layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      FillRow(want.data(), s.row_bytes(), h, l, kv);
      const int64_t off = kv == 0 ? KOffset(s, l, slot) : VOffset(s, l, slot);
      if (std::memcmp(page + off, want.data(), want.size()) != 0) return false;
    }
  }
  return true;
}

// What an engine step does: reserve, write K/V for the new tokens, commit.
inline absl::Status AppendWithKv(KvCacheManager& m, const std::string& id, absl::Span<const int32_t> tokens,
                                 std::vector<std::string>* preempted = nullptr) {
  auto info = m.GetSession(id);
  if (!info.ok()) return info.status();
  auto old = m.GetTokens(id);
  if (!old.ok()) return old.status();
  auto r = m.BeginStep(id, static_cast<int64_t>(tokens.size()));
  if (!r.ok()) return r.status();
  if (preempted != nullptr) *preempted = r->preempted;
  std::vector<int32_t> all = *old;
  all.insert(all.end(), tokens.begin(), tokens.end());
  const std::vector<uint64_t> h = PositionHashes(info->tenant, all);
  const KvShape& s = m.shape();
  for (int64_t pos = r->first_pos; pos < static_cast<int64_t>(all.size()); ++pos) {
    const PageId page = r->page_table[pos / s.page_tokens];
    if (page == kNoPage) return absl::InternalError("no page for a new token");
    WriteSlot(s, m.Tier0PageData(page), pos, h[pos]);
  }
  return m.CommitStep(id, tokens);
}

// Checks every live slot of the session holds the pattern of its tokens, reading
// from whichever tier holds the page.
inline absl::Status VerifyKv(KvCacheManager& m, const std::string& id) {
  auto info = m.GetSession(id);
  if (!info.ok()) return info.status();
  auto tokens = m.GetTokens(id);
  if (!tokens.ok()) return tokens.status();
  const std::vector<uint64_t> h = PositionHashes(info->tenant, *tokens);
  const KvShape& s = m.shape();
  for (int64_t pos = info->first_live_page * s.page_tokens; pos < static_cast<int64_t>(tokens->size());
       ++pos) {
    const int64_t p = pos / s.page_tokens;
    const int tier = info->page_tiers[p];
    if (tier < 0) return absl::InternalError(absl::StrCat(id, ": live page ", p, " missing"));
    const uint8_t* page = m.tier_storage(tier).PageData(info->page_ids[p]);
    if (!SlotMatches(s, page, pos, h[pos])) {
      return absl::InternalError(
          absl::StrCat(id, ": wrong K/V bytes at position ", pos, " (page ", p, ", tier ", tier, ")"));
    }
  }
  return absl::OkStatus();
}

inline std::vector<int32_t> Seq(int32_t from, int n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

}  // namespace kvcache::kv::testing

#endif  // KVCACHE_TESTS_WORKER_KV_KV_TEST_UTIL_H_
