#include "worker/kv/kv_transfer_port.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/kv/kv_test_util.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/kv_transfer.h"

// The edges of KvCacheManager's transfer port, directly and through the exporter and
// importer built on it: sessions closed or replaced under an export, freezing, the
// epoch filter of ReadPage, staging pages and the atomic commit.
namespace kvcache::kv {
namespace {

using ::kvcache::kv::testing::AppendWithKv;
using ::kvcache::kv::testing::MakeManager;
using ::kvcache::kv::testing::Seq;
using ::kvcache::kv::testing::VerifyKv;
using ::testing::HasSubstr;

std::vector<KvEventType> EventTypesAfter(const KvCacheManager& m, uint64_t seq) {
  std::vector<KvEventType> out;
  for (const KvEvent& e : m.ReadEvents(seq).events) out.push_back(e.type);
  return out;
}

// Stages one page filled with `fill`.
StagingPage StagePage(KvTransferPort& port, uint8_t fill) {
  const absl::StatusOr<StagingPage> page = port.AllocateStaging();
  EXPECT_TRUE(page.ok()) << page.status();
  const std::vector<uint8_t> bytes(static_cast<size_t>(port.shape().page_bytes()), fill);
  EXPECT_TRUE(port.WriteStaging(*page, 0, bytes).ok());
  return *page;
}

TEST(KvTransferPortTest, SessionClosedBetweenBulkAndFinalPhase) {
  auto m = MakeManager(16, 0);
  ASSERT_OK(m->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*m, "s", Seq(1, 10)));
  auto exp = std::move(SessionExporter::Create(m.get(), "s")).value();
  KvChunk c;
  while (*exp->NextBulk(&c)) {
  }
  EXPECT_EQ(exp->bulk_pages(), 2);
  const uint64_t seq = m->ReadEvents(0).last_seq;
  ASSERT_OK(m->CloseSession("s"));  // not frozen yet: closing is allowed
  absl::StatusOr<bool> next = exp->NextFinal(&c);
  EXPECT_EQ(next.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(next.status().message()), HasSubstr("closed meanwhile"));
  // The same id again is another session: the export still refuses it, and neither
  // freezes nor unfreezes it.
  ASSERT_OK(m->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*m, "s", Seq(50, 3)));
  EXPECT_EQ(exp->NextFinal(&c).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(exp->NextBulk(&c).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(AppendWithKv(*m, "s", Seq(53, 1)));
  exp.reset();
  ASSERT_OK(AppendWithKv(*m, "s", Seq(54, 1)));
  ASSERT_OK(VerifyKv(*m, "s"));
  for (KvEventType t : EventTypesAfter(*m, seq)) EXPECT_NE(t, KvEventType::kSessionExported);
  EXPECT_INVARIANTS(*m);

  // The port answers the same for a stale handle.
  KvTransferPort& port = m->transfer_port();
  ExportView v = std::move(port.OpenExport("s")).value();
  ASSERT_OK(m->CloseSession("s"));
  ASSERT_OK(m->CreateSession("s", "t"));
  std::vector<uint8_t> buf(16);
  EXPECT_EQ(port.CheckExport(v.handle).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(port.ReadPage(v.handle, 0, kAnyEpoch, 0, absl::MakeSpan(buf), nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(port.FreezeExport(v.handle).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(port.FinishExport(v.handle, 0).code(), absl::StatusCode::kFailedPrecondition);
  port.UnfreezeExport(v.handle);  // no-op
  EXPECT_EQ(port.OpenExport("gone").status().code(), absl::StatusCode::kNotFound);
  ASSERT_OK(m->CloseSession("s"));
  EXPECT_EQ(port.OpenExport("s").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_INVARIANTS(*m);
}

TEST(KvTransferPortTest, AbandonedFinalPhaseUnfreezesWithoutExportedEvent) {
  auto m = MakeManager(16, 0);
  ASSERT_OK(m->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*m, "s", Seq(1, 9)));
  const uint64_t seq = m->ReadEvents(0).last_seq;
  {
    auto exp = std::move(SessionExporter::Create(m.get(), "s")).value();
    KvChunk c;
    ASSERT_TRUE(*exp->NextFinal(&c));  // kBegin: not frozen yet
    EXPECT_EQ(c.kind, KvChunk::Kind::kBegin);
    ASSERT_OK(AppendWithKv(*m, "s", Seq(10, 1)));
    ASSERT_TRUE(*exp->NextFinal(&c));  // freezes
    EXPECT_EQ(m->BeginStep("s", 1).status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(m->Truncate("s", 4).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(m->CloseSession("s").code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_INVARIANTS(*m);
  }
  ASSERT_OK(AppendWithKv(*m, "s", Seq(11, 1)));
  ASSERT_OK(VerifyKv(*m, "s"));
  for (KvEventType t : EventTypesAfter(*m, seq)) EXPECT_NE(t, KvEventType::kSessionExported);
  EXPECT_INVARIANTS(*m);
}

TEST(KvTransferPortTest, FrozenSessionIsLeftAloneByThePolicy) {
  auto m = MakeManager(4, 4);
  KvTransferPort& port = m->transfer_port();
  ASSERT_OK(m->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*m, "s", Seq(1, 12)));  // 3 of 4 tier-0 pages
  ASSERT_OK(m->MarkIdle("s"));
  ExportView v = std::move(port.OpenExport("s")).value();
  ASSERT_TRUE(port.FreezeExport(v.handle).ok());
  const StagingPage a = std::move(port.AllocateStaging()).value();
  EXPECT_EQ(a.tier, 0);
  // Tier 0 is full and the frozen session stays: the next page is staged in tier 1.
  const StagingPage c = std::move(port.AllocateStaging()).value();
  EXPECT_EQ(c.tier, 1);
  EXPECT_EQ(m->GetSession("s")->tier1_pages, 0);
  EXPECT_EQ(m->GetStats().tier[0].in_flight_pages, 1);
  EXPECT_EQ(m->GetStats().tier[1].in_flight_pages, 1);
  EXPECT_EQ(m->GetStats().tier[1].free_pages, 3);
  EXPECT_INVARIANTS(*m);

  const uint64_t seq = m->ReadEvents(0).last_seq;
  ASSERT_OK(port.FinishExport(v.handle, 3));
  const EventBatch b = m->ReadEvents(seq);
  ASSERT_EQ(b.events.size(), 1u);
  EXPECT_EQ(b.events[0].type, KvEventType::kSessionExported);
  EXPECT_EQ(b.events[0].session_id, "s");
  EXPECT_EQ(b.events[0].pages, 3);
  EXPECT_EQ(b.events[0].num_tokens, 12);
  // Unfrozen: the policy may offload it now to make staging room in tier 0.
  const StagingPage b2 = std::move(port.AllocateStaging()).value();
  EXPECT_EQ(b2.tier, 0);
  EXPECT_EQ(m->GetSession("s")->tier1_pages, 3);
  EXPECT_EQ(m->GetStats().tier[0].in_flight_pages, 2);
  EXPECT_INVARIANTS(*m);
  const StagingPage all[] = {a, b2, c};
  port.FreeStaging(all);
  EXPECT_EQ(m->GetStats().tier[0].in_flight_pages, 0);
  EXPECT_EQ(m->GetStats().tier[1].in_flight_pages, 0);
  ASSERT_OK(m->Restore("s"));
  ASSERT_OK(VerifyKv(*m, "s"));
  EXPECT_INVARIANTS(*m);
}

TEST(KvTransferPortTest, ReadPageSkipsPagesWrittenSinceTheView) {
  auto m = MakeManager(16, 4);
  KvTransferPort& port = m->transfer_port();
  ASSERT_OK(m->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*m, "s", Seq(1, 6)));  // page 0 full, page 1 holds 2 tokens
  const ExportView v = std::move(port.OpenExport("s")).value();
  EXPECT_EQ(v.tokens, Seq(1, 6));
  EXPECT_EQ(v.first_live_page, 0);
  ASSERT_EQ(v.page_epoch.size(), 2u);
  const int64_t page_bytes = m->shape().page_bytes();
  std::vector<uint8_t> buf(static_cast<size_t>(page_bytes));
  PageChecksum sum = 0;
  ASSERT_TRUE(*port.ReadPage(v.handle, 0, v.write_epoch, 0, absl::MakeSpan(buf), &sum));
  const SessionInfo info = *m->GetSession("s");
  const uint8_t* page0 = m->Tier0PageData(info.page_ids[0]);
  const std::vector<uint8_t> page0_bytes = buf;
  EXPECT_EQ(page0_bytes, std::vector<uint8_t>(page0, page0 + page_bytes));
  EXPECT_EQ(sum, *m->tier_storage(0).Checksum(info.page_ids[0]));

  ASSERT_OK(AppendWithKv(*m, "s", Seq(7, 1)));  // writes page 1 again
  PageChecksum unused = 0;
  EXPECT_FALSE(*port.ReadPage(v.handle, 1, v.write_epoch, 0, absl::MakeSpan(buf), &unused));
  EXPECT_TRUE(*port.ReadPage(v.handle, 1, kAnyEpoch, 0, absl::MakeSpan(buf), nullptr));
  EXPECT_FALSE(*port.ReadPage(v.handle, 2, kAnyEpoch, 0, absl::MakeSpan(buf), nullptr));
  EXPECT_FALSE(*port.ReadPage(v.handle, -1, kAnyEpoch, 0, absl::MakeSpan(buf), nullptr));
  // A page in tier 1 reads the same, with the checksum it was offloaded with.
  ASSERT_OK(m->Offload("s"));
  std::vector<uint8_t> from_tier1(16);
  PageChecksum sum1 = 0;
  ASSERT_TRUE(*port.ReadPage(v.handle, 0, v.write_epoch, 8, absl::MakeSpan(from_tier1), &sum1));
  EXPECT_EQ(sum1, sum);
  EXPECT_EQ(from_tier1, std::vector<uint8_t>(page0_bytes.begin() + 8, page0_bytes.begin() + 24));
  // The range must stay inside the page.
  EXPECT_EQ(port.ReadPage(v.handle, 0, kAnyEpoch, page_bytes - 8, absl::MakeSpan(from_tier1), nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  const ExportExtent e = *port.CheckExport(v.handle);
  EXPECT_EQ(e.num_tokens, 7);
  EXPECT_EQ(e.first_live_page, 0);
  EXPECT_INVARIANTS(*m);
}

TEST(KvTransferPortTest, StagingPagesAreOwnedAndFreedOnce) {
  auto m = MakeManager(4, 0);
  KvTransferPort& port = m->transfer_port();
  ASSERT_OK(m->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*m, "s", Seq(1, 4)));
  const StagingPage session_page{0, m->GetSession("s")->page_ids[0]};
  const StagingPage page = StagePage(port, 0xab);
  EXPECT_EQ(m->GetStats().tier[0].in_flight_pages, 1);
  EXPECT_EQ(m->GetStats().tier[0].free_pages, 2);
  EXPECT_INVARIANTS(*m);
  // A session's page is not a staging page: never written through the port.
  const std::vector<uint8_t> junk(16, 0xff);
  EXPECT_EQ(port.WriteStaging(session_page, 0, junk).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(port.StagingChecksum(session_page).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(port.WriteStaging(page, m->shape().page_bytes() - 8, junk).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_OK(VerifyKv(*m, "s"));
  // Its checksum is that of its bytes.
  EXPECT_EQ(*port.StagingChecksum(page), *m->tier_storage(0).Checksum(page.id));
  EXPECT_EQ(m->tier_storage(0).PageData(page.id)[0], 0xab);
  // The same id in the other tier is not staging either.
  EXPECT_EQ(port.WriteStaging(StagingPage{1, page.id}, 0, junk).code(), absl::StatusCode::kInvalidArgument);
  port.CountChecksumFailure();
  EXPECT_EQ(m->GetStats().checksum_failures, 1);
  // Freed once, however often it is listed; other ids are skipped.
  const StagingPage twice[] = {page, page, StagingPage{}, session_page};
  port.FreeStaging(twice);
  EXPECT_EQ(m->GetStats().tier[0].in_flight_pages, 0);
  EXPECT_EQ(m->GetStats().tier[0].free_pages, 3);
  EXPECT_EQ(port.WriteStaging(page, 0, junk).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(VerifyKv(*m, "s"));
  EXPECT_INVARIANTS(*m);
}

TEST(KvTransferPortTest, CommitOfAnIdThatAppearedMeanwhileLeavesNoPages) {
  auto src = MakeManager(16, 0);
  auto dst = MakeManager(8, 0);
  ASSERT_OK(src->CreateSession("s", "t"));
  ASSERT_OK(AppendWithKv(*src, "s", Seq(1, 9)));
  auto chunks = std::move(ExportSession(src.get(), "s")).value();
  auto imp = std::move(SessionImporter::Create(dst.get())).value();
  for (size_t i = 0; i + 1 < chunks.size(); ++i) ASSERT_OK(imp->Add(chunks[i]));
  EXPECT_EQ(dst->GetStats().tier[0].in_flight_pages, 3);
  EXPECT_INVARIANTS(*dst);
  ASSERT_OK(dst->CreateSession("s", "other"));
  const uint64_t seq = dst->ReadEvents(0).last_seq;
  const absl::Status st = imp->Add(chunks.back());
  EXPECT_EQ(st.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(st.message()), HasSubstr("'s'"));
  EXPECT_FALSE(imp->committed());
  EXPECT_EQ(dst->GetStats().tier[0].in_flight_pages, 0);
  EXPECT_EQ(dst->GetStats().tier[0].free_pages, 8);
  EXPECT_EQ(dst->ReadEvents(0).last_seq, seq);
  const SessionInfo info = *dst->GetSession("s");
  EXPECT_EQ(info.tenant, "other");
  EXPECT_EQ(info.num_tokens, 0);
  EXPECT_INVARIANTS(*dst);
  // The import is over; destroying it frees nothing twice.
  EXPECT_EQ(imp->Add(chunks.back()).code(), absl::StatusCode::kFailedPrecondition);
  imp.reset();
  EXPECT_EQ(dst->GetStats().tier[0].free_pages, 8);
  EXPECT_INVARIANTS(*dst);
}

TEST(KvTransferPortTest, CommitImportValidatesAndTakesEveryStagingPage) {
  auto m = MakeManager(8, 0, /*window=*/6);
  KvTransferPort& port = m->transfer_port();
  const auto stats_ok = [&] {
    EXPECT_EQ(m->GetStats().tier[0].in_flight_pages, 0);
    EXPECT_EQ(m->GetStats().tier[0].free_pages, 8);
    EXPECT_INVARIANTS(*m);
  };
  // 10 tokens, window 6: page 0 is dead, pages 1 and 2 live.
  ImportedSession in;
  in.session_id = "s";
  in.tenant = "t";
  in.tokens = Seq(1, 10);
  in.first_live_page = 0;  // the window implies 1
  in.staged = {StagingPage{}, StagePage(port, 1), StagePage(port, 2)};
  EXPECT_EQ(port.CommitImport(in).code(), absl::StatusCode::kInvalidArgument);
  stats_ok();
  in.first_live_page = 1;
  in.staged = {StagingPage{}, StagePage(port, 1)};  // page 2 missing
  absl::Status st = port.CommitImport(in);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("page 2 missing"));
  stats_ok();
  const StagingPage dup = StagePage(port, 1);
  in.staged = {StagingPage{}, dup, dup};
  EXPECT_EQ(port.CommitImport(in).code(), absl::StatusCode::kInvalidArgument);
  stats_ok();
  in.tenant = "";
  in.staged = {StagingPage{}, StagePage(port, 1), StagePage(port, 2)};
  EXPECT_EQ(port.CommitImport(in).code(), absl::StatusCode::kInvalidArgument);
  stats_ok();
  EXPECT_EQ(m->GetSession("s").status().code(), absl::StatusCode::kNotFound);

  // Valid: live pages become the session's, the dead one and the extra are freed.
  in.tenant = "t";
  in.staged = {StagePage(port, 0), StagePage(port, 1), StagePage(port, 2), StagePage(port, 3)};
  const std::vector<StagingPage> staged = in.staged;
  const uint64_t seq = m->ReadEvents(0).last_seq;
  ASSERT_OK(port.CommitImport(in));
  const SessionInfo info = *m->GetSession("s");
  EXPECT_EQ(info.num_tokens, 10);
  EXPECT_EQ(info.first_live_page, 1);
  EXPECT_EQ(info.page_tiers, (std::vector<int32_t>{-1, 0, 0}));
  EXPECT_EQ(info.page_ids, (std::vector<PageId>{kNoPage, staged[1].id, staged[2].id}));
  EXPECT_EQ(m->GetStats().tier[0].in_flight_pages, 0);
  EXPECT_EQ(m->GetStats().tier[0].free_pages, 6);
  EXPECT_EQ(EventTypesAfter(*m, seq),
            (std::vector<KvEventType>{KvEventType::kSessionPlaced, KvEventType::kPrefixStored}));
  EXPECT_EQ(m->ReadEvents(seq).events[0].pages, 2);
  EXPECT_EQ(m->ReadEvents(seq).events[1].hashes.size(), 1u);  // page 1; page 0 was dead
  EXPECT_EQ(m->ReadEvents(seq).events[1].pages, 1);
  EXPECT_INVARIANTS(*m);
  // The same id again: ALREADY_EXISTS, its pages freed, the session untouched.
  in.staged = {StagingPage{}, StagePage(port, 7), StagePage(port, 8)};
  EXPECT_EQ(port.CheckImportId("s").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(port.CommitImport(in).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(m->GetStats().tier[0].in_flight_pages, 0);
  EXPECT_EQ(m->GetStats().tier[0].free_pages, 6);
  EXPECT_EQ(m->GetSession("s")->page_ids, info.page_ids);
  EXPECT_TRUE(port.CheckImportId("other").ok());
  EXPECT_INVARIANTS(*m);
}

}  // namespace
}  // namespace kvcache::kv
