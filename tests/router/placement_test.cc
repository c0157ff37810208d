#include "router/placement.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvcache::router {
namespace {

Candidate Cand(const std::string& w, int queued = 0, int device_pages = 0, int host_pages = 0,
               int running = 0) {
  Candidate c;
  c.worker = w;
  c.load.set_queued_prefill_tokens(queued);
  c.load.set_running_requests(running);
  c.match.device_pages = device_pages;
  c.match.host_pages = host_pages;
  return c;
}

TEST(PlacementTest, NoCandidatesIsUnavailable) {
  EXPECT_EQ(Choose({}, "s", "", 16, 0, {}, false).status().code(), absl::StatusCode::kUnavailable);
}

TEST(PlacementTest, AffinityWinsWhenItsWorkerIsACandidate) {
  auto p = Choose({}, "s", "b", 16, 0, {Cand("a", 0, 10), Cand("b", 5000, 2)}, false);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->worker, "b");
  EXPECT_EQ(p->reason, PlacementReason::kAffinity);
  EXPECT_EQ(p->predicted_cached_tokens, 32);
}

TEST(PlacementTest, AffinityWorkerGoneFallsBackToScore) {
  auto p = Choose({}, "s", "gone", 16, 0, {Cand("a"), Cand("b", 0, 4)}, false);
  EXPECT_EQ(p->worker, "b");
  EXPECT_EQ(p->reason, PlacementReason::kPrefix);
}

TEST(PlacementTest, PrefixBeatsSmallLoadButNotHugeLoad) {
  // 20 pages * 16 = 320 reused tokens vs 100 queued tokens: prefix wins.
  EXPECT_EQ(Choose({}, "s", "", 16, 0, {Cand("a", 0), Cand("b", 100, 20)}, false)->worker, "b");
  // 2000 queued tokens outweigh 320 reused tokens.
  EXPECT_EQ(Choose({}, "s", "", 16, 0, {Cand("a", 0), Cand("b", 2000, 20)}, false)->worker, "a");
}

TEST(PlacementTest, DeviceHitBeatsHostHitOfSameLength) {
  auto p = Choose({}, "s", "", 16, 0, {Cand("a", 0, 0, 10), Cand("b", 0, 10, 0)}, false);
  EXPECT_EQ(p->worker, "b");
}

TEST(PlacementTest, BoundedLoadCapStopsHerding) {
  PlacementConfig c;
  c.load_weight = 0.0;  // prefix alone would always win
  // "hot" holds the prefix but is far above the mean load: skipped.
  auto p = Choose(c, "s", "", 16, 0, {Cand("hot", 10000, 50), Cand("x", 0), Cand("y", 0)}, false);
  EXPECT_NE(p->worker, "hot");
  // When every worker is over the cap the cap is ignored.
  auto q = Choose(c, "s", "", 16, 0, {Cand("hot", 10000, 50)}, false);
  EXPECT_EQ(q->worker, "hot");
}

TEST(PlacementTest, TiesSpreadByRendezvousAndAreStable) {
  std::vector<Candidate> cands = {Cand("w0"), Cand("w1"), Cand("w2"), Cand("w3")};
  std::map<std::string, int> counts;
  for (int i = 0; i < 4000; ++i) {
    const std::string s = absl::StrCat("session-", i);
    auto p = Choose({}, s, "", 16, 0, cands, false);
    ++counts[p->worker];
    EXPECT_EQ(p->reason, PlacementReason::kLoad);
    // Same inputs, same answer, regardless of candidate order.
    std::vector<Candidate> reversed(cands.rbegin(), cands.rend());
    EXPECT_EQ(Choose({}, s, "", 16, 0, reversed, false)->worker, p->worker);
  }
  for (const auto& [w, n] : counts) EXPECT_NEAR(n, 1000, 150) << w;
}

TEST(PlacementTest, TiesGoToTheWorkerWithFewerSessionsFirst) {
  std::vector<Candidate> cands = {Cand("w0"), Cand("w1")};
  cands[0].sessions = 3;
  cands[1].sessions = 2;
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(Choose({}, absl::StrCat("s", i), "", 16, 0, cands, false)->worker, "w1");
  }
  // A better score still wins over fewer sessions.
  cands[0].match.device_pages = 1;
  EXPECT_EQ(Choose({}, "s", "", 16, 1, cands, false)->worker, "w0");
}

TEST(PlacementTest, FullTierZeroCostsEvictions) {
  // "full" holds 5 of the request's 30 pages but has no free page; "empty" has
  // room: pushing 25 pages out of a full tier 0 costs more than recomputing 5.
  Candidate full = Cand("full", 0, 5);
  full.load.set_pages_total_device(100);
  full.load.set_pages_free_device(0);
  Candidate empty = Cand("empty");
  empty.load.set_pages_total_device(100);
  empty.load.set_pages_free_device(100);
  EXPECT_EQ(Choose({}, "s", "", 16, 30, {full, empty}, false)->worker, "empty");
  // With room on both, the prefix wins again.
  full.load.set_pages_free_device(50);
  EXPECT_EQ(Choose({}, "s", "", 16, 30, {full, empty}, false)->worker, "full");
}

TEST(PlacementTest, RetryReason) {
  EXPECT_EQ(Choose({}, "s", "", 16, 0, {Cand("a")}, true)->reason, PlacementReason::kRetry);
}

}  // namespace
}  // namespace kvcache::router
