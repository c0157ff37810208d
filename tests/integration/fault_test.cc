// Fault injection on real kvcache-router and kvcache-worker processes over
// loopback gRPC: a worker frozen (SIGSTOP) past the router's health timeout and
// thawed, a router restarted under live sessions, the target or the source of a
// migration killed mid-stream, and a memory-pressure soak compared token for
// token with a worker that has room for everything. A worker killed mid-stream
// and APPEND to a lost worker are in router_test.cc.
//
// A migration is stopped mid-stream deterministically by a TCP proxy in front
// of its target (a TcpProxy that holds it): gRPC waits for the server's HTTP/2
// settings before sending, so freezing the target with SIGSTOP before the
// migration would stop it before its first byte, and freezing it later races.
//
// Each test says in a comment what a client sees and asserts exactly that.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/gguf/tiny_llama.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/generate_client.h"
#include "tests/testing/tcp_proxy.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

// The tiny model's KV: 2 layers x 2 KV heads x head_dim 16, f16 -> 256 bytes per
// token, 4 KiB per 16-token page.
constexpr int64_t kPageBytes = 16 * 256;

using testing::Reply;

v1::GenerateRequest Tokens(const std::string& session, const std::vector<int32_t>& ids, int max_tokens,
                           v1::Mode mode = v1::FULL_CONTEXT) {
  return testing::TokensRequest(session, ids, max_tokens, mode);
}

// `n` token ids of the byte range, different for each `seed`.
std::vector<int32_t> Prompt(int seed, int n) {
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(10 + (seed * 37 + i * 11 + (i * i) % 7) % 240);
  return ids;
}

template <typename Stub>
Reply Generate(Stub* stub, const v1::GenerateRequest& req) {
  return testing::Generate(stub, req, absl::Seconds(30));
}

// Probes `done` until it holds or `timeout` passes. Each probe is a blocking RPC
// or a /proc read; the short pause between probes only bounds the probe rate.
bool PollUntil(const std::function<bool()>& done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return done();
}

// Session id -> cached tokens, as a worker lists them (every tenant).
std::map<std::string, int> WorkerSessions(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ListSessionsRequest req;
  v1::ListSessionsResponse resp;
  grpc::Status st = v1::Worker::NewStub(channel)->ListSessions(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  std::map<std::string, int> out;
  for (const auto& s : resp.sessions()) out[s.session_id()] = s.tokens_cached();
  return out;
}

// The router's view of a worker ("SERVING", "DOWN", ...), or "" when unknown.
std::string RouterHealthOf(v1::KvCacheAdmin::Stub* admin, const std::string& worker_id) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ListWorkersRequest req;
  v1::ListWorkersResponse resp;
  if (!admin->ListWorkers(&ctx, req, &resp).ok()) return "";
  for (const auto& w : resp.workers()) {
    if (w.worker_id() == worker_id) return w.health();
  }
  return "";
}

class FaultTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new std::string(::testing::TempDir() + "/kvcache_fault_test_tiny.gguf");
    gguf::TinyLlamaOptions o;
    o.n_ctx = 4096;
    ASSERT_TRUE(gguf::WriteTinyLlama(o, *model_).ok());
  }
  static void TearDownTestSuite() {
    std::remove(model_->c_str());
    delete model_;
  }

  std::unique_ptr<testing::ServerUnderTest> StartWorker(const std::string& id,
                                                        std::vector<std::string> extra = {}) {
    // Small budgets (64 MiB per tier) keep start and exit fast; later flags win.
    std::vector<std::string> args = {"--model=" + *model_,
                                     "--worker_id=" + id,
                                     "--threads=1",
                                     "--load_report_interval=100ms",
                                     "--tier0_bytes=" + std::to_string(64 << 20),
                                     "--tier1_bytes=" + std::to_string(64 << 20)};
    args.insert(args.end(), extra.begin(), extra.end());
    auto w = testing::ServerUnderTest::Start(testing::BinaryPath("worker/kvcache-worker"), args);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  }

  void StartWorkers(int n, std::vector<std::string> extra = {}) {
    for (int i = 0; i < n; ++i) {
      workers_.push_back(StartWorker("w" + std::to_string(i), extra));
      ASSERT_NE(workers_.back(), nullptr);
    }
  }

  // A router over `addresses` (default: every worker's), ready once all are healthy.
  std::unique_ptr<testing::ServerUnderTest> StartRouter(std::vector<std::string> extra = {},
                                                        std::vector<std::string> addresses = {}) {
    if (addresses.empty()) {
      for (const auto& w : workers_) addresses.push_back(w->grpc_address());
    }
    const std::string list = absl::StrJoin(addresses, ",");
    std::vector<std::string> args = {"--workers=" + list, "--model=" + *model_, "--health_timeout=2s",
                                     "--rebalance_interval=0s",
                                     "--min_ready_workers=" + std::to_string(addresses.size())};
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = testing::ServerUnderTest::Start(testing::BinaryPath("router/kvcache-router"), args);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : nullptr;
  }

  // How many live workers list `session`.
  int PlacesHolding(const std::string& session, const std::set<int>& dead = {}) {
    int n = 0;
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (dead.count(static_cast<int>(i)) != 0) continue;
      n += static_cast<int>(WorkerSessions(workers_[i]->channel()).count(session));
    }
    return n;
  }

  static std::string* model_;
  std::vector<std::unique_ptr<testing::ServerUnderTest>> workers_;
};

std::string* FaultTest::model_ = nullptr;

// A worker frozen longer than --health_timeout, then thawed. Client view: while
// it is frozen, new FULL_CONTEXT sessions succeed, all on the other worker;
// once thawed the router lists it SERVING again (its Watch stream reconnected
// with a snapshot) and APPEND turns of its old sessions succeed there with
// their context served from cache (cached tokens > 0).
TEST_F(FaultTest, FrozenWorkerIsAvoidedThenRejoinsWithItsSessions) {
  StartWorkers(2);
  auto router = StartRouter();
  ASSERT_NE(router, nullptr);
  auto stub = v1::KvCache::NewStub(router->channel());
  auto admin = v1::KvCacheAdmin::NewStub(router->admin_channel());
  std::map<std::string, std::string> home;  // session -> worker id
  std::map<std::string, int> per_worker;
  for (int s = 0; s < 8; ++s) {
    const std::string id = "old-" + std::to_string(s);
    Reply r = Generate(stub.get(), Tokens(id, Prompt(s, 60), 4));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    home[id] = r.final.worker_id();
    ++per_worker[r.final.worker_id()];
  }
  ASSERT_EQ(per_worker.size(), 2u) << "eight sessions should spread over both workers";
  const std::string frozen = "w0", alive = "w1";

  workers_[0]->process().Signal(SIGSTOP);
  ASSERT_TRUE(PollUntil([&] { return RouterHealthOf(admin.get(), frozen) != "SERVING"; }, absl::Seconds(20)))
      << "the router never noticed the frozen worker";
  for (int s = 0; s < 6; ++s) {
    Reply r = Generate(stub.get(), Tokens("new-" + std::to_string(s), Prompt(100 + s, 50), 4));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.final.worker_id(), alive);
  }

  workers_[0]->process().Signal(SIGCONT);
  ASSERT_TRUE(PollUntil([&] { return RouterHealthOf(admin.get(), frozen) == "SERVING"; }, absl::Seconds(20)))
      << "the thawed worker did not rejoin";
  for (const auto& [id, worker] : home) {
    Reply r = Generate(stub.get(), Tokens(id, {42, 43, 44}, 3, v1::APPEND));
    ASSERT_TRUE(r.status.ok()) << id << ": " << r.status.error_message();
    EXPECT_EQ(r.final.worker_id(), worker) << id;
    EXPECT_GE(r.final.usage().cached_tokens(), 60) << id << " was not served from its cache";
  }
  EXPECT_EQ(testing::HealthCheck(router->channel(), "readiness").value_or(""), "SERVING");
}

// The router's kvcache_router_stale_session_copies, or -1 when it cannot be read.
int StaleCopies(const testing::ServerUnderTest& router) {
  auto body = testing::HttpGet(router.metrics_port(), "/metrics");
  if (!body.ok()) return -1;
  return static_cast<int>(testing::MetricSample(*body, "kvcache_router_stale_session_copies").value_or(-1));
}

// A worker frozen past --health_timeout and past the router's close of its
// copy, while a FULL_CONTEXT turn moves its session to the other worker (what
// the router's message tells a client to do), then thawed. Client view: the
// next APPEND runs on the conversation the FULL_CONTEXT turn defined, on the
// worker it ran on, token for token what a FULL_CONTEXT request of the whole
// conversation gives, and the thawed worker no longer holds the old copy. Before
// the fix the thawed worker's snapshot made its old copy the session again, and
// the APPEND answered OK from the conversation without the second turn.
TEST_F(FaultTest, AFrozenWorkersCopyOfAMovedSessionIsClosedNotServed) {
  StartWorkers(2);
  auto router = StartRouter();
  ASSERT_NE(router, nullptr);
  auto stub = v1::KvCache::NewStub(router->channel());
  auto admin = v1::KvCacheAdmin::NewStub(router->admin_channel());
  const std::string id = "moved";
  std::vector<int32_t> conversation = Prompt(1, 40);
  Reply first = Generate(stub.get(), Tokens(id, conversation, 4));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  const int frozen = first.final.worker_id() == "w0" ? 0 : 1;
  const std::string alive = frozen == 0 ? "w1" : "w0";
  conversation.insert(conversation.end(), first.tokens.begin(), first.tokens.end());

  workers_[frozen]->process().Signal(SIGSTOP);
  ASSERT_TRUE(PollUntil([&] { return RouterHealthOf(admin.get(), first.final.worker_id()) != "SERVING"; },
                        absl::Seconds(20)));
  const std::vector<int32_t> second_turn = Prompt(2, 20);
  conversation.insert(conversation.end(), second_turn.begin(), second_turn.end());
  Reply second = Generate(stub.get(), Tokens(id, conversation, 4));
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(second.final.worker_id(), alive);
  conversation.insert(conversation.end(), second.tokens.begin(), second.tokens.end());
  // The close of the frozen copy times out, and the router holds the copy back.
  ASSERT_TRUE(PollUntil([&] { return StaleCopies(*router) == 1; }, absl::Seconds(30)))
      << "stale copies: " << StaleCopies(*router);

  workers_[frozen]->process().Signal(SIGCONT);
  ASSERT_TRUE(PollUntil([&] { return StaleCopies(*router) == 0; }, absl::Seconds(30)))
      << "the thawed worker's copy was not closed; stale copies: " << StaleCopies(*router);
  EXPECT_EQ(WorkerSessions(workers_[frozen]->channel()).count(id), 0u);
  EXPECT_EQ(RouterHealthOf(admin.get(), first.final.worker_id()), "SERVING");

  const std::vector<int32_t> third_turn = Prompt(3, 10);
  Reply third = Generate(stub.get(), Tokens(id, third_turn, 6, v1::APPEND));
  ASSERT_TRUE(third.status.ok()) << third.status.error_message();
  EXPECT_EQ(third.final.worker_id(), alive);
  conversation.insert(conversation.end(), third_turn.begin(), third_turn.end());
  Reply reference = Generate(stub.get(), Tokens("", conversation, 6));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  EXPECT_EQ(third.tokens, reference.tokens);
  EXPECT_EQ(third.final.usage().prompt_tokens(), static_cast<int32_t>(conversation.size()));
}

// The router restarts (killed, a new one started) while the workers keep their
// sessions. Client view: APPEND to every existing session through the new
// router succeeds on the worker that held it, with its context from cache, and
// the new router predicted that reuse (its directory came from the snapshots).
TEST_F(FaultTest, RestartedRouterRebuildsItsDirectoryFromSnapshots) {
  StartWorkers(2);
  auto router = StartRouter();
  ASSERT_NE(router, nullptr);
  std::map<std::string, std::string> home;
  {
    auto stub = v1::KvCache::NewStub(router->channel());
    for (int s = 0; s < 6; ++s) {
      const std::string id = "keep-" + std::to_string(s);
      Reply r = Generate(stub.get(), Tokens(id, Prompt(s, 70), 4));
      ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      home[id] = r.final.worker_id();
    }
  }
  router->process().Signal(SIGKILL);
  ASSERT_TRUE(router->process().Wait(absl::Seconds(10)).ok());
  router.reset();

  auto fresh = StartRouter();  // ready once both workers' snapshots arrived
  ASSERT_NE(fresh, nullptr);
  auto stub = v1::KvCache::NewStub(fresh->channel());
  for (const auto& [id, worker] : home) {
    grpc::ClientContext ctx;
    v1::SessionRequest sr;
    sr.set_session_id(id);
    v1::SessionInfo info;
    ASSERT_TRUE(stub->GetSession(&ctx, sr, &info).ok()) << id;
    EXPECT_EQ(info.worker_id(), worker);
    Reply r = Generate(stub.get(), Tokens(id, {50, 51}, 3, v1::APPEND));
    ASSERT_TRUE(r.status.ok()) << id << ": " << r.status.error_message();
    EXPECT_EQ(r.final.worker_id(), worker) << id;
    EXPECT_GE(r.final.usage().cached_tokens(), 70) << id;
    EXPECT_GE(r.final.predicted_cached_tokens(), 70) << id;
  }
}

// Three workers; w2, the migration target, sits behind a TcpProxy that
// stops the stream after 256 KiB of the session's 750 KiB of KV (3,000 tokens),
// so the test acts while the target is mid-import. The session is created
// directly on w0 (the source); the router learns of it from w0's Watch stream.
class MigrationFaultTest : public FaultTest {
 protected:
  void SetUp() override {
    StartWorkers(3);
    auto proxy = testing::TcpProxy::Start(workers_[2]->grpc_address());
    ASSERT_TRUE(proxy.ok()) << proxy.status();
    proxy_ = std::move(*proxy);
    proxy_->HoldAfter(256 << 10);
    router_ = StartRouter({"--forget_after=1s"},
                          {workers_[0]->grpc_address(), workers_[1]->grpc_address(), proxy_->address()});
    ASSERT_NE(router_, nullptr);
    stub_ = v1::KvCache::NewStub(router_->channel());
    first_ = Generate(v1::Worker::NewStub(workers_[0]->channel()).get(), Tokens("big", prompt_, 4));
    ASSERT_TRUE(first_.status.ok()) << first_.status.error_message();
    ASSERT_TRUE(PollUntil(
        [&] {
          grpc::ClientContext ctx;
          v1::SessionRequest sr;
          sr.set_session_id("big");
          v1::SessionInfo info;
          return stub_->GetSession(&ctx, sr, &info).ok();
        },
        absl::Seconds(20)))
        << "the router never learnt of the session";
    cached_ = WorkerSessions(workers_[0]->channel()).at("big");
    ASSERT_GE(cached_, 3000);
  }

  void TearDown() override {
    router_.reset();
    proxy_.reset();
  }

  // Starts the admin MigrateSession of "big" to w2 on a thread and returns once
  // the stream is held mid-way. `*status` is set when the call returns.
  std::thread StartMigration(grpc::Status* status) {
    std::thread t([this, status] {
      auto admin = v1::KvCacheAdmin::NewStub(router_->admin_channel());
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      v1::AdminMigrateRequest req;
      req.set_session_id("big");
      req.set_target_worker("w2");
      v1::MigrateSessionResponse resp;
      *status = admin->MigrateSession(&ctx, req, &resp);
    });
    EXPECT_TRUE(proxy_->WaitForHold(absl::Seconds(30))) << "the migration stream never reached the target";
    return t;
  }

  const std::vector<int32_t> prompt_ = Prompt(7, 3000);
  std::unique_ptr<testing::TcpProxy> proxy_;
  std::unique_ptr<testing::ServerUnderTest> router_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  Reply first_;
  int cached_ = 0;
};

// The target dies mid-import. Client view: the MigrateSession admin call fails
// with a message; the session is whole on the source (listed there with all
// its tokens, and an APPEND through the router runs there with all of them
// cached); no other worker lists it.
TEST_F(MigrationFaultTest, TargetKilledMidMigrationLeavesTheSessionWholeOnTheSource) {
  grpc::Status migrate_status;
  std::thread migrate = StartMigration(&migrate_status);
  workers_[2]->process().Signal(SIGKILL);
  migrate.join();
  ASSERT_TRUE(workers_[2]->process().Wait(absl::Seconds(10)).ok());
  EXPECT_FALSE(migrate_status.ok());
  EXPECT_FALSE(migrate_status.error_message().empty());

  const auto on_source = WorkerSessions(workers_[0]->channel());
  ASSERT_EQ(on_source.count("big"), 1u) << "the session left the source";
  EXPECT_EQ(on_source.at("big"), cached_) << "the session is not whole";
  EXPECT_EQ(WorkerSessions(workers_[1]->channel()).count("big"), 0u);
  Reply more = Generate(stub_.get(), Tokens("big", {60, 61, 62}, 3, v1::APPEND));
  ASSERT_TRUE(more.status.ok()) << more.status.error_message();
  EXPECT_EQ(more.final.worker_id(), "w0");
  EXPECT_GE(more.final.usage().cached_tokens(), cached_);
}

// The source dies mid-stream. Client view: the admin call fails, and the
// session lives in at most one place: either the target committed it (then
// APPEND works there) or it is gone everywhere: once the router forgets the
// dead source (--forget_after) GetSession answers UNAVAILABLE saying it was
// lost with that worker (before 2026-12-07: NOT_FOUND, as a session that
// never existed), and a
// FULL_CONTEXT request of the same conversation is recomputed with the same
// reply. Nothing half-imported stays on the target: the same prompt sent to it
// directly finds no cached token.
TEST_F(MigrationFaultTest, SourceKilledMidMigrationLeavesTheSessionInOnePlaceOrNone) {
  grpc::Status migrate_status;
  std::thread migrate = StartMigration(&migrate_status);
  workers_[0]->process().Signal(SIGKILL);
  migrate.join();
  ASSERT_TRUE(workers_[0]->process().Wait(absl::Seconds(10)).ok());
  EXPECT_FALSE(migrate_status.ok());

  const int places = PlacesHolding("big", /*dead=*/{0});
  ASSERT_LE(places, 1) << "the session lives in two places";
  if (places == 1) {
    EXPECT_EQ(WorkerSessions(workers_[2]->channel()).count("big"), 1u);
    Reply more = Generate(stub_.get(), Tokens("big", {60, 61}, 2, v1::APPEND));
    ASSERT_TRUE(more.status.ok()) << more.status.error_message();
    EXPECT_EQ(more.final.worker_id(), "w2");
    return;
  }
  grpc::Status get;
  ASSERT_TRUE(PollUntil(
      [&] {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        v1::SessionRequest sr;
        sr.set_session_id("big");
        v1::SessionInfo info;
        get = stub_->GetSession(&ctx, sr, &info);
        return get.error_code() == grpc::UNAVAILABLE &&
               get.error_message().find("was lost with worker") != std::string::npos;
      },
      absl::Seconds(20)))
      << "the router still answers " << get.error_code() << ": " << get.error_message();
  EXPECT_THAT(get.error_message(), HasSubstr("'big'"));
  EXPECT_THAT(get.error_message(), HasSubstr("FULL_CONTEXT"));
  Reply probe = Generate(v1::Worker::NewStub(workers_[2]->channel()).get(), Tokens("", prompt_, 1));
  ASSERT_TRUE(probe.status.ok()) << probe.status.error_message();
  EXPECT_EQ(probe.final.usage().cached_tokens(), 0) << "pages of the aborted import were left behind";
  Reply again = Generate(stub_.get(), Tokens("big", prompt_, 4));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.final.usage().prompt_tokens(), 3000);
  EXPECT_EQ(again.tokens, first_.tokens);
  EXPECT_EQ(PlacesHolding("big", {0}), 1);
}

// One user's conversation: turn 0 FULL_CONTEXT, then APPEND turns, with every
// third turn a FULL_CONTEXT resend of the whole conversation so far.
struct Script {
  static constexpr int kTurns = 6;
  static constexpr size_t kReplyTokens = 6;
  static bool FullContext(int turn) { return turn % 3 == 0; }
  static std::vector<int32_t> Input(int user, int turn) {
    return turn == 0 ? Prompt(user, 30 + user % 17) : Prompt(1000 + user * 10 + turn, 5 + turn);
  }
};

// Runs `users` through the script on `stub` with `threads` client threads.
// replies[user][turn] is each reply's tokens; any failed call is recorded in
// `errors`. `seed` 0 is greedy; otherwise every call samples with its own seed.
template <typename Stub>
void RunScript(Stub* stub, int users, int threads, std::vector<std::vector<std::vector<int32_t>>>* replies,
               std::vector<std::string>* errors, uint64_t seed = 0) {
  replies->assign(users, std::vector<std::vector<int32_t>>(Script::kTurns));
  absl::Mutex mu;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int u = t; u < users; u += threads) {
        const std::string id = "soak-" + std::to_string(u);
        std::vector<int32_t> context;  // the whole conversation so far
        for (int turn = 0; turn < Script::kTurns; ++turn) {
          const std::vector<int32_t> in = Script::Input(u, turn);
          context.insert(context.end(), in.begin(), in.end());
          const bool full = Script::FullContext(turn);
          v1::GenerateRequest req =
              Tokens(id, full ? context : in, Script::kReplyTokens, full ? v1::FULL_CONTEXT : v1::APPEND);
          if (seed != 0) {
            req.mutable_sampling()->set_temperature(0.9f);
            req.mutable_sampling()->set_seed(seed * 100000 + static_cast<uint64_t>(u) * 10 + turn);
          }
          Reply r = Generate(stub, req);
          if (!r.status.ok() || r.tokens.size() != Script::kReplyTokens) {
            absl::MutexLock lock(&mu);
            errors->push_back(absl::StrCat(id, " turn ", turn, ": ", r.status.error_code(), " ",
                                           r.status.error_message(), " (", r.tokens.size(), " tokens)"));
            break;
          }
          (*replies)[u][turn] = r.tokens;
          context.insert(context.end(), r.tokens.begin(), r.tokens.end());
        }
      }
    });
  }
  for (auto& th : pool) th.join();
}

// 128 users of up to eight pages (about 120 tokens) on two workers whose tier 0
// holds 24 pages (three sessions each: six in all, twenty times fewer than the
// users), eight concurrent clients through the router. Client view: zero errors, every reply token for token
// the same as on a worker with room for everything, and every session still
// lives on exactly one worker at the end (none lost).
TEST_F(FaultTest, MemoryPressureSoakMatchesARoomyWorker) {
  constexpr int kUsers = 128;
  // Reference: the same script, one user at a time, on a worker with the
  // default (roomy) budgets.
  std::vector<std::vector<std::vector<int32_t>>> want;
  {
    auto roomy = StartWorker("roomy");
    ASSERT_NE(roomy, nullptr);
    auto direct = v1::Worker::NewStub(roomy->channel());
    std::vector<std::string> errors;
    RunScript(direct.get(), kUsers, /*threads=*/1, &want, &errors);
    ASSERT_TRUE(errors.empty()) << errors.front();
  }
  StartWorkers(2, {"--tier0_bytes=" + std::to_string(24 * kPageBytes)});
  auto router = StartRouter();
  ASSERT_NE(router, nullptr);
  auto stub = v1::KvCache::NewStub(router->channel());
  std::vector<std::vector<std::vector<int32_t>>> got;
  std::vector<std::string> errors;
  const absl::Time start = absl::Now();
  RunScript(stub.get(), kUsers, /*threads=*/8, &got, &errors);
  std::printf("soak: %d users x %d turns in %.1f s\n", kUsers, Script::kTurns,
              absl::ToDoubleSeconds(absl::Now() - start));
  EXPECT_TRUE(errors.empty()) << errors.size() << " errors, first: " << errors.front();
  for (int u = 0; u < kUsers; ++u) {
    for (int turn = 0; turn < Script::kTurns; ++turn) {
      EXPECT_EQ(got[u][turn], want[u][turn]) << "user " << u << " turn " << turn;
    }
  }
  // None lost: each session on exactly one worker.
  const auto a = WorkerSessions(workers_[0]->channel());
  const auto b = WorkerSessions(workers_[1]->channel());
  for (int u = 0; u < kUsers; ++u) {
    const std::string id = "soak-" + std::to_string(u);
    EXPECT_EQ(a.count(id) + b.count(id), 1u) << id;
  }
  // The squeeze happened: pages went to host RAM and came back.
  for (const auto& w : workers_) {
    auto body = testing::HttpGet(w->metrics_port(), "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    EXPECT_EQ(body->find("kvcache_offload_bytes_total 0\n"), std::string::npos) << "no offload happened";
  }
}

// One worker squeezed every way a user can configure it: tier 0 of 16 pages (two
// users' conversations), tier 1 of 0, 4 (tiny) or 64 pages, 8 or 32 clients at
// once. Client view: every call OK and every reply token for token what a roomy
// worker gives for the same calls; afterwards every page is free again (nothing
// leaked). With tier 1 too small the worker recomputes what it dropped; the
// recompute runs through prefill kernels whose float rounding differs from
// decode's (README, "Exactness"), so those cases are greedy; seeded sampling is
// checked where tier 1 takes what tier 0 cannot hold (bytes move, nothing is
// recomputed).
class PressureSoakTest : public FaultTest, public ::testing::WithParamInterface<std::tuple<int, int, int>> {};

TEST_P(PressureSoakTest, EveryReplyMatchesARoomyWorker) {
  const auto [tier1_pages, threads, seed] = GetParam();
  constexpr int kUsers = 32;
  std::vector<std::vector<std::vector<int32_t>>> want;
  {
    auto roomy = StartWorker("roomy");
    ASSERT_NE(roomy, nullptr);
    auto direct = v1::Worker::NewStub(roomy->channel());
    std::vector<std::string> errors;
    RunScript(direct.get(), kUsers, threads, &want, &errors, static_cast<uint64_t>(seed));
    ASSERT_TRUE(errors.empty()) << errors.front();
  }
  auto tight = StartWorker("tight", {"--tier0_bytes=" + std::to_string(16 * kPageBytes),
                                     "--tier1_bytes=" + std::to_string(tier1_pages * kPageBytes)});
  ASSERT_NE(tight, nullptr);
  auto stub = v1::Worker::NewStub(tight->channel());
  std::vector<std::vector<std::vector<int32_t>>> got;
  std::vector<std::string> errors;
  RunScript(stub.get(), kUsers, threads, &got, &errors, static_cast<uint64_t>(seed));
  EXPECT_TRUE(errors.empty()) << errors.size() << " errors, first: " << errors.front();
  int mismatches = 0;
  for (int u = 0; u < kUsers; ++u) {
    for (int turn = 0; turn < Script::kTurns; ++turn) {
      mismatches += got[u][turn] != want[u][turn];
      EXPECT_EQ(got[u][turn], want[u][turn]) << "user " << u << " turn " << turn;
    }
  }
  auto body = testing::HttpGet(tight->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  const size_t at = body->find("\nkvcache_recomputed_tokens_total ");
  std::printf("tier1=%d pages, %d clients, seed %d: %d mismatches, %s", tier1_pages, threads, seed,
              mismatches,
              at == std::string::npos ? "?\n" : body->substr(at + 1, body->find('\n', at + 1) - at).c_str());
  // Close everything: every page is free (or a cached prefix page) again.
  for (int u = 0; u < kUsers; ++u) {
    v1::SessionRequest sr;
    sr.set_session_id("soak-" + std::to_string(u));
    v1::CloseSessionResponse closed;
    grpc::ClientContext c;
    EXPECT_TRUE(stub->CloseSession(&c, sr, &closed).ok());
  }
  grpc::ClientContext wctx;
  wctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto watch = stub->Watch(&wctx, v1::WatchRequest());
  v1::WatchEvent ev;
  ASSERT_TRUE(watch->Read(&ev));
  EXPECT_EQ(ev.snapshot().sessions_size(), 0);
  EXPECT_EQ(ev.snapshot().load().pages_free_device(), ev.snapshot().load().pages_total_device());
  EXPECT_EQ(ev.snapshot().load().pages_free_host(), ev.snapshot().load().pages_total_host());
  wctx.TryCancel();
  watch->Finish();
}

INSTANTIATE_TEST_SUITE_P(Budgets, PressureSoakTest,
                         ::testing::Values(std::make_tuple(0, 8, 0), std::make_tuple(0, 32, 0),
                                           std::make_tuple(4, 32, 0), std::make_tuple(64, 32, 5),
                                           std::make_tuple(64, 8, 9)),
                         [](const auto& info) {
                           return absl::StrCat("tier1_", std::get<0>(info.param), "_clients_",
                                               std::get<1>(info.param), "_seed_", std::get<2>(info.param));
                         });

}  // namespace
}  // namespace kvcache
