#include "router/directory.h"

#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvcache::router {
namespace {

BlockHash H(uint8_t v) {
  BlockHash h;
  h.bytes.fill(v);
  return h;
}

std::string Bytes(const BlockHash& h) { return std::string(h.bytes.begin(), h.bytes.end()); }

v1::CacheEvent Prefix(v1::CacheEvent::Kind kind, v1::Tier tier, std::initializer_list<uint8_t> hs) {
  v1::CacheEvent e;
  e.set_kind(kind);
  e.set_tier(tier);
  for (uint8_t v : hs) e.add_block_hashes(Bytes(H(v)));
  return e;
}

constexpr char kTenant[] = "t";

v1::CacheEvent SessionEvent(v1::CacheEvent::Kind kind, const std::string& id, int tokens = 0,
                            const std::string& tenant = kTenant) {
  v1::CacheEvent e;
  e.set_kind(kind);
  e.set_session_id(id);
  e.set_tenant(tenant);
  e.set_tokens(tokens);
  return e;
}

SessionKey K(const std::string& id, const std::string& tenant = kTenant) { return SessionKey{tenant, id}; }

int64_t Count(const Directory& d, const WorkerId& w) {
  const auto counts = d.SessionCounts();
  auto it = counts.find(w);
  return it != counts.end() ? it->second : 0;
}

TEST(DirectoryTest, SessionsFollowEvents) {
  Directory d;
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 40));
  ASSERT_TRUE(d.FindSession(K("s1")).has_value());
  EXPECT_EQ(d.FindSession(K("s1"))->worker, "a");
  EXPECT_EQ(d.FindSession(K("s1"))->tokens, 40);
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_OFFLOADED, "s1"));
  EXPECT_EQ(d.FindSession(K("s1"))->tier, v1::TIER_HOST);
  EXPECT_EQ(d.FindSession(K("s1"))->tokens, 40);
  // Migrated to b: b's placement arrives, then a's late export must not erase it.
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 40));
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_EXPORTED, "s1"));
  ASSERT_TRUE(d.FindSession(K("s1")).has_value());
  EXPECT_EQ(d.FindSession(K("s1"))->worker, "b");
  EXPECT_EQ(Count(d, "a"), 0);
  EXPECT_EQ(Count(d, "b"), 1);
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_RESTORED, "s1"));
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s2"));
  EXPECT_EQ(Count(d, "a"), 1);
  EXPECT_EQ(Count(d, "b"), 1);
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_DROPPED, "s1"));
  EXPECT_FALSE(d.FindSession(K("s1")).has_value());
  EXPECT_EQ(Count(d, "b"), 0);
  EXPECT_EQ(Count(d, "nobody"), 0);
}

TEST(DirectoryTest, PrefixMatchIsLeadingAndTierAware) {
  Directory d;
  d.ApplyEvent("a", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {1, 2, 3}));
  d.ApplyEvent("b", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {1}));
  d.ApplyEvent("b", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_HOST, {2, 3, 4}));
  d.ApplyEvent("c", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {2, 3}));  // no page 1
  std::vector<BlockHash> chain = {H(1), H(2), H(3), H(4)};
  auto m = d.MatchPrefix(chain);
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m["a"].device_pages, 3);
  EXPECT_EQ(m["a"].host_pages, 0);
  EXPECT_EQ(m["b"].device_pages, 1);
  EXPECT_EQ(m["b"].host_pages, 3);
  EXPECT_EQ(m.count("c"), 0u);

  d.ApplyEvent("a", Prefix(v1::CacheEvent::PREFIX_REMOVED, v1::TIER_DEVICE, {2}));
  m = d.MatchPrefix(chain);
  EXPECT_EQ(m["a"].device_pages, 1);
}

TEST(DirectoryTest, SnapshotReplacesAndRemoveWorkerForgets) {
  Directory d;
  d.ApplyEvent("a", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {1, 2}));
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "old", 10));
  v1::WorkerSnapshot snap;
  snap.set_model_id("m");
  snap.add_device_block_hashes(Bytes(H(7)));
  snap.add_host_block_hashes(Bytes(H(8)));
  auto* s = snap.add_sessions();
  s->set_session_id("new");
  s->set_tenant(kTenant);
  s->set_tokens_cached(99);
  s->set_state(v1::SESSION_IDLE);
  snap.mutable_load()->set_running_requests(3);
  EXPECT_EQ(Count(d, "a"), 1);
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "new", 50));  // then found on a
  d.ApplySnapshot("a", snap);
  EXPECT_FALSE(d.FindSession(K("old")).has_value());
  EXPECT_EQ(Count(d, "a"), 1);
  EXPECT_EQ(Count(d, "b"), 0);
  EXPECT_EQ(d.FindSession(K("new"))->tokens, 99);
  EXPECT_EQ(d.prefix_entries(), 2u);
  EXPECT_TRUE(d.MatchPrefix(std::vector<BlockHash>{H(1)}).empty());
  EXPECT_EQ(d.Load("a")->running_requests(), 3);
  EXPECT_EQ(d.Describe("a")->model_id(), "m");

  // b's claim on "new" stands behind a's until b's stream lets go of it.
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_EXPORTED, "new"));
  auto lost = d.RemoveWorker("a");
  EXPECT_EQ(lost, std::vector<SessionKey>{K("new")});
  EXPECT_EQ(d.prefix_entries(), 0u);
  EXPECT_EQ(d.session_count(), 0u);
  EXPECT_EQ(Count(d, "a"), 0);
  EXPECT_FALSE(d.Load("a").has_value());
}

v1::WorkerSnapshot SnapshotOf(std::initializer_list<const char*> ids) {
  v1::WorkerSnapshot snap;
  for (const char* id : ids) {
    auto* s = snap.add_sessions();
    s->set_session_id(id);
    s->set_tenant(kTenant);
    s->set_tokens_cached(30);
    s->set_state(v1::SESSION_IDLE);
  }
  return snap;
}

using StaleCopies = std::vector<std::pair<SessionKey, WorkerId>>;

// A FULL_CONTEXT turn moved s1 from a to b while a hung, and the router's
// close of a's copy failed. When a comes back, its snapshot must not make the
// old conversation the session again (an APPEND would run on it and answer OK).
TEST(DirectoryTest, AStaleCopyDoesNotWinWhenItsWorkerComesBack) {
  Directory d;
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 40));
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 60));
  d.MarkStale(K("s1"), "a");
  EXPECT_EQ(d.FindSession(K("s1"))->worker, "b");
  d.ApplySnapshot("a", SnapshotOf({"s1", "s2"}));
  ASSERT_TRUE(d.FindSession(K("s1")).has_value());
  EXPECT_EQ(d.FindSession(K("s1"))->worker, "b");
  EXPECT_EQ(d.FindSession(K("s2"))->worker, "a");
  EXPECT_EQ(d.TakeStaleCopies(), (StaleCopies{{K("s1"), "a"}}));
  EXPECT_TRUE(d.TakeStaleCopies().empty());
  // Its tier moves do not claim it either; b's close leaves no session behind.
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_OFFLOADED, "s1"));
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_DROPPED, "s1"));
  EXPECT_FALSE(d.FindSession(K("s1")).has_value());
  // Listed again by the next snapshot (the close failed again): queued again.
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 60));
  d.ApplySnapshot("a", SnapshotOf({"s1", "s2"}));
  EXPECT_EQ(d.FindSession(K("s1"))->worker, "b");
  EXPECT_EQ(d.TakeStaleCopies(), (StaleCopies{{K("s1"), "a"}}));
  EXPECT_EQ(d.stale_copies(), 1u);
  d.ClearStale(K("s1"), "a");  // the close was answered
  EXPECT_EQ(d.stale_copies(), 0u);
}

// A worker the router forgot (unreachable past --forget_after) comes back with
// its sessions: those that a turn recreated elsewhere meanwhile are stale and
// closed; the others are its own again.
TEST(DirectoryTest, AForgottenWorkersSessionsComeBackOnlyWhereNobodyTookThemOver) {
  Directory d;
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 40));
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s2", 40));
  auto lost = d.RemoveWorker("a", /*may_return=*/true);
  EXPECT_EQ(lost.size(), 2u);
  EXPECT_EQ(d.stale_copies(), 2u);
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 60));
  d.ApplySnapshot("a", SnapshotOf({"s1", "s2"}));
  EXPECT_EQ(d.FindSession(K("s1"))->worker, "b");
  EXPECT_EQ(d.FindSession(K("s2"))->worker, "a");
  EXPECT_EQ(d.TakeStaleCopies(), (StaleCopies{{K("s1"), "a"}}));
  EXPECT_EQ(d.stale_copies(), 1u);  // s2's mark ended: a holds it
  // A worker that leaves the fleet leaves no marks behind.
  d.RemoveWorker("a");
  EXPECT_EQ(d.stale_copies(), 0u);
}

// A session whose worker was forgotten, or came back without it (a restarted
// process at the same address), is lost: Lookup says so (UNAVAILABLE naming
// the worker, for a client to resend it whole) instead of NOT_FOUND, until a
// worker lists the session again. A session its worker dropped (closed,
// expired) is not found, as one that never existed. Before, all four answered
// NOT_FOUND (qa23: lost sessions after drains and restarts).
TEST(DirectoryTest, ASessionLostWithItsWorkerIsSaidToBe) {
  Directory d;
  for (const char* id : {"s1", "s2", "s3", "s4"})
    d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, id, 40));
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_DROPPED, "s4"));
  d.ApplySnapshot("a", SnapshotOf({"s1"}));  // back without s2 and s3
  EXPECT_TRUE(d.Lookup(K("s1"), absl::ZeroDuration()).ok());
  for (const char* id : {"s2", "s3"}) {
    const absl::Status st = d.Lookup(K(id), absl::ZeroDuration()).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << id;
    EXPECT_NE(st.message().find("lost with worker a"), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find("FULL_CONTEXT"), absl::string_view::npos) << st;
  }
  EXPECT_EQ(d.Lookup(K("s4"), absl::ZeroDuration()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(d.Lookup(K("s2", "other tenant"), absl::ZeroDuration()).status().code(),
            absl::StatusCode::kNotFound);
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s2", 10));  // resent whole
  EXPECT_TRUE(d.Lookup(K("s2"), absl::ZeroDuration()).ok());
  EXPECT_FALSE(d.LostWith(K("s2")).has_value());
  d.RemoveWorker("b");
  EXPECT_EQ(d.LostWith(K("s2")), std::optional<WorkerId>("b"));
  EXPECT_EQ(d.LostWith(K("s1")), std::nullopt);
}

// Only the last Directory::kMaxLost lost sessions are remembered.
TEST(DirectoryTest, LostSessionsAreBounded) {
  Directory d;
  const int n = static_cast<int>(Directory::kMaxLost) + 10;
  for (int i = 0; i < n; ++i)
    d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, absl::StrCat("s", i), 4));
  d.RemoveWorker("a");
  size_t remembered = 0;
  for (int i = 0; i < n; ++i) remembered += d.LostWith(K(absl::StrCat("s", i))).has_value();
  EXPECT_EQ(remembered, Directory::kMaxLost);
}

TEST(DirectoryTest, AStaleMarkEndsWithAPlacementADropOrASnapshotWithoutTheCopy) {
  Directory d;
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 60));
  d.MarkStale(K("s1"), "a");
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 70));  // a new turn there
  EXPECT_EQ(d.stale_copies(), 0u);
  EXPECT_EQ(d.FindSession(K("s1"))->worker, "a");
  d.MarkStale(K("s1"), "b");
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_DROPPED, "s1"));
  EXPECT_EQ(d.stale_copies(), 0u);
  d.MarkStale(K("s9"), "c");
  d.ApplySnapshot("c", SnapshotOf({"s3"}));
  EXPECT_EQ(d.stale_copies(), 0u);
  EXPECT_TRUE(d.TakeStaleCopies().empty());
}

TEST(DirectoryTest, ReplicasFedTheSameStreamsAgree) {
  Directory r1, r2;
  std::vector<std::pair<std::string, v1::CacheEvent>> stream = {
      {"a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 16)},
      {"b", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {5, 6})},
      {"a", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {5})},
      {"b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s2", 32)},
  };
  // Per-worker order is what each Watch stream guarantees; interleaving across
  // workers may differ between replicas.
  for (const auto& [w, e] : stream) r1.ApplyEvent(w, e);
  for (int i : {1, 3, 0, 2}) r2.ApplyEvent(stream[i].first, stream[i].second);
  std::vector<BlockHash> chain = {H(5), H(6)};
  EXPECT_EQ(r1.MatchPrefix(chain)["a"].device_pages, r2.MatchPrefix(chain)["a"].device_pages);
  EXPECT_EQ(r1.MatchPrefix(chain)["b"].device_pages, r2.MatchPrefix(chain)["b"].device_pages);
  EXPECT_EQ(r1.FindSession(K("s2"))->worker, r2.FindSession(K("s2"))->worker);
  EXPECT_EQ(r1.session_count(), r2.session_count());
}

TEST(DirectoryTest, TwoTenantsWithTheSameIdAreIndependentEntries) {
  Directory d;
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "chat", 40, "alice"));
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "chat", 10, "bob"));  // no overwrite
  ASSERT_TRUE(d.FindSession(K("chat", "alice")).has_value());
  ASSERT_TRUE(d.FindSession(K("chat", "bob")).has_value());
  EXPECT_EQ(d.FindSession(K("chat", "alice"))->worker, "a");
  EXPECT_EQ(d.FindSession(K("chat", "alice"))->tokens, 40);
  EXPECT_EQ(d.FindSession(K("chat", "alice"))->tenant, "alice");
  EXPECT_EQ(d.FindSession(K("chat", "bob"))->worker, "b");
  EXPECT_EQ(d.FindSession(K("chat", "bob"))->tokens, 10);
  EXPECT_EQ(d.session_count(), 2u);
  EXPECT_EQ(Count(d, "a"), 1);
  EXPECT_EQ(Count(d, "b"), 1);
  EXPECT_EQ(d.SessionsNamed("chat").size(), 2u);

  // Events name their tenant's session only.
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_OFFLOADED, "chat", 0, "alice"));
  EXPECT_EQ(d.FindSession(K("chat", "alice"))->tier, v1::TIER_HOST);
  EXPECT_EQ(d.FindSession(K("chat", "bob"))->tier, v1::TIER_DEVICE);
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_TRUNCATED, "chat", 3, "bob"));
  EXPECT_EQ(d.FindSession(K("chat", "alice"))->tokens, 40);
  EXPECT_EQ(d.FindSession(K("chat", "bob"))->tokens, 3);
  // Both on one worker (it keys them apart too); dropping one keeps the other.
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "chat", 12, "bob"));
  EXPECT_EQ(Count(d, "a"), 2);
  EXPECT_EQ(Count(d, "b"), 0);
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_DROPPED, "chat", 0, "bob"));
  // b never said it let go of bob's "chat": its claim is the one left.
  ASSERT_TRUE(d.FindSession(K("chat", "bob")).has_value());
  EXPECT_EQ(d.FindSession(K("chat", "bob"))->worker, "b");
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_DROPPED, "chat", 0, "bob"));
  EXPECT_FALSE(d.FindSession(K("chat", "bob")).has_value());
  ASSERT_TRUE(d.FindSession(K("chat", "alice")).has_value());
  EXPECT_EQ(d.FindSession(K("chat", "alice"))->worker, "a");
  EXPECT_EQ(Count(d, "a"), 1);

  // A snapshot with both tenants' "chat" keeps both.
  v1::WorkerSnapshot snap;
  for (const char* tenant : {"alice", "bob"}) {
    auto* s = snap.add_sessions();
    s->set_session_id("chat");
    s->set_tenant(tenant);
    s->set_tokens_cached(tenant[0] == 'a' ? 50 : 60);
  }
  d.ApplySnapshot("c", snap);
  d.ApplySnapshot("a", v1::WorkerSnapshot());  // a restarted empty
  EXPECT_EQ(d.FindSession(K("chat", "alice"))->worker, "c");
  EXPECT_EQ(d.FindSession(K("chat", "alice"))->tokens, 50);
  EXPECT_EQ(d.FindSession(K("chat", "bob"))->worker, "c");
  EXPECT_EQ(d.FindSession(K("chat", "bob"))->tokens, 60);
  EXPECT_EQ(d.session_count(), 2u);
  auto lost = d.RemoveWorker("c");
  EXPECT_EQ(lost.size(), 2u);
  EXPECT_EQ(d.session_count(), 0u);
}

TEST(DirectoryTest, ATenantLearnsNothingAboutAnothersSessions) {
  Directory d;
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "secret", 40, "alice"));
  const auto mine = d.Lookup(K("secret", "alice"), absl::ZeroDuration());
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->worker, "a");

  // Bob asking for Alice's id gets exactly what he gets for an id nobody uses.
  Directory empty;
  const absl::Status unknown = empty.Lookup(K("secret", "bob"), absl::ZeroDuration()).status();
  const absl::Status others = d.Lookup(K("secret", "bob"), absl::ZeroDuration()).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(others, unknown);
  EXPECT_EQ(others.message(), "session 'secret' not found");
  EXPECT_FALSE(d.FindSession(K("secret", "bob")).has_value());
  EXPECT_FALSE(d.FindSession(K("secret", "")).has_value());
  // Waiting for it as well: Alice's session appearing does not end Bob's wait
  // with a location.
  absl::StatusOr<SessionLocation> waited;
  std::thread bob([&] { waited = d.Lookup(K("later", "bob"), absl::Milliseconds(200)); });
  d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "later", 8, "alice"));
  bob.join();
  EXPECT_EQ(waited.status(), empty.Lookup(K("later", "bob"), absl::ZeroDuration()).status());
  // While a wait for one's own session ends when its placement event arrives.
  std::thread alice([&] { waited = d.Lookup(K("soon", "alice"), absl::Seconds(60)); });
  d.ApplyEvent("b", SessionEvent(v1::CacheEvent::SESSION_PLACED, "soon", 8, "alice"));
  alice.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->worker, "b");
}

TEST(DirectoryTest, PagesHeldByManyWorkersMatchAndLeaveOneByOne) {
  // A shared system prompt: page 1 on every worker, page 2 on some.
  Directory d;
  for (int w = 0; w < 40; ++w) {
    d.ApplyEvent(absl::StrCat("w", w), Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {1}));
    if (w % 3 == 0) {
      d.ApplyEvent(absl::StrCat("w", w),
                   Prefix(v1::CacheEvent::PREFIX_STORED, w % 2 ? v1::TIER_HOST : v1::TIER_DEVICE, {2}));
    }
  }
  EXPECT_EQ(d.distinct_pages(), 2u);
  EXPECT_EQ(d.prefix_entries(), 40u + 14u);
  auto m = d.MatchPrefix(std::vector<BlockHash>{H(1), H(2)});
  EXPECT_EQ(m.size(), 40u);
  EXPECT_EQ(m["w0"].device_pages, 2);
  EXPECT_EQ(m["w3"].device_pages, 1);
  EXPECT_EQ(m["w3"].host_pages, 1);
  EXPECT_EQ(m["w1"].device_pages, 1);
  EXPECT_EQ(m["w1"].host_pages, 0);
  // Removing from the middle of a widely held page keeps the others.
  for (int w = 0; w < 40; w += 2) {
    d.ApplyEvent(absl::StrCat("w", w), Prefix(v1::CacheEvent::PREFIX_REMOVED, v1::TIER_DEVICE, {1}));
  }
  m = d.MatchPrefix(std::vector<BlockHash>{H(1), H(2)});
  EXPECT_EQ(m.size(), 20u);
  EXPECT_EQ(m.count("w0"), 0u);
  EXPECT_EQ(m["w3"].total_pages(), 2);
  // A removed worker frees its index; a new one reusing it starts empty.
  d.RemoveWorker("w3");
  EXPECT_EQ(d.MatchPrefix(std::vector<BlockHash>{H(1)}).count("w3"), 0u);
  d.ApplyEvent("new", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {7}));
  m = d.MatchPrefix(std::vector<BlockHash>{H(1)});
  EXPECT_EQ(m.count("new"), 0u);
  EXPECT_EQ(d.MatchPrefix(std::vector<BlockHash>{H(7)}).size(), 1u);
  for (int w = 0; w < 40; ++w) d.RemoveWorker(absl::StrCat("w", w));
  d.RemoveWorker("new");
  EXPECT_EQ(d.prefix_entries(), 0u);
  EXPECT_EQ(d.distinct_pages(), 0u);
}

TEST(DirectoryTest, DigestDependsOnContentNotOrder) {
  Directory a, b;
  a.ApplyEvent("x", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 10));
  a.ApplyEvent("y", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {1, 2}));
  a.ApplyEvent("x", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_HOST, {1}));
  // The same content learnt in another order (and other worker indices).
  b.ApplyEvent("x", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_HOST, {1}));
  b.ApplyEvent("y", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {2, 1}));
  b.ApplyEvent("x", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s1", 99));  // lengths are left out
  EXPECT_EQ(a.Digest(), b.Digest());
  b.ApplyEvent("x", SessionEvent(v1::CacheEvent::SESSION_OFFLOADED, "s1"));
  EXPECT_NE(a.Digest(), b.Digest());
  a.ApplyEvent("x", SessionEvent(v1::CacheEvent::SESSION_OFFLOADED, "s1"));
  EXPECT_EQ(a.Digest(), b.Digest());
  a.ApplyEvent("y", Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_HOST, {2}));
  EXPECT_NE(a.Digest(), b.Digest());
  EXPECT_NE(Directory().Digest(), a.Digest());
}

TEST(DirectoryTest, MemoryGrowsWithPagesAndShrinksWhenTheyLeave) {
  Directory d;
  const Directory::MemoryUsage empty = d.Memory();
  v1::CacheEvent e;
  e.set_kind(v1::CacheEvent::PREFIX_STORED);
  for (int i = 0; i < 10000; ++i) {
    BlockHash h;
    std::memcpy(h.bytes.data(), &i, sizeof(i));
    h.bytes[31] = 1;
    e.add_block_hashes(Bytes(h));
  }
  d.ApplyEvent("a", e);
  const Directory::MemoryUsage full = d.Memory();
  EXPECT_GT(full.page_bytes, empty.page_bytes + 10000 * 16);
  EXPECT_LT(full.page_bytes / 10000, 100u);  // the per-page budget
  d.RemoveWorker("a");
  EXPECT_EQ(d.prefix_entries(), 0u);
}

TEST(DirectoryTest, ASessionThatMovesTwiceEndsWhereItIsInAnyInterleavingOfTheStreams) {
  // s moves a -> b -> a. Stream a says: exported, placed. Stream b says:
  // placed, exported. Every interleaving of the two ends with s on a.
  const std::vector<std::pair<WorkerId, v1::CacheEvent::Kind>> a = {{"a", v1::CacheEvent::SESSION_EXPORTED},
                                                                    {"a", v1::CacheEvent::SESSION_PLACED}};
  const std::vector<std::pair<WorkerId, v1::CacheEvent::Kind>> b = {{"b", v1::CacheEvent::SESSION_PLACED},
                                                                    {"b", v1::CacheEvent::SESSION_EXPORTED}};
  // Interleavings as masks: bit i set = the i-th event comes from b.
  int checked = 0;
  for (int mask = 0; mask < 16; ++mask) {
    if (__builtin_popcount(mask) != 2) continue;
    Directory d;
    d.ApplyEvent("a", SessionEvent(v1::CacheEvent::SESSION_PLACED, "s", 10));
    size_t ia = 0, ib = 0;
    for (int i = 0; i < 4; ++i) {
      const auto& [w, kind] = (mask >> i & 1) ? b[ib++] : a[ia++];
      d.ApplyEvent(w, SessionEvent(kind, "s", 10));
    }
    ASSERT_TRUE(d.FindSession(K("s")).has_value()) << "mask " << mask;
    EXPECT_EQ(d.FindSession(K("s"))->worker, "a") << "mask " << mask;
    EXPECT_EQ(Count(d, "a"), 1);
    EXPECT_EQ(Count(d, "b"), 0);
    ++checked;
  }
  EXPECT_EQ(checked, 6);
}

TEST(DirectoryTest, PrefixMatchEqualsAPageByPageReferenceOnRandomFleets) {
  // Long runs of identically held pages (a shared prompt) are counted in bulk;
  // the result must equal the page-by-page definition.
  std::mt19937 rng(5);
  for (int round = 0; round < 200; ++round) {
    Directory d;
    const int workers = 1 + static_cast<int>(rng() % 12);
    const int pages = 1 + static_cast<int>(rng() % 20);
    // tiers[w][p]: 0 absent, 1 device, 2 host, 3 both.
    std::vector<std::vector<uint8_t>> tiers(workers, std::vector<uint8_t>(pages));
    const int cut = static_cast<int>(rng() % (pages + 1));  // pages before it are shared by all alike
    std::vector<uint8_t> shared(pages);
    for (int p = 0; p < pages; ++p) shared[p] = static_cast<uint8_t>(rng() % 4);
    for (int w = 0; w < workers; ++w) {
      for (int p = 0; p < pages; ++p) {
        tiers[w][p] = p < cut && rng() % 4 != 0 ? shared[p] : static_cast<uint8_t>(rng() % 4);
        if (rng() % 3 == 0 && p > 0) tiers[w][p] = tiers[w][p - 1];
        const WorkerId name = absl::StrCat("w", w);
        if (tiers[w][p] & 1) {
          d.ApplyEvent(name,
                       Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_DEVICE, {static_cast<uint8_t>(p + 1)}));
        }
        if (tiers[w][p] & 2) {
          d.ApplyEvent(name,
                       Prefix(v1::CacheEvent::PREFIX_STORED, v1::TIER_HOST, {static_cast<uint8_t>(p + 1)}));
        }
      }
    }
    std::vector<BlockHash> chain;
    for (int p = 0; p < pages; ++p) chain.push_back(H(static_cast<uint8_t>(p + 1)));
    auto got = d.MatchPrefix(chain);
    absl::flat_hash_map<WorkerId, PrefixMatch> want;
    for (int w = 0; w < workers; ++w) {
      if (tiers[w][0] == 0) continue;
      PrefixMatch m;
      for (int p = 0; p < pages && tiers[w][p] != 0; ++p) {
        if ((tiers[w][p] & 1) && m.host_pages == 0) {
          ++m.device_pages;
        } else {
          ++m.host_pages;
        }
      }
      want[absl::StrCat("w", w)] = m;
    }
    ASSERT_EQ(got.size(), want.size()) << "round " << round;
    for (const auto& [w, m] : want) {
      ASSERT_TRUE(got.contains(w)) << "round " << round << " " << w;
      EXPECT_EQ(got[w].device_pages, m.device_pages) << "round " << round << " " << w;
      EXPECT_EQ(got[w].host_pages, m.host_pages) << "round " << round << " " << w;
    }
  }
}

TEST(DirectoryTest, AWorkersPageLogStaysBoundedUnderChurn) {
  // Pages stored and removed over and over: what the directory keeps per
  // worker to forget it stays proportional to what the worker holds.
  Directory d;
  auto batch = [](v1::CacheEvent::Kind kind, int from, int n) {
    v1::CacheEvent e;
    e.set_kind(kind);
    e.set_tier(v1::TIER_DEVICE);
    for (int i = from; i < from + n; ++i) {
      BlockHash h;
      std::memcpy(h.bytes.data(), &i, sizeof(i));
      h.bytes[31] = 2;
      e.add_block_hashes(Bytes(h));
    }
    return e;
  };
  d.ApplyEvent("a", batch(v1::CacheEvent::PREFIX_STORED, 0, 2000));
  const size_t held_bytes = d.Memory().page_bytes;
  for (int round = 1; round <= 50; ++round) {
    d.ApplyEvent("a", batch(v1::CacheEvent::PREFIX_REMOVED, (round - 1) * 2000, 2000));
    d.ApplyEvent("a", batch(v1::CacheEvent::PREFIX_STORED, round * 2000, 2000));
  }
  EXPECT_EQ(d.prefix_entries(), 2000u);
  // 100,000 pages went through; the log holds at most 2 x 2,000 + 1,024 keys.
  EXPECT_LT(d.Memory().page_bytes, held_bytes + (2 * 2000 + 1024) * sizeof(uint64_t) * 2);
  d.RemoveWorker("a");
  EXPECT_EQ(d.prefix_entries(), 0u);
  EXPECT_EQ(d.distinct_pages(), 0u);
}

TEST(DirectoryTest, MalformedHashesAreIgnored) {
  Directory d;
  v1::CacheEvent e;
  e.set_kind(v1::CacheEvent::PREFIX_STORED);
  e.add_block_hashes("short");
  d.ApplyEvent("a", e);
  EXPECT_EQ(d.prefix_entries(), 0u);
}

}  // namespace
}  // namespace kvcache::router
