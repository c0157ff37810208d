#include "router/watch_ingest.h"

#include "gtest/gtest.h"

namespace kvcache::router {
namespace {

std::string Hash(uint8_t v) { return std::string(32, static_cast<char>(v)); }

BlockHash H(uint8_t v) {
  BlockHash h;
  h.bytes.fill(v);
  return h;
}

v1::WatchEvent Snapshot(uint64_t seq, std::initializer_list<uint8_t> device, bool more) {
  v1::WatchEvent ev;
  ev.set_sequence(seq);
  v1::WorkerSnapshot* s = ev.mutable_snapshot();
  s->set_worker_id("a");
  for (uint8_t v : device) s->add_device_block_hashes(Hash(v));
  s->set_more(more);
  return ev;
}

v1::WatchEvent Stored(uint64_t seq, uint8_t v) {
  v1::WatchEvent ev;
  ev.set_sequence(seq);
  ev.mutable_event()->set_kind(v1::CacheEvent::PREFIX_STORED);
  ev.mutable_event()->set_tier(v1::TIER_DEVICE);
  ev.mutable_event()->add_block_hashes(Hash(v));
  return ev;
}

TEST(WatchIngestTest, SnapshotPartsApplyWholeThenEventsInSequence) {
  Directory d;
  WatchIngest in(&d, "a");
  v1::WatchEvent m = Snapshot(1, {1, 2}, /*more=*/true);
  ASSERT_EQ(*in.Ingest(&m), WatchIngest::Applied::kSnapshotPart);
  EXPECT_EQ(d.prefix_entries(), 0u);  // nothing until the last part
  m = Snapshot(2, {3}, /*more=*/false);
  ASSERT_EQ(*in.Ingest(&m), WatchIngest::Applied::kSnapshot);
  EXPECT_EQ(m.snapshot().device_block_hashes_size(), 3);  // the whole snapshot, for the caller
  EXPECT_EQ(d.prefix_entries(), 3u);
  m = Stored(3, 4);
  ASSERT_EQ(*in.Ingest(&m), WatchIngest::Applied::kEvent);
  EXPECT_EQ(d.MatchPrefix(std::vector<BlockHash>{H(4)}).at("a").device_pages, 1);
  EXPECT_EQ(in.expected_sequence(), 4u);
}

TEST(WatchIngestTest, AGapRefusesEverythingUntilAResyncSnapshot) {
  Directory d;
  WatchIngest in(&d, "a");
  v1::WatchEvent m = Snapshot(1, {1}, false);
  ASSERT_TRUE(in.Ingest(&m).ok());
  m = Stored(3, 5);  // 2 was lost
  EXPECT_EQ(in.Ingest(&m).status().code(), absl::StatusCode::kDataLoss);
  m = Stored(4, 6);  // later messages of the broken stream are refused too
  EXPECT_EQ(in.Ingest(&m).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(d.prefix_entries(), 1u);
  EXPECT_EQ(in.gaps(), 1u);
  // The resync: a new stream, whose snapshot replaces what was known.
  in.Reset();
  m = Snapshot(1, {5, 6, 7}, false);
  ASSERT_TRUE(in.Ingest(&m).ok());
  EXPECT_EQ(d.prefix_entries(), 3u);
  EXPECT_TRUE(d.MatchPrefix(std::vector<BlockHash>{H(1)}).empty());
}

TEST(WatchIngestTest, ReorderedAndDuplicatedMessagesAreGaps) {
  Directory d;
  WatchIngest in(&d, "a");
  v1::WatchEvent m = Snapshot(1, {}, false);
  ASSERT_TRUE(in.Ingest(&m).ok());
  m = Stored(2, 1);
  ASSERT_TRUE(in.Ingest(&m).ok());
  m = Stored(2, 1);  // duplicate
  EXPECT_FALSE(in.Ingest(&m).ok());
  in.Reset();
  m = Snapshot(1, {}, false);
  ASSERT_TRUE(in.Ingest(&m).ok());
  m = Stored(3, 1);  // overtook 2
  EXPECT_FALSE(in.Ingest(&m).ok());
}

TEST(WatchIngestTest, AnEventInsideASnapshotsPartsIsAGap) {
  Directory d;
  WatchIngest in(&d, "a");
  v1::WatchEvent m = Snapshot(1, {1}, /*more=*/true);
  ASSERT_TRUE(in.Ingest(&m).ok());
  m = Stored(2, 9);
  EXPECT_EQ(in.Ingest(&m).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(d.prefix_entries(), 0u);
}

}  // namespace
}  // namespace kvcache::router
