// kvcache-cli as a real process against a real kvcache-worker (tiny random
// model, --target=worker): generate, a two-turn chat fed on stdin, sessions,
// and the errors a user sees for an unreachable address and bad usage.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/gguf/tiny_llama.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/child_process.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kExitMarker[] = "__kvcache_cli_test_exit=";

struct CliRun {
  std::string output;  // stdout and stderr together, without the exit marker
  int exit_code = -1;
};

// Runs `/bin/sh -c "<shell> 2>&1; echo <marker>$?"` and waits for the marker line,
// so the whole output is read before the process is reaped.
CliRun RunShell(const std::string& shell) {
  CliRun run;
  auto child =
      testing::ChildProcess::Start({"/bin/sh", "-c", absl::StrCat(shell, " 2>&1; echo ", kExitMarker, "$?")});
  EXPECT_TRUE(child.ok()) << child.status();
  if (!child.ok()) return run;
  auto line = (*child)->WaitForLine(kExitMarker, absl::Seconds(120));
  EXPECT_TRUE(line.ok()) << line.status() << "\noutput so far:\n" << (*child)->output();
  if (!line.ok()) return run;
  const std::string& out = (*child)->output();
  run.output = out.substr(0, out.rfind(kExitMarker));
  EXPECT_TRUE(absl::SimpleAtoi(line->substr(line->rfind('=') + 1), &run.exit_code)) << *line;
  (*child)->Wait(absl::Seconds(10)).IgnoreError();
  return run;
}

std::string Cli() { return testing::BinaryPath("router/cli/kvcache-cli"); }

class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new std::string(::testing::TempDir() + "/kvcache_cli_test_tiny.gguf");
    gguf::TinyLlamaOptions o;
    o.n_ctx = 1024;
    ASSERT_TRUE(gguf::WriteTinyLlama(o, *model_).ok());
    auto w = testing::ServerUnderTest::Start(testing::BinaryPath("worker/kvcache-worker"),
                                             {"--model=" + *model_, "--worker_id=w-cli", "--threads=1"});
    ASSERT_TRUE(w.ok()) << w.status();
    worker_ = w->release();
  }
  static void TearDownTestSuite() {
    delete worker_;
    worker_ = nullptr;
    std::remove(model_->c_str());
    delete model_;
  }

  // kvcache-cli aimed at the worker, with `args` after it.
  static std::string Direct(const std::string& args) {
    return absl::StrCat(Cli(), " --router=", worker_->grpc_address(), " --target=worker ", args);
  }

  static std::string* model_;
  static testing::ServerUnderTest* worker_;
};

std::string* CliTest::model_ = nullptr;
testing::ServerUnderTest* CliTest::worker_ = nullptr;

TEST_F(CliTest, GeneratePrintsTextThenUsage) {
  CliRun r = RunShell(Direct("generate --prompt='hello there' --max_tokens=8 --ignore_eos"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("worker: w-cli"));
  EXPECT_THAT(r.output, HasSubstr("generated_tokens: 8"));
  EXPECT_THAT(r.output, HasSubstr("finish_reason: length"));
  EXPECT_THAT(r.output, HasSubstr("session: (ephemeral)"));
}

TEST_F(CliTest, ChatAppendsTheSecondTurnToTheCachedSession) {
  CliRun r = RunShell(
      absl::StrCat("printf 'first question\\nsecond question\\n' | ",
                   Direct("chat --session=cli-chat --system='be brief' --max_tokens=8 --ignore_eos")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // One status line per turn: the first prefills everything, the second reuses
  // the cached first turn.
  std::regex status(R"(\[worker w-cli \| cached (\d+)/(\d+) tokens)");
  std::vector<std::pair<int, int>> turns;
  for (std::sregex_iterator it(r.output.begin(), r.output.end(), status), end; it != end; ++it) {
    turns.emplace_back(std::stoi((*it)[1]), std::stoi((*it)[2]));
  }
  ASSERT_EQ(turns.size(), 2u) << r.output;
  EXPECT_EQ(turns[0].first, 0);
  EXPECT_GT(turns[1].first, 0);
  EXPECT_GT(turns[1].second, turns[0].second);
  EXPECT_THAT(r.output, HasSubstr("session cli-chat kept"));

  // The named session stays: list it, show it, close it.
  CliRun list = RunShell(Direct("sessions"));
  EXPECT_EQ(list.exit_code, 0) << list.output;
  EXPECT_THAT(list.output, HasSubstr("SESSION"));
  EXPECT_THAT(list.output, HasSubstr("cli-chat"));
  CliRun show = RunShell(Direct("sessions --session=cli-chat"));
  EXPECT_EQ(show.exit_code, 0) << show.output;
  EXPECT_THAT(show.output, HasSubstr("session: cli-chat"));
  EXPECT_THAT(show.output, HasSubstr("worker: w-cli"));
  CliRun close = RunShell(Direct("sessions --close=cli-chat"));
  EXPECT_EQ(close.exit_code, 0) << close.output;
  EXPECT_THAT(close.output, HasSubstr("closed session cli-chat"));
  CliRun gone = RunShell(Direct("sessions --session=cli-chat"));
  EXPECT_EQ(gone.exit_code, 3) << gone.output;
  EXPECT_THAT(gone.output, HasSubstr("NOT_FOUND"));
}

TEST_F(CliTest, ChatWithoutSessionClosesItsRandomSession) {
  CliRun r = RunShell(absl::StrCat("printf 'hi\\n' | ", Direct("chat --max_tokens=4 --ignore_eos")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[worker w-cli"));
  CliRun list = RunShell(Direct("sessions"));
  EXPECT_FALSE(std::regex_search(list.output, std::regex("cli-[0-9a-f]{12}"))) << list.output;
}

TEST_F(CliTest, UnreachableAddressIsOneLineAndExitCode2) {
  // A bound socket that never listens: connections are refused, and no other
  // process can take the port while the test runs.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));

  CliRun r = RunShell(absl::StrCat(Cli(), " --router=", address, " --connect_timeout=1s sessions"));
  close(fd);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output,
            absl::StrCat("kvcache-cli: cannot reach router at ", address, " (no connection within 1s)\n"));
}

TEST_F(CliTest, BadUsagePrintsUsageAndFails) {
  for (const std::string args : {"", "bogus", "--no_such_flag sessions", "generate extra-arg",
                                 "--target=nowhere sessions", "--target=worker workers"}) {
    CliRun r = RunShell(absl::StrCat(Cli(), " ", args));
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr("usage: kvcache-cli")) << args;
  }
}

}  // namespace
}  // namespace kvcache
