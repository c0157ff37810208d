// Starts each server binary as a real process on port 0 and checks what every
// kvcache server must do: health SERVING over gRPC, reflection, /metrics in
// Prometheus text format, clean exit on SIGTERM, clear errors for bad flags.
#include <signal.h>
#include <sys/wait.h>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "tests/testing/child_process.h"

namespace kvcache {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

struct Binary {
  std::string path;
  std::string service;     // the kvcache service it must list
  std::string extra_flag;  // binary-specific flag for this test
};

class ServerScaffoldTest : public ::testing::TestWithParam<Binary> {};

TEST_P(ServerScaffoldTest, ServesHealthReflectionMetricsAndStopsOnSigterm) {
  // A router with no workers is alive but not ready unless told to be.
  auto server = testing::ServerUnderTest::Start(testing::BinaryPath(GetParam().path),
                                                {"--shutdown_deadline=2s", GetParam().extra_flag});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = (*server)->channel();

  EXPECT_EQ(*testing::HealthCheck(channel, ""), "SERVING");
  EXPECT_EQ(*testing::HealthCheck(channel, "liveness"), "SERVING");
  EXPECT_EQ(*testing::HealthCheck(channel, "readiness"), "SERVING");

  auto names = testing::ReflectionListServices(channel);
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, Contains(GetParam().service));
  EXPECT_THAT(*names, Contains("grpc.health.v1.Health"));
  EXPECT_THAT(*names, Contains("grpc.reflection.v1alpha.ServerReflection"));

  auto metrics = testing::HttpGet((*server)->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics, HasSubstr("# TYPE "));
  EXPECT_THAT(*metrics, HasSubstr("# HELP "));

  const absl::Time start = absl::Now();
  (*server)->process().Signal(SIGTERM);
  auto status = (*server)->process().Wait(absl::Seconds(10));
  ASSERT_TRUE(status.ok()) << "did not exit within 10 s of SIGTERM";
  EXPECT_TRUE(WIFEXITED(*status)) << "status " << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_P(ServerScaffoldTest, BadFlagsExitNonZero) {
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--no_such_flag=1"},
                                               {"--listen=nonsense"},
                                               {"--listen=127.0.0.1:70000"},
                                               {"--shutdown_deadline=-1s"},
                                               {"--keepalive_time=-1s"},
                                               {"--keepalive_timeout=0s"},
                                               {"--max_connection_age=-1s"},
                                               {"--log_level=loud"},
                                               {"positional"}}) {
    std::vector<std::string> argv = {testing::BinaryPath(GetParam().path)};
    argv.insert(argv.end(), args.begin(), args.end());
    auto child = testing::ChildProcess::Start(argv);
    ASSERT_TRUE(child.ok());
    auto status = (*child)->Wait(absl::Seconds(10));
    ASSERT_TRUE(status.ok()) << args[0] << " did not exit";
    EXPECT_TRUE(WIFEXITED(*status)) << args[0];
    EXPECT_NE(WEXITSTATUS(*status), 0) << args[0];
  }
}

// A worker address the router could never reach is a flag error at start (it
// started and watched 'a:b:c' for ever).
TEST(RouterFlagsTest, MalformedWorkerAddressesExitNonZero) {
  for (const char* workers :
       {"a:b:c", "127.0.0.1:notaport", "127.0.0.1:99999", "127.0.0.1:0", ":50051", "nohostport"}) {
    auto [code, out] = testing::RunToExit(absl::StrCat(testing::BinaryPath("router/kvcache-router"),
                                                       " --allow_unauthenticated --workers=", workers));
    EXPECT_NE(code, 0) << workers << ": " << out;
    EXPECT_THAT(out, HasSubstr("worker address")) << workers;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Binaries, ServerScaffoldTest,
    ::testing::Values(Binary{"worker/kvcache-worker", "kvcache.v1.Worker", "--threads=1"},
                      Binary{"router/kvcache-router", "kvcache.v1.KvCache", "--min_ready_workers=0"}),
    [](const auto& info) { return info.index == 0 ? "worker" : "router"; });

}  // namespace
}  // namespace kvcache
