#include "worker/kv/kv_cache_manager.h"

#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/kv/kv_test_util.h"

namespace kvcache::kv {
namespace {

using ::kvcache::kv::testing::AppendWithKv;
using ::kvcache::kv::testing::MakeManager;
using ::kvcache::kv::testing::Seq;
using ::kvcache::kv::testing::SmallOptions;
using ::kvcache::kv::testing::VerifyKv;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(KvCacheManagerTest, CreateValidatesOptions) {
  KvCacheOptions o = SmallOptions(0, 0);
  EXPECT_EQ(KvCacheManager::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = SmallOptions(4, 4);
  o.model_id = "";
  EXPECT_EQ(KvCacheManager::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = SmallOptions(4, 4);
  o.shape.head_dim = 0;
  EXPECT_EQ(KvCacheManager::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  // Budgets in bytes become page counts (rounded down).
  o = SmallOptions(4, 2);
  o.tier0_bytes += o.shape.page_bytes() - 1;
  auto m = KvCacheManager::Create(o);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)->tier_capacity_pages(0), 4);
  EXPECT_EQ((*m)->tier_capacity_pages(1), 2);
}

TEST(KvCacheManagerTest, BadCallsReturnClearStatuses) {
  auto m = MakeManager(8, 8);
  EXPECT_EQ(m->AppendTokens("nope", Seq(0, 3)).code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(m->AppendTokens("nope", Seq(0, 3)).message()), HasSubstr("'nope'"));
  EXPECT_EQ(m->CreateSession("", "t").code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(m->CreateSession("a", "t"));
  EXPECT_EQ(m->CreateSession("a", "t").code(), absl::StatusCode::kAlreadyExists);
  // Past max_session_tokens (4096).
  EXPECT_EQ(m->BeginStep("a", 5000).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->BeginStep("a", -1).status().code(), absl::StatusCode::kInvalidArgument);
  // More than tier 0 can ever hold: RESOURCE_EXHAUSTED, nothing allocated.
  EXPECT_EQ(m->BeginStep("a", 40).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m->GetStats().tier[0].free_pages, 8);
  EXPECT_EQ(m->CommitStep("a", Seq(0, 1)).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(m->BeginStep("a", 2).ok());
  EXPECT_EQ(m->BeginStep("a", 2).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->CommitStep("a", Seq(0, 3)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->CloseSession("a").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(m->CommitStep("a", Seq(0, 2)));
  EXPECT_EQ(m->Truncate("a", 3).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(m->CloseSession("a"));
  // Closed sessions are named as closed.
  EXPECT_EQ(m->Fork("a", "b").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(m->Fork("a", "b").message()), HasSubstr("closed"));
  EXPECT_EQ(m->AppendTokens("a", Seq(0, 1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->Fork("zzz", "b").code(), absl::StatusCode::kNotFound);
  EXPECT_INVARIANTS(*m);
  EXPECT_EQ(m->GetStats().tier[0].free_pages, 8);
}

TEST(KvCacheManagerTest, AppendAllocatesPagesAndKeepsTokens) {
  auto m = MakeManager(8, 0);
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", Seq(100, 3)));
  EXPECT_EQ(m->GetSession("a")->tier0_pages, 1);
  ASSERT_OK(AppendWithKv(*m, "a", Seq(103, 6)));  // 9 tokens -> 3 pages
  auto info = m->GetSession("a");
  EXPECT_EQ(info->num_tokens, 9);
  EXPECT_EQ(info->tier0_pages, 3);
  EXPECT_EQ(*m->GetTokens("a"), Seq(100, 9));
  ASSERT_OK(VerifyKv(*m, "a"));
  const KvStats st = m->GetStats();
  EXPECT_EQ(st.allocated_token_slots, 12);
  EXPECT_EQ(st.used_token_slots, 9);
  EXPECT_EQ(st.waste_token_slots, 3);
  // Committing fewer tokens than reserved releases the unused pages.
  auto r = m->BeginStep("a", 8);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first_pos, 9);
  EXPECT_EQ(r->page_table.size(), 5u);
  ASSERT_OK(m->CommitStep("a", Seq(109, 1)));
  EXPECT_EQ(m->GetSession("a")->tier0_pages, 3);
  EXPECT_INVARIANTS(*m);
  ASSERT_OK(m->BeginStep("a", 4).status());
  ASSERT_OK(m->AbortStep("a"));
  EXPECT_EQ(m->GetSession("a")->tier0_pages, 3);
  EXPECT_EQ(m->GetSession("a")->num_tokens, 10);
  ASSERT_OK(m->CloseSession("a"));
  EXPECT_EQ(m->GetStats().tier[0].free_pages + m->GetStats().tier[0].cached_unreferenced_pages, 8);
  EXPECT_INVARIANTS(*m);
}

TEST(KvCacheManagerTest, PrefixCacheSharesFullPagesPerTenant) {
  auto m = MakeManager(16, 0);
  const std::vector<int32_t> prompt = Seq(1, 10);  // 2 full pages + 2 tokens
  ASSERT_OK(m->CreateSession("a", "alice"));
  ASSERT_OK(AppendWithKv(*m, "a", prompt));
  EXPECT_EQ(m->LookupPrefix("alice", prompt), 8);
  EXPECT_EQ(m->LookupPrefix("bob", prompt), 0);  // tenant isolation

  ASSERT_OK(m->CreateSession("b", "alice"));
  auto hit = m->AttachPrefix("b", prompt);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(*hit, 8);
  auto a = m->GetSession("a");
  auto b = m->GetSession("b");
  EXPECT_EQ(a->page_ids[0], b->page_ids[0]);
  EXPECT_EQ(a->page_ids[1], b->page_ids[1]);
  ASSERT_OK(AppendWithKv(*m, "b", Seq(50, 5)));  // 13 tokens: a third full page
  ASSERT_OK(VerifyKv(*m, "a"));
  ASSERT_OK(VerifyKv(*m, "b"));

  ASSERT_OK(m->CreateSession("c", "bob"));
  EXPECT_EQ(*m->AttachPrefix("c", prompt), 0);
  // Diverging second page: only the first page matches.
  std::vector<int32_t> other = prompt;
  other[5] = 999;
  ASSERT_OK(m->CreateSession("d", "alice"));
  EXPECT_EQ(*m->AttachPrefix("d", other), 4);
  EXPECT_EQ(*m->AttachPrefix("d", other), 0);  // nothing further is cached
  // Only a page-aligned session whose tokens start the prompt can be extended.
  EXPECT_EQ(m->AttachPrefix("d", Seq(100, 8)).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->AttachPrefix("a", prompt).status().code(), absl::StatusCode::kFailedPrecondition);

  const KvStats st = m->GetStats();
  EXPECT_EQ(st.prefix_query_tokens, 30);
  EXPECT_EQ(st.prefix_hit_tokens, 12);
  EXPECT_EQ(st.tier[0].prefix_shared_pages, 3);  // a's two full pages + b's third
  EXPECT_INVARIANTS(*m);

  // Closing every user leaves the pages cached but unreferenced, still hit-able.
  for (const char* id : {"a", "b", "c", "d"}) ASSERT_OK(m->CloseSession(id));
  EXPECT_EQ(m->GetStats().tier[0].cached_unreferenced_pages, 3);
  ASSERT_OK(m->CreateSession("e", "alice"));
  EXPECT_EQ(*m->AttachPrefix("e", prompt), 8);
  ASSERT_OK(VerifyKv(*m, "e"));
  EXPECT_INVARIANTS(*m);
}

TEST(KvCacheManagerTest, AttachPrefixPicksUpPagesComputedSince) {
  auto m = MakeManager(16, 0);
  const std::vector<int32_t> prompt = Seq(1, 13);
  ASSERT_OK(m->CreateSession("late", "t"));
  EXPECT_EQ(*m->AttachPrefix("late", prompt), 0);  // nothing cached yet
  // Another session computes the first two pages of the same prompt.
  ASSERT_OK(m->CreateSession("first", "t"));
  ASSERT_OK(AppendWithKv(*m, "first", absl::MakeConstSpan(prompt).subspan(0, 9)));
  EXPECT_EQ(*m->AttachPrefix("late", prompt), 8);
  EXPECT_EQ(m->GetSession("late")->page_ids[1], m->GetSession("first")->page_ids[1]);
  ASSERT_OK(AppendWithKv(*m, "late", absl::MakeConstSpan(prompt).subspan(8)));
  ASSERT_OK(VerifyKv(*m, "late"));
  const KvStats st = m->GetStats();
  EXPECT_EQ(st.prefix_query_tokens, 13);  // counted once per request, on the empty session
  EXPECT_EQ(st.prefix_hit_tokens, 8);
  EXPECT_INVARIANTS(*m);
}

// Evicts every unreferenced cached tier-0 page by filling tier 0 with a session
// of `pages` full pages of unrelated tokens.
void FillTier0(KvCacheManager& m, const std::string& id, int pages) {
  ASSERT_OK(m.CreateSession(id, "filler"));
  ASSERT_OK(AppendWithKv(m, id, Seq(5000, pages * 4)));
}

TEST(KvCacheManagerTest, Tier1PrefixHitIsRestoredNotRecomputed) {
  auto m = MakeManager(6, 8);
  const std::vector<int32_t> prompt = Seq(1, 10);  // 2 full pages + 2 tokens
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", prompt));
  ASSERT_OK(m->Offload("a"));
  const uint64_t after_offload = m->ReadEvents(0).last_seq;
  FillTier0(*m, "fill", 6);  // the cached tier-0 copies are evicted
  EXPECT_EQ(m->GetStats().tier[0].cached_unreferenced_pages, 0);
  ASSERT_OK(m->CloseSession("fill"));
  // Both tiers are reported: tier 0 lost the hashes, tier 1 holds them.
  const std::vector<BlockHash> hashes = ChainBlockHashes(prompt, 4, "test-model", "t");
  bool removed_from_device = false;
  for (const KvEvent& e : m->ReadEvents(after_offload).events) {
    if (e.type == KvEventType::kPrefixRemoved && e.tier == 0) removed_from_device |= e.hashes == hashes;
    EXPECT_FALSE(e.type == KvEventType::kPrefixRemoved && e.tier == 1);
  }
  EXPECT_TRUE(removed_from_device);
  KvSnapshot snap = m->Snapshot();
  EXPECT_THAT(snap.host_prefix_hashes, ::testing::UnorderedElementsAreArray(hashes));
  EXPECT_EQ(m->LookupPrefix("t", prompt), 8);
  EXPECT_EQ(m->LookupPrefix("u", prompt), 0);  // tenant isolation holds in tier 1 too

  ASSERT_OK(m->CreateSession("b", "t"));
  int64_t restored = 0;
  EXPECT_EQ(*m->AttachPrefix("b", prompt, &restored), 8);
  EXPECT_EQ(restored, 8);
  ASSERT_OK(VerifyKv(*m, "b"));                   // the copies hold a's K/V for those positions
  EXPECT_EQ(m->GetSession("a")->tier1_pages, 3);  // a keeps its own copies
  EXPECT_EQ(m->GetStats().restore_pages, 2);
  // The restored pages are tier-0 prefix pages again: a third session shares them.
  ASSERT_OK(m->CreateSession("c", "t"));
  restored = 0;
  EXPECT_EQ(*m->AttachPrefix("c", prompt, &restored), 8);
  EXPECT_EQ(restored, 0);
  EXPECT_EQ(m->GetSession("c")->page_ids[0], m->GetSession("b")->page_ids[0]);
  ASSERT_OK(AppendWithKv(*m, "b", Seq(40, 3)));
  ASSERT_OK(VerifyKv(*m, "b"));
  EXPECT_INVARIANTS(*m);

  // Closing a frees its tier-1 pages, and routers are told.
  const uint64_t before_close = m->ReadEvents(0).last_seq;
  ASSERT_OK(m->CloseSession("a"));
  bool removed_from_host = false;
  for (const KvEvent& e : m->ReadEvents(before_close).events) {
    if (e.type == KvEventType::kPrefixRemoved && e.tier == 1) removed_from_host |= e.hashes == hashes;
  }
  EXPECT_TRUE(removed_from_host);
  EXPECT_TRUE(m->Snapshot().host_prefix_hashes.empty());
  EXPECT_INVARIANTS(*m);
}

TEST(KvCacheManagerTest, CorruptTier1PrefixPageIsNotServed) {
  auto m = MakeManager(6, 8);
  const std::vector<int32_t> prompt = Seq(1, 10);
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", prompt));
  ASSERT_OK(m->Offload("a"));
  FillTier0(*m, "fill", 6);
  ASSERT_OK(m->CloseSession("fill"));
  const PageId second = m->GetSession("a")->page_ids[1];
  m->tier_storage(1).PageData(second)[5] ^= 0x10;
  ASSERT_OK(m->CreateSession("b", "t"));
  int64_t restored = 0;
  EXPECT_EQ(*m->AttachPrefix("b", prompt, &restored), 4);  // the first page only
  EXPECT_EQ(restored, 4);
  EXPECT_EQ(m->GetStats().checksum_failures, 1);
  ASSERT_OK(VerifyKv(*m, "b"));
  EXPECT_EQ(m->LookupPrefix("t", prompt), 4);  // the corrupt page is unindexed
  EXPECT_INVARIANTS(*m);
  // Its own session still finds out on restore.
  EXPECT_EQ(m->Restore("a").code(), absl::StatusCode::kDataLoss);
  EXPECT_INVARIANTS(*m);
}

TEST(KvCacheManagerTest, ForkCopiesOnlyThePartialTail) {
  auto m = MakeManager(16, 0);
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", Seq(1, 10)));
  ASSERT_OK(m->Fork("a", "b"));
  EXPECT_EQ(m->Fork("a", "b").code(), absl::StatusCode::kAlreadyExists);
  auto a = m->GetSession("a");
  auto b = m->GetSession("b");
  EXPECT_EQ(a->page_ids[0], b->page_ids[0]);
  EXPECT_EQ(a->page_ids[1], b->page_ids[1]);
  EXPECT_NE(a->page_ids[2], b->page_ids[2]);
  EXPECT_EQ(m->GetStats().tier[0].free_pages, 16 - 4);
  // Divergent continuations do not disturb each other.
  ASSERT_OK(AppendWithKv(*m, "a", Seq(500, 5)));
  ASSERT_OK(AppendWithKv(*m, "b", Seq(700, 7)));
  ASSERT_OK(VerifyKv(*m, "a"));
  ASSERT_OK(VerifyKv(*m, "b"));
  EXPECT_INVARIANTS(*m);
}

TEST(KvCacheManagerTest, TruncateThenAppendCopiesASharedTail) {
  auto m = MakeManager(16, 0);
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", Seq(1, 8)));
  ASSERT_OK(m->Fork("a", "b"));
  ASSERT_OK(m->Truncate("b", 6));  // b's tail is a's full (shared, cached) page 1
  EXPECT_EQ(m->GetSession("b")->page_ids[1], m->GetSession("a")->page_ids[1]);
  ASSERT_OK(AppendWithKv(*m, "b", Seq(900, 3)));
  EXPECT_NE(m->GetSession("b")->page_ids[1], m->GetSession("a")->page_ids[1]);
  ASSERT_OK(VerifyKv(*m, "a"));
  ASSERT_OK(VerifyKv(*m, "b"));
  EXPECT_EQ(m->LookupPrefix("t", Seq(1, 8)), 8);  // the cached page was not overwritten
  ASSERT_OK(m->Truncate("b", 0));
  EXPECT_EQ(m->GetSession("b")->tier0_pages, 0);
  EXPECT_INVARIANTS(*m);
}

// A session cut back inside a page that only the prefix cache shares with it,
// on a full tier 0: no page is left for the copy, so the cache gives the page
// up and the append writes in place. It used to fail RESOURCE_EXHAUSTED on a
// worker with nothing else in it (a FULL_CONTEXT turn editing the last message
// of a conversation that had filled tier 0).
TEST(KvCacheManagerTest, AppendOnAFullTierTakesACachedTailPageBack) {
  auto m = MakeManager(4, 0);
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", Seq(1, 16)));  // 4 full pages, all cached
  EXPECT_EQ(m->LookupPrefix("t", Seq(1, 16)), 16);
  ASSERT_OK(m->Truncate("a", 14));
  const PageId tail = m->GetSession("a")->page_ids[3];
  ASSERT_OK(AppendWithKv(*m, "a", Seq(900, 2)));
  EXPECT_EQ(m->GetSession("a")->page_ids[3], tail) << "written in place";
  ASSERT_OK(VerifyKv(*m, "a"));
  EXPECT_EQ(m->LookupPrefix("t", Seq(1, 16)), 12) << "the page's old content is no longer offered";
  EXPECT_INVARIANTS(*m);

  // With a page free, the cached page is copied and stays offered.
  auto roomy = MakeManager(5, 0);
  ASSERT_OK(roomy->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*roomy, "a", Seq(1, 16)));
  ASSERT_OK(roomy->Truncate("a", 14));
  const PageId cached = roomy->GetSession("a")->page_ids[3];
  ASSERT_OK(AppendWithKv(*roomy, "a", Seq(900, 2)));
  EXPECT_NE(roomy->GetSession("a")->page_ids[3], cached);
  ASSERT_OK(VerifyKv(*roomy, "a"));
  EXPECT_EQ(roomy->LookupPrefix("t", Seq(1, 16)), 16);
  EXPECT_INVARIANTS(*roomy);
}

TEST(KvCacheManagerTest, SlidingWindowReleasesDeadPages) {
  auto m = MakeManager(16, 0, /*window=*/6);
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", Seq(1, 13)));  // positions < 13-6=7 are dead: page 0
  auto info = m->GetSession("a");
  EXPECT_EQ(info->first_live_page, 1);
  EXPECT_EQ(info->tier0_pages, 3);
  EXPECT_EQ(info->page_tiers[0], -1);
  ASSERT_OK(AppendWithKv(*m, "a", Seq(14, 3)));  // 16 tokens: < 10 dead: pages 0, 1
  EXPECT_EQ(m->GetSession("a")->first_live_page, 2);
  ASSERT_OK(VerifyKv(*m, "a"));
  auto r = m->BeginStep("a", 1);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->page_table[0], kNoPage);
  EXPECT_EQ(r->page_table[1], kNoPage);
  ASSERT_OK(m->AbortStep("a"));
  // Cutting back into released positions is refused; a cut that stays valid is fine.
  EXPECT_EQ(m->Truncate("a", 12).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(m->Truncate("a", 15));
  EXPECT_EQ(*m->GetTokens("a"), Seq(1, 15));
  EXPECT_INVARIANTS(*m);
}

TEST(KvCacheManagerTest, OffloadRestoreIsBitExact) {
  auto m = MakeManager(8, 8);
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", Seq(1, 14)));
  std::vector<std::vector<uint8_t>> before;
  const SessionInfo resident = *m->GetSession("a");
  for (PageId p : resident.page_ids) {
    const uint8_t* d = m->Tier0PageData(p);
    before.emplace_back(d, d + m->shape().page_bytes());
  }
  ASSERT_OK(m->Offload("a"));
  auto info = m->GetSession("a");
  EXPECT_EQ(info->tier0_pages, 0);
  EXPECT_EQ(info->tier1_pages, 4);
  ASSERT_OK(VerifyKv(*m, "a"));  // reads tier 1
  EXPECT_INVARIANTS(*m);
  // Appending restores first (BeginStep), then continues.
  auto r = m->BeginStep("a", 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->restored_pages, 4);
  ASSERT_OK(m->AbortStep("a"));
  info = m->GetSession("a");
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(std::memcmp(m->Tier0PageData(info->page_ids[i]), before[i].data(), before[i].size()), 0);
  }
  const KvStats st = m->GetStats();
  EXPECT_EQ(st.offload_bytes, 4 * m->shape().page_bytes());
  EXPECT_EQ(st.restore_bytes, 4 * m->shape().page_bytes());
  EXPECT_EQ(st.tier[1].free_pages, 8);
  ASSERT_OK(AppendWithKv(*m, "a", Seq(15, 3)));
  ASSERT_OK(VerifyKv(*m, "a"));
  EXPECT_INVARIANTS(*m);
}

TEST(KvCacheManagerTest, CorruptTier1PageIsDataLossAndDropsCleanly) {
  auto m = MakeManager(8, 8);
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", Seq(1, 9)));
  ASSERT_OK(m->Offload("a"));
  const PageId t1 = m->GetSession("a")->page_ids[1];
  m->tier_storage(1).PageData(t1)[17] ^= 0x40;
  const absl::Status st = m->Restore("a");
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st.message()), HasSubstr("'a'"));
  auto info = m->GetSession("a");
  EXPECT_EQ(info->num_tokens, 0);
  EXPECT_EQ(info->tier0_pages + info->tier1_pages, 0);
  const KvStats s = m->GetStats();
  EXPECT_EQ(s.checksum_failures, 1);
  EXPECT_EQ(s.tier[1].free_pages, 8);
  EXPECT_EQ(s.tier[0].free_pages + s.tier[0].cached_unreferenced_pages, 8);
  EXPECT_INVARIANTS(*m);
  // The session is usable again (recompute).
  ASSERT_OK(AppendWithKv(*m, "a", Seq(1, 5)));
  ASSERT_OK(VerifyKv(*m, "a"));
}

TEST(KvCacheManagerTest, PressurePolicyRunsInOrder) {
  // Tier 0: 6 pages, tier 1: 4 pages.
  auto m = MakeManager(6, 4);
  // Step 2 candidate: a cached, unreferenced prefix page.
  ASSERT_OK(m->CreateSession("old", "t"));
  ASSERT_OK(AppendWithKv(*m, "old", Seq(1, 4)));
  ASSERT_OK(m->CloseSession("old"));
  EXPECT_EQ(m->GetStats().tier[0].cached_unreferenced_pages, 1);
  // Idle sessions (LRU order idle1, idle2) and one running session.
  for (const char* id : {"idle1", "idle2", "run"}) ASSERT_OK(m->CreateSession(id, "t"));
  ASSERT_OK(AppendWithKv(*m, "idle1", Seq(100, 6)));  // 2 pages
  ASSERT_OK(m->MarkIdle("idle1"));
  ASSERT_OK(AppendWithKv(*m, "idle2", Seq(200, 3)));  // 1 page
  ASSERT_OK(m->MarkIdle("idle2"));
  ASSERT_OK(AppendWithKv(*m, "run", Seq(300, 3)));  // 1 page, running
  ASSERT_EQ(m->GetStats().tier[0].free_pages, 1);
  const uint64_t seq0 = m->ReadEvents(0).last_seq;

  ASSERT_OK(m->CreateSession("new", "t"));
  // 2 pages: 1 free + the evictable prefix page (step 2); nobody is offloaded.
  ASSERT_OK(AppendWithKv(*m, "new", Seq(400, 8)));
  EXPECT_EQ(m->GetStats().prefix_pages_evicted, 1);
  EXPECT_EQ(m->GetStats().offloads, 0);
  // 1 more page: step 3 offloads the LRU idle session (idle1), not idle2.
  ASSERT_OK(AppendWithKv(*m, "new", Seq(408, 1)));
  EXPECT_EQ(m->GetSession("idle1")->tier1_pages, 2);
  EXPECT_EQ(m->GetSession("idle2")->tier1_pages, 0);
  // 4 more pages: idle2 offloaded (tier 1 now 3/4), then "run" is preempted (step 5).
  std::vector<std::string> preempted;
  ASSERT_OK(AppendWithKv(*m, "new", Seq(409, 12), &preempted));
  EXPECT_THAT(preempted, ElementsAre("run"));
  EXPECT_EQ(m->GetSession("run")->tier1_pages, 1);
  EXPECT_FALSE(m->GetSession("run")->running);
  EXPECT_EQ(m->GetStats().preemptions, 1);
  ASSERT_OK(VerifyKv(*m, "idle1"));
  ASSERT_OK(VerifyKv(*m, "run"));
  EXPECT_INVARIANTS(*m);
  // "run" continues: its restore needs tier-0 room, so the now idle "new" is offloaded,
  // and tier 1 (full) drops the LRU offloaded session's tail pages (step 4): idle1 is
  // cut to a complete-page prefix.
  ASSERT_OK(m->MarkIdle("new"));
  ASSERT_OK(AppendWithKv(*m, "run", Seq(303, 2)));
  EXPECT_GE(m->GetStats().drops, 1);
  auto idle1 = m->GetSession("idle1");
  EXPECT_LT(idle1->num_tokens, 6);
  EXPECT_EQ(idle1->num_tokens % 4, 0);  // cut to a complete-page prefix
  ASSERT_OK(VerifyKv(*m, "idle1"));
  ASSERT_OK(VerifyKv(*m, "run"));
  ASSERT_OK(VerifyKv(*m, "new"));
  EXPECT_INVARIANTS(*m);
  // Events told a consumer what moved.
  std::vector<std::string> kinds;
  for (const KvEvent& e : m->ReadEvents(seq0).events) kinds.push_back(EventTypeName(e.type));
  EXPECT_THAT(kinds, ::testing::Contains("prefix_removed"));
  EXPECT_THAT(kinds, ::testing::Contains("session_offloaded"));
  EXPECT_THAT(kinds, ::testing::Contains("session_restored"));
  EXPECT_THAT(kinds, ::testing::Contains("session_dropped"));
}

TEST(KvCacheManagerTest, PinnedAndSteppingSessionsAreNeverMoved) {
  auto m = MakeManager(4, 4);
  ASSERT_OK(m->CreateSession("pinned", "t"));
  ASSERT_OK(m->CreateSession("step", "t"));
  ASSERT_OK(m->CreateSession("x", "t"));
  ASSERT_OK(AppendWithKv(*m, "pinned", Seq(1, 5)));  // 2 pages
  ASSERT_OK(m->PinSession("pinned"));
  ASSERT_OK(m->MarkIdle("pinned"));
  EXPECT_EQ(m->Offload("pinned").code(), absl::StatusCode::kFailedPrecondition);
  auto r = m->BeginStep("step", 4);  // 1 page, in a step
  ASSERT_TRUE(r.ok());
  // 2 more pages: only 1 free; pinned and stepping sessions are untouchable.
  EXPECT_EQ(m->BeginStep("x", 8).status().code(), absl::StatusCode::kResourceExhausted);
  // What routers count as not to be had (WorkerLoad.pages_held_device).
  EXPECT_EQ(m->GetStats().tier[0].held_pages, 3);
  EXPECT_EQ(m->Tier0PagesFreeable(), 1);  // the free one
  EXPECT_EQ(m->GetSession("pinned")->tier0_pages, 2);
  EXPECT_EQ(m->GetSession("step")->tier0_pages, 1);
  EXPECT_EQ(m->GetSession("x")->tier0_pages, 0);
  EXPECT_INVARIANTS(*m);
  const std::vector<uint64_t> h = testing::PositionHashes("t", Seq(10, 4));
  for (int pos = 0; pos < 4; ++pos) {
    testing::WriteSlot(m->shape(), m->Tier0PageData(r->page_table[0]), pos, h[pos]);
  }
  ASSERT_OK(m->CommitStep("step", Seq(10, 4)));
  ASSERT_OK(m->UnpinSession("pinned"));
  ASSERT_OK(m->MarkIdle("step"));
  EXPECT_EQ(m->GetStats().tier[0].held_pages, 0);
  EXPECT_EQ(m->Tier0PagesFreeable(), 4);
  ASSERT_OK(AppendWithKv(*m, "x", Seq(20, 8)));  // now the idle ones move
  ASSERT_OK(VerifyKv(*m, "pinned"));
  ASSERT_OK(VerifyKv(*m, "step"));
  EXPECT_INVARIANTS(*m);
}

// Moving out a session whose tier-0 pages all have other holders (here a fork
// of a pinned session) frees nothing; it only copies shared pages to tier 1.
// A session whose going frees pages goes first, though it was used later.
TEST(KvCacheManagerTest, PressureMovesOutSessionsThatFreePagesFirst) {
  auto m = MakeManager(8, 8);
  ASSERT_OK(m->CreateSession("base", "t"));
  ASSERT_OK(AppendWithKv(*m, "base", Seq(1, 8)));  // 2 full pages
  ASSERT_OK(m->MarkIdle("base"));
  ASSERT_OK(m->PinSession("base"));
  ASSERT_OK(m->Fork("base", "twin"));  // shares both pages
  ASSERT_OK(m->MarkIdle("twin"));
  EXPECT_EQ(m->GetStats().tier[0].held_pages, 2);  // the pinned base's, counted once
  EXPECT_EQ(m->Tier0PagesFreeable(), 6);           // the idle twin's pages are the pinned base's too
  ASSERT_OK(m->CreateSession("lone", "t"));
  ASSERT_OK(AppendWithKv(*m, "lone", Seq(100, 8)));  // 2 pages of its own, used last
  ASSERT_OK(m->MarkIdle("lone"));
  EXPECT_EQ(m->Tier0PagesFreeable(), 6);  // 4 free and lone's 2
  ASSERT_OK(m->CreateSession("x", "t"));
  ASSERT_OK(AppendWithKv(*m, "x", Seq(200, 24)));  // 6 pages: 4 free, 2 to make
  EXPECT_EQ(m->GetSession("twin")->tier0_pages, 2);
  EXPECT_EQ(m->GetSession("twin")->tier1_pages, 0) << "nothing copied for nothing";
  EXPECT_EQ(m->GetSession("lone")->tier1_pages, 2);
  ASSERT_OK(VerifyKv(*m, "twin"));
  ASSERT_OK(VerifyKv(*m, "lone"));
  EXPECT_INVARIANTS(*m);
  // When nothing else can go, a session that frees nothing alone still goes
  // (its pages may have no other holder once another has gone too).
  ASSERT_OK(m->UnpinSession("base"));
  ASSERT_OK(m->MarkIdle("x"));
  ASSERT_OK(m->PinSession("x"));
  EXPECT_EQ(m->Tier0PagesFreeable(), 2);  // the pages base and twin share, both idle now
  ASSERT_OK(m->CreateSession("y", "t"));
  {
    absl::Status st = AppendWithKv(*m, "y", Seq(300, 8));  // 2 pages: only base and twin can go
    ASSERT_TRUE(st.ok()) << st;
  }
  EXPECT_EQ(m->GetSession("twin")->tier0_pages + m->GetSession("base")->tier0_pages, 0);
  ASSERT_OK(VerifyKv(*m, "y"));
  EXPECT_INVARIANTS(*m);
}

TEST(KvCacheManagerTest, NoTier1DropsIdleSessions) {
  auto m = MakeManager(3, 0);
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", Seq(1, 10)));
  ASSERT_OK(m->MarkIdle("a"));
  ASSERT_OK(m->CreateSession("b", "t"));
  ASSERT_OK(AppendWithKv(*m, "b", Seq(100, 6)));
  // Pages of a's full prefix stay cached until evicted; a's cache is dropped.
  auto a = m->GetSession("a");
  EXPECT_EQ(a->tier0_pages + a->tier1_pages, 0);
  EXPECT_EQ(a->num_tokens, 0);
  EXPECT_EQ(m->Offload("b").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_INVARIANTS(*m);
}

TEST(KvCacheManagerTest, EventsSequenceAndSnapshot) {
  KvCacheOptions o = SmallOptions(8, 0);
  o.event_capacity = 4;
  auto m = std::move(KvCacheManager::Create(o)).value();
  ASSERT_OK(m->CreateSession("a", "t"));
  ASSERT_OK(AppendWithKv(*m, "a", Seq(1, 8)));
  EventBatch b = m->ReadEvents(0);
  ASSERT_EQ(b.events.size(), 2u);
  EXPECT_EQ(b.events[0].type, KvEventType::kSessionPlaced);
  EXPECT_EQ(b.events[1].type, KvEventType::kPrefixStored);
  EXPECT_EQ(b.events[1].hashes, ChainBlockHashes(Seq(1, 8), 4, "test-model", "t"));
  EXPECT_EQ(b.events[1].seq, b.events[0].seq + 1);
  for (int i = 0; i < 5; ++i) ASSERT_OK(m->CreateSession("s" + std::to_string(i), "t"));
  b = m->ReadEvents(2);
  EXPECT_TRUE(b.gap);  // the ring kept only 4: resync from a snapshot
  EXPECT_EQ(b.events.size(), 4u);
  EXPECT_EQ(b.last_seq, 7u);
  const KvSnapshot snap = m->Snapshot();
  EXPECT_EQ(snap.last_seq, 7u);
  EXPECT_EQ(snap.sessions.size(), 6u);
  EXPECT_EQ(snap.sessions[0].id, "a");
  EXPECT_EQ(snap.sessions[0].num_tokens, 8);
  EXPECT_EQ(snap.prefix_hashes.size(), 2u);
  EXPECT_FALSE(m->ReadEvents(7).gap);
  EXPECT_TRUE(m->ReadEvents(7).events.empty());
}

}  // namespace
}  // namespace kvcache::kv
