#include "router/placement.h"

#include <cmath>
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
  EXPECT_EQ(Choose({}, "s", "", 16, 0, /*new_session=*/true, {}, false).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(PlacementTest, AffinityWinsWhenItsWorkerIsACandidate) {
  auto p = Choose({}, "s", "b", 16, 0, /*new_session=*/true, {Cand("a", 0, 10), Cand("b", 5000, 2)}, false);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->worker, "b");
  EXPECT_EQ(p->reason, PlacementReason::kAffinity);
  EXPECT_EQ(p->predicted_cached_tokens, 32);
}

TEST(PlacementTest, AffinityWorkerGoneFallsBackToScore) {
  auto p = Choose({}, "s", "gone", 16, 0, /*new_session=*/true, {Cand("a"), Cand("b", 0, 4)}, false);
  EXPECT_EQ(p->worker, "b");
  EXPECT_EQ(p->reason, PlacementReason::kPrefix);
}

TEST(PlacementTest, PrefixBeatsSmallLoadButNotHugeLoad) {
  // 20 pages * 16 = 320 reused tokens vs 100 queued tokens: prefix wins.
  EXPECT_EQ(
      Choose({}, "s", "", 16, 0, /*new_session=*/true, {Cand("a", 0), Cand("b", 100, 20)}, false)->worker,
      "b");
  // 2000 queued tokens outweigh 320 reused tokens.
  EXPECT_EQ(
      Choose({}, "s", "", 16, 0, /*new_session=*/true, {Cand("a", 0), Cand("b", 2000, 20)}, false)->worker,
      "a");
}

TEST(PlacementTest, DeviceHitBeatsHostHitOfSameLength) {
  auto p =
      Choose({}, "s", "", 16, 0, /*new_session=*/true, {Cand("a", 0, 0, 10), Cand("b", 0, 10, 0)}, false);
  EXPECT_EQ(p->worker, "b");
}

TEST(PlacementTest, BoundedLoadCapStopsHerding) {
  PlacementConfig c;
  c.load_weight = 0.0;  // prefix alone would always win
  // "hot" holds the prefix but is far above the mean load: skipped.
  auto p = Choose(c, "s", "", 16, 0, /*new_session=*/true,
                  {Cand("hot", 10000, 50), Cand("x", 0), Cand("y", 0)}, false);
  EXPECT_NE(p->worker, "hot");
  // When every worker is over the cap the cap is ignored.
  auto q = Choose(c, "s", "", 16, 0, /*new_session=*/true, {Cand("hot", 10000, 50)}, false);
  EXPECT_EQ(q->worker, "hot");
  // --load_balance=0: no cap, the score alone decides.
  c.cap_factor = 0;
  auto r = Choose(c, "s", "", 16, 0, /*new_session=*/true,
                  {Cand("hot", 10000, 50), Cand("x", 0), Cand("y", 0)}, false);
  EXPECT_EQ(r->worker, "hot");
}

// A worker whose whole tier 0 cannot hold the request and its reply would cut
// the reply short: it comes after every worker that can, whatever the caps or
// the prefix it holds say, and is chosen when none can.
TEST(PlacementTest, AWorkerTooSmallForTheRequestComesLast) {
  Candidate tiny = Cand("tiny", 0, /*device_pages=*/4);
  Candidate big = Cand("big", 3000);
  tiny.holds_context = false;
  big.sessions = 9;
  EXPECT_EQ(Choose({}, "s", "", 16, 4, /*new_session=*/true, {tiny, big}, false)->worker, "big");
  big.holds_context = false;
  EXPECT_EQ(Choose({}, "s", "", 16, 4, /*new_session=*/true, {tiny, big}, false)->worker, "tiny");
}

// A worker far behind its peers (stalled, or slower) takes no new session while
// the load cap is on, whatever the session bound says; without the load cap the
// session bound alone spreads them.
TEST(PlacementTest, TheLoadCapOutranksTheSessionBound) {
  PlacementConfig c;
  Candidate stalled = Cand("stalled", 4000);
  Candidate idle = Cand("idle", 0);
  stalled.sessions = 2;
  idle.sessions = 8;
  EXPECT_EQ(Choose(c, "s", "", 16, 4, /*new_session=*/true, {stalled, idle}, false)->worker, "idle");
  c.cap_factor = 0;
  EXPECT_EQ(Choose(c, "s", "", 16, 4, /*new_session=*/true, {stalled, idle}, false)->worker, "stalled");
}

TEST(PlacementTest, TiesSpreadByRendezvousAndAreStable) {
  std::vector<Candidate> cands = {Cand("w0"), Cand("w1"), Cand("w2"), Cand("w3")};
  std::map<std::string, int> counts;
  for (int i = 0; i < 4000; ++i) {
    const std::string s = absl::StrCat("session-", i);
    auto p = Choose({}, s, "", 16, 0, /*new_session=*/true, cands, false);
    ++counts[p->worker];
    EXPECT_EQ(p->reason, PlacementReason::kLoad);
    // Same inputs, same answer, regardless of candidate order.
    std::vector<Candidate> reversed(cands.rbegin(), cands.rend());
    EXPECT_EQ(Choose({}, s, "", 16, 0, /*new_session=*/true, reversed, false)->worker, p->worker);
  }
  for (const auto& [w, n] : counts) EXPECT_NEAR(n, 1000, 150) << w;
}

TEST(PlacementTest, TiesGoToTheWorkerWithFewerSessionsFirst) {
  std::vector<Candidate> cands = {Cand("w0"), Cand("w1")};
  cands[0].sessions = 3;
  cands[1].sessions = 2;
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(Choose({}, absl::StrCat("s", i), "", 16, 0, /*new_session=*/true, cands, false)->worker, "w1");
  }
  // A better score still wins over fewer sessions (here for a request that
  // keeps no session: a new one would give w0 more than its share).
  cands[0].match.device_pages = 1;
  EXPECT_EQ(Choose({}, "s", "", 16, 1, /*new_session=*/false, cands, false)->worker, "w0");
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
  EXPECT_EQ(Choose({}, "s", "", 16, 30, /*new_session=*/true, {full, empty}, false)->worker, "empty");
  // With room on both, the prefix wins again.
  full.load.set_pages_free_device(50);
  EXPECT_EQ(Choose({}, "s", "", 16, 30, /*new_session=*/true, {full, empty}, false)->worker, "full");
}

// A burst placed before any load report arrives: each placement counts what it
// dispatched (as the router does), `rounds` requests of `prompt_pages` pages
// whose first `shared_pages` the candidates hold as `cands[i].match`.
// `sessions`: each request creates a named session (bound by the session cap).
std::map<std::string, int> Burst(std::vector<Candidate> cands, int rounds, int prompt_pages, bool sessions) {
  std::map<std::string, int> placed;
  for (int i = 0; i < rounds; ++i) {
    auto p = Choose({}, absl::StrCat("new-", i), "", 16, prompt_pages, sessions, cands, false);
    EXPECT_TRUE(p.ok());
    for (Candidate& c : cands) {
      if (c.worker != p->worker) continue;
      ++c.dispatched_requests;
      c.dispatched_prefill_tokens += 16 * prompt_pages - p->predicted_cached_tokens;
      ++c.sessions;
    }
    ++placed[p->worker];
  }
  return placed;
}

TEST(PlacementTest, BurstSharingAPrefixSpreadsOverWorkers) {
  // 32 new sessions of 20 pages whose first 12 pages "a" holds: the prefix
  // draws them to "a" until its queue outweighs recomputing 12 pages on "b"
  // (which, before any report, is not known to have cached them since).
  auto placed = Burst({Cand("a", 0, 12), Cand("b")}, 32, 20, /*sessions=*/false);
  EXPECT_GT(placed["a"], placed["b"]);
  EXPECT_GE(placed["b"], 8) << "a took " << placed["a"];
  // New sessions stay: their counts stay within one of each worker's share.
  placed = Burst({Cand("a", 0, 12), Cand("b")}, 32, 20, /*sessions=*/true);
  EXPECT_EQ(placed["a"], 16);
  EXPECT_EQ(placed["b"], 16);
}

TEST(PlacementTest, BurstOfDistinctSessionsSpreadsEvenly) {
  for (bool sessions : {false, true}) {
    auto placed = Burst({Cand("a"), Cand("b"), Cand("c"), Cand("d")}, 32, 10, sessions);
    for (const auto& [w, n] : placed) EXPECT_EQ(n, 8) << w;
  }
}

// Sessions stay where they are placed. New conversations that share a system
// prompt cached on "a", arriving one at a time (the queues empty in between),
// would all score best on "a"; the session cap spreads them while "b" idles.
TEST(PlacementTest, NewSessionsSharingACachedPrefixAreBoundedPerWorker) {
  std::vector<Candidate> cands = {Cand("a", 0, 26), Cand("b")};
  std::map<std::string, int> placed;
  for (int i = 0; i < 8; ++i) {
    auto p = Choose({}, absl::StrCat("user-", i), "", 16, 108, /*new_session=*/true, cands, false);
    ASSERT_TRUE(p.ok());
    ++placed[p->worker];
    for (Candidate& c : cands) c.sessions += c.worker == p->worker ? 1 : 0;
    // Once "b" has served a conversation it holds the system prompt too.
    if (p->worker == "b") cands[1].match.device_pages = 26;
    const int64_t most = std::max(cands[0].sessions, cands[1].sessions);
    EXPECT_LE(most, (i + 2) / 2) << "after " << i + 1;  // ceil((i + 1) / 2)
  }
  EXPECT_EQ(placed["a"], 4);
  EXPECT_EQ(placed["b"], 4);
  // A looser factor lets the prefix take more first: ceil(1.5 * 3 / 2) = 3
  // sessions go to "a" before "b" gets one.
  PlacementConfig loose;
  loose.session_cap_factor = 1.5;
  cands = {Cand("a", 0, 26), Cand("b")};
  int before_b = 0;
  for (int i = 0; i < 8; ++i) {
    auto p = Choose(loose, absl::StrCat("user-", i), "", 16, 108, /*new_session=*/true, cands, false);
    if (p->worker == "b") break;
    ++before_b;
    ++cands[0].sessions;
  }
  EXPECT_EQ(before_b, 3);

  // Without the cap (or for a request that keeps no session) the prefix wins
  // every time.
  PlacementConfig off;
  off.session_cap_factor = 0;
  cands = {Cand("a", 0, 26), Cand("b")};
  cands[0].sessions = 7;
  EXPECT_EQ(Choose(off, "user-8", "", 16, 108, /*new_session=*/true, cands, false)->worker, "a");
  EXPECT_EQ(Choose({}, "no-session", "", 16, 108, /*new_session=*/false, cands, false)->worker, "a");
  EXPECT_EQ(Choose({}, "user-8", "", 16, 108, /*new_session=*/true, cands, false)->worker, "b");
  // A session's own worker is not bound by the cap: its turns stay there.
  EXPECT_EQ(Choose({}, "user-0", "a", 16, 108, /*new_session=*/true, cands, false)->worker, "a");
}

TEST(PlacementTest, LargerWorkersHoldMoreSessions) {
  // 5 sessions against 2, the 8th on its way: with equal pages "a" may hold
  // ceil(8 / 2) = 4, so the prefix it holds does not take it there.
  std::vector<Candidate> cands = {Cand("a", 0, 26), Cand("b")};
  cands[0].sessions = 5;
  cands[1].sessions = 2;
  for (Candidate& c : cands) {
    c.load.set_pages_total_device(1000);
    c.load.set_pages_free_device(500);
    c.load.set_pages_total_host(1000);
  }
  EXPECT_EQ(Choose({}, "s", "", 16, 108, /*new_session=*/true, cands, false)->worker, "b");
  // With twice the pages (host RAM counts), it may hold ceil(8 * 2 / 3) = 6.
  cands[0].load.set_pages_total_host(3000);
  EXPECT_EQ(Choose({}, "s", "", 16, 108, /*new_session=*/true, cands, false)->worker, "a");
}

TEST(PlacementTest, FasterWorkersTakeMoreOfABurst) {
  std::vector<Candidate> cands = {Cand("fast"), Cand("slow")};
  cands[0].load.set_prefill_tokens_per_second(2000);
  cands[1].load.set_prefill_tokens_per_second(1000);
  auto placed = Burst(cands, 30, 10, /*sessions=*/false);
  EXPECT_NEAR(placed["fast"], 20, 2);
}

TEST(PlacementTest, DispatchedWorkCountsUntilTheReportCatchesUp) {
  // The report says idle, but this router has just sent "a" 3,000 tokens.
  Candidate a = Cand("a", 0, 4);
  a.dispatched_requests = 2;
  a.dispatched_prefill_tokens = 3000;
  EXPECT_EQ(Choose({}, "s", "", 16, 8, /*new_session=*/true, {a, Cand("b")}, false)->worker, "b");
  // Once the report covers it, the larger of the two counts (not their sum).
  a.load.set_queued_prefill_tokens(3000);
  EXPECT_EQ(LoadTokens({}, a), 3000 + 32 * 2);
}

TEST(PlacementTest, RetryReason) {
  EXPECT_EQ(Choose({}, "s", "", 16, 0, /*new_session=*/true, {Cand("a")}, true)->reason,
            PlacementReason::kRetry);
}

}  // namespace
}  // namespace kvcache::router
