// Secure by default, with real processes over loopback: servers refuse to start
// without credentials, workers take calls only from holders of the cluster
// token, the router sends that token and keeps admin calls for admin tokens,
// and a migration goes only to a worker that proves it holds the same token.
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/gguf/tiny_llama.h"
#include "common/peer_auth.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/generate_client.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using testing::Reply;

constexpr char kToken[] = "cluster-token-of-the-test-fleet-0123456789";
constexpr char kOtherToken[] = "another-fleet-token-9876543210-abcdef";
constexpr char kAdminToken[] = "ops-admin-token";

class AuthTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(::testing::TempDir());
    gguf::TinyLlamaOptions o;
    o.n_ctx = 1024;
    ASSERT_TRUE(gguf::WriteTinyLlama(o, Path("auth_tiny.gguf")).ok());
    std::ofstream(Path("token")) << kToken << "\n";
    std::ofstream(Path("other-token")) << kOtherToken << "\n";
    std::ofstream(Path("tokens")) << kAdminToken << " ops admin\n";
  }
  static void TearDownTestSuite() {
    for (const char* f : {"auth_tiny.gguf", "token", "other-token", "tokens"}) std::remove(Path(f).c_str());
    delete dir_;
  }
  static std::string Path(const std::string& name) { return *dir_ + "/kvcache_auth_test_" + name; }

  static std::unique_ptr<testing::ServerUnderTest> StartWorker(const std::string& name,
                                                               const std::string& auth_flag) {
    auto w = testing::ServerUnderTest::Start(
        testing::BinaryPath("worker/kvcache-worker"),
        {"--model=" + Path("auth_tiny.gguf"), "--worker_id=" + name, "--threads=1",
         "--load_report_interval=100ms", "--tier0_bytes=" + std::to_string(4 << 20),
         "--tier1_bytes=" + std::to_string(4 << 20), auth_flag});
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  }

  static std::shared_ptr<grpc::Channel> WithToken(const std::string& address, const std::string& token) {
    return NewBearerChannel(address, grpc::InsecureChannelCredentials(), token);
  }

  static grpc::StatusCode GetSessionCode(v1::Worker::Stub* stub, const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::SessionRequest req;
    req.set_session_id(id);
    v1::SessionInfo info;
    return stub->GetSession(&ctx, req, &info).error_code();
  }

  static grpc::Status Migrate(v1::Worker::Stub* source, const std::string& id, const std::string& target) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::MigrateSessionRequest req;
    req.set_session_id(id);
    req.set_target_address(target);
    v1::MigrateSessionResponse resp;
    return source->MigrateSession(&ctx, req, &resp);
  }

  static std::string* dir_;
};

std::string* AuthTest::dir_ = nullptr;

TEST_F(AuthTest, ServersWithoutCredentialsRefuseToStart) {
  const std::string common = " --listen=127.0.0.1:0 --metrics_listen= --model=" + Path("auth_tiny.gguf");
  auto [worker_code, worker_out] = testing::RunToExit(testing::BinaryPath("worker/kvcache-worker") + common);
  EXPECT_NE(worker_code, 0) << worker_out;
  EXPECT_THAT(worker_out, HasSubstr("--cluster_token_file"));
  EXPECT_THAT(worker_out, HasSubstr("--allow_unauthenticated"));
  EXPECT_THAT(worker_out, ::testing::Not(HasSubstr("listening")));
  auto [router_code, router_out] = testing::RunToExit(testing::BinaryPath("router/kvcache-router") + common);
  EXPECT_NE(router_code, 0) << router_out;
  EXPECT_THAT(router_out, HasSubstr("--auth_tokens_file"));
  EXPECT_THAT(router_out, ::testing::Not(HasSubstr("listening")));
  // A token too short to be a secret is refused too.
  std::ofstream(Path("short")) << "secret\n";
  auto [short_code, short_out] = testing::RunToExit(testing::BinaryPath("worker/kvcache-worker") + common +
                                                    " --cluster_token_file=" + Path("short"));
  EXPECT_NE(short_code, 0) << short_out;
  EXPECT_THAT(short_out, HasSubstr("at least 16"));
  std::remove(Path("short").c_str());
}

// A router whose HTTP API cannot listen stops at start with the reason (it hung
// before, waiting for a readiness loop that only a served router stops).
TEST_F(AuthTest, RouterThatCannotListenForHttpExitsWithTheReason) {
  auto [code, out] = testing::RunToExit(
      testing::BinaryPath("router/kvcache-router") +
      " --listen=127.0.0.1:0 --metrics_listen= --allow_unauthenticated --workers=127.0.0.1:1"
      " --http_listen=bad --model=" +
      Path("auth_tiny.gguf"));
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("--http_listen='bad'"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("listening")));
}

TEST_F(AuthTest, WorkerServesOnlyHoldersOfTheClusterToken) {
  auto w = StartWorker("w-auth", "--cluster_token_file=" + Path("token"));
  ASSERT_NE(w, nullptr);  // readiness answered without a token: probes stay open
  const v1::GenerateRequest req = testing::TextRequest("s1", "hello fleet", 3);

  auto anonymous = v1::Worker::NewStub(w->channel());
  Reply none = testing::Generate(anonymous.get(), req);
  EXPECT_EQ(none.status.error_code(), grpc::UNAUTHENTICATED) << none.status.error_message();
  EXPECT_TRUE(none.tokens.empty());
  auto wrong = v1::Worker::NewStub(WithToken(w->grpc_address(), kOtherToken));
  EXPECT_EQ(testing::Generate(wrong.get(), req).status.error_code(), grpc::UNAUTHENTICATED);

  auto fleet = v1::Worker::NewStub(WithToken(w->grpc_address(), kToken));
  Reply ok = testing::Generate(fleet.get(), req);
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.tokens.size(), 3u);

  // The session exists, but an outsider learns nothing about it: not NOT_FOUND
  // or OK, UNAUTHENTICATED.
  EXPECT_EQ(GetSessionCode(fleet.get(), "s1"), grpc::OK);
  EXPECT_EQ(GetSessionCode(anonymous.get(), "s1"), grpc::UNAUTHENTICATED);
  EXPECT_EQ(GetSessionCode(wrong.get(), "s1"), grpc::UNAUTHENTICATED);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto watch = anonymous->Watch(&ctx, v1::WatchRequest());
    v1::WatchEvent event;
    EXPECT_FALSE(watch->Read(&event));
    EXPECT_EQ(watch->Finish().error_code(), grpc::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ExportSessionRequest er;
    er.set_session_id("s1");
    auto exported = anonymous->ExportSession(&ctx, er);
    v1::SessionChunk chunk;
    EXPECT_FALSE(exported->Read(&chunk));
    EXPECT_EQ(exported->Finish().error_code(), grpc::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::SessionInfo info;
    auto import = anonymous->ImportSession(&ctx, &info);
    import->WritesDone();
    EXPECT_EQ(import->Finish().error_code(), grpc::UNAUTHENTICATED);
  }
  // An outsider cannot move a session to a host of its choosing.
  EXPECT_EQ(Migrate(anonymous.get(), "s1", "127.0.0.1:1").error_code(), grpc::UNAUTHENTICATED);
  EXPECT_EQ(GetSessionCode(fleet.get(), "s1"), grpc::OK);

  auto metrics = testing::HttpGet(w->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics, ::testing::ContainsRegex("kvcache_worker_unauthenticated_calls_total [1-9]"));
}

TEST_F(AuthTest, RouterSendsTheClusterTokenAndKeepsAdminForAdminTokens) {
  auto w = StartWorker("w-auth", "--cluster_token_file=" + Path("token"));
  ASSERT_NE(w, nullptr);
  auto router = testing::ServerUnderTest::Start(
      testing::BinaryPath("router/kvcache-router"),
      {"--workers=" + w->grpc_address(), "--model=" + Path("auth_tiny.gguf"), "--rebalance_interval=0s",
       "--min_ready_workers=1", "--cluster_token_file=" + Path("token"), "--allow_unauthenticated",
       "--auth_tokens_file=" + Path("tokens")});
  // Ready means the router watches the worker: it presented the token.
  ASSERT_TRUE(router.ok()) << router.status();
  auto api = v1::KvCache::NewStub((*router)->channel());
  Reply r = testing::Generate(api.get(), testing::TextRequest("via-router", "hello", 3));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 3u);

  // Anonymous callers are tenant "default", never admin.
  auto anonymous_admin = v1::KvCacheAdmin::NewStub((*router)->channel());
  {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse resp;
    grpc::Status st = anonymous_admin->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp);
    EXPECT_EQ(st.error_code(), grpc::PERMISSION_DENIED) << st.error_message();
  }
  auto admin = v1::KvCacheAdmin::NewStub(WithToken((*router)->grpc_address(), kAdminToken));
  {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse resp;
    grpc::Status st = admin->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(resp.workers_size(), 1);
    EXPECT_EQ(resp.workers(0).health(), "SERVING");
  }
  // A token the router does not know is refused, not treated as anonymous.
  auto unknown = v1::KvCache::NewStub(WithToken((*router)->grpc_address(), "not-a-known-token"));
  EXPECT_EQ(testing::Generate(unknown.get(), testing::TextRequest("x", "hi", 1)).status.error_code(),
            grpc::UNAUTHENTICATED);

  // A router without the cluster token cannot use the worker.
  auto outsider = testing::ServerUnderTest::Start(
      testing::BinaryPath("router/kvcache-router"),
      {"--workers=" + w->grpc_address(), "--model=" + Path("auth_tiny.gguf"), "--rebalance_interval=0s",
       "--min_ready_workers=0", "--allow_unauthenticated"});
  ASSERT_TRUE(outsider.ok()) << outsider.status();
  auto outsider_api = v1::KvCache::NewStub((*outsider)->channel());
  Reply refused = testing::Generate(outsider_api.get(), testing::TextRequest("no", "hello", 3));
  EXPECT_FALSE(refused.status.ok());
  EXPECT_TRUE(refused.tokens.empty());
  // Without a tokens file, a caller that sends some token (as SDKs always do) is
  // anonymous too: tenant "default", never admin.
  auto any_token = WithToken((*outsider)->grpc_address(), "sk-anything");
  {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse resp;
    grpc::Status st = v1::KvCache::NewStub(any_token)->ListSessions(&ctx, v1::ListSessionsRequest(), &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse resp;
    grpc::Status st =
        v1::KvCacheAdmin::NewStub(any_token)->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp);
    EXPECT_EQ(st.error_code(), grpc::PERMISSION_DENIED) << st.error_message();
  }
}

TEST_F(AuthTest, MigrationGoesOnlyToWorkersThatProveTheSameToken) {
  auto source = StartWorker("w-src", "--cluster_token_file=" + Path("token"));
  auto open = StartWorker("w-open", "--allow_unauthenticated");
  auto foreign = StartWorker("w-foreign", "--cluster_token_file=" + Path("other-token"));
  auto peer = StartWorker("w-peer", "--cluster_token_file=" + Path("token"));
  ASSERT_TRUE(source && open && foreign && peer);
  auto src = v1::Worker::NewStub(WithToken(source->grpc_address(), kToken));
  Reply first = testing::Generate(src.get(), testing::TextRequest("moving", std::string(100, 'a'), 4));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();

  // A worker that takes anyone's calls cannot prove it holds the token.
  grpc::Status to_open = Migrate(src.get(), "moving", open->grpc_address());
  EXPECT_EQ(to_open.error_code(), grpc::FAILED_PRECONDITION) << to_open.error_message();
  EXPECT_THAT(to_open.error_message(), HasSubstr("cluster token"));
  auto open_stub = v1::Worker::NewStub(open->channel());
  EXPECT_EQ(GetSessionCode(open_stub.get(), "moving"), grpc::NOT_FOUND) << "bytes reached the open worker";
  // A worker of another fleet refuses our token, and we refuse it.
  grpc::Status to_foreign = Migrate(src.get(), "moving", foreign->grpc_address());
  EXPECT_EQ(to_foreign.error_code(), grpc::FAILED_PRECONDITION) << to_foreign.error_message();
  auto foreign_stub = v1::Worker::NewStub(WithToken(foreign->grpc_address(), kOtherToken));
  EXPECT_EQ(GetSessionCode(foreign_stub.get(), "moving"), grpc::NOT_FOUND);
  // Both refusals left the session whole where it was.
  EXPECT_EQ(GetSessionCode(src.get(), "moving"), grpc::OK);

  // A peer of the same fleet gets it.
  grpc::Status to_peer = Migrate(src.get(), "moving", peer->grpc_address());
  ASSERT_TRUE(to_peer.ok()) << to_peer.error_message();
  auto peer_stub = v1::Worker::NewStub(WithToken(peer->grpc_address(), kToken));
  EXPECT_EQ(GetSessionCode(peer_stub.get(), "moving"), grpc::OK);
  EXPECT_EQ(GetSessionCode(src.get(), "moving"), grpc::NOT_FOUND);
  Reply next = testing::Generate(peer_stub.get(), testing::TextRequest("moving", " more", 2, v1::APPEND));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_GE(next.final.usage().cached_tokens(), first.final.usage().prompt_tokens())
      << "the conversation moved with its cache";

  // The handshake is no oracle for outsiders.
  auto anonymous = v1::Worker::NewStub(peer->channel());
  grpc::ClientContext ctx;
  v1::PeerHandshakeRequest hr;
  hr.set_nonce(std::string(32, 'n'));
  v1::PeerHandshakeResponse hresp;
  EXPECT_EQ(anonymous->PeerHandshake(&ctx, hr, &hresp).error_code(), grpc::UNAUTHENTICATED);
}

}  // namespace
}  // namespace kvcache
