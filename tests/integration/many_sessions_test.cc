// 100,000 sessions on one worker (tiny model) with a router watching it: the
// worker's Watch snapshot comes in parts, the router rebuilds its directory from
// them, and sessions stay routable. The sessions are forks of one conversation
// whose pages are all full, so they share every page and cost no prefill.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/gguf/tiny_llama.h"
#include "gtest/gtest.h"
#include "kvcache/v1/router.grpc.pb.h"
#include "kvcache/v1/worker.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/generate_client.h"

namespace kvcache {
namespace {

constexpr int kSessions = 100000;

// Sessions the router lists on its one worker, or -1.
int RouterSessions(v1::KvCacheAdmin::Stub* admin) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ListWorkersResponse resp;
  if (!admin->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok() || resp.workers_size() != 1) return -1;
  return resp.workers(0).sessions();
}

TEST(ManySessionsTest, HundredThousandSessionsStayWatchedAndRoutable) {
  const std::string model = ::testing::TempDir() + "/kvcache_many_sessions_test_tiny.gguf";
  gguf::TinyLlamaOptions o;
  o.n_ctx = 1024;
  ASSERT_TRUE(gguf::WriteTinyLlama(o, model).ok());
  auto worker = testing::ServerUnderTest::Start(
      testing::BinaryPath("worker/kvcache-worker"),
      {"--model=" + model, "--threads=1", "--tier0_bytes=" + std::to_string(16 << 20), "--tier1_bytes=0"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto stub = v1::Worker::NewStub((*worker)->channel());

  // 32 prompt tokens + 1 generated: the cache holds exactly two full pages.
  std::vector<int32_t> prompt;
  for (int i = 0; i < 32; ++i) prompt.push_back(20 + i);
  // One source per client thread: forks of one source are serialised (the
  // source is busy while it is forked).
  constexpr int kThreads = 4;
  for (int t = 0; t < kThreads; ++t) {
    testing::Reply base = testing::Generate(
        stub.get(), testing::TokensRequest(absl::StrCat("base-", t), prompt, 1, v1::FULL_CONTEXT),
        absl::Seconds(60));
    ASSERT_TRUE(base.status.ok()) << base.status.error_message();
  }

  const absl::Time start = absl::Now();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kSessions; i += kThreads) {
        v1::ForkSessionRequest fr;
        fr.set_session_id(absl::StrCat("base-", t));
        fr.set_new_session_id(absl::StrCat("fork-", i));
        v1::SessionInfo info;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        grpc::Status st = stub->ForkSession(&ctx, fr, &info);
        if (!st.ok() && failures++ == 0) std::printf("fork %d: %s\n", i, st.error_message().c_str());
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  std::printf("%d forks in %.1f s\n", kSessions, absl::ToDoubleSeconds(absl::Now() - start));

  // A router that starts now learns all of them from the parted snapshot.
  auto router = testing::ServerUnderTest::Start(testing::BinaryPath("router/kvcache-router"),
                                                {"--workers=" + (*worker)->grpc_address(), "--model=" + model,
                                                 "--rebalance_interval=0s", "--min_ready_workers=1"});
  ASSERT_TRUE(router.ok()) << router.status();
  auto admin = v1::KvCacheAdmin::NewStub((*router)->admin_channel());
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  int listed = RouterSessions(admin.get());
  while (listed != kSessions + kThreads && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));  // bounds the probe rate only
    listed = RouterSessions(admin.get());
  }
  EXPECT_EQ(listed, kSessions + kThreads);

  // Any of them is routable: an APPEND turn on the last fork through the router.
  auto kv = v1::KvCache::NewStub((*router)->channel());
  v1::GenerateRequest turn =
      testing::TokensRequest(absl::StrCat("fork-", kSessions - 1), {60, 61, 62}, 2, v1::APPEND);
  testing::Reply r = testing::Generate(kv.get(), turn, absl::Seconds(60));
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 2u);
  EXPECT_EQ(r.final.worker_id().empty(), false);
  std::remove(model.c_str());
}

}  // namespace
}  // namespace kvcache
