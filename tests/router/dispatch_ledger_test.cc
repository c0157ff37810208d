#include "router/dispatch_ledger.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::router {
namespace {

std::vector<BlockHash> Chain(std::vector<int32_t> tokens) {
  return ChainBlockHashes(tokens, 2, "model", "tenant");
}

TEST(DispatchLedgerTest, CountsUntilEachRequestFinishes) {
  DispatchLedger ledger;
  const auto a = Chain({1, 2, 3, 4, 5, 6});
  const auto b = Chain({1, 2, 3, 4, 9, 9, 9, 9});
  ledger.Dispatch("w0", a, 100);
  ledger.Dispatch("w0", b, 40);
  EXPECT_EQ(ledger.Get("w0").requests, 2);
  EXPECT_EQ(ledger.Get("w0").prefill_tokens, 140);
  EXPECT_EQ(ledger.Get("w1").requests, 0);
  // Pages in flight, leading pages only.
  EXPECT_EQ(ledger.LeadingPages("w0", Chain({1, 2, 3, 4, 5, 6, 7, 8})), 3);
  EXPECT_EQ(ledger.LeadingPages("w0", Chain({1, 2, 3, 4, 9, 9, 9, 9, 9, 9})), 4);
  EXPECT_EQ(ledger.LeadingPages("w0", Chain({7, 7, 3, 4})), 0);
  EXPECT_EQ(ledger.LeadingPages("w1", a), 0);

  ledger.PrefillDone("w0", 100);
  EXPECT_EQ(ledger.Get("w0").prefill_tokens, 40);
  ledger.Finish("w0", a, 0);
  // b still computes the shared first two pages.
  EXPECT_EQ(ledger.LeadingPages("w0", a), 2);
  ledger.Finish("w0", b, 40);
  EXPECT_EQ(ledger.LeadingPages("w0", a), 0);
  EXPECT_EQ(ledger.workers_tracked(), 0u);
}

// A request that ended OK leaves its pages counted on its worker for a grace
// period: the worker's cache events for them may not be applied yet.
TEST(DispatchLedgerTest, ComputedPagesCountForAGracePeriodAfterFinish) {
  DispatchLedger ledger;
  const auto a = Chain({1, 2, 3, 4, 5, 6});
  const auto b = Chain({7, 7, 7, 7});
  ledger.Dispatch("w0", a, 6);
  ledger.Dispatch("w0", b, 4);
  ledger.Finish("w0", a, 0, /*computed=*/true);
  ledger.Finish("w0", b, 0, /*computed=*/false);  // failed: nothing to count
  EXPECT_EQ(ledger.LeadingPages("w0", Chain({1, 2, 3, 4, 8, 8})), 2);
  EXPECT_EQ(ledger.LeadingPages("w0", b), 0);
  EXPECT_EQ(ledger.LeadingPages("w1", a), 0);
  EXPECT_EQ(ledger.Get("w0").requests, 0);
  EXPECT_EQ(ledger.workers_tracked(), 0u);  // nothing outstanding
}

TEST(DispatchLedgerTest, SessionsInFlightNameTheirWorkerUntilTheLastEnds) {
  DispatchLedger ledger;
  const SessionKey s{"tenant", "s"};
  const SessionKey other{"other-tenant", "s"};
  EXPECT_FALSE(ledger.SessionWorker(s).has_value());
  ledger.SessionDispatched(s, "w1", /*creates=*/false);
  ledger.SessionDispatched(s, "w1", /*creates=*/false);  // a second request, refused there
  EXPECT_EQ(ledger.SessionWorker(s), "w1");
  EXPECT_FALSE(ledger.SessionWorker(other).has_value());  // tenants are separate
  ledger.SessionFinished(s, "w1", /*creates=*/false, /*held=*/false);
  EXPECT_EQ(ledger.SessionWorker(s), "w1");
  ledger.SessionFinished(s, "w1", /*creates=*/false, /*held=*/true);
  EXPECT_FALSE(ledger.SessionWorker(s).has_value());
  EXPECT_EQ(ledger.sessions_tracked(), 0u);
  // Where it ended stays known for the grace period (the directory may trail).
  EXPECT_EQ(ledger.RecentSessionWorker(s), "w1");
  EXPECT_FALSE(ledger.RecentSessionWorker(other).has_value());
  EXPECT_THAT(ledger.RecentSessionsNamed("s"), ::testing::ElementsAre(s));
  // Closed through the router: it lives nowhere now.
  ledger.SessionClosed(s);
  EXPECT_FALSE(ledger.RecentSessionWorker(s).has_value());
  EXPECT_TRUE(ledger.RecentSessionsNamed("s").empty());
}

TEST(DispatchLedgerTest, OnlyARequestThatLeftTheSessionNamesItsWorker) {
  DispatchLedger ledger;
  const SessionKey s{"tenant", "s"};
  const SessionKey other{"other-tenant", "s"};
  // A first request that failed before any token created nothing.
  ledger.SessionDispatched(s, "w0", /*creates=*/false);
  EXPECT_THAT(ledger.RecentSessionsNamed("s"), ::testing::ElementsAre(s));  // in flight
  ledger.SessionFinished(s, "w0", /*creates=*/false, /*held=*/false);
  EXPECT_FALSE(ledger.RecentSessionWorker(s).has_value());
  // One that did; a later failed one elsewhere does not move it.
  ledger.SessionDispatched(s, "w1", /*creates=*/false);
  ledger.SessionFinished(s, "w1", /*creates=*/false, /*held=*/true);
  ledger.SessionDispatched(s, "w0", /*creates=*/false);
  ledger.SessionFinished(s, "w0", /*creates=*/false, /*held=*/false);
  EXPECT_EQ(ledger.RecentSessionWorker(s), "w1");
  // Every tenant's session by that id, once each.
  ledger.SessionDispatched(other, "w0", /*creates=*/false);
  EXPECT_THAT(ledger.RecentSessionsNamed("s"), ::testing::UnorderedElementsAre(s, other));
  EXPECT_TRUE(ledger.RecentSessionsNamed("t").empty());
}

// New sessions count on their worker from dispatch until the directory lists
// them there (the worker's event trails the dispatch).
TEST(DispatchLedgerTest, SessionsBeingCreatedCountOnTheirWorkerUntilTheDirectoryListsThem) {
  DispatchLedger ledger;
  const SessionKey a{"tenant", "a"};
  const SessionKey b{"tenant", "b"};
  ledger.SessionDispatched(a, "w0", /*creates=*/true);
  ledger.SessionDispatched(b, "w0", /*creates=*/true);
  ledger.SessionDispatched(a, "w1", /*creates=*/false);  // a turn on a session that exists
  EXPECT_EQ(ledger.Get("w0").new_sessions, 2);
  EXPECT_EQ(ledger.Get("w1").new_sessions, 0);
  EXPECT_EQ(ledger.workers_tracked(), 1u);
  // a ended held, not yet listed: it goes on counting; b failed first: it is
  // nowhere.
  ledger.SessionFinished(a, "w0", /*creates=*/true, /*held=*/true);
  ledger.SessionFinished(b, "w0", /*creates=*/true, /*held=*/false);
  ledger.SessionFinished(a, "w1", /*creates=*/false, /*held=*/true);
  EXPECT_EQ(ledger.Get("w0").new_sessions, 1);
  EXPECT_THAT(ledger.Creations("w0"), ::testing::ElementsAre(a));
  EXPECT_TRUE(ledger.Creations("w1").empty());
  EXPECT_EQ(ledger.workers_tracked(), 0u) << "nothing is in flight";
  EXPECT_EQ(ledger.sessions_tracked(), 0u);
  ledger.Listed(a, "w0");
  EXPECT_EQ(ledger.Get("w0").new_sessions, 0);
  EXPECT_TRUE(ledger.Creations("w0").empty());
  // Closed through the router: it lives nowhere.
  ledger.SessionDispatched(b, "w1", /*creates=*/true);
  ledger.SessionFinished(b, "w1", /*creates=*/true, /*held=*/true);
  EXPECT_EQ(ledger.Get("w1").new_sessions, 1);
  ledger.SessionClosed(b);
  EXPECT_EQ(ledger.Get("w1").new_sessions, 0);
}

// The directory lists a session as soon as its worker has placed it, which is
// often while its first request still runs: from then on it counts once, as
// the directory's, not also as the ledger's.
TEST(DispatchLedgerTest, ASessionTheDirectoryListsStopsCountingAsACreation) {
  DispatchLedger ledger;
  const SessionKey a{"tenant", "a"};
  const SessionKey b{"tenant", "b"};
  ledger.SessionDispatched(a, "w0", /*creates=*/true);
  ledger.SessionDispatched(b, "w0", /*creates=*/true);
  EXPECT_EQ(ledger.Get("w0").new_sessions, 2);
  ledger.Listed(a, "w1");  // listed elsewhere: still being created here
  EXPECT_EQ(ledger.Get("w0").new_sessions, 2);
  ledger.Listed(a, "w0");
  EXPECT_EQ(ledger.Get("w0").new_sessions, 1);
  EXPECT_THAT(ledger.Creations("w0"), ::testing::ElementsAre(b));
  EXPECT_EQ(ledger.workers_tracked(), 1u);
  ledger.SessionFinished(a, "w0", /*creates=*/true, /*held=*/true);
  EXPECT_EQ(ledger.Get("w0").new_sessions, 1) << "a counts as the directory's";
  ledger.SessionFinished(b, "w0", /*creates=*/true, /*held=*/false);
  EXPECT_EQ(ledger.Get("w0").new_sessions, 0) << "b failed before it was held";
  EXPECT_EQ(ledger.workers_tracked(), 0u);
  EXPECT_EQ(ledger.sessions_tracked(), 0u);
}

}  // namespace
}  // namespace kvcache::router
