// kvcache-worker as real processes over loopback gRPC: generation, multi-turn
// reuse, bad input and its status codes, Watch, offload, migration between two
// workers, drain and metrics. Most tests run a tiny random model (milliseconds
// per step); the multi-turn test runs the real SmolLM2.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/model_path.h"
#include "common/gguf/tiny_llama.h"
#include "common/input_tokens.h"
#include "common/status.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "tests/common/gguf/reference_data.h"
#include "tests/common/tokenizer/llamacpp_vocab.h"
#include "tests/testing/child_process.h"
#include "tests/testing/generate_client.h"
#include "tests/testing/tcp_proxy.h"

namespace kvcache {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

using Turn = testing::Reply;

Turn Generate(v1::Worker::Stub* stub, const v1::GenerateRequest& req, int deadline_s = 120) {
  return testing::Generate(stub, req, absl::Seconds(deadline_s));
}

v1::GenerateRequest Text(const std::string& session, const std::string& text, int max_tokens,
                         v1::Mode mode = v1::FULL_CONTEXT) {
  return testing::TextRequest(session, text, max_tokens, mode);
}

// The session ids that events on `w` name while `act` runs: a Watch opened
// before it, read until a session "probe" placed after it (events come in
// order, so what came before the probe is what `act` announced).
std::vector<std::string> SessionsAnnouncedBy(v1::Worker::Stub* w, const std::function<void()>& act) {
  grpc::ClientContext wctx;
  wctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto watch = w->Watch(&wctx, v1::WatchRequest());
  v1::WatchEvent ev;
  std::vector<std::string> ids;
  if (!watch->Read(&ev) || !ev.has_snapshot()) {
    ADD_FAILURE() << "no Watch snapshot";
    return ids;
  }
  act();
  EXPECT_TRUE(Generate(w, Text("probe", "after", 1)).status.ok());
  while (watch->Read(&ev)) {
    if (!ev.has_event()) continue;
    if (ev.event().kind() == v1::CacheEvent::SESSION_PLACED && ev.event().session_id() == "probe") break;
    ids.push_back(ev.event().session_id());
  }
  wctx.TryCancel();
  watch->Finish();
  return ids;
}

// Session `id`'s export stream, chunk by chunk (max_chunk_bytes 0: the
// worker's default); empty when the export failed.
std::vector<v1::SessionChunk> ExportChunks(v1::Worker::Stub* stub, const std::string& id,
                                           int64_t max_chunk_bytes = 0) {
  grpc::ClientContext c;
  v1::ExportSessionRequest er;
  er.set_session_id(id);
  er.set_max_chunk_bytes(max_chunk_bytes);
  auto reader = stub->ExportSession(&c, er);
  std::vector<v1::SessionChunk> chunks;
  v1::SessionChunk chunk;
  while (reader->Read(&chunk)) chunks.push_back(chunk);
  const grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  return st.ok() ? chunks : std::vector<v1::SessionChunk>();
}

// An import of session `id` from `from` into `to`, fed every chunk but its
// commit: the pages stay staged there until Commit, Cancel or destruction.
class ImportUpToCommit {
 public:
  ImportUpToCommit(v1::Worker::Stub* from, const std::string& id, v1::Worker::Stub* to)
      : chunks_(ExportChunks(from, id)) {
    ok_ = chunks_.size() >= 2 && chunks_.back().has_commit();
    if (!ok_) return;
    writer_ = to->ImportSession(&ctx_, &info_);
    for (size_t i = 0; i + 1 < chunks_.size() && ok_; ++i) ok_ = writer_->Write(chunks_[i]);
  }
  ~ImportUpToCommit() {
    if (writer_ != nullptr && !finished_) Cancel();
  }
  ImportUpToCommit(const ImportUpToCommit&) = delete;
  ImportUpToCommit& operator=(const ImportUpToCommit&) = delete;

  // Every chunk but the commit went out.
  bool ok() const { return ok_; }
  // Sends the commit chunk (which fails once the worker has answered) and
  // returns the worker's status.
  grpc::Status Commit() {
    writer_->Write(chunks_.back());
    writer_->WritesDone();
    finished_ = true;
    return writer_->Finish();
  }
  grpc::Status Cancel() {
    ctx_.TryCancel();
    finished_ = true;
    return writer_->Finish();
  }

 private:
  const std::vector<v1::SessionChunk> chunks_;
  grpc::ClientContext ctx_;
  v1::SessionInfo info_;
  std::unique_ptr<grpc::ClientWriter<v1::SessionChunk>> writer_;
  bool ok_ = false;
  bool finished_ = false;
};

// Tier-0 pages that imports under way have staged on `w` (its /metrics).
int64_t StagedDevicePages(const testing::ServerUnderTest& w) {
  auto m = testing::HttpGet(w.metrics_port(), "/metrics");
  if (!m.ok()) return 0;
  return static_cast<int64_t>(
      testing::MetricSample(*m, "kvcache_kv_pages{state=\"in_flight\",tier=\"device\"}").value_or(0));
}

v1::WorkerSnapshot Snapshot(v1::Worker::Stub* stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::WatchRequest req;
  auto reader = stub->Watch(&ctx, req);
  v1::WatchEvent ev;
  EXPECT_TRUE(reader->Read(&ev));
  ctx.TryCancel();
  reader->Finish();
  return ev.snapshot();
}

class WorkerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tiny_model_ = new std::string(::testing::TempDir() + "/kvcache_worker_test_tiny.gguf");
    gguf::TinyLlamaOptions o;
    o.n_layer = 2;
    o.n_embd = 64;
    o.n_ff = 128;
    o.n_ctx = 1024;
    ASSERT_TRUE(gguf::WriteTinyLlama(o, *tiny_model_).ok());
  }
  static void TearDownTestSuite() {
    std::remove(tiny_model_->c_str());
    delete tiny_model_;
  }

  std::unique_ptr<testing::ServerUnderTest> StartWorker(std::vector<std::string> args, bool tiny = true) {
    args.push_back("--model=" + (tiny ? *tiny_model_ : gguf::DefaultModelPath()));
    args.push_back("--threads=1");
    args.push_back("--load_report_interval=100ms");
    auto w = testing::ServerUnderTest::Start(testing::BinaryPath("worker/kvcache-worker"), args);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  }

  static std::string* tiny_model_;
};

std::string* WorkerTest::tiny_model_ = nullptr;

TEST_F(WorkerTest, StreamsTokensAndUsage) {
  auto w = StartWorker({"--worker_id=w1"});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  Turn t = Generate(stub.get(), Text("", "hello there, worker", 12));
  ASSERT_TRUE(t.status.ok()) << t.status.error_message();
  EXPECT_EQ(t.tokens.size(), 12u);
  EXPECT_EQ(t.final.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(t.final.worker_id(), "w1");
  EXPECT_EQ(t.final.usage().generated_tokens(), 12);
  EXPECT_GT(t.final.usage().prompt_tokens(), 0);
  EXPECT_GT(t.final.usage().time_to_first_token_us(), 0);
  EXPECT_EQ(t.final.session_id(), "");  // ephemeral
  // Same request, same greedy tokens.
  Turn again = Generate(stub.get(), Text("", "hello there, worker", 12));
  EXPECT_EQ(again.tokens, t.tokens);
  // Sampling: a seed repeats the text; without a seed or session it does not.
  auto sampled = [&](uint64_t seed) {
    v1::GenerateRequest req = Text("", "hello there, worker", 12);
    req.mutable_sampling()->set_temperature(1.0f);
    req.mutable_sampling()->set_seed(seed);
    Turn s = Generate(stub.get(), req);
    EXPECT_TRUE(s.status.ok()) << s.status.error_message();
    return s.tokens;
  };
  EXPECT_EQ(sampled(77), sampled(77));
  std::set<std::vector<int32_t>> unseeded;
  for (int i = 0; i < 4; ++i) unseeded.insert(sampled(0));
  EXPECT_GE(unseeded.size(), 2u) << "four unseeded requests without a session sampled one text";

  // Without --worker_id, workers on one machine's port 0 still get distinct ids.
  auto unnamed = StartWorker({});
  ASSERT_NE(unnamed, nullptr);
  auto unnamed_stub = v1::Worker::NewStub(unnamed->channel());
  Turn u = Generate(unnamed_stub.get(), Text("", "who are you", 2));
  ASSERT_TRUE(u.status.ok()) << u.status.error_message();
  EXPECT_EQ(u.final.worker_id(), absl::StrCat("127.0.0.1-pid", unnamed->process().pid()));
}

TEST_F(WorkerTest, BadInputGetsClearStatusAndLeaksNothing) {
  auto w = StartWorker({"--max_tokens_per_request=100", "--max_context=512"});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  const int64_t free_before = Snapshot(stub.get()).load().pages_free_device();

  struct Case {
    std::string name;
    v1::GenerateRequest req;
    grpc::StatusCode code;
  };
  std::vector<Case> cases;
  auto add = [&](std::string name, std::function<void(v1::GenerateRequest&)> edit, grpc::StatusCode code) {
    v1::GenerateRequest r = Text("", "a valid prompt", 4);
    edit(r);
    cases.push_back({std::move(name), r, code});
  };
  add(
      "empty input", [](auto& r) { r.clear_input(); }, grpc::INVALID_ARGUMENT);
  add(
      "empty text", [](auto& r) { r.mutable_input()->set_text(""); }, grpc::INVALID_ARGUMENT);
  add(
      "token outside vocab", [](auto& r) { r.mutable_input()->mutable_tokens()->add_ids(1 << 30); },
      grpc::INVALID_ARGUMENT);
  add(
      "negative token", [](auto& r) { r.mutable_input()->mutable_tokens()->add_ids(-5); },
      grpc::INVALID_ARGUMENT);
  add(
      "context too long", [](auto& r) { r.mutable_input()->set_text(std::string(3000, 'x')); },
      grpc::OUT_OF_RANGE);
  add(
      "max_tokens huge", [](auto& r) { r.mutable_sampling()->set_max_tokens(1000000); },
      grpc::INVALID_ARGUMENT);
  add(
      "max_tokens negative", [](auto& r) { r.mutable_sampling()->set_max_tokens(-1); },
      grpc::INVALID_ARGUMENT);
  add(
      "temperature", [](auto& r) { r.mutable_sampling()->set_temperature(7); }, grpc::INVALID_ARGUMENT);
  add(
      "top_p", [](auto& r) { r.mutable_sampling()->set_top_p(1.5f); }, grpc::INVALID_ARGUMENT);
  add(
      "bad session id", [](auto& r) { r.set_session_id("no spaces allowed"); }, grpc::INVALID_ARGUMENT);
  add(
      "append without id", [](auto& r) { r.set_mode(v1::APPEND); }, grpc::INVALID_ARGUMENT);
  add(
      "append unknown",
      [](auto& r) {
        r.set_mode(v1::APPEND);
        r.set_session_id("ghost");
      },
      grpc::NOT_FOUND);
  add(
      "bad chat role",
      [](auto& r) {
        auto* m = r.mutable_input()->mutable_chat()->add_messages();
        m->set_role("wizard");
        m->set_content("hi");
      },
      grpc::INVALID_ARGUMENT);
  add(
      "too many stops",
      [](auto& r) {
        for (int i = 0; i < 20; ++i) r.mutable_sampling()->add_stop("x");
      },
      grpc::INVALID_ARGUMENT);
  add(
      "over message limit", [](auto& r) { r.mutable_input()->set_text(std::string(9 << 20, 'a')); },
      grpc::RESOURCE_EXHAUSTED);
  // An APPEND that goes on its session's cut reply (continued_tokens) names
  // the cut request and has no input and no tokens_read of its own.
  auto going_on = [](v1::GenerateRequest& r) {
    r.set_mode(v1::APPEND);
    r.set_session_id("ghost");
    r.set_continued_tokens(2);
    r.set_request_id("cut-request");
  };
  add("append going on with an input", going_on, grpc::INVALID_ARGUMENT);
  add(
      "append going on with tokens_read",
      [&](auto& r) {
        going_on(r);
        r.clear_input();
        r.set_tokens_read(1);
      },
      grpc::INVALID_ARGUMENT);
  add(
      "append going on an unknown session",
      [&](auto& r) {
        going_on(r);
        r.clear_input();
      },
      grpc::NOT_FOUND);
  add(
      "append going on without a request_id",
      [&](auto& r) {
        going_on(r);
        r.clear_input();
        r.clear_request_id();
      },
      grpc::INVALID_ARGUMENT);
  add(
      "negative continued_tokens", [](auto& r) { r.set_continued_tokens(-1); }, grpc::INVALID_ARGUMENT);
  add(
      "request_id over 64 bytes", [](auto& r) { r.set_request_id(std::string(65, 'r')); },
      grpc::INVALID_ARGUMENT);
  for (const Case& c : cases) {
    Turn t = Generate(stub.get(), c.req);
    EXPECT_EQ(t.status.error_code(), c.code) << c.name << ": " << t.status.error_message();
    EXPECT_FALSE(t.status.error_message().empty()) << c.name;
    EXPECT_TRUE(t.tokens.empty()) << c.name;
  }
  // Malformed UTF-8 in a proto3 string field never reaches the worker's code:
  // protobuf refuses to parse the message (gRPC 1.51 answers UNIMPLEMENTED with
  // no message). What matters here: refused, no tokens, nothing leaked, alive.
  {
    Turn t = Generate(stub.get(), Text("", "abc\xff\xfe", 4));
    EXPECT_FALSE(t.status.ok());
    EXPECT_TRUE(t.tokens.empty());
  }
  // The unknown-session message names it.
  Turn ghost = Generate(stub.get(), cases[11].req);
  EXPECT_THAT(ghost.status.error_message(), HasSubstr("ghost"));

  // Session calls on unknown sessions.
  grpc::ClientContext ctx;
  v1::SessionRequest sr;
  sr.set_session_id("ghost");
  v1::SessionInfo info;
  EXPECT_EQ(stub->GetSession(&ctx, sr, &info).error_code(), grpc::NOT_FOUND);

  // The worker is still healthy and holds no pages for any of it.
  Turn ok = Generate(stub.get(), Text("", "still fine?", 3));
  EXPECT_TRUE(ok.status.ok());
  EXPECT_EQ(Snapshot(stub.get()).load().pages_free_device(), free_before);
  EXPECT_EQ(testing::HealthCheck(w->channel(), "readiness").value_or(""), "SERVING");
}

// worker.proto: once a drain began, calls that would create, change or bring in
// a session get UNAVAILABLE ("worker is draining"), while reads, CloseSession
// and the calls a drain needs are still served. A Watch subscriber (what a
// router is) keeps the SIGTERMed worker waiting for its sessions to leave.
TEST_F(WorkerTest, DrainingWorkerRefusesSessionChangesAndServesReadsAndClose) {
  auto w = StartWorker({"--shutdown_deadline=60s"});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  for (const char* id : {"keep", "other"}) {
    ASSERT_TRUE(Generate(stub.get(), Text(id, "a conversation before the drain", 3)).status.ok());
  }
  grpc::ClientContext wctx;
  auto watch = stub->Watch(&wctx, v1::WatchRequest());
  v1::WatchEvent ev;
  ASSERT_TRUE(watch->Read(&ev));  // subscribed
  w->process().Signal(SIGTERM);
  bool draining = false;
  while (!draining && watch->Read(&ev)) draining = ev.has_load() && ev.load().draining();
  ASSERT_TRUE(draining) << "no draining load report";

  auto session = [](const std::string& id) {
    v1::SessionRequest r;
    r.set_session_id(id);
    return r;
  };
  auto expect_draining = [](const grpc::Status& st, const char* call) {
    EXPECT_EQ(st.error_code(), grpc::UNAVAILABLE) << call << ": " << st.error_message();
    EXPECT_EQ(st.error_message(), "worker is draining") << call;
  };
  {
    grpc::ClientContext c;
    v1::ForkSessionRequest fr;
    fr.set_session_id("keep");
    fr.set_new_session_id("keep-fork");
    v1::SessionInfo info;
    expect_draining(stub->ForkSession(&c, fr, &info), "ForkSession");
  }
  {
    grpc::ClientContext c;
    v1::PinSessionRequest pr;
    pr.set_session_id("keep");
    pr.set_pinned(true);
    v1::SessionInfo info;
    expect_draining(stub->PinSession(&c, pr, &info), "PinSession");
  }
  {
    grpc::ClientContext c;
    v1::SessionInfo info;
    expect_draining(stub->OffloadSession(&c, session("keep"), &info), "OffloadSession");
  }
  {
    grpc::ClientContext c;
    v1::SessionInfo info;
    expect_draining(stub->RestoreSession(&c, session("keep"), &info), "RestoreSession");
  }
  expect_draining(Generate(stub.get(), Text("keep", " more", 2, v1::APPEND)).status, "Generate");
  // Nothing changed: the session is as it was, unpinned, and no fork exists.
  {
    grpc::ClientContext c;
    v1::SessionInfo info;
    ASSERT_TRUE(stub->GetSession(&c, session("keep"), &info).ok());
    EXPECT_FALSE(info.pinned());
    EXPECT_EQ(info.state(), v1::SESSION_IDLE);
    grpc::ClientContext c2;
    EXPECT_EQ(stub->GetSession(&c2, session("keep-fork"), &info).error_code(), grpc::NOT_FOUND);
  }
  // Closing is still served; once no session is left the worker exits 0.
  for (const char* id : {"keep", "other"}) {
    grpc::ClientContext c;
    v1::CloseSessionResponse closed;
    EXPECT_TRUE(stub->CloseSession(&c, session(id), &closed).ok()) << id;
  }
  auto status = w->process().Wait(absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << "the drained worker did not exit";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  wctx.TryCancel();
  watch->Finish();
}

// SIGTERM with a session that no router moves away (one watches, so the
// worker waits for it): the health Watch streams of "" and liveness turn
// NOT_SERVING when the server stops and end OK before the process exits.
// Before, the wait for the sessions took the whole --shutdown_deadline and the
// server's stop then cancelled the Watch streams (UNAVAILABLE).
TEST_F(WorkerTest, HealthWatchesEndOkWhenTheSessionsCannotLeave) {
  auto w = StartWorker({"--shutdown_deadline=3s"});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  ASSERT_TRUE(Generate(stub.get(), Text("stays", "a conversation no router moves", 3)).status.ok());
  grpc::ClientContext wctx;
  auto watch = stub->Watch(&wctx, v1::WatchRequest());
  v1::WatchEvent ev;
  ASSERT_TRUE(watch->Read(&ev));  // subscribed: a router that could move the session
  auto health = grpc::health::v1::Health::NewStub(w->channel());
  struct HealthWatch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderInterface<grpc::health::v1::HealthCheckResponse>> reader;
  };
  HealthWatch watches[2];
  const char* services[2] = {"", "liveness"};
  for (int i = 0; i < 2; ++i) {
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(services[i]);
    watches[i].reader = health->Watch(&watches[i].ctx, req);
    grpc::health::v1::HealthCheckResponse r;
    ASSERT_TRUE(watches[i].reader->Read(&r));
    EXPECT_EQ(r.status(), grpc::health::v1::HealthCheckResponse::SERVING) << services[i];
  }
  w->process().Signal(SIGTERM);
  for (int i = 0; i < 2; ++i) {
    grpc::health::v1::HealthCheckResponse r, last;
    while (watches[i].reader->Read(&r)) last = r;
    EXPECT_EQ(last.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING) << services[i];
    const grpc::Status end = watches[i].reader->Finish();
    EXPECT_TRUE(end.ok()) << "'" << services[i] << "': " << end.error_code() << " " << end.error_message();
  }
  auto status = w->process().Wait(absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << "the worker did not exit";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  wctx.TryCancel();
  watch->Finish();
}

// worker.proto: a malformed session id is INVALID_ARGUMENT on every session
// call (not NOT_FOUND), and an import stream whose chunks are out of order or
// whose Begin names a malformed id is INVALID_ARGUMENT and leaves no trace.
TEST_F(WorkerTest, MalformedSessionIdsAndImportStreamsAreInvalidArgument) {
  auto w = StartWorker({});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  const int64_t free_before = Snapshot(stub.get()).load().pages_free_device();
  for (const std::string& bad :
       {std::string("a/b"), std::string("bad id"), std::string(129, 'a'), std::string()}) {
    auto code = [&](auto call) {
      grpc::ClientContext c;
      return call(&c).error_code();
    };
    v1::SessionRequest sr;
    sr.set_session_id(bad);
    v1::SessionInfo info;
    EXPECT_EQ(code([&](grpc::ClientContext* c) { return stub->GetSession(c, sr, &info); }),
              grpc::INVALID_ARGUMENT)
        << "GetSession '" << bad << "'";
    v1::CloseSessionResponse closed;
    EXPECT_EQ(code([&](grpc::ClientContext* c) { return stub->CloseSession(c, sr, &closed); }),
              grpc::INVALID_ARGUMENT)
        << "CloseSession '" << bad << "'";
    EXPECT_EQ(code([&](grpc::ClientContext* c) { return stub->OffloadSession(c, sr, &info); }),
              grpc::INVALID_ARGUMENT)
        << "OffloadSession '" << bad << "'";
    EXPECT_EQ(code([&](grpc::ClientContext* c) { return stub->RestoreSession(c, sr, &info); }),
              grpc::INVALID_ARGUMENT)
        << "RestoreSession '" << bad << "'";
    v1::PinSessionRequest pr;
    pr.set_session_id(bad);
    pr.set_pinned(true);
    EXPECT_EQ(code([&](grpc::ClientContext* c) { return stub->PinSession(c, pr, &info); }),
              grpc::INVALID_ARGUMENT)
        << "PinSession '" << bad << "'";
    v1::ForkSessionRequest fr;
    fr.set_session_id(bad);
    fr.set_new_session_id("fine");
    EXPECT_EQ(code([&](grpc::ClientContext* c) { return stub->ForkSession(c, fr, &info); }),
              grpc::INVALID_ARGUMENT)
        << "ForkSession '" << bad << "'";
    v1::MigrateSessionRequest mr;
    mr.set_session_id(bad);
    mr.set_target_address("127.0.0.1:1");
    v1::MigrateSessionResponse moved;
    EXPECT_EQ(code([&](grpc::ClientContext* c) { return stub->MigrateSession(c, mr, &moved); }),
              grpc::INVALID_ARGUMENT)
        << "MigrateSession '" << bad << "'";
    v1::ExportSessionRequest er;
    er.set_session_id(bad);
    EXPECT_EQ(code([&](grpc::ClientContext* c) {
                auto reader = stub->ExportSession(c, er);
                v1::SessionChunk chunk;
                while (reader->Read(&chunk)) {
                }
                return reader->Finish();
              }),
              grpc::INVALID_ARGUMENT)
        << "ExportSession '" << bad << "'";
  }

  // A real session's export, then imports of altered copies of it.
  ASSERT_TRUE(Generate(stub.get(), Text("src", std::string(100, 'm'), 4)).status.ok());
  const std::vector<v1::SessionChunk> chunks = ExportChunks(stub.get(), "src", 1 << 10);  // several chunks
  ASSERT_GE(chunks.size(), 4u);
  {
    grpc::ClientContext c;
    v1::ExportSessionRequest er;
    er.set_session_id("src");
    er.set_max_chunk_bytes(-1);
    auto reader = stub->ExportSession(&c, er);
    v1::SessionChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    EXPECT_EQ(reader->Finish().error_code(), grpc::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext c;
    v1::SessionRequest sr;
    sr.set_session_id("src");
    v1::CloseSessionResponse closed;
    ASSERT_TRUE(stub->CloseSession(&c, sr, &closed).ok());
  }
  auto import = [&](const std::vector<v1::SessionChunk>& stream) {
    grpc::ClientContext c;
    v1::SessionInfo info;
    auto writer = stub->ImportSession(&c, &info);
    for (const auto& chunk : stream) {
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  };
  std::vector<v1::SessionChunk> swapped = chunks;
  std::swap(swapped[1], swapped[2]);
  grpc::Status st = import(swapped);
  EXPECT_EQ(st.error_code(), grpc::INVALID_ARGUMENT) << st.error_message();
  std::vector<v1::SessionChunk> bad_id = chunks;
  ASSERT_TRUE(bad_id[0].has_begin());
  bad_id[0].mutable_begin()->set_session_id("bad id/x");
  st = import(bad_id);
  EXPECT_EQ(st.error_code(), grpc::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(Snapshot(stub.get()).sessions_size(), 0) << "a refused import left a session";
  // The unaltered stream imports, and continues.
  st = import(chunks);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(Generate(stub.get(), Text("src", " more", 2, v1::APPEND)).status.ok());
  {
    grpc::ClientContext c;
    v1::SessionRequest sr;
    sr.set_session_id("src");
    v1::CloseSessionResponse closed;
    ASSERT_TRUE(stub->CloseSession(&c, sr, &closed).ok());
  }
  EXPECT_EQ(Snapshot(stub.get()).load().pages_free_device(), free_before);
}

TEST_F(WorkerTest, ConcurrentRequestOnOneSessionIsAborted) {
  auto w = StartWorker({});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  // A long request holds the session; a second one must be refused, not queued.
  testing::PartialStream first(stub.get(), Text("busy", "long running", 500));
  ASSERT_TRUE(first.ReadTokens(1));  // it is running
  Turn second = Generate(stub.get(), Text("busy", "second", 3));
  EXPECT_EQ(second.status.error_code(), grpc::ABORTED);
  first.Cancel();
  EXPECT_EQ(first.Finish().status.error_code(), grpc::CANCELLED);
}

TEST_F(WorkerTest, CancelAndDeadlineFreePages) {
  auto w = StartWorker({});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  const int64_t free_before = Snapshot(stub.get()).load().pages_free_device();
  Turn t = Generate(stub.get(), Text("", std::string(200, 'q'), 900), /*deadline_s=*/0);
  EXPECT_EQ(t.status.error_code(), grpc::DEADLINE_EXCEEDED);
  {
    testing::PartialStream stream(stub.get(), Text("", std::string(200, 'r'), 900));
    ASSERT_TRUE(stream.ReadTokens(1));
    stream.Cancel();
    EXPECT_EQ(stream.Finish().status.error_code(), grpc::CANCELLED);
  }
  // Cancellation takes effect at the next step the worker runs after it hears of
  // it, which can be after the client's Finish returns (a loaded machine saw 16
  // pages still held by the one read below): the pages come back.
  Turn after = Generate(stub.get(), Text("", "x", 1));
  ASSERT_TRUE(after.status.ok());
  int64_t deadline_free = -1;
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        deadline_free = Snapshot(stub.get()).load().pages_free_device();
        return deadline_free == free_before;
      },
      absl::Seconds(15)));
  EXPECT_EQ(deadline_free, free_before);
}

// A deadline that passes mid-stream reaches the engine as gRPC's cancellation
// of the call; kvcache_requests_total still counts it as DEADLINE_EXCEEDED, the
// code the client saw, not as a client's CANCELLED.
TEST_F(WorkerTest, DeadlinePassedMidStreamIsCountedAsDeadlineExceeded) {
  auto w = StartWorker({}, /*tiny=*/false);  // SmolLM2: 500 tokens take seconds
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  Turn t =
      testing::Generate(stub.get(), Text("", "Tell me a very long story.", 500), absl::Milliseconds(1500));
  EXPECT_EQ(t.status.error_code(), grpc::DEADLINE_EXCEEDED);
  EXPECT_FALSE(t.tokens.empty()) << "the deadline passed before generation started";
  auto counted = [&](const std::string& code) {
    auto body = testing::HttpGet(w->metrics_port(), "/metrics");
    return body.ok() && body->find("kvcache_requests_total{code=\"" + code + "\"} 1") != std::string::npos;
  };
  EXPECT_TRUE(testing::WaitUntil([&] { return counted("DEADLINE_EXCEEDED"); }, absl::Seconds(15)));
  EXPECT_FALSE(counted("CANCELLED"));
}

// A client that vanishes mid-stream without closing its connection (its node
// died, a partition): the worker's keepalive pings go unanswered, it closes the
// connection, and the request ends as cancelled, its session free for the
// client's next attempt, instead of generating for no one with the session busy.
TEST_F(WorkerTest, ClientThatVanishesMidStreamIsCutByKeepalive) {
  // SmolLM2: 2,000 tokens take far longer than the 7 s the cut takes. (A
  // timeout under 5 s would also cut idle clients that are alive: gRPC C++
  // answers pings on a channel with no call open every 5 s.)
  auto w = StartWorker({"--keepalive_time=1s", "--keepalive_timeout=6s", "--max_tokens_per_request=4000"},
                       /*tiny=*/false);
  ASSERT_NE(w, nullptr);
  auto proxy = testing::TcpProxy::Start(w->grpc_address());
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  auto far =
      v1::Worker::NewStub(grpc::CreateChannel((*proxy)->address(), grpc::InsecureChannelCredentials()));
  testing::PartialStream stream(far.get(), Text("gone", "Tell me a very long story.", 2000),
                                absl::Seconds(120));
  ASSERT_TRUE(stream.ReadTokens(3));
  (*proxy)->Freeze();
  EXPECT_TRUE((*proxy)->WaitForServerHangUp(absl::Seconds(30))) << "the worker kept the connection";
  auto counted = [&](const std::string& code) {
    auto body = testing::HttpGet(w->metrics_port(), "/metrics");
    return body.ok() && body->find("kvcache_requests_total{code=\"" + code + "\"} 1") != std::string::npos;
  };
  EXPECT_TRUE(testing::WaitUntil([&] { return counted("CANCELLED"); }, absl::Seconds(15)));
  EXPECT_FALSE(counted("OK"));
  // The client, back on another connection, continues its conversation. A new
  // one: the fixture's channel sat idle through the freeze, and an idle gRPC C++
  // channel answers pings only every 5 s, so under load the 6 s timeout may have
  // cut it too ("Socket closed" once in a full ctest run on 2 busy cores).
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(w->grpc_address(), grpc::InsecureChannelCredentials()));
  Turn next = Generate(stub.get(), Text("gone", " and then?", 2, v1::APPEND));
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
}

// --max_connection_age: the server asks a client to reconnect once its
// connection is that old (so that, behind a Kubernetes Service, long-lived
// clients spread over replicas added later); a stream in flight then finishes
// within the grace, and the client's next call goes over a new connection.
TEST_F(WorkerTest, OldConnectionsAreReplacedWithoutCuttingStreams) {
  // SmolLM2: 600 tokens take longer than the 1 s age (about 4 s here).
  auto w = StartWorker({"--max_connection_age=1s", "--max_connection_age_grace=60s"}, /*tiny=*/false);
  ASSERT_NE(w, nullptr);
  auto channel = grpc::CreateChannel(w->grpc_address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Worker::NewStub(channel);
  const absl::Time start = absl::Now();
  Turn long_one = Generate(stub.get(), Text("", "Tell me a very long story.", 600));
  ASSERT_TRUE(long_one.status.ok()) << long_one.status.error_message();
  EXPECT_EQ(long_one.tokens.size(), 600u);
  EXPECT_GT(absl::Now() - start, absl::Seconds(1.2)) << "the stream ended before the connection's age";
  // The server's GOAWAY put the channel back to IDLE (without it: READY).
  EXPECT_EQ(channel->GetState(/*try_to_connect=*/false), GRPC_CHANNEL_IDLE);
  Turn next = Generate(stub.get(), Text("", "and a short one", 2));
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
}

TEST_F(WorkerTest, SessionCallsAndWatchEvents) {
  auto w = StartWorker({});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  // Watch from the start: snapshot, then events for the new session.
  grpc::ClientContext wctx;
  wctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::WatchRequest wr;
  auto watch = stub->Watch(&wctx, wr);
  v1::WatchEvent ev;
  ASSERT_TRUE(watch->Read(&ev));
  ASSERT_TRUE(ev.has_snapshot());
  EXPECT_EQ(ev.sequence(), 1u);
  EXPECT_EQ(ev.snapshot().sessions_size(), 0);

  Turn t = Generate(stub.get(), Text("chat-1", std::string(100, 'z'), 5));
  ASSERT_TRUE(t.status.ok());
  bool placed = false, stored = false, load = false;
  uint64_t seq = 1;
  while (!(placed && stored && load) && watch->Read(&ev)) {
    EXPECT_EQ(ev.sequence(), ++seq);
    if (ev.has_event() && ev.event().kind() == v1::CacheEvent::SESSION_PLACED) {
      placed = ev.event().session_id() == "chat-1";
    }
    if (ev.has_event() && ev.event().kind() == v1::CacheEvent::PREFIX_STORED) {
      stored = ev.event().block_hashes_size() > 0 && ev.event().block_hashes(0).size() == 32;
    }
    if (ev.has_load()) load = ev.load().sessions() >= 1;
  }
  EXPECT_TRUE(placed && stored && load);
  wctx.TryCancel();
  watch->Finish();

  auto call = [&](auto method, auto req, auto* resp) {
    grpc::ClientContext c;
    return (stub.get()->*method)(&c, req, resp);
  };
  v1::SessionRequest sr;
  sr.set_session_id("chat-1");
  v1::SessionInfo info;
  ASSERT_TRUE(call(&v1::Worker::Stub::GetSession, sr, &info).ok());
  EXPECT_EQ(info.tokens_cached(), t.final.usage().prompt_tokens() + 4);  // the last sampled token has no K/V
  EXPECT_EQ(info.context_tokens(), t.final.usage().prompt_tokens() + 5);
  EXPECT_GT(info.pages_device(), 0);
  // Another tenant sees nothing.
  v1::SessionRequest other = sr;
  other.set_tenant("someone-else");
  EXPECT_EQ(call(&v1::Worker::Stub::GetSession, other, &info).error_code(), grpc::NOT_FOUND);

  ASSERT_TRUE(call(&v1::Worker::Stub::OffloadSession, sr, &info).ok());
  EXPECT_EQ(info.pages_device(), 0);
  EXPECT_GT(info.pages_host(), 0);
  EXPECT_EQ(info.state(), v1::SESSION_OFFLOADED);
  ASSERT_TRUE(call(&v1::Worker::Stub::RestoreSession, sr, &info).ok());
  EXPECT_EQ(info.pages_host(), 0);

  v1::ForkSessionRequest fr;
  fr.set_session_id("chat-1");
  fr.set_new_session_id("chat-2");
  ASSERT_TRUE(call(&v1::Worker::Stub::ForkSession, fr, &info).ok());
  EXPECT_EQ(call(&v1::Worker::Stub::ForkSession, fr, &info).error_code(), grpc::ALREADY_EXISTS);

  v1::PinSessionRequest pr;
  pr.set_session_id("chat-2");
  pr.set_pinned(true);
  ASSERT_TRUE(call(&v1::Worker::Stub::PinSession, pr, &info).ok());
  EXPECT_TRUE(info.pinned());
  EXPECT_EQ(call(
                &v1::Worker::Stub::OffloadSession,
                [] {
                  v1::SessionRequest r;
                  r.set_session_id("chat-2");
                  return r;
                }(),
                &info)
                .error_code(),
            grpc::FAILED_PRECONDITION);

  v1::ListSessionsRequest lr;
  v1::ListSessionsResponse list;
  ASSERT_TRUE(call(&v1::Worker::Stub::ListSessions, lr, &list).ok());
  EXPECT_EQ(list.sessions_size(), 2);

  v1::CloseSessionResponse closed;
  ASSERT_TRUE(call(&v1::Worker::Stub::CloseSession, sr, &closed).ok());
  EXPECT_EQ(call(&v1::Worker::Stub::GetSession, sr, &info).error_code(), grpc::NOT_FOUND);
}

TEST_F(WorkerTest, SessionFieldsTellTheTruthAndTenantsAreSeparate) {
  auto w = StartWorker({"--page_tokens=16"});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  auto call = [&](auto method, auto req, auto* resp) {
    grpc::ClientContext c;
    return (stub.get()->*method)(&c, req, resp);
  };
  auto session = [](const std::string& id, const std::string& tenant) {
    v1::SessionRequest r;
    r.set_session_id(id);
    r.set_tenant(tenant);
    return r;
  };
  const int64_t before_ms = absl::ToUnixMillis(absl::Now());
  v1::GenerateRequest req = Text("s", std::string(70, 'q'), 5);
  Turn t = Generate(stub.get(), req);
  ASSERT_TRUE(t.status.ok()) << t.status.error_message();
  const int64_t after_ms = absl::ToUnixMillis(absl::Now());
  v1::SessionInfo info;
  ASSERT_TRUE(call(&v1::Worker::Stub::GetSession, session("s", ""), &info).ok());
  EXPECT_GE(info.last_used_unix_ms(), before_ms);
  EXPECT_LE(info.last_used_unix_ms(), after_ms);
  EXPECT_EQ(info.pages_shared(), 0);
  const int tokens = info.tokens_cached();
  const int full_pages = tokens / 16;
  ASSERT_GT(full_pages, 0);

  // A fork shares every full page; closing it frees only its private tail.
  v1::ForkSessionRequest fr;
  fr.set_session_id("s");
  fr.set_new_session_id("f");
  ASSERT_TRUE(call(&v1::Worker::Stub::ForkSession, fr, &info).ok());
  EXPECT_EQ(info.pages_shared(), full_pages);
  ASSERT_TRUE(call(&v1::Worker::Stub::GetSession, session("s", ""), &info).ok());
  EXPECT_EQ(info.pages_shared(), full_pages);
  EXPECT_LE(info.last_used_unix_ms(), after_ms);  // a read does not count as use
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(call(&v1::Worker::Stub::CloseSession, session("f", ""), &closed).ok());
  EXPECT_EQ(closed.pages_freed(), tokens % 16 == 0 ? 0 : 1);
  ASSERT_TRUE(call(&v1::Worker::Stub::GetSession, session("s", ""), &info).ok());
  EXPECT_EQ(info.pages_shared(), 0);
  ASSERT_TRUE(call(&v1::Worker::Stub::CloseSession, session("s", ""), &closed).ok());
  EXPECT_EQ(closed.pages_freed(), (tokens + 15) / 16);

  // The same id in two tenants: two sessions; a third tenant learns nothing.
  for (const char* tenant : {"acme", "globex"}) {
    v1::GenerateRequest r = Text("shared-id", std::string("tenant ") + tenant + " says hello", 4);
    r.set_tenant(tenant);
    Turn turn = Generate(stub.get(), r);
    ASSERT_TRUE(turn.status.ok()) << tenant << ": " << turn.status.error_message();
  }
  ASSERT_TRUE(call(&v1::Worker::Stub::CloseSession, session("shared-id", "acme"), &closed).ok());
  ASSERT_TRUE(call(&v1::Worker::Stub::GetSession, session("shared-id", "globex"), &info).ok());
  EXPECT_EQ(info.tenant(), "globex");
  const grpc::Status theirs = call(&v1::Worker::Stub::GetSession, session("shared-id", "initech"), &info);
  const grpc::Status unknown = call(&v1::Worker::Stub::GetSession, session("no-such-id", "initech"), &info);
  EXPECT_EQ(theirs.error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(unknown.error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(theirs.error_message(),
            absl::StrReplaceAll(unknown.error_message(), {{"no-such-id", "shared-id"}}));
  v1::GenerateRequest append = Text("shared-id", " more", 2, v1::APPEND);
  append.set_tenant("initech");
  Turn refused = Generate(stub.get(), append);
  EXPECT_EQ(refused.status.error_code(), grpc::NOT_FOUND);
}

TEST_F(WorkerTest, IdleSessionsExpireAndTheWatchSaysSo) {
  auto w = StartWorker({"--session_idle_ttl=300ms"});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  grpc::ClientContext wctx;
  wctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto watch = stub->Watch(&wctx, v1::WatchRequest());
  v1::WatchEvent ev;
  ASSERT_TRUE(watch->Read(&ev));
  ASSERT_TRUE(Generate(stub.get(), Text("goes", "an idle conversation", 3)).status.ok());
  ASSERT_TRUE(Generate(stub.get(), Text("stays", "a pinned conversation", 3)).status.ok());
  v1::PinSessionRequest pin;
  pin.set_session_id("stays");
  pin.set_pinned(true);
  v1::SessionInfo info;
  {
    grpc::ClientContext c;
    ASSERT_TRUE(stub->PinSession(&c, pin, &info).ok());
  }
  bool dropped = false;
  while (!dropped && watch->Read(&ev)) {
    dropped = ev.has_event() && ev.event().kind() == v1::CacheEvent::SESSION_DROPPED &&
              ev.event().session_id() == "goes";
    EXPECT_FALSE(ev.has_event() && ev.event().kind() == v1::CacheEvent::SESSION_DROPPED &&
                 ev.event().session_id() == "stays");
  }
  EXPECT_TRUE(dropped);
  wctx.TryCancel();
  watch->Finish();
  v1::SessionRequest sr;
  sr.set_session_id("goes");
  grpc::ClientContext c1;
  EXPECT_EQ(stub->GetSession(&c1, sr, &info).error_code(), grpc::NOT_FOUND);
  sr.set_session_id("stays");
  grpc::ClientContext c2;
  EXPECT_TRUE(stub->GetSession(&c2, sr, &info).ok());
}

TEST_F(WorkerTest, LargeSnapshotsComeInParts) {
  auto w = StartWorker({"--watch_snapshot_part=3"});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  for (int i = 0; i < 7; ++i) {
    ASSERT_TRUE(
        Generate(stub.get(), Text("part-" + std::to_string(i), std::string(40, 'a' + i), 2)).status.ok());
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto reader = stub->Watch(&ctx, v1::WatchRequest());
  std::set<std::string> sessions;
  int parts = 0, hashes = 0;
  uint64_t seq = 0;
  v1::WatchEvent ev;
  while (reader->Read(&ev)) {
    ASSERT_TRUE(ev.has_snapshot()) << "an event before the last snapshot part";
    EXPECT_EQ(ev.sequence(), ++seq);
    const v1::WorkerSnapshot& part = ev.snapshot();
    EXPECT_LE(part.sessions_size() + part.device_block_hashes_size(), 3);
    if (parts == 0) {
      EXPECT_FALSE(part.model_id().empty());
    }
    ++parts;
    for (const auto& s : part.sessions()) sessions.insert(s.session_id());
    hashes += part.device_block_hashes_size();
    if (!part.more()) break;
  }
  ctx.TryCancel();
  reader->Finish();
  EXPECT_EQ(sessions.size(), 7u);
  EXPECT_GE(hashes, 7);  // every 40-token prompt fills at least two pages
  EXPECT_EQ(parts, (7 + hashes + 2) / 3);
}

TEST_F(WorkerTest, OffloadUnderPressureKeepsOutputIdentical) {
  // Reference worker with room for everything; squeezed worker whose tier 0
  // holds 12 pages (192 tokens of the tiny model) while four 120-token sessions
  // need 32.
  auto roomy = StartWorker({});
  auto tight = StartWorker({"--tier0_bytes=" + std::to_string(12 * 16 * 2 * 2 * 2 * 16 * 2)});
  ASSERT_NE(roomy, nullptr);
  ASSERT_NE(tight, nullptr);
  auto a = v1::Worker::NewStub(roomy->channel());
  auto b = v1::Worker::NewStub(tight->channel());
  for (int turn = 0; turn < 2; ++turn) {
    for (int s = 0; s < 4; ++s) {
      const std::string id = "user-" + std::to_string(s);
      const std::string text = turn == 0 ? std::string(110, static_cast<char>('a' + s)) : " and more";
      const v1::Mode mode = turn == 0 ? v1::FULL_CONTEXT : v1::APPEND;
      Turn ra = Generate(a.get(), Text(id, text, 8, mode));
      Turn rb = Generate(b.get(), Text(id, text, 8, mode));
      ASSERT_TRUE(ra.status.ok()) << ra.status.error_message();
      ASSERT_TRUE(rb.status.ok()) << rb.status.error_message();
      EXPECT_EQ(rb.tokens, ra.tokens) << id << " turn " << turn;
    }
  }
  // The squeeze really happened: the tight worker offloaded and restored.
  auto body = testing::HttpGet(tight->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok());
  EXPECT_THAT(*body, HasSubstr("kvcache_offload_bytes_total"));
  EXPECT_EQ(body->find("kvcache_offload_bytes_total 0\n"), std::string::npos) << "no offload happened";
}

TEST_F(WorkerTest, MigrationMovesPagesAndContinuesIdentically) {
  auto src = StartWorker({"--worker_id=src"});
  auto dst = StartWorker({"--worker_id=dst"});
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  auto s = v1::Worker::NewStub(src->channel());
  auto d = v1::Worker::NewStub(dst->channel());
  auto pin = [&s](const std::string& id) {
    grpc::ClientContext c;
    v1::PinSessionRequest pr;
    pr.set_session_id(id);
    pr.set_pinned(true);
    v1::SessionInfo info;
    return s->PinSession(&c, pr, &info);
  };
  v1::MigrateSessionResponse unused;
  auto migrate = [&s](const std::string& id, const std::string& target, v1::MigrateSessionResponse* out) {
    grpc::ClientContext c;
    v1::MigrateSessionRequest req;
    req.set_session_id(id);
    req.set_target_address(target);
    return s->MigrateSession(&c, req, out);
  };
  Turn t1 = Generate(s.get(), Text("moving", std::string(300, 'm'), 10));
  ASSERT_TRUE(t1.status.ok());
  // A copy stays on the source as the reference.
  {
    grpc::ClientContext c;
    v1::ForkSessionRequest fr;
    fr.set_session_id("moving");
    fr.set_new_session_id("reference");
    v1::SessionInfo info;
    ASSERT_TRUE(s->ForkSession(&c, fr, &info).ok());
  }
  // The client's pin moves with the session.
  ASSERT_TRUE(pin("moving").ok());
  // So does the time of its last request: a move does not restart the idle TTL.
  int64_t last_used_ms = 0;
  {
    grpc::ClientContext c;
    v1::SessionRequest r;
    r.set_session_id("moving");
    v1::SessionInfo info;
    ASSERT_TRUE(s->GetSession(&c, r, &info).ok());
    last_used_ms = info.last_used_unix_ms();
  }
  // (The import happens at a later millisecond than the last request.)
  while (absl::ToUnixMillis(absl::Now()) <= last_used_ms) std::this_thread::yield();
  // The source's Watch, from before the move.
  grpc::ClientContext wctx;
  wctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto watch = s->Watch(&wctx, v1::WatchRequest());
  v1::WatchEvent ev;
  ASSERT_TRUE(watch->Read(&ev));  // the snapshot
  v1::MigrateSessionResponse mr;
  {
    grpc::Status st = migrate("moving", dst->grpc_address(), &mr);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  EXPECT_GT(mr.bytes_moved(), 0);
  EXPECT_EQ(mr.session().worker_id(), "dst");
  EXPECT_TRUE(mr.session().pinned());
  EXPECT_EQ(mr.session().last_used_unix_ms(), last_used_ms);
  // The source announces the move as worker.proto says: SESSION_EXPORTED naming
  // the new holder, not SESSION_DROPPED.
  bool exported = false;
  while (!exported && watch->Read(&ev)) {
    if (!ev.has_event() || ev.event().session_id() != "moving") continue;
    EXPECT_NE(ev.event().kind(), v1::CacheEvent::SESSION_DROPPED);
    exported = ev.event().kind() == v1::CacheEvent::SESSION_EXPORTED;
    if (exported) {
      EXPECT_EQ(ev.event().target_worker(), "dst");
    }
  }
  EXPECT_TRUE(exported);
  wctx.TryCancel();
  watch->Finish();
  EXPECT_GE(mr.total_us(), mr.pause_us());
  // Gone from the source, present on the target.
  EXPECT_EQ(Generate(s.get(), Text("moving", " next", 3, v1::APPEND)).status.error_code(), grpc::NOT_FOUND);
  // The length of the last reply moved too: tokens_read counts against it
  // there (all 10 read: accepted; 11: more than the reply).
  v1::GenerateRequest over = Text("moving", " next", 3, v1::APPEND);
  over.set_tokens_read(11);
  EXPECT_EQ(Generate(d.get(), over).status.error_code(), grpc::INVALID_ARGUMENT);
  v1::GenerateRequest next = Text("moving", " next question", 10, v1::APPEND);
  next.set_tokens_read(10);
  Turn moved = Generate(d.get(), next);
  Turn ref = Generate(s.get(), Text("reference", " next question", 10, v1::APPEND));
  ASSERT_TRUE(moved.status.ok()) << moved.status.error_message();
  ASSERT_TRUE(ref.status.ok());
  EXPECT_EQ(moved.tokens, ref.tokens);
  // The target reused the moved pages instead of recomputing.
  EXPECT_EQ(moved.final.usage().cached_tokens(), ref.final.usage().cached_tokens());
  EXPECT_GT(moved.final.usage().cached_tokens(), 300);

  // A migration to a dead address fails and leaves the session where it was.
  EXPECT_FALSE(migrate("reference", "127.0.0.1:1", &unused).ok());
  EXPECT_TRUE(Generate(s.get(), Text("reference", " still here", 2, v1::APPEND)).status.ok());
  // A target that already holds the id (here: the source itself) refuses the
  // import, and the caller hears the target's reason, not a CANCELLED.
  const grpc::Status self_st = migrate("reference", src->grpc_address(), &unused);
  EXPECT_EQ(self_st.error_code(), grpc::ALREADY_EXISTS) << self_st.error_message();
  EXPECT_THAT(self_st.error_message(), HasSubstr("the session stays here"));
  EXPECT_TRUE(Generate(s.get(), Text("reference", " and still", 2, v1::APPEND)).status.ok());

  // A pinned session whose pin the target's quota cannot take stays here, pinned,
  // and the target never announces it: it refuses before the commit (it used to
  // commit, then drop it, and its watchers saw the session placed, then dropped).
  auto small = StartWorker({"--worker_id=small", "--tenant_max_pinned_pages=1"});
  ASSERT_NE(small, nullptr);
  auto small_stub = v1::Worker::NewStub(small->channel());
  ASSERT_TRUE(pin("reference").ok());
  grpc::Status quota_st;
  const std::vector<std::string> announced = SessionsAnnouncedBy(
      small_stub.get(), [&] { quota_st = migrate("reference", small->grpc_address(), &unused); });
  EXPECT_EQ(quota_st.error_code(), grpc::RESOURCE_EXHAUSTED) << quota_st.error_message();
  EXPECT_THAT(quota_st.error_message(), HasSubstr("the session stays here"));
  EXPECT_THAT(quota_st.error_message(), HasSubstr("would pin"));
  EXPECT_THAT(announced, Not(Contains("reference")));
  {
    grpc::ClientContext c;
    v1::SessionRequest gr;
    gr.set_session_id("reference");
    v1::SessionInfo info;
    ASSERT_TRUE(s->GetSession(&c, gr, &info).ok());
    EXPECT_TRUE(info.pinned());
  }
  {
    grpc::ClientContext c;
    v1::ListSessionsResponse listed;
    ASSERT_TRUE(
        v1::Worker::NewStub(small->channel())->ListSessions(&c, v1::ListSessionsRequest(), &listed).ok());
    ASSERT_EQ(listed.sessions_size(), 1);  // the probe's
    EXPECT_EQ(listed.sessions(0).session_id(), "probe");
  }
}

// A pinned session whose pages the target's tier 0 cannot hold now (another
// import's staged pages hold it; a running request would too) is refused before
// the import commits: the source keeps it pinned, and the target never announces
// it. It used to commit, fail the pin's restore, then drop it: its watchers saw
// the session placed, offloaded and dropped (qa31, with a running request).
// (A tier 0 that pinned sessions hold for good was refused at the commit already.)
TEST_F(WorkerTest, APinnedImportThatTier0CannotHoldNowIsRefusedBeforeItsCommit) {
  auto src = StartWorker({"--worker_id=src"});
  // 12 pages of the tiny model (16 tokens each), as OffloadUnderPressureKeepsOutputIdentical.
  auto dst =
      StartWorker({"--worker_id=dst", "--tier0_bytes=" + std::to_string(12 * 16 * 2 * 2 * 2 * 16 * 2)});
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  auto s = v1::Worker::NewStub(src->channel());
  auto d = v1::Worker::NewStub(dst->channel());
  // Another session's import, held before its commit, stages most of tier 0.
  ASSERT_TRUE(Generate(s.get(), Text("filler", std::string(140, 'f'), 4)).status.ok());
  ImportUpToCommit filler(s.get(), "filler", d.get());
  ASSERT_TRUE(filler.ok());
  ASSERT_TRUE(testing::WaitUntil([&] { return StagedDevicePages(*dst) >= 9; }));
  ASSERT_TRUE(Generate(s.get(), Text("kept", std::string(100, 'k'), 4)).status.ok());
  {
    grpc::ClientContext c;
    v1::PinSessionRequest pr;
    pr.set_session_id("kept");
    pr.set_pinned(true);
    v1::SessionInfo info;
    ASSERT_TRUE(s->PinSession(&c, pr, &info).ok());
    ASSERT_GT(info.pages_device(), 3) << "the moving session would fit what the filler leaves";
  }

  grpc::Status st;
  const std::vector<std::string> announced = SessionsAnnouncedBy(d.get(), [&] {
    grpc::ClientContext c;
    v1::MigrateSessionRequest req;
    req.set_session_id("kept");
    req.set_target_address(dst->grpc_address());
    v1::MigrateSessionResponse resp;
    st = s->MigrateSession(&c, req, &resp);
  });
  filler.Cancel();
  EXPECT_EQ(st.error_code(), grpc::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("tier-0 pages"));
  EXPECT_THAT(st.error_message(), HasSubstr("the session stays here"));
  EXPECT_THAT(announced, Not(Contains("kept")));
  {
    grpc::ClientContext c;
    v1::SessionRequest gr;
    gr.set_session_id("kept");
    v1::SessionInfo info;
    ASSERT_TRUE(s->GetSession(&c, gr, &info).ok());
    EXPECT_TRUE(info.pinned());
  }
  const Turn next = Generate(s.get(), Text("kept", " and on", 2, v1::APPEND));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_GE(next.final.usage().cached_tokens(), 100);
}

// A chat reply cut at max_tokens has no end of turn; the next APPEND closes it
// first, and one with tokens_read = 0 goes back to before its request and
// closes the reply before it again. A moved session does the same on its new
// worker: both flags travel in the Commit (the target used to take the first
// from the last reply alone and the second as false, so a tokens_read = 0
// turn after a move ran on a conversation without that end of turn).
TEST_F(WorkerTest, AMovedSessionClosesRepliesCutShortAsItsSourceWould) {
  auto src = StartWorker({"--worker_id=src"}, /*tiny=*/false);
  auto dst = StartWorker({"--worker_id=dst"}, /*tiny=*/false);
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  auto s = v1::Worker::NewStub(src->channel());
  auto d = v1::Worker::NewStub(dst->channel());
  auto chat = [](const std::string& session, v1::Mode mode, const std::string& text) {
    v1::GenerateRequest r;
    r.set_session_id(session);
    r.set_mode(mode);
    auto* m = r.mutable_input()->mutable_chat()->add_messages();
    m->set_role("user");
    m->set_content(text);
    r.mutable_sampling()->set_temperature(0);
    r.mutable_sampling()->set_max_tokens(6);
    r.mutable_sampling()->set_ignore_eos(true);  // every reply is cut: no end of turn
    return r;
  };
  ASSERT_TRUE(Generate(s.get(), chat("s", v1::FULL_CONTEXT, "Name three colours.")).status.ok());
  ASSERT_TRUE(Generate(s.get(), chat("s", v1::APPEND, "And three animals?")).status.ok());
  {
    grpc::ClientContext c;
    v1::ForkSessionRequest fr;
    fr.set_session_id("s");
    fr.set_new_session_id("ref");
    v1::SessionInfo info;
    ASSERT_TRUE(s->ForkSession(&c, fr, &info).ok());
  }
  {
    grpc::ClientContext c;
    v1::MigrateSessionRequest mr;
    mr.set_session_id("s");
    mr.set_target_address(dst->grpc_address());
    v1::MigrateSessionResponse resp;
    const grpc::Status st = s->MigrateSession(&c, mr, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  // The target exports both flags as it took them.
  {
    grpc::ClientContext c;
    v1::ExportSessionRequest er;
    er.set_session_id("s");
    auto reader = d->ExportSession(&c, er);
    v1::SessionChunk chunk;
    bool committed = false;
    while (reader->Read(&chunk)) {
      if (!chunk.has_commit()) continue;
      committed = true;
      EXPECT_TRUE(chunk.commit().has_reply_open() && chunk.commit().reply_open());
      EXPECT_TRUE(chunk.commit().has_reply_open_before() && chunk.commit().reply_open_before());
    }
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_TRUE(committed);
  }
  // The client read none of the last reply: it resends its turn.
  v1::GenerateRequest resent = chat("s", v1::APPEND, "And three animals?");
  resent.set_tokens_read(0);
  v1::GenerateRequest resent_ref = resent;
  resent_ref.set_session_id("ref");
  Turn moved = Generate(d.get(), resent);
  Turn ref = Generate(s.get(), resent_ref);
  ASSERT_TRUE(moved.status.ok()) << moved.status.error_message();
  ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();
  EXPECT_EQ(moved.final.usage().prompt_tokens(), ref.final.usage().prompt_tokens());
  EXPECT_EQ(moved.tokens, ref.tokens);
  // And the next turn closes the new cut reply on both.
  Turn next = Generate(d.get(), chat("s", v1::APPEND, "And three trees?"));
  Turn next_ref = Generate(s.get(), chat("ref", v1::APPEND, "And three trees?"));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.final.usage().prompt_tokens(), next_ref.final.usage().prompt_tokens());
  EXPECT_EQ(next.tokens, next_ref.tokens);
}

// Every MigrateSession runs on a background thread of the source, and every
// migration opens a channel to its target: a session moved back and forth many
// times leaves neither worker with more threads than it had.
TEST_F(WorkerTest, ManyMigrationsLeaveNoThreadsBehind) {
  auto a = StartWorker({"--worker_id=a"});
  auto b = StartWorker({"--worker_id=b"});
  ASSERT_TRUE(a && b);
  auto sa = v1::Worker::NewStub(a->channel());
  auto sb = v1::Worker::NewStub(b->channel());
  ASSERT_TRUE(Generate(sa.get(), Text("ball", std::string(100, 'b'), 3)).status.ok());
  // One round first: gRPC's own pools start their threads.
  auto migrate = [](v1::Worker::Stub* from, const std::string& to) {
    grpc::ClientContext c;
    v1::MigrateSessionRequest req;
    req.set_session_id("ball");
    req.set_target_address(to);
    v1::MigrateSessionResponse resp;
    return from->MigrateSession(&c, req, &resp);
  };
  ASSERT_TRUE(migrate(sa.get(), b->grpc_address()).ok());
  ASSERT_TRUE(migrate(sb.get(), a->grpc_address()).ok());
  const pid_t pa = a->process().pid(), pb = b->process().pid();
  const int threads_a = testing::ThreadCount(pa), threads_b = testing::ThreadCount(pb);
  ASSERT_GT(threads_a, 0);
  for (int i = 0; i < 40; ++i) {
    grpc::Status there = migrate(sa.get(), b->grpc_address());
    ASSERT_TRUE(there.ok()) << i << ": " << there.error_message();
    grpc::Status back = migrate(sb.get(), a->grpc_address());
    ASSERT_TRUE(back.ok()) << i << ": " << back.error_message();
  }
  // A leak would leave one thread per migration (40). gRPC's own pools may grow
  // by a few under load: a clean-clone CI run beside other work saw +3 on the
  // target (21 against 18) with the bound at +2.
  EXPECT_LE(testing::ThreadCount(pa), threads_a + 8) << "40 migrations left threads on the source";
  EXPECT_LE(testing::ThreadCount(pb), threads_b + 8);
  EXPECT_TRUE(Generate(sa.get(), Text("ball", " still whole?", 2, v1::APPEND)).status.ok());
}

TEST_F(WorkerTest, DrainMovesSessionsAndExits) {
  auto src = StartWorker({"--worker_id=leaving"});
  auto dst = StartWorker({"--worker_id=staying"});
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  auto s = v1::Worker::NewStub(src->channel());
  auto d = v1::Worker::NewStub(dst->channel());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(Generate(s.get(), Text("d" + std::to_string(i), std::string(50 + i, 'd'), 4)).status.ok());
  }
  grpc::ClientContext c;
  v1::DrainRequest dr;
  dr.add_targets(dst->grpc_address());
  v1::DrainResponse resp;
  ASSERT_TRUE(s->Drain(&c, dr, &resp).ok());
  EXPECT_EQ(resp.sessions_migrated(), 3);
  EXPECT_EQ(resp.sessions_dropped(), 0);
  auto status = src->process().Wait(absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << "drained worker did not exit";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  for (int i = 0; i < 3; ++i) {
    Turn t = Generate(d.get(), Text("d" + std::to_string(i), " after drain", 2, v1::APPEND));
    EXPECT_TRUE(t.status.ok()) << t.status.error_message();
    EXPECT_GT(t.final.usage().cached_tokens(), 40);
  }
}

// A SIGTERMed worker whose drain has nothing left to do exits at once, also
// while a client holds an idle connection to it that it does not poll (this
// test's channel): gRPC closes such a connection only when its client reads
// the GOAWAY, or when the server's stop gives up on it. Before, the worker
// waited for that client's next backup poll (5.1 s here) or out
// --shutdown_deadline (10 s in each SIGTERM test of the router's); now 1.1 s
// (1.3 s under ASan).
TEST_F(WorkerTest, ASigtermedWorkerDoesNotWaitForIdleClientConnections) {
  auto w = StartWorker({"--shutdown_deadline=60s"});
  ASSERT_NE(w, nullptr);
  // Without keepalive pings, whose timers would read the GOAWAY.
  auto channel = grpc::CreateChannel(w->grpc_address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Worker::NewStub(channel);
  ASSERT_TRUE(Generate(stub.get(), Text("idle", "a turn", 2)).status.ok());
  const absl::Time start = absl::Now();
  w->process().Signal(SIGTERM);
  auto status = w->process().Wait(absl::Seconds(50));
  ASSERT_TRUE(status.ok()) << "did not exit within 50 s of SIGTERM";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
}

// A worker told to stop while a session's import into it is in flight waits
// for that import, refuses its commit (UNAVAILABLE "worker is draining": the
// exporter keeps the session and tries elsewhere), then exits. Before, it
// counted no session, stopped, and the import could commit into the exiting
// process: the session was lost (qa27, a router's move for room onto a worker
// SIGTERMed 0.1 s later: 4 of 4 runs).
TEST_F(WorkerTest, AWorkerToldToStopRefusesTheCommitOfAnImportInFlight) {
  auto src = StartWorker({"--worker_id=src"});
  auto dst = StartWorker({"--worker_id=dst", "--shutdown_deadline=30s"});
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  auto s = v1::Worker::NewStub(src->channel());
  auto d = v1::Worker::NewStub(dst->channel());
  ASSERT_TRUE(Generate(s.get(), Text("s", std::string(100, 'm'), 4)).status.ok());
  ImportUpToCommit import(s.get(), "s", d.get());
  ASSERT_TRUE(import.ok());
  // Under way there: the pages are staged.
  ASSERT_TRUE(testing::WaitUntil([&] { return StagedDevicePages(*dst) > 0; }));
  dst->process().Signal(SIGTERM);
  ASSERT_TRUE(testing::WaitUntil([&] {
    auto ready = testing::HealthCheck(dst->channel(), "readiness");
    return ready.ok() && *ready == "NOT_SERVING";
  }));
  const grpc::Status st = import.Commit();
  EXPECT_EQ(st.error_code(), grpc::UNAVAILABLE) << st.error_message();
  EXPECT_EQ(st.error_message(), kWorkerDrainingMessage);
  auto status = dst->process().Wait(absl::Seconds(20));
  ASSERT_TRUE(status.ok()) << "did not exit after refusing the import";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  // The session is still the source's, whole.
  Turn next = Generate(s.get(), Text("s", " more", 2, v1::APPEND));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_GE(next.final.usage().cached_tokens(), 100);
}

// A drain moves a pinned session whose pin the target's quota cannot take
// unpinned, instead of leaving it on a worker that is about to exit (a
// migration that is not a drain refuses it and leaves it where it was,
// MigrationMovesPagesAndContinuesIdentically). A black-box test lost such a
// session: the drain reported it dropped, and the worker exited with it.
TEST_F(WorkerTest, DrainMovesAPinnedSessionOverTheTargetsPinQuotaUnpinned) {
  auto src = StartWorker({"--worker_id=leaving"});
  auto dst = StartWorker({"--worker_id=small", "--tenant_max_pinned_pages=1"});
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  auto s = v1::Worker::NewStub(src->channel());
  auto d = v1::Worker::NewStub(dst->channel());
  const Turn first = Generate(s.get(), Text("kept", std::string(80, 'k'), 4));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  {
    grpc::ClientContext c;
    v1::PinSessionRequest pr;
    pr.set_session_id("kept");
    pr.set_pinned(true);
    v1::SessionInfo info;
    const grpc::Status st = s->PinSession(&c, pr, &info);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_TRUE(info.pinned());
  }
  grpc::ClientContext c;
  v1::DrainRequest dr;
  dr.add_targets(dst->grpc_address());
  v1::DrainResponse resp;
  ASSERT_TRUE(s->Drain(&c, dr, &resp).ok());
  EXPECT_EQ(resp.sessions_migrated(), 1);
  EXPECT_EQ(resp.sessions_dropped(), 0);
  auto status = src->process().Wait(absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << "drained worker did not exit";
  {
    grpc::ClientContext gc;
    v1::SessionRequest gr;
    gr.set_session_id("kept");
    v1::SessionInfo info;
    const grpc::Status st = d->GetSession(&gc, gr, &info);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_FALSE(info.pinned()) << "over the target's quota, the pin stays behind";
    EXPECT_GE(info.tokens_cached(), 80);
  }
  const Turn t = Generate(d.get(), Text("kept", " after drain", 2, v1::APPEND));
  EXPECT_TRUE(t.status.ok()) << t.status.error_message();
  EXPECT_GT(t.final.usage().cached_tokens(), 80);
}

// The CPU kernel level comes from --cpu_kernel_level, else from
// $KVCACHE_CPU_KERNEL_LEVEL, else the best the CPU has; kvcache_worker_info says
// which one runs. A name that is not a level stops the worker at start (exit 2)
// with an error naming where the value came from.
TEST_F(WorkerTest, StartFlagsKernelLevelFromFlagOrEnvironmentAndHelp) {
  const char* inherited = std::getenv("KVCACHE_CPU_KERNEL_LEVEL");
  const std::string saved = inherited != nullptr ? inherited : "";
  auto info_line = [](testing::ServerUnderTest& w) {
    auto body = testing::HttpGet(w.metrics_port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    for (absl::string_view line : absl::StrSplit(body.ok() ? *body : "", '\n')) {
      if (absl::StartsWith(line, "kvcache_worker_info{")) return std::string(line);
    }
    return std::string("no kvcache_worker_info");
  };
  // The flag wins over the environment (which is not even read).
  ASSERT_EQ(setenv("KVCACHE_CPU_KERNEL_LEVEL", "no-such-level", 1), 0);
  {
    auto w = StartWorker({"--cpu_kernel_level=scalar"});
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(info_line(*w), R"(kvcache_worker_info{cpu_kernel_level="scalar",device="cpu"} 1)");
    auto stub = v1::Worker::NewStub(w->channel());
    Turn t = Generate(stub.get(), Text("", "scalar kernels", 6));
    ASSERT_TRUE(t.status.ok()) << t.status.error_message();
    EXPECT_EQ(t.tokens.size(), 6u);
  }
  // An unusable environment value without the flag: refused at start.
  const std::string worker = testing::BinaryPath("worker/kvcache-worker") + " --allow_unauthenticated";
  auto [env_code, env_out] = testing::RunToExit(worker);
  EXPECT_EQ(env_code, 2) << env_out;
  EXPECT_THAT(env_out, HasSubstr("$KVCACHE_CPU_KERNEL_LEVEL"));
  EXPECT_THAT(env_out, HasSubstr("want auto, avx512, avx2 or scalar"));
  EXPECT_THAT(env_out, ::testing::Not(HasSubstr("listening")));
  // The environment alone sets the level.
  ASSERT_EQ(setenv("KVCACHE_CPU_KERNEL_LEVEL", "scalar", 1), 0);
  {
    auto w = StartWorker({});
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(info_line(*w), R"(kvcache_worker_info{cpu_kernel_level="scalar",device="cpu"} 1)");
  }
  // auto: the best level this CPU has (never scalar on an x86-64 with AVX2).
  ASSERT_EQ(setenv("KVCACHE_CPU_KERNEL_LEVEL", "auto", 1), 0);
  {
    auto w = StartWorker({});
    ASSERT_NE(w, nullptr);
    EXPECT_THAT(info_line(*w), ::testing::AnyOf(HasSubstr(R"(cpu_kernel_level="avx512")"),
                                                HasSubstr(R"(cpu_kernel_level="avx2")"),
                                                HasSubstr(R"(cpu_kernel_level="scalar")")));
  }
  if (saved.empty()) {
    unsetenv("KVCACHE_CPU_KERNEL_LEVEL");
  } else {
    setenv("KVCACHE_CPU_KERNEL_LEVEL", saved.c_str(), 1);
  }
  auto [flag_code, flag_out] = testing::RunToExit(worker + " --cpu_kernel_level=sse4");
  EXPECT_EQ(flag_code, 2) << flag_out;
  EXPECT_THAT(flag_out, HasSubstr("--cpu_kernel_level: cpu kernel level 'sse4'"));
  // --help lists the worker's own flags and the shared server ones (Abseil's
  // default listed none: no source file is named like the binary).
  auto [help_code, help_out] = testing::RunToExit(worker + " --help");
  EXPECT_THAT(help_out, HasSubstr("--cpu_kernel_level"));
  EXPECT_THAT(help_out, HasSubstr("--tier0_bytes"));
  EXPECT_THAT(help_out, HasSubstr("--listen"));
  EXPECT_THAT(help_out, ::testing::Not(HasSubstr("listening")));
}

// The worker and kvcache-model-info (which sizes against the worker's flags)
// refuse the same bad KV budget flags with the same reason, before any work.
TEST_F(WorkerTest, WorkerAndModelInfoRefuseTheSameBadBudgetFlags) {
  const std::string worker = testing::BinaryPath("worker/kvcache-worker") + " --allow_unauthenticated";
  const std::string info = testing::BinaryPath("common/gguf/kvcache-model-info");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--kv_dtype=f8", "--kv_dtype='f8': want f16, bf16 or f32"},
      {"--page_tokens=0", "--page_tokens=0: must be in [1, 1024]"},
      {"--page_tokens=-3", "--page_tokens=-3: must be in [1, 1024]"},
      {"--page_tokens=100000", "--page_tokens=100000: must be in [1, 1024]"},
      {"--tier0_bytes=-5", "--tier0_bytes=-5: must be positive"},
      {"--tier1_bytes=-1", "--tier1_bytes=-1: must not be negative"},
  };
  for (const auto& [flag, reason] : cases) {
    for (const std::string& binary : {worker, info}) {
      auto [code, out] = testing::RunToExit(binary + " --model=" + *tiny_model_ + " " + flag);
      EXPECT_NE(code, 0) << binary << " " << flag << ": " << out;
      EXPECT_THAT(out, HasSubstr(reason)) << binary << " " << flag;
      EXPECT_THAT(out, ::testing::Not(HasSubstr("listening"))) << binary << " " << flag;
    }
  }
  auto [code, out] =
      testing::RunToExit(info + " --model=" + *tiny_model_ + " --kv_dtype=bf16 --page_tokens=32");
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("--page_tokens=32 --kv_dtype=bf16"));
}

// A weight type no kernel decodes (Q3_K: llama.cpp's Q2_K and Q3_K_S files hold
// it): the worker refuses the file at start, and kvcache-model-info marks the
// type and exits 1 with the same reason. The worker used to start, say it was
// ready, and fail every request with INTERNAL.
TEST_F(WorkerTest, WorkerAndModelInfoRefuseAWeightTypeNoKernelDecodes) {
  gguf::TinyLlamaOptions o;
  o.n_embd = 256;  // a whole K-quant super-block per row
  o.n_ff = 512;
  o.type_overrides = {{"ffn_down.weight", gguf::GgmlType::kQ3_K}};
  const std::string path = ::testing::TempDir() + "/kvcache_worker_test_q3_k.gguf";
  ASSERT_TRUE(gguf::WriteTinyLlama(o, path).ok());
  const std::string reason = "tensor blk.0.ffn_down.weight: tensor type q3_K is not supported";
  auto [code, out] = testing::RunToExit(testing::BinaryPath("worker/kvcache-worker") +
                                        " --allow_unauthenticated --model=" + path);
  EXPECT_NE(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("UNIMPLEMENTED: " + reason));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("listening")));
  auto [info_code, info] =
      testing::RunToExit(testing::BinaryPath("common/gguf/kvcache-model-info") + " --model=" + path);
  EXPECT_EQ(info_code, 1) << info;
  EXPECT_THAT(info, HasSubstr("NOT SUPPORTED"));
  EXPECT_THAT(info, HasSubstr("worker:            refuses this file: UNIMPLEMENTED: " + reason));
  std::remove(path.c_str());
}

// KV budgets given that the worker's memory limit cannot hold
// (--memory_limit_bytes, else the container's cgroup limit) stop it at start
// with the sum spelled out, instead of the OOM killer ending it, and its
// sessions, at peak load; budgets left at their defaults shrink to fit.
TEST_F(WorkerTest, KvBudgetsFitItsMemoryLimit) {
  const std::string worker = testing::BinaryPath("worker/kvcache-worker") +
                             " --allow_unauthenticated --model=" + *tiny_model_ +
                             " --memory_limit_bytes=1073741824";
  auto [code, out] = testing::RunToExit(worker + " --tier0_bytes=268435456 --tier1_bytes=1073741824");
  EXPECT_EQ(code, 2) << out;
  EXPECT_THAT(
      out,
      HasSubstr("--tier0_bytes=268435456 (tier 0 is host memory on the CPU) + --tier1_bytes=1073741824"));
  EXPECT_THAT(out, HasSubstr("above this worker's memory limit of 1073741824 bytes (--memory_limit_bytes)"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("listening")));
  // A budget given at its default value is given too: refused, not shrunk.
  {
    auto [given_code, given] = testing::RunToExit(worker + " --tier0_bytes=1073741824 --tier1_bytes=0");
    EXPECT_EQ(given_code, 2) << given;
    EXPECT_THAT(given, HasSubstr("--tier0_bytes=1073741824")) << given;
  }
  // kvcache-model-info prints the same sum for the same flags.
  auto [info_code, info] =
      testing::RunToExit(testing::BinaryPath("common/gguf/kvcache-model-info") + " --model=" + *tiny_model_ +
                         " --tier0_bytes=268435456 --tier1_bytes=1073741824");
  ASSERT_EQ(info_code, 0) << info;
  const size_t at = info.find("host memory: ");
  ASSERT_NE(at, std::string::npos) << info;
  const std::string sum = info.substr(at + 13, info.find(' ', at + 13) - (at + 13));
  EXPECT_THAT(out, HasSubstr(" = " + sum + " bytes")) << info;

  // Within the limit it serves as given; a negative limit turns the check off.
  for (const char* limit : {"--memory_limit_bytes=1073741824", "--memory_limit_bytes=-1"}) {
    auto w = StartWorker({limit, "--tier0_bytes=268435456", "--tier1_bytes=268435456"});
    ASSERT_NE(w, nullptr) << limit;
    auto stub = v1::Worker::NewStub(w->channel());
    EXPECT_TRUE(Generate(stub.get(), Text("", "within the limit", 2)).status.ok()) << limit;
    auto metrics = testing::HttpGet(w->metrics_port(), "/metrics");
    ASSERT_TRUE(metrics.ok());
    EXPECT_THAT(*metrics, HasSubstr("kvcache_kv_capacity_bytes{tier=\"host\"} 268")) << limit;
  }

  // The defaults (1 GiB of tier 0, 4 GiB of tier 1) shrink: tier 1 to nothing,
  // tier 0 to what is left.
  auto w = StartWorker({"--memory_limit_bytes=1073741824"});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  EXPECT_TRUE(Generate(stub.get(), Text("", "defaults that fit", 2)).status.ok());
  auto metrics = testing::HttpGet(w->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_THAT(*metrics, HasSubstr("kvcache_kv_capacity_bytes{tier=\"host\"} 0\n"));
  EXPECT_THAT(*metrics, ::testing::Not(HasSubstr("kvcache_kv_capacity_bytes{tier=\"device\"} 1073741824")));
}

TEST_F(WorkerTest, MetricsPassPromtool) {
  auto w = StartWorker({});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  ASSERT_TRUE(Generate(stub.get(), Text("", "metrics please", 4)).status.ok());
  auto body = testing::HttpGet(w->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  for (const char* name :
       {"kvcache_kv_pages", "kvcache_kv_usage_ratio", "kvcache_prefix_query_tokens_total", "kvcache_sessions",
        "kvcache_requests_total", "kvcache_time_to_first_token_seconds",
        "kvcache_inter_token_latency_seconds", "kvcache_step_duration_seconds", "kvcache_batch_size",
        "kvcache_requests_running", "kvcache_step_part_seconds_total"}) {
    EXPECT_THAT(*body, HasSubstr(std::string("# TYPE ") + name)) << name;
  }
  // The CPU runner times a one-sequence step's products and attention apart.
  for (const char* part : {"forward", "products", "attention"}) {
    const std::string prefix = absl::StrCat("kvcache_step_part_seconds_total{part=\"", part, "\"} ");
    const size_t at = body->find(prefix);
    ASSERT_NE(at, std::string::npos) << part;
    EXPECT_GT(std::stod(body->substr(at + prefix.size())), 0.0) << part;
  }
  // promtool reads the exposition from stdin.
  const std::string path = ::testing::TempDir() + "/kvcache_metrics.txt";
  std::ofstream(path) << *body;
  auto promtool =
      testing::ChildProcess::Start({"/bin/sh", "-c", "promtool check metrics < " + path + " 2>&1"});
  ASSERT_TRUE(promtool.ok());
  auto out = (*promtool)->WaitForLine("", absl::Seconds(30));
  auto exit = (*promtool)->Wait(absl::Seconds(30));
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << (*promtool)->output();
  std::remove(path.c_str());
}

// kvcache_kv_usage_ratio counts the pages sessions and steps hold, not the
// prefix cache's unreferenced pages (taken back on demand): an idle worker whose
// cache remembers a prompt is not full, and KvCacheDeviceCacheFull stays quiet.
TEST_F(WorkerTest, UsageRatioLeavesOutUnreferencedPrefixPages) {
  auto w = StartWorker({});
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  std::string prompt;
  for (int i = 0; i < 40; ++i) prompt += absl::StrCat("word", i, " ");
  ASSERT_TRUE(Generate(stub.get(), Text("", prompt, 2)).status.ok());  // ephemeral: closed at the end
  auto body = testing::HttpGet(w->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  auto value = [&](absl::string_view series) -> double {
    for (absl::string_view line : absl::StrSplit(*body, '\n')) {
      if (absl::ConsumePrefix(&line, series) && absl::ConsumePrefix(&line, " ")) {
        double v = -1;
        EXPECT_TRUE(absl::SimpleAtod(line, &v)) << line;
        return v;
      }
    }
    ADD_FAILURE() << "no " << series << " in " << *body;
    return -1;
  };
  EXPECT_GT(value("kvcache_kv_pages{state=\"cached\",tier=\"device\"}"), 0);
  EXPECT_EQ(value("kvcache_kv_usage_ratio{tier=\"device\"}"), 0);
}

TEST_F(WorkerTest, SmolLm2MultiTurnReusesTheConversation) {
  auto w = StartWorker({"--threads=2"}, /*tiny=*/false);
  ASSERT_NE(w, nullptr);
  auto stub = v1::Worker::NewStub(w->channel());
  v1::GenerateRequest r1;
  r1.set_session_id("alice");
  auto* chat = r1.mutable_input()->mutable_chat();
  auto* m = chat->add_messages();
  m->set_role("user");
  m->set_content("Write one sentence about the sea, and mention a lighthouse and a storm in it.");
  r1.mutable_sampling()->set_max_tokens(24);
  Turn t1 = Generate(stub.get(), r1);
  ASSERT_TRUE(t1.status.ok()) << t1.status.error_message();
  EXPECT_FALSE(t1.text.empty());

  v1::GenerateRequest r2;
  r2.set_session_id("alice");
  r2.set_mode(v1::APPEND);
  auto* m2 = r2.mutable_input()->mutable_chat()->add_messages();
  m2->set_role("user");
  m2->set_content("Now say it shorter.");
  r2.mutable_sampling()->set_max_tokens(16);
  Turn t2 = Generate(stub.get(), r2);
  ASSERT_TRUE(t2.status.ok()) << t2.status.error_message();
  const auto& u1 = t1.final.usage();
  const auto& u2 = t2.final.usage();
  // Turn 2 reuses turn 1's whole context (all but the last sampled token).
  EXPECT_GE(u2.cached_tokens(), u1.prompt_tokens() + u1.generated_tokens() - 1);
  EXPECT_LT(u2.prompt_tokens() - u2.cached_tokens(), u1.prompt_tokens());
  std::printf("turn 1: prompt %d, cached %d, ttft %.1f ms | turn 2: prompt %d, cached %d, ttft %.1f ms\n",
              u1.prompt_tokens(), u1.cached_tokens(), u1.time_to_first_token_us() / 1000.0,
              u2.prompt_tokens(), u2.cached_tokens(), u2.time_to_first_token_us() / 1000.0);
  // No timing assertion here (CI shares its cores: turn 2 once took 127 ms
  // against turn 1's 105 ms); worker_bench measures cached against cold TTFT.
}

// The models users deploy, end to end: tiny random-weight decoders of each
// architecture carrying a real vocabulary and chat template from llama.cpp's
// models/ folder (fetched by scripts/setup.sh): Qwen 2.5 (qwen2 + its BPE and
// ChatML), Qwen 3 (qwen3 + the same vocabulary), Llama 3.1 (llama with
// rope_freqs + llama-bpe and the Llama 3 template), Llama 2 / Mistral (llama +
// SentencePiece). Each worker serves a chat turn and an APPEND turn that reuses
// the whole conversation from cache, greedily and reproducibly.
TEST_F(WorkerTest, RealVocabulariesServeMultiTurnChat) {
  struct Case {
    const char* arch;
    const char* vocab;
    const char* chat_template;  // tests/data/chat_templates/<name>.jinja
  };
  for (const Case& c :
       {Case{"qwen2", "qwen2", "qwen2.5-7b-instruct"}, Case{"qwen3", "qwen2", "qwen3-0.6b"},
        Case{"llama", "llama-bpe", "llama-3.1-8b-instruct"}, Case{"llama", "llama-spm", "mistral-v1"}}) {
    SCOPED_TRACE(absl::StrCat(c.arch, " with the ", c.vocab, " vocabulary"));
    const std::string vocab_path = testing::LlamaCppVocabPath(c.vocab);
    auto vocab = gguf::GgufFile::Open(vocab_path);
    ASSERT_TRUE(vocab.ok()) << vocab.status() << testing::kLlamaCppVocabHint;
    gguf::TinyLlamaOptions o;
    o.architecture = c.arch;
    o.n_ctx = 1024;
    o.vocab = vocab->get();
    o.rope_freqs = std::string(c.vocab) == "llama-bpe";
    o.head_dim = std::string(c.arch) == "qwen3" ? 32 : 0;
    o.weight_type = gguf::GgmlType::kQ8_0;  // a 150k-token embedding stays small
    auto tmpl = testing::ReadFileBytes(
        absl::StrCat(testing::SourceDir(), "/tests/data/chat_templates/", c.chat_template, ".jinja"));
    ASSERT_TRUE(tmpl.ok()) << tmpl.status();
    o.chat_template = *tmpl;
    const std::string path =
        absl::StrCat(::testing::TempDir(), "/kvcache_real_vocab_", c.arch, "_", c.vocab, ".gguf");
    ASSERT_TRUE(gguf::WriteTinyLlama(o, path).ok());
    std::vector<std::string> args = {"--model=" + path, "--threads=1", "--load_report_interval=100ms"};
    auto w = testing::ServerUnderTest::Start(testing::BinaryPath("worker/kvcache-worker"), args);
    ASSERT_TRUE(w.ok()) << w.status();
    auto stub = v1::Worker::NewStub((*w)->channel());

    auto chat_turn = [&](const std::string& session, v1::Mode mode, bool with_system,
                         const std::string& text) {
      v1::GenerateRequest r;
      r.set_session_id(session);
      r.set_mode(mode);
      auto* chat = r.mutable_input()->mutable_chat();
      if (with_system) {
        auto* sys = chat->add_messages();
        sys->set_role("system");
        sys->set_content("You answer in one short sentence.");
      }
      auto* m = chat->add_messages();
      m->set_role("user");
      m->set_content(text);
      r.mutable_sampling()->set_max_tokens(6);
      r.mutable_sampling()->set_ignore_eos(true);  // random weights may pick an end token at once
      return Generate(stub.get(), r);
    };
    const bool system = std::string(c.vocab) != "llama-spm";  // Mistral v1 folds it; keep to user turns
    Turn t1 = chat_turn("s", v1::FULL_CONTEXT, system, "What is the capital of France? Réponds en français.");
    ASSERT_TRUE(t1.status.ok()) << t1.status.error_message();
    EXPECT_EQ(t1.tokens.size(), 6u);
    Turn t2 = chat_turn("s", v1::APPEND, false, "And of Germany?");
    ASSERT_TRUE(t2.status.ok()) << t2.status.error_message();
    const auto& u1 = t1.final.usage();
    const auto& u2 = t2.final.usage();
    EXPECT_GE(u2.cached_tokens(), u1.prompt_tokens() + u1.generated_tokens() - 1);
    EXPECT_GT(u2.prompt_tokens(), u2.cached_tokens());
    // The same conversation in another session: the same tokens.
    Turn r1 =
        chat_turn("twin", v1::FULL_CONTEXT, system, "What is the capital of France? Réponds en français.");
    // Plain text through the same tokenizer.
    Turn text = Generate(stub.get(), Text("", "Once upon a time, über alles 1234", 6));
    ASSERT_TRUE(text.status.ok()) << text.status.error_message();
    EXPECT_EQ(text.tokens.size(), 6u);
    Turn r2 = chat_turn("twin", v1::APPEND, false, "And of Germany?");
    EXPECT_EQ(r1.tokens, t1.tokens);
    EXPECT_EQ(r2.tokens, t2.tokens);

    // Turn 1 was cut by max_tokens, without its end-of-turn token: the APPEND
    // turn closed it first, so that the session holds what the template renders
    // for the whole conversation (turn 1's prompt, the reply, the end of turn,
    // turn 2), which a FULL_CONTEXT request of those tokens shows. It used to
    // run without the end of turn, one token shorter, on malformed chat.
    auto file = gguf::GgufFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    auto tokenizer = tok::Tokenizer::FromGguf(**file);
    auto chat_template = tok::ChatTemplate::FromGguf(**file);
    ASSERT_TRUE(tokenizer.ok() && chat_template.ok());
    auto chat_of = [&](bool with_system, const std::string& text) {
      v1::Input input;
      if (with_system) {
        auto* sys = input.mutable_chat()->add_messages();
        sys->set_role("system");
        sys->set_content("You answer in one short sentence.");
      }
      auto* m = input.mutable_chat()->add_messages();
      m->set_role("user");
      m->set_content(text);
      return input;
    };
    auto p1 = TokenizeInput(chat_of(system, "What is the capital of France? Réponds en français."), false,
                            **tokenizer, &*chat_template);
    auto p2 = TokenizeInput(chat_of(false, "And of Germany?"), true, **tokenizer, &*chat_template);
    ASSERT_TRUE(p1.ok() && p2.ok());
    tok::EncodeOptions special;
    special.add_special = false;
    special.parse_special = true;
    std::vector<int32_t> whole = *p1;
    whole.insert(whole.end(), t1.tokens.begin(), t1.tokens.end());
    for (int32_t id : (*tokenizer)->Encode(chat_template->EndOfTurn(), special)) whole.push_back(id);
    whole.insert(whole.end(), p2->begin(), p2->end());
    v1::GenerateRequest full = testing::TokensRequest("", whole, 6);
    full.mutable_sampling()->set_ignore_eos(true);
    Turn f = Generate(stub.get(), full);
    ASSERT_TRUE(f.status.ok()) << f.status.error_message();
    EXPECT_EQ(u2.prompt_tokens(), f.final.usage().prompt_tokens());
    EXPECT_EQ(t2.tokens, f.tokens);
    std::remove(path.c_str());
  }
}

}  // namespace
}  // namespace kvcache
