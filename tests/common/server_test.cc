#include "common/server.h"

#include <map>
#include <string>
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

// The channel arguments a Keepalive sets, by name.
std::map<std::string, int> IntArgs(const grpc::ChannelArguments& args) {
  std::map<std::string, int> out;
  const grpc_channel_args c = args.c_channel_args();
  for (size_t i = 0; i < c.num_args; ++i) {
    if (c.args[i].type == GRPC_ARG_INTEGER) out[c.args[i].key] = c.args[i].value.integer;
  }
  return out;
}

TEST(KeepaliveTest, ChannelsPingPeersUnlessTurnedOff) {
  Keepalive k;
  k.time = absl::Seconds(30);
  k.timeout = absl::Seconds(10);
  EXPECT_TRUE(k.Validate().ok());
  auto args = IntArgs(k.ChannelArgs());
  EXPECT_EQ(args[GRPC_ARG_KEEPALIVE_TIME_MS], 30000);
  EXPECT_EQ(args[GRPC_ARG_KEEPALIVE_TIMEOUT_MS], 10000);
  EXPECT_EQ(args[GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS], 1);
  EXPECT_EQ(args[GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA], 0);  // also on a stream that waits
  // Never faster than a peer accepts.
  k.time = absl::Milliseconds(10);
  EXPECT_EQ(IntArgs(k.ChannelArgs())[GRPC_ARG_KEEPALIVE_TIME_MS], 1000);
  k.time = absl::ZeroDuration();
  EXPECT_TRUE(k.Validate().ok());
  EXPECT_TRUE(IntArgs(k.ChannelArgs()).empty());
  k.time = absl::Seconds(-1);
  EXPECT_EQ(k.Validate().code(), absl::StatusCode::kInvalidArgument);
  k.time = absl::Seconds(30);
  k.timeout = absl::ZeroDuration();
  EXPECT_EQ(k.Validate().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcache
