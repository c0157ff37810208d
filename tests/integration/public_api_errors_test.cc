// Every bad request the public API (kvcache-router in front of a real
// kvcache-worker, with bearer-token authentication) can receive, and the status
// code a client gets for it: one table per service. Each case asserts the code
// and a non-empty message; afterwards the router and the worker are still
// healthy, serve a valid request, and the worker holds no page for any of it.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/gguf/tiny_llama.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/generate_client.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

constexpr char kUser[] = "user-secret";
constexpr char kAdmin[] = "ops-secret";
constexpr int kDefaultMaxTokens = 5;

// How a case authenticates.
enum class Auth { kUser, kAdmin, kNone, kUnknown };

void Authorize(grpc::ClientContext* ctx, Auth auth) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  switch (auth) {
    case Auth::kUser:
      ctx->AddMetadata("authorization", absl::StrCat("Bearer ", kUser));
      break;
    case Auth::kAdmin:
      ctx->AddMetadata("authorization", absl::StrCat("Bearer ", kAdmin));
      break;
    case Auth::kUnknown:
      ctx->AddMetadata("authorization", "Bearer not-a-token");
      break;
    case Auth::kNone:
      break;
  }
}

using testing::Reply;

Reply Generate(v1::KvCache::Stub* stub, const v1::GenerateRequest& req, Auth auth = Auth::kUser) {
  const char* token = auth == Auth::kUser      ? kUser
                      : auth == Auth::kAdmin   ? kAdmin
                      : auth == Auth::kUnknown ? "not-a-token"
                                               : "";
  return testing::Generate(stub, req, absl::Seconds(30), token);
}

v1::GenerateRequest Text(const std::string& session, const std::string& text, int max_tokens = 4,
                         v1::Mode mode = v1::FULL_CONTEXT) {
  return testing::TextRequest(session, text, max_tokens, mode);
}

// Free tier-0 pages of a worker, from the snapshot that opens its Watch stream.
int64_t FreeDevicePages(const std::shared_ptr<grpc::Channel>& worker) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::WatchRequest req;
  auto reader = v1::Worker::NewStub(worker)->Watch(&ctx, req);
  v1::WatchEvent ev;
  EXPECT_TRUE(reader->Read(&ev));
  ctx.TryCancel();
  reader->Finish();
  return ev.snapshot().load().pages_free_device();
}

class PublicApiErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = ::testing::TempDir() + "/kvcache_public_api_tiny.gguf";
    gguf::TinyLlamaOptions o;
    o.n_ctx = 1024;
    ASSERT_TRUE(gguf::WriteTinyLlama(o, model_).ok());
    tokens_file_ = ::testing::TempDir() + "/kvcache_public_api_tokens.txt";
    std::ofstream(tokens_file_) << kUser << " tenant-a\n" << kAdmin << " ops admin\n";
    auto w = testing::ServerUnderTest::Start(
        testing::BinaryPath("worker/kvcache-worker"),
        {"--model=" + model_, "--worker_id=w0", "--threads=1", "--load_report_interval=100ms",
         "--max_context=512", "--max_tokens_per_request=100",
         "--default_max_tokens=" + std::to_string(kDefaultMaxTokens),
         "--tier0_bytes=" + std::to_string(64 << 20), "--tier1_bytes=" + std::to_string(64 << 20)});
    ASSERT_TRUE(w.ok()) << w.status();
    worker_ = std::move(*w);
    auto r = testing::ServerUnderTest::Start(
        testing::BinaryPath("router/kvcache-router"),
        {"--workers=" + worker_->grpc_address(), "--model=" + model_, "--health_timeout=2s",
         "--rebalance_interval=0s", "--min_ready_workers=1", "--auth_tokens_file=" + tokens_file_});
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = std::move(*r);
    stub_ = v1::KvCache::NewStub(router_->channel());
    admin_ = v1::KvCacheAdmin::NewStub(router_->admin_channel());
  }
  void TearDown() override {
    router_.reset();
    worker_.reset();
    std::remove(model_.c_str());
    std::remove(tokens_file_.c_str());
  }

  // The router and the worker still answer, readiness SERVING, and a valid
  // request is served.
  void ExpectHealthy() {
    EXPECT_EQ(testing::HealthCheck(router_->channel(), "readiness").value_or(""), "SERVING");
    EXPECT_EQ(testing::HealthCheck(worker_->channel(), "readiness").value_or(""), "SERVING");
    Reply ok = Generate(stub_.get(), Text("", "still fine?", 3));
    EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
    EXPECT_EQ(ok.tokens.size(), 3u);
  }

  std::string model_;
  std::string tokens_file_;
  std::unique_ptr<testing::ServerUnderTest> worker_;
  std::unique_ptr<testing::ServerUnderTest> router_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::unique_ptr<v1::KvCacheAdmin::Stub> admin_;
};

TEST_F(PublicApiErrorsTest, GenerateRejectsEveryBadRequestWithItsCode) {
  const int64_t free_before = FreeDevicePages(worker_->channel());
  struct Case {
    std::string name;
    std::function<void(v1::GenerateRequest&)> edit;
    grpc::StatusCode code;
    std::string message_names = "";  // the message must contain this
    Auth auth = Auth::kUser;
  };
  const std::vector<Case> cases = {
      {"no input", [](auto& r) { r.clear_input(); }, grpc::INVALID_ARGUMENT},
      {"empty text", [](auto& r) { r.mutable_input()->set_text(""); }, grpc::INVALID_ARGUMENT},
      {"empty token list", [](auto& r) { r.mutable_input()->mutable_tokens(); }, grpc::INVALID_ARGUMENT},
      {"chat without messages", [](auto& r) { r.mutable_input()->mutable_chat(); }, grpc::INVALID_ARGUMENT},
      {"token id over the vocabulary", [](auto& r) { r.mutable_input()->mutable_tokens()->add_ids(1 << 30); },
       grpc::INVALID_ARGUMENT, "vocabulary"},
      {"negative token id", [](auto& r) { r.mutable_input()->mutable_tokens()->add_ids(-5); },
       grpc::INVALID_ARGUMENT, "vocabulary"},
      {"stop token id over the vocabulary",
       [](auto& r) { r.mutable_sampling()->add_stop_token_ids(1 << 30); }, grpc::INVALID_ARGUMENT},
      {"context over --max_context", [](auto& r) { r.mutable_input()->set_text(std::string(3000, 'x')); },
       grpc::OUT_OF_RANGE},
      {"max_tokens negative", [](auto& r) { r.mutable_sampling()->set_max_tokens(-1); },
       grpc::INVALID_ARGUMENT},
      {"max_tokens over --max_tokens_per_request", [](auto& r) { r.mutable_sampling()->set_max_tokens(101); },
       grpc::INVALID_ARGUMENT, "max_tokens"},
      {"max_tokens huge", [](auto& r) { r.mutable_sampling()->set_max_tokens(1 << 30); },
       grpc::INVALID_ARGUMENT},
      {"temperature over 2", [](auto& r) { r.mutable_sampling()->set_temperature(7); },
       grpc::INVALID_ARGUMENT},
      {"temperature negative", [](auto& r) { r.mutable_sampling()->set_temperature(-0.5f); },
       grpc::INVALID_ARGUMENT},
      {"top_p over 1", [](auto& r) { r.mutable_sampling()->set_top_p(1.5f); }, grpc::INVALID_ARGUMENT},
      {"top_p negative", [](auto& r) { r.mutable_sampling()->set_top_p(-0.1f); }, grpc::INVALID_ARGUMENT},
      {"top_k negative", [](auto& r) { r.mutable_sampling()->set_top_k(-1); }, grpc::INVALID_ARGUMENT},
      {"top_k over the vocabulary", [](auto& r) { r.mutable_sampling()->set_top_k(1 << 20); },
       grpc::INVALID_ARGUMENT},
      {"session id with spaces", [](auto& r) { r.set_session_id("no spaces allowed"); },
       grpc::INVALID_ARGUMENT},
      {"session id over 128 bytes", [](auto& r) { r.set_session_id(std::string(129, 'a')); },
       grpc::INVALID_ARGUMENT},
      {"unknown mode", [](auto& r) { r.set_mode(static_cast<v1::Mode>(7)); }, grpc::INVALID_ARGUMENT},
      {"APPEND without a session id", [](auto& r) { r.set_mode(v1::APPEND); }, grpc::INVALID_ARGUMENT},
      {"APPEND to an unknown session",
       [](auto& r) {
         r.set_mode(v1::APPEND);
         r.set_session_id("ghost-session");
       },
       grpc::NOT_FOUND, "ghost-session"},
      {"unknown chat role",
       [](auto& r) {
         auto* m = r.mutable_input()->mutable_chat()->add_messages();
         m->set_role("wizard");
         m->set_content("hi");
       },
       grpc::INVALID_ARGUMENT, "wizard"},
      {"too many stop strings",
       [](auto& r) {
         for (int i = 0; i < 17; ++i) r.mutable_sampling()->add_stop("x");
       },
       grpc::INVALID_ARGUMENT},
      {"stop string over 256 bytes", [](auto& r) { r.mutable_sampling()->add_stop(std::string(257, 's')); },
       grpc::INVALID_ARGUMENT},
      {"empty stop string", [](auto& r) { r.mutable_sampling()->add_stop(""); }, grpc::INVALID_ARGUMENT},
      {"message over the 8 MiB limit",
       [](auto& r) { r.mutable_input()->set_text(std::string(9 << 20, 'a')); }, grpc::RESOURCE_EXHAUSTED},
      {"no token", [](auto&) {}, grpc::UNAUTHENTICATED, "", Auth::kNone},
      {"unknown token", [](auto&) {}, grpc::UNAUTHENTICATED, "", Auth::kUnknown},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest req = Text("", "a valid prompt");
    c.edit(req);
    Reply r = Generate(stub_.get(), req, c.auth);
    EXPECT_EQ(r.status.error_code(), c.code) << c.name << ": " << r.status.error_message();
    EXPECT_FALSE(r.status.error_message().empty()) << c.name;
    EXPECT_THAT(r.status.error_message(), HasSubstr(c.message_names)) << c.name;
    EXPECT_TRUE(r.tokens.empty()) << c.name;
  }
  // max_tokens 0 is not an error: it means the server default.
  Reply zero = Generate(stub_.get(), Text("", "a valid prompt", 0));
  ASSERT_TRUE(zero.status.ok()) << zero.status.error_message();
  EXPECT_EQ(zero.final.usage().generated_tokens(), kDefaultMaxTokens);

  EXPECT_EQ(FreeDevicePages(worker_->channel()), free_before) << "a refused request left pages behind";
  ExpectHealthy();
}

TEST_F(PublicApiErrorsTest, SessionAndAdminCallsRejectBadRequestsWithTheirCodes) {
  for (const char* id : {"alpha", "beta"}) {
    Reply r = Generate(stub_.get(), Text(id, "a short conversation"));
    ASSERT_TRUE(r.status.ok()) << id << ": " << r.status.error_message();
  }
  const int64_t free_before = FreeDevicePages(worker_->channel());

  struct Case {
    std::string name;
    std::function<grpc::Status(grpc::ClientContext*)> call;
    grpc::StatusCode code;
    Auth auth = Auth::kUser;
    std::string message_names = "";
  };
  auto session = [](const std::string& id) {
    v1::SessionRequest r;
    r.set_session_id(id);
    return r;
  };
  auto fork = [](const std::string& from, const std::string& to) {
    v1::ForkSessionRequest r;
    r.set_session_id(from);
    r.set_new_session_id(to);
    return r;
  };
  auto pin = [](const std::string& id) {
    v1::PinSessionRequest r;
    r.set_session_id(id);
    r.set_pinned(true);
    return r;
  };
  auto migrate = [](const std::string& id, const std::string& target) {
    v1::AdminMigrateRequest r;
    r.set_session_id(id);
    r.set_target_worker(target);
    return r;
  };
  auto drain = [](const std::string& worker) {
    v1::DrainWorkerRequest r;
    r.set_worker(worker);
    return r;
  };
  v1::SessionInfo info;
  v1::CloseSessionResponse closed;
  v1::ListSessionsResponse sessions;
  v1::ListWorkersResponse workers;
  v1::MigrateSessionResponse migrated;
  v1::DrainResponse drained;
  const std::vector<Case> cases = {
      {"GetSession unknown", [&](auto* c) { return stub_->GetSession(c, session("ghost"), &info); },
       grpc::NOT_FOUND, Auth::kUser, "ghost"},
      {"CloseSession unknown", [&](auto* c) { return stub_->CloseSession(c, session("ghost"), &closed); },
       grpc::NOT_FOUND, Auth::kUser, "ghost"},
      {"ForkSession unknown", [&](auto* c) { return stub_->ForkSession(c, fork("ghost", "copy"), &info); },
       grpc::NOT_FOUND, Auth::kUser, "ghost"},
      {"PinSession unknown", [&](auto* c) { return stub_->PinSession(c, pin("ghost"), &info); },
       grpc::NOT_FOUND, Auth::kUser, "ghost"},
      {"GetSession malformed id", [&](auto* c) { return stub_->GetSession(c, session("bad id"), &info); },
       grpc::INVALID_ARGUMENT, Auth::kUser, "session_id"},
      {"CloseSession malformed id", [&](auto* c) { return stub_->CloseSession(c, session("a/b"), &closed); },
       grpc::INVALID_ARGUMENT, Auth::kUser, "session_id"},
      {"PinSession empty id", [&](auto* c) { return stub_->PinSession(c, pin(""), &info); },
       grpc::INVALID_ARGUMENT, Auth::kUser, "session_id"},
      {"ForkSession to an existing id",
       [&](auto* c) { return stub_->ForkSession(c, fork("alpha", "beta"), &info); }, grpc::ALREADY_EXISTS},
      {"another tenant's session (admin is tenant ops)",
       [&](auto* c) { return stub_->GetSession(c, session("alpha"), &info); }, grpc::NOT_FOUND, Auth::kAdmin},
      {"GetSession without a token", [&](auto* c) { return stub_->GetSession(c, session("alpha"), &info); },
       grpc::UNAUTHENTICATED, Auth::kNone},
      {"ListSessions without a token",
       [&](auto* c) { return stub_->ListSessions(c, v1::ListSessionsRequest(), &sessions); },
       grpc::UNAUTHENTICATED, Auth::kNone},
      {"CloseSession with an unknown token",
       [&](auto* c) { return stub_->CloseSession(c, session("alpha"), &closed); }, grpc::UNAUTHENTICATED,
       Auth::kUnknown},
      {"ListWorkers as a user",
       [&](auto* c) { return admin_->ListWorkers(c, v1::ListWorkersRequest(), &workers); },
       grpc::PERMISSION_DENIED},
      {"MigrateSession as a user",
       [&](auto* c) { return admin_->MigrateSession(c, migrate("alpha", ""), &migrated); },
       grpc::PERMISSION_DENIED},
      {"DrainWorker as a user", [&](auto* c) { return admin_->DrainWorker(c, drain("w0"), &drained); },
       grpc::PERMISSION_DENIED},
      {"ListWorkers without a token",
       [&](auto* c) { return admin_->ListWorkers(c, v1::ListWorkersRequest(), &workers); },
       grpc::UNAUTHENTICATED, Auth::kNone},
      {"DrainWorker without a token", [&](auto* c) { return admin_->DrainWorker(c, drain("w0"), &drained); },
       grpc::UNAUTHENTICATED, Auth::kNone},
      {"MigrateSession to an unknown worker",
       [&](auto* c) { return admin_->MigrateSession(c, migrate("alpha", "nowhere:1"), &migrated); },
       grpc::NOT_FOUND, Auth::kAdmin, "nowhere:1"},
      {"MigrateSession of an unknown session",
       [&](auto* c) { return admin_->MigrateSession(c, migrate("ghost", "w0"), &migrated); }, grpc::NOT_FOUND,
       Auth::kAdmin, "ghost"},
      {"MigrateSession without a session id",
       [&](auto* c) { return admin_->MigrateSession(c, migrate("", "w0"), &migrated); },
       grpc::INVALID_ARGUMENT, Auth::kAdmin, "session_id"},
      {"MigrateSession of a malformed session id",
       [&](auto* c) { return admin_->MigrateSession(c, migrate("a b/c", ""), &migrated); },
       grpc::INVALID_ARGUMENT, Auth::kAdmin, "session_id"},
      {"DrainWorker of an unknown worker",
       [&](auto* c) { return admin_->DrainWorker(c, drain("nowhere"), &drained); }, grpc::NOT_FOUND,
       Auth::kAdmin, "nowhere"},
  };
  for (const Case& c : cases) {
    grpc::ClientContext ctx;
    Authorize(&ctx, c.auth);
    const grpc::Status st = c.call(&ctx);
    EXPECT_EQ(st.error_code(), c.code) << c.name << ": " << st.error_message();
    EXPECT_FALSE(st.error_message().empty()) << c.name;
    EXPECT_THAT(st.error_message(), HasSubstr(c.message_names)) << c.name;
  }
  // Nothing changed: both sessions are still there, unpinned, and no page moved.
  for (const char* id : {"alpha", "beta"}) {
    grpc::ClientContext ctx;
    Authorize(&ctx, Auth::kUser);
    ASSERT_TRUE(stub_->GetSession(&ctx, session(id), &info).ok()) << id;
    EXPECT_FALSE(info.pinned()) << id;
    EXPECT_EQ(info.worker_id(), "w0");
  }
  {
    // The scheme is case-insensitive, as HTTP's is.
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", absl::StrCat("bearer ", kUser));
    EXPECT_TRUE(stub_->GetSession(&ctx, session("alpha"), &info).ok()) << "lower-case 'bearer' refused";
  }
  EXPECT_EQ(FreeDevicePages(worker_->channel()), free_before);
  ExpectHealthy();
}

}  // namespace
}  // namespace kvcache
