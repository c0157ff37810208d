#include "common/health_service.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/child_process.h"

namespace kvcache {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// A HealthService on a real gRPC server over loopback.
class HealthServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&health_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = Health::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    // A long deadline: a Watch stream left open would hold this for a minute.
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(60));
    server_->Wait();
  }

  grpc::Status Check(const std::string& service, HealthCheckResponse::ServingStatus* status) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    HealthCheckRequest req;
    req.set_service(service);
    HealthCheckResponse resp;
    grpc::Status st = stub_->Check(&ctx, req, &resp);
    *status = resp.status();
    return st;
  }

  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;
    // The next status, or -1 once the stream has ended.
    int Next() {
      HealthCheckResponse resp;
      return reader->Read(&resp) ? resp.status() : -1;
    }
  };
  std::unique_ptr<Stream> Watch(const std::string& service) {
    auto s = std::make_unique<Stream>();
    s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    HealthCheckRequest req;
    req.set_service(service);
    s->reader = stub_->Watch(&s->ctx, req);
    return s;
  }

  HealthService health_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Health::Stub> stub_;
};

TEST_F(HealthServiceTest, CheckAndWatchFollowTheStatus) {
  health_.SetServingStatus("a", true);
  HealthCheckResponse::ServingStatus status;
  ASSERT_TRUE(Check("a", &status).ok());
  EXPECT_EQ(status, HealthCheckResponse::SERVING);
  EXPECT_EQ(Check("b", &status).error_code(), grpc::StatusCode::NOT_FOUND);

  auto a = Watch("a");
  auto b = Watch("b");
  EXPECT_EQ(a->Next(), HealthCheckResponse::SERVING);
  EXPECT_EQ(b->Next(), HealthCheckResponse::SERVICE_UNKNOWN);
  health_.SetServingStatus("a", false);
  EXPECT_EQ(a->Next(), HealthCheckResponse::NOT_SERVING);
  health_.SetServingStatus("a", false);  // no change: nothing sent
  health_.SetServingStatus("a", true);
  EXPECT_EQ(a->Next(), HealthCheckResponse::SERVING);
  health_.SetServingStatus("b", true);
  EXPECT_EQ(b->Next(), HealthCheckResponse::SERVING);
  ASSERT_TRUE(Check("b", &status).ok());
  EXPECT_EQ(status, HealthCheckResponse::SERVING);
  EXPECT_EQ(health_.watchers(), 2u);

  a->ctx.TryCancel();
  EXPECT_EQ(a->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(testing::WaitUntil([&] { return health_.watchers() == 1; }));
  b->ctx.TryCancel();
  b->reader->Finish();
  EXPECT_TRUE(testing::WaitUntil([&] { return health_.watchers() == 0; }));
}

TEST_F(HealthServiceTest, ShutdownSendsNotServingThenEndsEveryWatch) {
  health_.SetServingStatus("", true);
  health_.SetServingStatus("readiness", true);
  std::vector<std::unique_ptr<Stream>> streams;
  for (const char* service : {"", "readiness", "readiness", "unknown"}) {
    streams.push_back(Watch(service));
    EXPECT_NE(streams.back()->Next(), -1) << service;
  }
  health_.Shutdown();
  for (size_t i = 0; i < streams.size(); ++i) {
    if (i < 3) {
      EXPECT_EQ(streams[i]->Next(), HealthCheckResponse::NOT_SERVING) << i;
    }
    EXPECT_EQ(streams[i]->Next(), -1) << i;  // the server ended it
    grpc::Status st = streams[i]->reader->Finish();
    EXPECT_TRUE(st.ok()) << i << ": " << st.error_message();
  }
  // Later calls see the shut-down service; statuses no longer change.
  health_.SetServingStatus("readiness", true);
  HealthCheckResponse::ServingStatus status;
  ASSERT_TRUE(Check("readiness", &status).ok());
  EXPECT_EQ(status, HealthCheckResponse::NOT_SERVING);
  auto late = Watch("readiness");
  EXPECT_EQ(late->Next(), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(late->Next(), -1);
  EXPECT_TRUE(late->reader->Finish().ok());
  EXPECT_TRUE(testing::WaitUntil([&] { return health_.watchers() == 0; }));
}

// Watchers that come, read and cancel while the status flips as fast as it can,
// and a shutdown in the middle: every stream ends, none is left registered
// (ASan checks the watchers' lifetimes).
TEST_F(HealthServiceTest, WatchersComingAndGoingWhileTheStatusFlips) {
  health_.SetServingStatus("s", true);
  std::atomic<bool> stop{false};
  std::thread flipper([&] {
    for (int i = 0; !stop.load(); ++i) health_.SetServingStatus("s", i % 2 == 0);
  });
  std::vector<std::thread> clients;
  std::atomic<int> ended{0};
  for (int c = 0; c < 8; ++c) {
    clients.emplace_back([&, c] {
      for (int round = 0; round < 20; ++round) {
        auto s = Watch("s");
        for (int k = 0; k < (c + round) % 4 + 1; ++k) {
          const int v = s->Next();
          if (v == -1) break;
          EXPECT_TRUE(v == HealthCheckResponse::SERVING || v == HealthCheckResponse::NOT_SERVING) << v;
        }
        s->ctx.TryCancel();
        s->reader->Finish();
        ended.fetch_add(1);
      }
    });
  }
  for (auto& t : clients) t.join();
  auto last = Watch("s");
  int final_status = last->Next();
  EXPECT_NE(final_status, -1);
  health_.Shutdown();
  stop.store(true);
  flipper.join();
  // Statuses written before the shutdown may still arrive; the last one the
  // stream showed is NOT_SERVING.
  int v = 0;
  while ((v = last->Next()) != -1) final_status = v;
  EXPECT_EQ(final_status, HealthCheckResponse::NOT_SERVING);
  EXPECT_TRUE(last->reader->Finish().ok());
  EXPECT_EQ(ended.load(), 8 * 20);
  EXPECT_TRUE(testing::WaitUntil([&] { return health_.watchers() == 0; }));
}

}  // namespace
}  // namespace kvcache
