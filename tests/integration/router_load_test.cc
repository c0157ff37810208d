// kvcache-router under many concurrent streams: 2,000 Generate calls, 256 open
// at once, through one router in front of two real kvcache-worker processes.
// Every call must end OK with all its tokens, the run must not stall, and the
// router must not grow a thread per stream (it proxies through gRPC's callback
// API; only a small fixed executor and a few housekeeping threads are its own).
#include <atomic>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/gguf/tiny_llama.h"
#include "gtest/gtest.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/generate_client.h"

namespace kvcache {
namespace {

constexpr int kRequests = 2000;
constexpr int kConcurrent = 256;
constexpr int kMaxTokens = 4;
// Generous: the run takes a few seconds on a 2-core machine; a stalled stream
// would hold it until its 60 s deadline.
constexpr absl::Duration kRunBound = absl::Seconds(90);
// The router's own threads (main, readiness, rebalancer, evacuator, executor,
// pool health and one Watch per worker) plus gRPC's and the metrics exposer's
// pools: a few dozen at most, whatever the number of streams.
constexpr int kMaxRouterThreads = 64;

class RouterLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = ::testing::TempDir() + "/kvcache_router_load_tiny.gguf";
    gguf::TinyLlamaOptions o;
    o.n_ctx = 2048;
    ASSERT_TRUE(gguf::WriteTinyLlama(o, model_).ok());
  }
  void TearDown() override { std::remove(model_.c_str()); }

  std::string model_;
};

TEST_F(RouterLoadTest, TwoThousandStreamsTwoHundredFiftySixAtOnceWithBoundedThreads) {
  std::vector<std::unique_ptr<testing::ServerUnderTest>> workers;
  std::string list;
  for (int i = 0; i < 2; ++i) {
    auto w = testing::ServerUnderTest::Start(testing::BinaryPath("worker/kvcache-worker"),
                                             {"--model=" + model_, "--worker_id=w" + std::to_string(i),
                                              "--threads=1", "--load_report_interval=100ms"});
    ASSERT_TRUE(w.ok()) << w.status();
    list += (list.empty() ? "" : ",") + (*w)->grpc_address();
    workers.push_back(std::move(*w));
  }
  auto router = testing::ServerUnderTest::Start(
      testing::BinaryPath("router/kvcache-router"),
      {"--workers=" + list, "--model=" + model_, "--rebalance_interval=0s", "--min_ready_workers=2"});
  ASSERT_TRUE(router.ok()) << router.status();
  const pid_t router_pid = (*router)->process().pid();
  const int threads_before = testing::ThreadCount(router_pid);
  ASSERT_GT(threads_before, 0);

  // Samples the router's thread count while the run lasts.
  std::atomic<int> max_threads{threads_before};
  absl::Notification run_over;
  std::thread sampler([&] {
    while (!run_over.WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
      const int n = testing::ThreadCount(router_pid);
      if (n > max_threads.load()) max_threads = n;
    }
  });

  // kConcurrent clients, each one conversation: a FULL_CONTEXT first turn,
  // then APPEND turns (affinity, and the directory lookup that may wait for
  // the worker's placement event), until kRequests calls were made in all.
  std::atomic<int> next{0}, ok{0}, wrong{0};
  absl::Mutex mu;
  std::string first_failure;
  auto stub = v1::KvCache::NewStub((*router)->channel());
  std::vector<std::thread> clients;
  const absl::Time start = absl::Now();
  for (int c = 0; c < kConcurrent; ++c) {
    clients.emplace_back([&, c] {
      const std::string session = absl::StrCat("load-", c);
      for (int turn = 0; next.fetch_add(1) < kRequests; ++turn) {
        const v1::GenerateRequest req =
            turn == 0 ? testing::TextRequest(session, absl::StrCat("hello number ", c), kMaxTokens)
                      : testing::TextRequest(session, " and?", kMaxTokens, v1::APPEND);
        testing::Reply r = testing::Generate(stub.get(), req, absl::Seconds(60));
        if (r.status.ok() && static_cast<int>(r.tokens.size()) == kMaxTokens &&
            r.final.usage().generated_tokens() == kMaxTokens) {
          ok.fetch_add(1);
          continue;
        }
        wrong.fetch_add(1);
        absl::MutexLock lock(&mu);
        if (first_failure.empty()) {
          first_failure = absl::StrCat(session, " turn ", turn, ": ", r.status.error_code(), " ",
                                       r.status.error_message(), ", ", r.tokens.size(), " tokens");
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  const absl::Duration took = absl::Now() - start;
  run_over.Notify();
  sampler.join();

  EXPECT_EQ(ok.load(), kRequests) << wrong.load() << " calls failed; first: " << first_failure;
  EXPECT_LT(took, kRunBound);
  EXPECT_LT(max_threads.load(), kMaxRouterThreads)
      << "the router grew threads with the streams (" << threads_before << " before the run)";
  std::printf("%d calls (%d at once) in %.2f s; router threads %d before, at most %d during the run\n",
              kRequests, kConcurrent, absl::ToDoubleSeconds(took), threads_before, max_threads.load());
  EXPECT_EQ(testing::HealthCheck((*router)->channel(), "readiness").value_or(""), "SERVING");
}

}  // namespace
}  // namespace kvcache
