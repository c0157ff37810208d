// Clients that vanish mid-stream: kvcache-cli processes streaming a long
// generation are killed (SIGKILL, no goodbye) dozens of times, straight against a
// worker and through a router. Afterwards both processes are alive and serve,
// the worker has no request left running, and it counted the cancellations.
// Under the sanitizer build (scripts/check-clang.sh) a reactor used after gRPC
// deleted it fails here.
#include <signal.h>

#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/gguf/tiny_llama.h"
#include "gtest/gtest.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/generate_client.h"

namespace kvcache {
namespace {

// Reads the worker's Watch stream until a load report shows no request running
// (true) or the stream ends or times out (false).
bool WaitNothingRunning(v1::Worker::Stub* stub, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoSeconds(timeout));
  auto reader = stub->Watch(&ctx, v1::WatchRequest());
  v1::WatchEvent ev;
  bool idle = false;
  while (!idle && reader->Read(&ev)) {
    const v1::WorkerLoad* load = ev.has_load()       ? &ev.load()
                                 : ev.has_snapshot() ? &ev.snapshot().load()
                                                     : nullptr;
    idle = load != nullptr && load->running_requests() == 0 && load->waiting_requests() == 0;
  }
  ctx.TryCancel();
  reader->Finish();
  return idle;
}

TEST(ClientKillTest, KilledClientsLeaveEveryProcessServing) {
  const std::string model = ::testing::TempDir() + "/kvcache_client_kill_test_tiny.gguf";
  gguf::TinyLlamaOptions o;
  o.n_ctx = 4096;
  ASSERT_TRUE(gguf::WriteTinyLlama(o, model).ok());
  auto worker = testing::ServerUnderTest::Start(
      testing::BinaryPath("worker/kvcache-worker"),
      {"--model=" + model, "--threads=1", "--load_report_interval=100ms",
       "--tier0_bytes=" + std::to_string(64 << 20), "--tier1_bytes=" + std::to_string(64 << 20)});
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto router = testing::ServerUnderTest::Start(testing::BinaryPath("router/kvcache-router"),
                                                {"--workers=" + (*worker)->grpc_address(), "--model=" + model,
                                                 "--rebalance_interval=0s", "--min_ready_workers=1"});
  ASSERT_TRUE(router.ok()) << router.status();

  constexpr int kKills = 40;
  int killed_streaming = 0;
  for (int i = 0; i < kKills; ++i) {
    const bool direct = i % 2 == 0;
    auto cli = testing::ChildProcess::Start(
        {testing::BinaryPath("router/cli/kvcache-cli"),
         "--router=" + (direct ? (*worker)->grpc_address() : (*router)->grpc_address()),
         direct ? "--target=worker" : "--target=router", "--max_tokens=3000",
         i % 4 < 2 ? "--session=" : absl::StrCat("--session=kill-", i), "generate",
         absl::StrCat("--prompt=tell me a very long story, number ", i)});
    ASSERT_TRUE(cli.ok()) << cli.status();
    // A few bytes of text: the stream is live, tokens are flowing.
    absl::Status streaming = (*cli)->WaitForOutput(8, absl::Seconds(60));
    killed_streaming += streaming.ok();
    (*cli)->Signal(SIGKILL);
    (void)(*cli)->Wait(absl::Seconds(10));
  }
  EXPECT_EQ(killed_streaming, kKills) << "some clients never got a token";

  // Both processes still run and serve; the worker cancelled every orphan.
  EXPECT_FALSE((*worker)->process().exited());
  EXPECT_FALSE((*router)->process().exited());
  auto wstub = v1::Worker::NewStub((*worker)->channel());
  EXPECT_TRUE(WaitNothingRunning(wstub.get(), absl::Seconds(60)))
      << "generations of killed clients still run";
  testing::Reply direct = testing::Generate(
      wstub.get(), testing::TextRequest("", "still there?", 4, v1::FULL_CONTEXT), absl::Seconds(60));
  EXPECT_TRUE(direct.status.ok()) << direct.status.error_message();
  EXPECT_EQ(direct.tokens.size(), 4u);
  auto rstub = v1::KvCache::NewStub((*router)->channel());
  testing::Reply routed = testing::Generate(
      rstub.get(), testing::TextRequest("", "and you?", 4, v1::FULL_CONTEXT), absl::Seconds(60));
  EXPECT_TRUE(routed.status.ok()) << routed.status.error_message();
  EXPECT_EQ(routed.tokens.size(), 4u);
  auto metrics = testing::HttpGet((*worker)->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_NE(metrics->find("kvcache_requests_total{code=\"CANCELLED\"}"), std::string::npos);
  std::remove(model.c_str());
}

}  // namespace
}  // namespace kvcache
