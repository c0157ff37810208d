#include "common/server.h"

#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "prometheus/counter.h"
#include "tests/testing/child_process.h"

namespace kvcache {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

class ServerProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.name = "server-test";
    options.shutdown_deadline = absl::Seconds(2);
    auto p = ServerProcess::Init(options);
    ASSERT_TRUE(p.ok()) << p.status();
    process_ = std::move(*p);
    serve_thread_ = std::thread([this] { served_ = process_->Serve({&service_}); });
  }

  void TearDown() override {
    process_->RequestShutdown();
    serve_thread_.join();
    EXPECT_TRUE(served_.ok()) << served_;
  }

  std::shared_ptr<grpc::Channel> Channel() {
    // The port is known once Serve has bound it; readiness waits on Watch.
    while (process_->grpc_port() == 0) std::this_thread::yield();
    return grpc::CreateChannel("127.0.0.1:" + std::to_string(process_->grpc_port()),
                               grpc::InsecureChannelCredentials());
  }

  kvcache::v1::Worker::CallbackService service_;
  std::unique_ptr<ServerProcess> process_;
  std::thread serve_thread_;
  absl::Status served_;
};

TEST_F(ServerProcessTest, HealthLivenessAndReadinessAreSeparate) {
  auto channel = Channel();
  ASSERT_TRUE(testing::WaitForServing(channel, kReadinessService, absl::Seconds(10)).ok());
  EXPECT_EQ(*testing::HealthCheck(channel, ""), "SERVING");
  EXPECT_EQ(*testing::HealthCheck(channel, kLivenessService), "SERVING");
  process_->SetReady(false);
  EXPECT_EQ(*testing::HealthCheck(channel, kReadinessService), "NOT_SERVING");
  EXPECT_EQ(*testing::HealthCheck(channel, kLivenessService), "SERVING");
  process_->SetReady(true);
  EXPECT_EQ(*testing::HealthCheck(channel, kReadinessService), "SERVING");
  EXPECT_EQ(testing::HealthCheck(channel, "no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ServerProcessTest, ReflectionListsServices) {
  auto names = testing::ReflectionListServices(Channel());
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, Contains("kvcache.v1.Worker"));
  EXPECT_THAT(*names, Contains("grpc.health.v1.Health"));
}

TEST_F(ServerProcessTest, MetricsServedInPrometheusTextFormat) {
  auto& family = prometheus::BuildCounter()
                     .Name("server_test_events_total")
                     .Help("Events seen by the test")
                     .Register(process_->metrics());
  family.Add({}).Increment(3);
  auto body = testing::HttpGet(process_->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_THAT(*body, HasSubstr("# TYPE server_test_events_total counter"));
  EXPECT_THAT(*body, HasSubstr("server_test_events_total 3"));
}

TEST(ServerProcessStandaloneTest, RejectsBadOptions) {
  ServerOptions options;
  EXPECT_EQ(ServerProcess::Init(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.name = "x";
  options.metrics_address = "127.0.0.1:0";
  options.tls_client_ca_file = "/nonexistent";
  EXPECT_EQ(MakeServerCredentials(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.tls_cert_file = "/nonexistent/cert.pem";
  options.tls_key_file = "/nonexistent/key.pem";
  EXPECT_EQ(MakeServerCredentials(options).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvcache
