#include "worker/kv/kv_transfer.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/kv/kv_test_util.h"

namespace kvcache::kv {
namespace {

using ::kvcache::kv::testing::AppendWithKv;
using ::kvcache::kv::testing::MakeManager;
using ::kvcache::kv::testing::Seq;
using ::kvcache::kv::testing::VerifyKv;
using ::testing::HasSubstr;

// Bytes of every live page, in page order.
std::vector<std::vector<uint8_t>> PageBytes(KvCacheManager& m, const std::string& id) {
  const SessionInfo info = *m.GetSession(id);
  std::vector<std::vector<uint8_t>> out;
  for (size_t p = info.first_live_page; p < info.page_ids.size(); ++p) {
    const uint8_t* d = m.tier_storage(info.page_tiers[p]).PageData(info.page_ids[p]);
    out.emplace_back(d, d + m.shape().page_bytes());
  }
  return out;
}

TEST(KvTransferTest, ExportImportRoundTripIsBitExactFromBothTiers) {
  auto src = MakeManager(32, 32);
  auto dst = MakeManager(32, 0);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 30)));  // 8 pages, tail partial
  ASSERT_OK(src->CreateSession("other", "t"));
  ASSERT_OK(AppendWithKv(*src, "other", Seq(1000, 12)));
  ASSERT_OK(src->Offload("s"));
  ASSERT_OK(src->Restore("s"));
  ASSERT_OK(src->Offload("s"));  // export reads tier 1
  ExportOptions eo;
  eo.max_chunk_bytes = 1500;  // 512 B pages: 2 whole pages per chunk
  auto chunks = ExportSession(src.get(), "s", eo);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  for (const KvChunk& c : *chunks) EXPECT_LE(c.ByteSize(), 1500);
  EXPECT_EQ(chunks->front().kind, KvChunk::Kind::kBegin);
  EXPECT_EQ(chunks->back().kind, KvChunk::Kind::kCommit);
  ASSERT_OK(ImportSession(dst.get(), *chunks));
  EXPECT_EQ(*dst->GetTokens("s"), Seq(1, 30));
  EXPECT_EQ(PageBytes(*src, "s"), PageBytes(*dst, "s"));
  ASSERT_OK(VerifyKv(*dst, "s"));
  // The imported session's full pages are in the destination's prefix cache.
  EXPECT_EQ(dst->LookupPrefix("t", Seq(1, 30)), 28);
  // It continues like the original.
  ASSERT_OK(AppendWithKv(*dst, "s", Seq(31, 5)));
  ASSERT_OK(VerifyKv(*dst, "s"));
  EXPECT_INVARIANTS(*src);
  EXPECT_INVARIANTS(*dst);
  // Importing twice: ALREADY_EXISTS, nothing staged is left behind.
  EXPECT_EQ(ImportSession(dst.get(), *chunks).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(dst->GetStats().tier[0].in_flight_pages, 0);
  ImportOptions rename;
  rename.session_id = "copy";
  ASSERT_OK(ImportSession(dst.get(), *chunks, rename));
  ASSERT_OK(VerifyKv(*dst, "copy"));
  EXPECT_INVARIANTS(*dst);
}

TEST(KvTransferTest, LargePagesAreSplitAndChunksStayUnder4MiB) {
  KvCacheOptions o;
  o.shape = KvShape{30, 3, 64, KvDtype::kF16, 16};  // 368,640 B pages
  o.model_id = "smol";
  o.tier0_bytes = 64 * o.shape.page_bytes();
  auto src = std::move(KvCacheManager::Create(o)).value();
  auto dst = std::move(KvCacheManager::Create(o)).value();
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(7, 300)));
  ExportOptions eo;
  eo.max_chunk_bytes = 100 * 1024;  // forces each page into 4 segments
  auto chunks = ExportSession(src.get(), "s", eo);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  for (const KvChunk& c : *chunks) EXPECT_LE(c.ByteSize(), eo.max_chunk_bytes);
  ASSERT_OK(ImportSession(dst.get(), *chunks));
  EXPECT_EQ(PageBytes(*src, "s"), PageBytes(*dst, "s"));
  // Default chunking: whole pages, under 2 MiB (and so well under 4 MiB).
  auto big = ExportSession(src.get(), "s");
  ASSERT_TRUE(big.ok());
  for (const KvChunk& c : *big) EXPECT_LE(c.ByteSize(), kDefaultChunkBytes);
}

TEST(KvTransferTest, CorruptChunkIsRejectedAndLeavesNoTrace) {
  auto src = MakeManager(16, 0);
  auto dst = MakeManager(8, 0);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 14)));
  ASSERT_OK(dst->CreateSession("resident", "t"));
  ASSERT_OK(AppendWithKv(*dst, "resident", Seq(500, 6)));
  auto chunks = std::move(ExportSession(src.get(), "s")).value();
  const KvStats before = dst->GetStats();
  const uint64_t seq = dst->ReadEvents(0).last_seq;

  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].kind != KvChunk::Kind::kPages) continue;
    std::vector<KvChunk> bad = chunks;
    bad[i].payload[bad[i].payload.size() / 2] ^= 1;
    const absl::Status st = ImportSession(dst.get(), bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(st.message()), HasSubstr("'s'"));
  }
  // A forged commit checksum is caught too.
  std::vector<KvChunk> bad = chunks;
  bad.back().page_checksums[0] ^= 1;
  EXPECT_EQ(ImportSession(dst.get(), bad).code(), absl::StatusCode::kDataLoss);
  // Missing page, missing token chunk, payload/segment mismatch: INVALID_ARGUMENT.
  bad = chunks;
  bad.erase(bad.begin() + 2);
  EXPECT_EQ(ImportSession(dst.get(), bad).code(), absl::StatusCode::kInvalidArgument);
  bad = chunks;
  ASSERT_EQ(bad[1].kind, KvChunk::Kind::kTokens);
  bad.erase(bad.begin() + 1);
  EXPECT_EQ(ImportSession(dst.get(), bad).code(), absl::StatusCode::kInvalidArgument);
  bad = chunks;
  bad[2].payload.pop_back();
  EXPECT_EQ(ImportSession(dst.get(), bad).code(), absl::StatusCode::kInvalidArgument);
  bad = chunks;
  bad.pop_back();
  EXPECT_EQ(ImportSession(dst.get(), bad).code(), absl::StatusCode::kInvalidArgument);

  // Nothing changed: no session, same page states, no new events.
  EXPECT_EQ(dst->GetSession("s").status().code(), absl::StatusCode::kNotFound);
  const KvStats after = dst->GetStats();
  EXPECT_EQ(after.tier[0].free_pages, before.tier[0].free_pages);
  EXPECT_EQ(after.tier[0].in_flight_pages, 0);
  EXPECT_EQ(after.sessions, before.sessions);
  EXPECT_EQ(dst->ReadEvents(0).last_seq, seq);
  ASSERT_OK(VerifyKv(*dst, "resident"));
  EXPECT_INVARIANTS(*dst);
  // And the intact stream still imports.
  ASSERT_OK(ImportSession(dst.get(), chunks));
  ASSERT_OK(VerifyKv(*dst, "s"));
}

TEST(KvTransferTest, ShapeOrModelMismatchIsRejected) {
  auto src = MakeManager(8, 0);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 5)));
  auto chunks = std::move(ExportSession(src.get(), "s")).value();
  auto other_model = MakeManager(8, 0, 0, "another-model");
  EXPECT_EQ(ImportSession(other_model.get(), chunks).code(), absl::StatusCode::kFailedPrecondition);
  auto other_shape = MakeManager(8, 0, /*window=*/8);
  EXPECT_EQ(ImportSession(other_shape.get(), chunks).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_INVARIANTS(*other_model);
  EXPECT_EQ(other_shape->GetStats().tier[0].free_pages, 8);
  // An aborted importer refuses further chunks.
  auto imp = std::move(SessionImporter::Create(other_model.get())).value();
  EXPECT_FALSE(imp->Add(chunks[0]).ok());
  EXPECT_EQ(imp->Add(chunks[1]).code(), absl::StatusCode::kFailedPrecondition);
  auto fresh = std::move(SessionImporter::Create(other_model.get())).value();
  EXPECT_EQ(fresh->Add(chunks[1]).code(), absl::StatusCode::kInvalidArgument);  // no kBegin
}

TEST(KvTransferTest, AbandonedImportFreesStaging) {
  auto src = MakeManager(8, 0);
  auto dst = MakeManager(8, 0);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 9)));
  auto chunks = std::move(ExportSession(src.get(), "s")).value();
  {
    auto imp = std::move(SessionImporter::Create(dst.get())).value();
    for (size_t i = 0; i + 1 < chunks.size(); ++i) ASSERT_OK(imp->Add(chunks[i]));
    EXPECT_EQ(dst->GetStats().tier[0].in_flight_pages, 3);
    EXPECT_EQ(dst->GetSession("s").status().code(), absl::StatusCode::kNotFound);
    EXPECT_INVARIANTS(*dst);
  }
  EXPECT_EQ(dst->GetStats().tier[0].in_flight_pages, 0);
  EXPECT_EQ(dst->GetStats().tier[0].free_pages, 8);
  EXPECT_INVARIANTS(*dst);
}

// A session larger than the target's whole tier 0 is refused with what it
// needed, and leaves nothing staged behind.
TEST(KvTransferTest, ImportLargerThanTier0IsRefusedAndFreesStaging) {
  auto src = MakeManager(8, 0);
  auto dst = MakeManager(2, 0);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 20)));
  auto chunks = std::move(ExportSession(src.get(), "s")).value();
  {
    auto imp = std::move(SessionImporter::Create(dst.get())).value();
    absl::Status st;
    for (size_t i = 0; i < chunks.size() && st.ok(); ++i) st = imp->Add(chunks[i]);
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(st.message(), HasSubstr("(20 tokens): no room with 2 of its pages staged"));
    EXPECT_THAT(st.message(), HasSubstr("tier 1 has no page to give"));
  }
  EXPECT_EQ(dst->GetSession("s").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(dst->GetStats().tier[0].free_pages, 2);
  EXPECT_INVARIANTS(*dst);
}

// A migration onto a worker whose tier 0 is held by a running session (in a
// step: it cannot move now) stages what does not fit in tier 1: the session
// arrives offloaded, byte for byte, findable by prefix there, and restores on
// its next step. One larger than what pinned sessions leave of tier 0 could
// never be restored there and is refused, as is one with room in neither tier.
// Session "busy" of `tokens` tokens, held in tier 0 by a step (a request running).
absl::Status HoldInAStep(KvCacheManager& m, int tokens) {
  if (absl::Status st = m.CreateSession("busy", "t"); !st.ok()) return st;
  if (absl::Status st = AppendWithKv(m, "busy", Seq(500, tokens)); !st.ok()) return st;
  return m.BeginStep("busy", 0).status();
}

TEST(KvTransferTest, ImportOntoAHeldTier0ArrivesOffloaded) {
  auto src = MakeManager(8, 0);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 18)));  // 5 pages, tail partial
  const auto chunks = std::move(ExportSession(src.get(), "s")).value();
  for (const int free_tier0 : {0, 2}) {
    SCOPED_TRACE(absl::StrCat(free_tier0, " tier-0 pages free"));
    auto dst = MakeManager(6, 8);
    ASSERT_OK(HoldInAStep(*dst, 4 * (6 - free_tier0)));  // running: held in tier 0 for now
    const uint64_t seq = dst->ReadEvents(0).last_seq;
    ASSERT_OK(ImportSession(dst.get(), chunks));
    const SessionInfo info = *dst->GetSession("s");
    std::vector<int32_t> tiers(5, 1);
    for (int i = 0; i < free_tier0; ++i) tiers[i] = 0;
    EXPECT_EQ(info.page_tiers, tiers);
    EXPECT_EQ(info.tier1_pages, 5 - free_tier0);
    EXPECT_EQ(PageBytes(*src, "s"), PageBytes(*dst, "s"));
    ASSERT_OK(VerifyKv(*dst, "s"));
    EXPECT_EQ(dst->GetStats().tier[0].in_flight_pages, 0);
    EXPECT_EQ(dst->GetStats().tier[1].in_flight_pages, 0);
    EXPECT_EQ(dst->GetStats().offloaded_sessions, 1);
    std::vector<KvEventType> types;
    for (const KvEvent& e : dst->ReadEvents(seq).events) types.push_back(e.type);
    EXPECT_EQ(types[0], KvEventType::kSessionPlaced);
    EXPECT_EQ(types[1], KvEventType::kSessionOffloaded);
    EXPECT_EQ(dst->ReadEvents(seq).events[1].pages, 5 - free_tier0);
    // Its 4 full pages are findable by prefix in whichever tier holds them.
    EXPECT_EQ(dst->LookupPrefix("t", Seq(1, 18)), 16);
    EXPECT_INVARIANTS(*dst);
    // Once the running session's step ends, the next step restores it and goes on.
    ASSERT_OK(dst->CommitStep("busy", {}));
    ASSERT_OK(dst->MarkIdle("busy"));
    ASSERT_OK(AppendWithKv(*dst, "s", Seq(19, 3)));
    EXPECT_EQ(dst->GetSession("s")->tier1_pages, 0);
    ASSERT_OK(VerifyKv(*dst, "s"));
    EXPECT_INVARIANTS(*dst);
  }
  // Refused, saying `why`, with nothing staged left behind.
  auto refused = [&](KvCacheManager& m, const std::string& why) {
    const absl::Status st = ImportSession(&m, chunks);
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(st.message()), HasSubstr(why));
    EXPECT_EQ(m.GetSession("s").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(m.GetStats().tier[0].in_flight_pages, 0);
    EXPECT_EQ(m.GetStats().tier[1].in_flight_pages, 0);
    EXPECT_INVARIANTS(m);
  };
  // Pinned sessions hold 2 of 6 tier-0 pages for good and a running one the
  // rest: the 5-page session could never be restored, so it is refused.
  auto pinned = MakeManager(6, 8);
  ASSERT_OK(pinned->CreateSession("pin", "t"));
  ASSERT_OK(AppendWithKv(*pinned, "pin", Seq(700, 8)));
  ASSERT_OK(pinned->PinSession("pin"));
  ASSERT_OK(HoldInAStep(*pinned, 16));
  refused(*pinned, "could never be restored here");
  EXPECT_EQ(pinned->GetStats().tier[1].free_pages, 8);
  // No tier 1 and tier 0 held: refused.
  auto full = MakeManager(6, 0);
  ASSERT_OK(HoldInAStep(*full, 20));
  refused(*full, "no room with 1 of its pages staged");
  EXPECT_EQ(full->GetStats().tier[0].free_pages, 1);
  ASSERT_OK(full->AbortStep("busy"));
}

TEST(KvTransferTest, PreCopyFinalPhaseSendsOnlyWhatChanged) {
  auto src = MakeManager(64, 0);
  auto dst = MakeManager(64, 0);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 82)));  // 20 full pages + 2 tokens
  auto exp = std::move(SessionExporter::Create(src.get(), "s")).value();
  auto imp = std::move(SessionImporter::Create(dst.get())).value();
  KvChunk c;
  // Bulk phase interleaved with decoding: the session keeps appending.
  int decoded = 0;
  while (true) {
    auto more = exp->NextBulk(&c);
    ASSERT_TRUE(more.ok()) << more.status();
    if (!*more) break;
    ASSERT_OK(imp->Add(c));
    ASSERT_OK(AppendWithKv(*src, "s", Seq(1000 + decoded, 1)));
    ++decoded;
  }
  EXPECT_EQ(exp->bulk_pages(), 20);
  // A step in progress blocks the final phase; between steps it proceeds.
  ASSERT_TRUE(src->BeginStep("s", 1).ok());
  EXPECT_EQ(exp->NextFinal(&c).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(src->AbortStep("s"));
  while (true) {
    auto more = exp->NextFinal(&c);
    ASSERT_TRUE(more.ok()) << more.status();
    if (!*more) break;
    // Frozen while the final phase runs; unfrozen once the commit chunk is out.
    if (c.kind != KvChunk::Kind::kCommit) {
      EXPECT_EQ(src->BeginStep("s", 1).status().code(), absl::StatusCode::kFailedPrecondition);
    }
    ASSERT_OK(imp->Add(c));
  }
  ASSERT_TRUE(imp->committed());
  // Only the tail region changed: final pages independent of the 20 bulk pages.
  const int64_t len = 82 + decoded;
  EXPECT_EQ(exp->final_pages(), (len + 3) / 4 - 20);
  EXPECT_EQ(*dst->GetTokens("s"), *src->GetTokens("s"));
  EXPECT_EQ(PageBytes(*src, "s"), PageBytes(*dst, "s"));
  ASSERT_OK(VerifyKv(*dst, "s"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(5, 1)));  // unfrozen after commit
  EXPECT_INVARIANTS(*src);
  EXPECT_INVARIANTS(*dst);
}

TEST(KvTransferTest, PreCopyHandlesTruncationAndWindowedSessions) {
  auto src = MakeManager(64, 0, /*window=*/10);
  auto dst = MakeManager(64, 0, /*window=*/10);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 40)));
  auto exp = std::move(SessionExporter::Create(src.get(), "s")).value();
  auto imp = std::move(SessionImporter::Create(dst.get())).value();
  KvChunk c;
  while (*exp->NextBulk(&c)) ASSERT_OK(imp->Add(c));
  // Rewrite history after the bulk phase: cut back and decode differently.
  ASSERT_OK(src->Truncate("s", 38));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(700, 9)));
  while (true) {
    auto more = exp->NextFinal(&c);
    ASSERT_TRUE(more.ok()) << more.status();
    if (!*more) break;
    ASSERT_OK(imp->Add(c));
  }
  ASSERT_TRUE(imp->committed());
  EXPECT_EQ(*dst->GetTokens("s"), *src->GetTokens("s"));
  EXPECT_EQ(dst->GetSession("s")->first_live_page, src->GetSession("s")->first_live_page);
  EXPECT_EQ(PageBytes(*src, "s"), PageBytes(*dst, "s"));
  ASSERT_OK(VerifyKv(*dst, "s"));
  EXPECT_INVARIANTS(*dst);
}

TEST(KvTransferTest, ExportOfClosedSessionFails) {
  auto src = MakeManager(8, 0);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 5)));
  auto exp = std::move(SessionExporter::Create(src.get(), "s")).value();
  ASSERT_OK(src->CloseSession("s"));
  KvChunk c;
  EXPECT_EQ(exp->NextBulk(&c).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SessionExporter::Create(src.get(), "none").status().code(), absl::StatusCode::kNotFound);
  ExportOptions eo;
  eo.max_chunk_bytes = 8 << 20;
  EXPECT_EQ(SessionExporter::Create(src.get(), "s", eo).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcache::kv
