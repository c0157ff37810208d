// The real kvcache-router in front of two fake workers, to pin down
// interleavings that real workers produce only by chance: an APPEND that waits
// on a worker while its session moves to another worker (a drain, or any
// migration), and the worker then answering NOT_FOUND (the session is gone
// there) or refusing the request as draining.
//
// RouterService's proxy (router/router_service.cc, OnAttemptDone) must follow
// the session to its new worker in those cases, and only in those: a NOT_FOUND
// from the worker that still holds the session in the router's directory is the
// client's answer, with no retry.
//
// The fakes are in-process gRPC servers speaking kvcache.v1.Worker as far as
// the router uses it: Watch (a snapshot, then cache events and load reports
// pushed by the test), Generate (answered at once, refused, or held until the
// test releases it) and MigrateSession (which the router's evacuator calls on
// a draining worker; the fake moves the session the way a real worker does).
// The router probes workers only through their Watch streams, never through
// grpc.health.v1, so the fakes serve no health service.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/llama_hparams.h"
#include "common/gguf/tiny_llama.h"
#include "common/status.h"
#include "common/stream_writer.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/generate_client.h"

namespace kvcache {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::Reply;

// The tenant the router gives callers without a token (--allow_unauthenticated).
constexpr char kTenant[] = "default";
constexpr char kSession[] = "conversation-1";
constexpr int kSessionTokens = 48;

// One fake worker: a gRPC server on 127.0.0.1 port 0 whose cache state and
// answers the test sets.
//
// Watch: every stream opens with a snapshot of the sessions the fake holds
// (sequence 1) and then carries, numbered, each event the test causes
// (PlaceSession, AnnounceExported, AnnounceDraining). Generate: by default answers
// at once with the fake's own tokens; RefuseWith answers every call with a
// status; HoldCalls keeps each call open until ReleaseHeld (HoldAfterFirstToken:
// once it has streamed its first token). MigrateSession
// hands the session to the peer named by its target address.
//
// Thread-safety: every public method may be called from any thread; gRPC
// calls the service methods on its own threads.
class FakeWorker final : public v1::Worker::CallbackService {
 public:
  // Starts serving. `tokens`: what Generate streams when it serves a call.
  static absl::StatusOr<std::unique_ptr<FakeWorker>> Start(const std::string& worker_id,
                                                           std::vector<int32_t> tokens) {
    std::unique_ptr<FakeWorker> w(new FakeWorker(worker_id, std::move(tokens)));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(w.get());
    w->server_ = builder.BuildAndStart();
    if (w->server_ == nullptr || port == 0) return absl::InternalError("fake worker: cannot listen");
    w->address_ = absl::StrCat("127.0.0.1:", port);
    return w;
  }

  ~FakeWorker() override { Stop(); }

  const std::string& address() const { return address_; }
  const std::string& worker_id() const { return worker_id_; }

  // The worker whose address a MigrateSession names (null: unknown). Set
  // before the router starts.
  void set_find_peer(std::function<FakeWorker*(const std::string&)> find_peer) {
    absl::MutexLock lock(&mu_);
    find_peer_ = std::move(find_peer);
  }

  // Every later Generate call is answered with `status`, before any token.
  void RefuseWith(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    mode_ = Mode::kRefuse;
    refusal_ = status;
  }
  // Every later Generate call stays open until ReleaseHeld.
  void HoldCalls() {
    absl::MutexLock lock(&mu_);
    mode_ = Mode::kHold;
  }
  // Every later Generate call streams its first token, then stays open until
  // ReleaseHeld.
  void HoldAfterFirstToken() {
    absl::MutexLock lock(&mu_);
    mode_ = Mode::kHoldAfterFirstToken;
  }
  // Waits until a held call is open; false after `timeout`.
  bool AwaitHeldCall(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto held = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !held_.empty(); };
    return mu_.AwaitWithTimeout(absl::Condition(&held), timeout);
  }
  // Ends every held call with `status` (a real worker's answer to an APPEND
  // whose session left while it was queued is NOT_FOUND); OK streams the rest
  // of the fake's tokens and the final message first.
  void ReleaseHeld(const grpc::Status& status) {
    std::vector<GenerateWriter*> held;
    {
      absl::MutexLock lock(&mu_);
      held.swap(held_);
    }
    for (GenerateWriter* g : held) {
      if (status.ok()) {
        for (size_t i = g->sent; i < tokens_.size(); ++i) g->Push(TokenMessage(tokens_[i]));
        g->Push(FinalMessage(g->session_id, g->prompt_tokens));
      }
      g->Close(status);
      g->Unref();
    }
  }

  std::vector<v1::GenerateRequest> GenerateCalls() const {
    absl::MutexLock lock(&mu_);
    return generate_calls_;
  }
  std::vector<v1::MigrateSessionRequest> Migrations() const {
    absl::MutexLock lock(&mu_);
    return migrations_;
  }
  // CloseSession calls so far.
  int CloseCalls() const {
    absl::MutexLock lock(&mu_);
    return close_calls_;
  }

  // The session lives here now: listed by later snapshots, announced to open
  // streams (SESSION_PLACED, as a worker does when it creates or imports one).
  void PlaceSession(const std::string& tenant, const std::string& id, int tokens) {
    absl::MutexLock lock(&mu_);
    sessions_[{tenant, id}] = tokens;
    EmitLocked(SessionEvent(v1::CacheEvent::SESSION_PLACED, tenant, id, tokens));
  }
  // The session left for worker `to` (SESSION_EXPORTED naming it: what a real
  // migration source emits when it drops its copy, see WorkerService::Migrate).
  void AnnounceExported(const std::string& tenant, const std::string& id, const std::string& to) {
    absl::MutexLock lock(&mu_);
    sessions_.erase({tenant, id});
    v1::WatchEvent ev = SessionEvent(v1::CacheEvent::SESSION_EXPORTED, tenant, id, 0);
    ev.mutable_event()->set_target_worker(to);
    EmitLocked(std::move(ev));
  }
  // The model id its snapshots report (a router places only on workers of
  // its own model). Before the router connects.
  void set_model_id(std::string id) {
    absl::MutexLock lock(&mu_);
    model_id_ = std::move(id);
  }
  // A load report with draining = true: how a worker that got SIGTERM tells
  // its routers (WatchHub::CurrentLoad).
  void AnnounceDraining() {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    v1::WatchEvent ev;
    *ev.mutable_load() = LoadLocked();
    EmitLocked(std::move(ev));
  }

  // Ends every open stream and held call, then the server. Idempotent.
  void Stop() {
    std::vector<WatchWriter*> watchers;
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
      stopped_ = true;
      for (WatchWriter* w : watchers_) {
        w->Ref();  // it is in watchers_ until its OnDone: alive
        watchers.push_back(w);
      }
    }
    for (WatchWriter* w : watchers) {
      w->Close(grpc::Status::OK);
      w->Unref();
    }
    ReleaseHeld(grpc::Status(grpc::UNAVAILABLE, "fake worker stopped"));
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  // ---- v1::Worker ----

  grpc::ServerWriteReactor<v1::WatchEvent>* Watch(grpc::CallbackServerContext* /*context*/,
                                                  const v1::WatchRequest* /*request*/) override {
    auto* w = new WatchWriter(this);
    absl::MutexLock lock(&mu_);
    if (stopped_) {
      w->Close(grpc::Status(grpc::UNAVAILABLE, "fake worker stopped"));
      return w;
    }
    watchers_.insert(w);
    v1::WatchEvent ev;
    v1::WorkerSnapshot* snap = ev.mutable_snapshot();
    snap->set_worker_id(worker_id_);
    snap->set_model_id(model_id_);
    v1::KvShape* shape = snap->mutable_kv_shape();
    shape->set_layers(2);
    shape->set_kv_heads(2);
    shape->set_head_dim(16);
    shape->set_dtype("f32");
    shape->set_page_tokens(16);
    for (const auto& [key, tokens] : sessions_) {
      v1::SessionInfo* s = snap->add_sessions();
      s->set_tenant(key.first);
      s->set_session_id(key.second);
      s->set_worker_id(worker_id_);
      s->set_tokens_cached(tokens);
      s->set_state(v1::SESSION_IDLE);
    }
    *snap->mutable_load() = LoadLocked();
    w->SendLocked(std::move(ev));
    return w;
  }

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* /*context*/,
                                                           const v1::GenerateRequest* request) override {
    auto* g = new GenerateWriter();
    g->session_id = request->session_id();
    g->prompt_tokens = request->input().tokens().ids_size();
    Mode mode;
    grpc::Status refusal;
    {
      absl::MutexLock lock(&mu_);
      generate_calls_.push_back(*request);
      mode = stopped_ ? Mode::kRefuse : mode_;
      refusal = stopped_ ? grpc::Status(grpc::UNAVAILABLE, "fake worker stopped") : refusal_;
      if (mode == Mode::kHoldAfterFirstToken) {
        g->Push(TokenMessage(tokens_[0]));  // before ReleaseHeld can see it
        g->sent = 1;
      }
      if (mode == Mode::kHold || mode == Mode::kHoldAfterFirstToken) {
        g->Ref();  // ReleaseHeld's
        held_.push_back(g);
      }
    }
    if (mode == Mode::kRefuse) {
      g->Close(refusal);
    } else if (mode == Mode::kServe) {
      for (int32_t id : tokens_) g->Push(TokenMessage(id));
      g->Push(FinalMessage(request->session_id(), request->input().tokens().ids_size()));
      g->Close(grpc::Status::OK);
    }
    return g;
  }

  // Drops the session without a word on the Watch streams: the router's
  // directory keeps listing it here, as it does while a real worker's event is
  // on its way.
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::SessionRequest* request,
                                         v1::CloseSessionResponse* /*response*/) override {
    {
      absl::MutexLock lock(&mu_);
      ++close_calls_;
      sessions_.erase({request->tenant(), request->session_id()});
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* MigrateSession(grpc::CallbackServerContext* context,
                                           const v1::MigrateSessionRequest* request,
                                           v1::MigrateSessionResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    bool held;
    int tokens = 0;
    std::function<FakeWorker*(const std::string&)> find_peer;
    {
      absl::MutexLock lock(&mu_);
      migrations_.push_back(*request);
      auto it = sessions_.find({request->tenant(), request->session_id()});
      held = it != sessions_.end();
      if (held) tokens = it->second;
      find_peer = find_peer_;
    }
    FakeWorker* peer = find_peer ? find_peer(request->target_address()) : nullptr;
    if (!held) {
      reactor->Finish(
          grpc::Status(grpc::NOT_FOUND, absl::StrCat("session '", request->session_id(), "' not found")));
    } else if (peer == nullptr) {
      reactor->Finish(grpc::Status(grpc::UNAVAILABLE, "unknown migration target"));
    } else {
      // As WorkerService::Migrate: the target commits the import (and its
      // stream says SESSION_PLACED), then the source drops its copy.
      peer->PlaceSession(request->tenant(), request->session_id(), tokens);
      AnnounceExported(request->tenant(), request->session_id(), peer->worker_id());
      v1::SessionInfo* s = response->mutable_session();
      s->set_session_id(request->session_id());
      s->set_tenant(request->tenant());
      s->set_worker_id(peer->worker_id());
      s->set_tokens_cached(tokens);
      s->set_state(v1::SESSION_IDLE);
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }

 private:
  enum class Mode { kServe, kRefuse, kHold, kHoldAfterFirstToken };

  // A Generate stream. A client that goes away ends it (a held call included).
  class GenerateWriter final : public StreamWriter<v1::GenerateResponse> {
   public:
    std::string session_id;  // the request's
    int prompt_tokens = 0;   // the request's
    size_t sent = 0;         // of the fake's tokens, before it was held

   private:
    void OnClientGone() override { Close(grpc::Status(grpc::CANCELLED, "client went away")); }
  };

  // A Watch stream: numbers its messages from 1, as a real one does. In the
  // owner's watchers_ from its start until gRPC is done with it.
  class WatchWriter final : public StreamWriter<v1::WatchEvent> {
   public:
    explicit WatchWriter(FakeWorker* owner) : owner_(owner) {}
    // REQUIRES: the owner's mu_ held (which keeps numbers in queue order).
    void SendLocked(v1::WatchEvent ev) {
      ev.set_sequence(++sequence_);
      Push(std::move(ev));
    }

   private:
    void OnClientGone() override { Close(grpc::Status(grpc::CANCELLED, "watch cancelled")); }
    void OnFinished() override { owner_->RemoveWatcher(this); }

    FakeWorker* const owner_;
    uint64_t sequence_ = 0;  // under the owner's mu_
  };

  FakeWorker(std::string worker_id, std::vector<int32_t> tokens)
      : worker_id_(std::move(worker_id)), tokens_(std::move(tokens)) {}

  static v1::GenerateResponse TokenMessage(int32_t id) {
    v1::GenerateResponse msg;
    msg.mutable_token()->set_id(id);
    return msg;
  }
  // The end of a served call that streamed every one of the fake's tokens.
  v1::GenerateResponse FinalMessage(const std::string& session_id, int prompt_tokens) const {
    v1::GenerateResponse msg;
    v1::GenerateResponse::Final* f = msg.mutable_final();
    f->set_finish_reason(v1::FINISH_REASON_LENGTH);
    f->set_session_id(session_id);
    f->set_worker_id(worker_id_);
    f->mutable_usage()->set_prompt_tokens(prompt_tokens);
    f->mutable_usage()->set_cached_tokens(kSessionTokens);
    f->mutable_usage()->set_generated_tokens(static_cast<int32_t>(tokens_.size()));
    return msg;
  }

  static v1::WatchEvent SessionEvent(v1::CacheEvent::Kind kind, const std::string& tenant,
                                     const std::string& id, int tokens) {
    v1::WatchEvent ev;
    v1::CacheEvent* e = ev.mutable_event();
    e->set_kind(kind);
    e->set_tenant(tenant);
    e->set_session_id(id);
    e->set_tier(v1::TIER_DEVICE);
    e->set_tokens(tokens);
    return ev;
  }

  v1::WorkerLoad LoadLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::WorkerLoad load;
    load.set_pages_total_device(1024);
    load.set_pages_free_device(1024);
    load.set_sessions(static_cast<int32_t>(sessions_.size()));
    load.set_draining(draining_);
    return load;
  }

  void EmitLocked(const v1::WatchEvent& ev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (WatchWriter* w : watchers_) w->SendLocked(ev);
  }

  void RemoveWatcher(WatchWriter* w) {
    absl::MutexLock lock(&mu_);
    watchers_.erase(w);
  }

  const std::string worker_id_;
  std::string model_id_ ABSL_GUARDED_BY(mu_) = "tiny-llama-fake";
  const std::vector<int32_t> tokens_;
  std::string address_;  // set once by Start
  std::unique_ptr<grpc::Server> server_;

  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, int> sessions_
      ABSL_GUARDED_BY(mu_);  // (tenant, id) -> tokens
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  Mode mode_ ABSL_GUARDED_BY(mu_) = Mode::kServe;
  grpc::Status refusal_ ABSL_GUARDED_BY(mu_);
  std::set<WatchWriter*> watchers_ ABSL_GUARDED_BY(mu_);
  std::vector<GenerateWriter*> held_ ABSL_GUARDED_BY(mu_);  // each with a reference of ours
  std::vector<v1::GenerateRequest> generate_calls_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::MigrateSessionRequest> migrations_ ABSL_GUARDED_BY(mu_);
  int close_calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<FakeWorker*(const std::string&)> find_peer_ ABSL_GUARDED_BY(mu_);
};

// One client Generate through the router on a thread of its own, while the
// test thread drives the fakes. Joined at the latest on destruction (the
// call's deadline bounds that).
class BackgroundGenerate {
 public:
  BackgroundGenerate(v1::KvCache::Stub* stub, v1::GenerateRequest request)
      : thread_([this, stub, request = std::move(request)] {
          reply_ = testing::Generate(stub, request, absl::Seconds(30));
        }) {}
  ~BackgroundGenerate() {
    if (thread_.joinable()) thread_.join();
  }
  Reply Join() {
    thread_.join();
    return reply_;
  }

 private:
  Reply reply_;  // before thread_: constructed before the thread writes it
  std::thread thread_;
};

const std::vector<int32_t> kTokensA = {101, 102, 103};
const std::vector<int32_t> kTokensB = {201, 202, 203, 204};

class RouterDrainRaceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The router tokenises with the model's vocabulary; the fakes never read it.
    model_ =
        new std::string(absl::StrCat(::testing::TempDir(), "/kvcache_drain_race_test_", getpid(), ".gguf"));
    ASSERT_TRUE(gguf::WriteTinyLlama(gguf::TinyLlamaOptions(), *model_).ok());
    auto file = gguf::GgufFile::Open(*model_);
    ASSERT_TRUE(file.ok()) << file.status();
    auto hp = gguf::LoadLlamaHparams(**file);
    ASSERT_TRUE(hp.ok()) << hp.status();
    model_id_ = new std::string(gguf::ModelId(**file, *hp));
  }
  static void TearDownTestSuite() {
    std::remove(model_->c_str());
    delete model_;
    delete model_id_;
  }

  void SetUp() override {
    auto a = FakeWorker::Start("fake-a", kTokensA);
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(*a);
    auto b = FakeWorker::Start("fake-b", kTokensB);
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(*b);
    a_->set_model_id(*model_id_);
    b_->set_model_id(*model_id_);
    auto find = [this](const std::string& address) -> FakeWorker* {
      if (address == a_->address()) return a_.get();
      if (address == b_->address()) return b_.get();
      return nullptr;
    };
    a_->set_find_peer(find);
    b_->set_find_peer(find);
    a_->PlaceSession(kTenant, kSession, kSessionTokens);  // in A's first snapshot

    // Readiness (which ServerUnderTest waits for) needs both Watch streams
    // connected, i.e. both snapshots applied. The fakes send no periodic load
    // reports, so the health timeout is longer than any test.
    auto r = testing::ServerUnderTest::Start(
        testing::BinaryPath("router/kvcache-router"),
        {"--workers=" + a_->address() + "," + b_->address(), "--model=" + *model_, "--min_ready_workers=2",
         "--health_timeout=300s", "--forget_after=300s", "--rebalance_interval=0s", "--max_attempts=3"});
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = std::move(*r);
    api_ = v1::KvCache::NewStub(router_->channel());
    admin_ = v1::KvCacheAdmin::NewStub(router_->admin_channel());
    ASSERT_TRUE(testing::WaitUntil([&] { return SessionsOn("fake-a") == 1 && SessionsOn("fake-b") == 0; }));
  }

  void TearDown() override {
    router_.reset();  // SIGTERM, reaped (SIGKILL after a grace period)
    if (a_) a_->Stop();
    if (b_) b_->Stop();
  }

  // The router's view of each worker, by worker id.
  std::map<std::string, v1::WorkerInfo> Workers() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ListWorkersResponse resp;
    std::map<std::string, v1::WorkerInfo> out;
    if (!admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok()) return out;
    for (const auto& w : resp.workers()) out[w.worker_id()] = w;
    return out;
  }
  int SessionsOn(const std::string& worker_id) {
    auto ws = Workers();
    auto it = ws.find(worker_id);
    return it == ws.end() ? -1 : it->second.sessions();
  }
  std::string HealthOf(const std::string& worker_id) {
    auto ws = Workers();
    auto it = ws.find(worker_id);
    return it == ws.end() ? "" : it->second.health();
  }

  static v1::GenerateRequest Append() {
    return testing::TokensRequest(kSession, {10, 11, 12}, 4, v1::APPEND);
  }

  // `w` got exactly one Generate call: the client's APPEND, as the client sent it
  // but for the tenant the router fills in.
  void ExpectOneAppendOn(const FakeWorker& w) {
    const std::vector<v1::GenerateRequest> calls = w.GenerateCalls();
    ASSERT_EQ(calls.size(), 1u) << w.worker_id();
    EXPECT_EQ(calls[0].session_id(), kSession);
    EXPECT_EQ(calls[0].mode(), v1::APPEND);
    EXPECT_EQ(calls[0].tenant(), kTenant);
    EXPECT_THAT(calls[0].input().tokens().ids(), ElementsAre(10, 11, 12));
  }

  // The client got B's answer to its APPEND: A was tried once, then the router
  // followed the session to B, which got the APPEND once.
  void ExpectFollowedToB(const Reply& r) {
    ASSERT_TRUE(r.status.ok()) << r.status.error_code() << ": " << r.status.error_message();
    EXPECT_THAT(r.tokens, ElementsAreArray(kTokensB));
    EXPECT_EQ(r.final.worker_id(), "fake-b");
    EXPECT_EQ(a_->GenerateCalls().size(), 1u);
    ExpectOneAppendOn(*b_);
  }

  static grpc::Status SessionGone() {
    return grpc::Status(grpc::NOT_FOUND, absl::StrCat("session '", kSession, "' not found"));
  }

  static std::string* model_id_;  // gguf::ModelId of model_: what the fakes report
  static std::string* model_;
  std::unique_ptr<FakeWorker> a_;
  std::unique_ptr<FakeWorker> b_;
  std::unique_ptr<testing::ServerUnderTest> router_;
  std::unique_ptr<v1::KvCache::Stub> api_;
  std::unique_ptr<v1::KvCacheAdmin::Stub> admin_;
};

std::string* RouterDrainRaceTest::model_ = nullptr;
std::string* RouterDrainRaceTest::model_id_ = nullptr;

// The session moves (here: B's stream says it holds it; A's has not yet said
// it let go, the order a real migration's two streams often arrive in) while
// the APPEND waits on A, and A, not draining, then answers NOT_FOUND. The
// directory alone tells the router to follow the session.
TEST_F(RouterDrainRaceTest, AppendWaitingWhileItsSessionMovesFollowsItToTheNewWorker) {
  a_->HoldCalls();
  BackgroundGenerate call(api_.get(), Append());
  ASSERT_TRUE(a_->AwaitHeldCall(absl::Seconds(10))) << "the APPEND never reached the session's worker";
  b_->PlaceSession(kTenant, kSession, kSessionTokens);
  ASSERT_TRUE(testing::WaitUntil([&] { return SessionsOn("fake-b") == 1 && SessionsOn("fake-a") == 0; }));
  EXPECT_EQ(HealthOf("fake-a"), "SERVING");  // not draining: the directory is what says "moved"
  a_->ReleaseHeld(SessionGone());

  const Reply r = call.Join();
  ExpectFollowedToB(r);
}

// The real drain: A (SIGTERMed) reports draining while the APPEND waits on it;
// the router's evacuator migrates the session to B through A's
// MigrateSession (B: placed, A: dropped); A then answers the queued APPEND
// NOT_FOUND. The client gets B's answer.
TEST_F(RouterDrainRaceTest, AppendWaitingOnADrainingWorkerFollowsTheEvacuatedSession) {
  a_->HoldCalls();
  BackgroundGenerate call(api_.get(), Append());
  ASSERT_TRUE(a_->AwaitHeldCall(absl::Seconds(10))) << "the APPEND never reached the session's worker";
  a_->AnnounceDraining();
  ASSERT_TRUE(testing::WaitUntil([&] {
    return HealthOf("fake-a") == "DRAINING" && SessionsOn("fake-a") == 0 && SessionsOn("fake-b") == 1;
  })) << "the router did not evacuate the draining worker";
  const std::vector<v1::MigrateSessionRequest> moves = a_->Migrations();
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].session_id(), kSession);
  EXPECT_EQ(moves[0].tenant(), kTenant);
  EXPECT_EQ(moves[0].target_address(), b_->address());
  a_->ReleaseHeld(SessionGone());

  const Reply r = call.Join();
  ExpectFollowedToB(r);
}

// The order a rebalance or an admin move often shows: A drops the session and
// answers the queued APPEND NOT_FOUND before the router has seen either stream
// say where the session went (A not draining). The router waits for the
// directory and follows the session to B.
TEST_F(RouterDrainRaceTest, NotFoundBeforeTheMoveIsSeenFollowsTheSessionWhenItAppears) {
  a_->HoldCalls();
  BackgroundGenerate call(api_.get(), Append());
  ASSERT_TRUE(a_->AwaitHeldCall(absl::Seconds(10))) << "the APPEND never reached the session's worker";
  a_->ReleaseHeld(SessionGone());
  // Only now does the move reach the router: B placed, A exported.
  b_->PlaceSession(kTenant, kSession, kSessionTokens);
  a_->AnnounceExported(kTenant, kSession, "fake-b");

  const Reply r = call.Join();
  ExpectFollowedToB(r);
  EXPECT_EQ(HealthOf("fake-a"), "SERVING");
}

// Nothing moved: NOT_FOUND from the worker that holds the session in the
// router's view is the client's answer, tried once, never sent elsewhere.
TEST_F(RouterDrainRaceTest, NotFoundFromTheSessionsOwnWorkerReachesTheClient) {
  a_->RefuseWith(SessionGone());
  const Reply r = testing::Generate(api_.get(), Append(), absl::Seconds(30));
  EXPECT_EQ(r.status.error_code(), grpc::NOT_FOUND) << r.status.error_message();
  EXPECT_THAT(r.status.error_message(), HasSubstr(kSession));
  EXPECT_TRUE(r.tokens.empty());
  EXPECT_EQ(a_->GenerateCalls().size(), 1u) << "the router retried a NOT_FOUND on the worker that said it";
  EXPECT_TRUE(b_->GenerateCalls().empty()) << "the router sent the APPEND to a worker without the session";
  EXPECT_EQ(SessionsOn("fake-a"), 1);
  EXPECT_EQ(HealthOf("fake-a"), "SERVING");
}

// A refuses the APPEND as draining before its Watch stream says it drains.
// The refusal alone marks A draining; the router's evacuator then moves the
// session to B (so it appears there only after the refusal), and the APPEND,
// waiting for that, follows it.
TEST_F(RouterDrainRaceTest, DrainRefusalWaitsForTheSessionToMoveAndFollowsIt) {
  a_->RefuseWith(grpc::Status(grpc::UNAVAILABLE, kWorkerDrainingMessage));
  const Reply r = testing::Generate(api_.get(), Append(), absl::Seconds(30));
  ExpectFollowedToB(r);
  const std::vector<v1::MigrateSessionRequest> moves = a_->Migrations();
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].target_address(), b_->address());
  EXPECT_EQ(HealthOf("fake-a"), "DRAINING");
  EXPECT_EQ(SessionsOn("fake-b"), 1);
}

// FULL_CONTEXT turns that alternate between the workers (round-robin
// placement) move the session each time, and each closes the copy the previous
// turn left, although the workers' events never arrive here (these fakes send
// none on Generate or CloseSession): the directory keeps listing the session
// on A, where the first snapshot put it, and only the router's own record of
// its last turn knows it is on the other worker now.
TEST_F(RouterDrainRaceTest, FullContextTurnsCloseTheCopyThePreviousTurnLeft) {
  auto rr = testing::ServerUnderTest::Start(
      testing::BinaryPath("router/kvcache-router"),
      {"--workers=" + a_->address() + "," + b_->address(), "--model=" + *model_, "--min_ready_workers=2",
       "--health_timeout=300s", "--forget_after=300s", "--rebalance_interval=0s", "--placement=round_robin"});
  ASSERT_TRUE(rr.ok()) << rr.status();
  auto api = v1::KvCache::NewStub((*rr)->channel());
  std::vector<std::string> served;
  for (int turn = 0; turn < 4; ++turn) {
    const Reply r = testing::Generate(
        api.get(), testing::TokensRequest(kSession, {1, 2, 3}, 4, v1::FULL_CONTEXT), absl::Seconds(30));
    ASSERT_TRUE(r.status.ok()) << turn << ": " << r.status.error_message();
    served.push_back(r.final.worker_id());
  }
  // Each move off a worker closes the copy there, once.
  std::map<std::string, int> moved_off;
  std::string where = "fake-a";
  for (const std::string& w : served) {
    if (w != where) ++moved_off[where];
    where = w;
  }
  EXPECT_GE(moved_off["fake-b"], 1) << "round-robin never moved the session off B";
  EXPECT_TRUE(testing::WaitUntil(
      [&] { return a_->CloseCalls() >= moved_off["fake-a"] && b_->CloseCalls() >= moved_off["fake-b"]; },
      absl::Seconds(10)));
  EXPECT_EQ(a_->CloseCalls(), moved_off["fake-a"]) << absl::StrJoin(served, ",");
  EXPECT_EQ(b_->CloseCalls(), moved_off["fake-b"]) << absl::StrJoin(served, ",");
}

// A FULL_CONTEXT turn that moves the session (here: A refuses it, and the
// retry runs on B) closes the copy it leaves on A as soon as B has streamed
// the turn's first token: from then until the stream ends the session is busy
// on B and nothing can move it back to A. Closed when the stream ended, the
// copy's close could reach A after a drain of B had moved the live session
// there (a black-box drain test lost a session that way).
TEST_F(RouterDrainRaceTest, AMovingTurnClosesTheCopyItLeavesAtItsFirstToken) {
  a_->RefuseWith(grpc::Status(grpc::UNAVAILABLE, "fake worker overloaded"));
  b_->HoldAfterFirstToken();
  BackgroundGenerate call(api_.get(), testing::TokensRequest(kSession, {1, 2, 3}, 4, v1::FULL_CONTEXT));
  ASSERT_TRUE(b_->AwaitHeldCall(absl::Seconds(10))) << "the retry never reached B";
  EXPECT_TRUE(testing::WaitUntil([&] { return a_->CloseCalls() == 1; }, absl::Seconds(10)))
      << "the copy on A was not closed while the turn ran on B";
  b_->ReleaseHeld(grpc::Status::OK);
  const Reply r = call.Join();
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_THAT(r.tokens, ElementsAreArray(kTokensB));
  EXPECT_EQ(r.final.worker_id(), "fake-b");
  EXPECT_EQ(a_->CloseCalls(), 1);
}

// After an admin migration through the router moves the session from A to B,
// the next FULL_CONTEXT turn runs on B, where the session lives, and closes
// nothing on A. The router's record of the session's last turn (on A, kept
// for 2 s while the workers' events travel) used to outweigh the migration:
// the turn then "left a copy" on A and closed it, and when a drain had moved
// the session back to A meanwhile, that close ended the live session. Then a
// turn that B refuses moves the session to A and closes B's copy: once that
// close has reached B, one the earlier turn sent to A would have too.
TEST_F(RouterDrainRaceTest, AFullContextTurnAfterAMigrationClosesNothingWhereTheSessionWas) {
  const v1::GenerateRequest turn = testing::TokensRequest(kSession, {1, 2, 3}, 4, v1::FULL_CONTEXT);
  Reply r = testing::Generate(api_.get(), turn, absl::Seconds(30));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.final.worker_id(), "fake-a");
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::AdminMigrateRequest req;
    req.set_session_id(kSession);
    req.set_target_worker("fake-b");
    v1::MigrateSessionResponse resp;
    const grpc::Status st = admin_->MigrateSession(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  ASSERT_TRUE(testing::WaitUntil([&] { return SessionsOn("fake-a") == 0 && SessionsOn("fake-b") == 1; }));
  r = testing::Generate(api_.get(), turn, absl::Seconds(30));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.final.worker_id(), "fake-b");

  b_->RefuseWith(grpc::Status(grpc::UNAVAILABLE, "fake worker overloaded"));
  r = testing::Generate(api_.get(), turn, absl::Seconds(30));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.final.worker_id(), "fake-a");
  EXPECT_TRUE(testing::WaitUntil([&] { return b_->CloseCalls() == 1; }, absl::Seconds(10)))
      << "the turn that moved the session to A did not close its copy on B";
  EXPECT_EQ(a_->CloseCalls(), 0) << "a turn closed the session on the worker it had migrated from";
}

// When every worker refuses a FULL_CONTEXT request, a worker's "no room now"
// (RESOURCE_EXHAUSTED: a later retry may fit) outweighs another's "never here"
// (OUT_OF_RANGE), whichever came last; OUT_OF_RANGE only when each said so.
// The router used to answer the last refusal, so a retryable request could
// read as one that fits no worker.
TEST_F(RouterDrainRaceTest, EveryWorkerRefusingAnswersNoRoomNowOverNeverHere) {
  const grpc::Status no_room(grpc::RESOURCE_EXHAUSTED, "fake: no KV cache memory now");
  const grpc::Status never(grpc::OUT_OF_RANGE, "fake: the context exceeds this tier 0");
  const v1::GenerateRequest turn = testing::TokensRequest(kSession, {1, 2, 3}, 4, v1::FULL_CONTEXT);
  a_->RefuseWith(no_room);  // the session's worker: tried first
  b_->RefuseWith(never);
  Reply r = testing::Generate(api_.get(), turn, absl::Seconds(30));
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_EQ(a_->GenerateCalls().size(), 1u);
  EXPECT_EQ(b_->GenerateCalls().size(), 1u);
  a_->RefuseWith(never);
  r = testing::Generate(api_.get(), turn, absl::Seconds(30));
  EXPECT_EQ(r.status.error_code(), grpc::OUT_OF_RANGE) << r.status.error_message();
  EXPECT_EQ(a_->GenerateCalls().size(), 2u);
  EXPECT_EQ(b_->GenerateCalls().size(), 2u);
  // One worker had no room, the other was lost before its first token (killed,
  // or hung until keepalive cut it): a later retry may fit on the first, so
  // RESOURCE_EXHAUSTED (HTTP 429), not the lost one's UNAVAILABLE (503).
  a_->RefuseWith(no_room);
  b_->RefuseWith(grpc::Status(grpc::UNAVAILABLE, "fake: Socket closed"));
  r = testing::Generate(api_.get(), turn, absl::Seconds(30));
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
}

// A client whose deadline passes while the worker has not answered counts as
// DEADLINE_EXCEEDED in the router's requests, not CANCELLED: dashboards tell
// timeouts (an HTTP API's 504 among them) from clients that left.
TEST_F(RouterDrainRaceTest, AClientDeadlineCountsAsDeadlineExceeded) {
  a_->HoldCalls();
  const Reply r = testing::Generate(api_.get(), Append(), absl::Milliseconds(300));
  EXPECT_EQ(r.status.error_code(), grpc::DEADLINE_EXCEEDED) << r.status.error_message();
  std::string metrics;
  EXPECT_TRUE(testing::WaitUntil([&] {
    metrics = testing::HttpGet(router_->metrics_port(), "/metrics").value_or("");
    return metrics.find("kvcache_router_requests_total{code=") != std::string::npos;
  }));
  EXPECT_THAT(metrics, HasSubstr("kvcache_router_requests_total{code=\"DEADLINE_EXCEEDED\"} 1"));
  EXPECT_THAT(metrics, Not(HasSubstr("code=\"CANCELLED\"")));
  a_->ReleaseHeld(grpc::Status(grpc::CANCELLED, "released"));
}

// An APPEND whose deadline passes after its first token: the router's call to
// the worker carries the same deadline, and its timer may fire before the
// client's call ends. Either way the client gets DEADLINE_EXCEEDED, and the
// router counts it so; it used to answer UNAVAILABLE "session ... was lost with
// worker" for about 1 in 10 (a black-box probe: 30 of 300), which tells a client
// to drop a session that is fine. Repeated, as the two timers race.
TEST_F(RouterDrainRaceTest, AnAppendPastItsDeadlineMidStreamIsATimeoutNotALostSession) {
  a_->HoldAfterFirstToken();
  constexpr int kTurns = 20;
  for (int i = 0; i < kTurns; ++i) {
    const Reply r = testing::Generate(api_.get(), Append(), absl::Milliseconds(200));
    EXPECT_EQ(r.status.error_code(), grpc::DEADLINE_EXCEEDED) << i << ": " << r.status.error_message();
    EXPECT_EQ(r.tokens.size(), 1u) << i;
    // What a worker answers once the deadline it was given has passed.
    a_->ReleaseHeld(grpc::Status(grpc::DEADLINE_EXCEEDED, "fake: deadline passed"));
  }
  std::string metrics;
  EXPECT_TRUE(testing::WaitUntil([&] {
    metrics = testing::HttpGet(router_->metrics_port(), "/metrics").value_or("");
    return metrics.find(absl::StrCat("kvcache_router_requests_total{code=\"DEADLINE_EXCEEDED\"} ", kTurns)) !=
           std::string::npos;
  })) << metrics;
  EXPECT_THAT(metrics, Not(HasSubstr("code=\"UNAVAILABLE\"")));
}

}  // namespace
}  // namespace kvcache
