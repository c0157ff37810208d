#include "worker/backend/cpu/compute_pool.h"

#include <atomic>
#include <cstdint>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace kvcache::cpu {
namespace {

// Every index runs exactly once, whatever the loop size and thread count. Plain
// ints: what the loop wrote is visible when ParallelFor returns (checked by
// ThreadSanitizer builds as well).
TEST(ComputePoolTest, RunsEveryIndexOnce) {
  ComputePool pool;
  for (int threads : {1, 2, 3, 8}) {
    for (int64_t n : {0, 1, 2, 7, 64, 1000, 100000}) {
      std::vector<int> hits(static_cast<size_t>(n));
      pool.ParallelFor(n, threads, [&](int64_t i) { ++hits[i]; });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << "n=" << n << " threads=" << threads;
    }
  }
  EXPECT_EQ(pool.helpers(), 7);
}

// Helpers take part: with an index that waits until a second thread has run
// one, the loop finishes only if another thread joins.
TEST(ComputePoolTest, HelpersJoinTheLoop) {
  ComputePool pool;
  absl::Mutex mu;
  std::set<std::thread::id> ids;
  pool.ParallelFor(2, 2, [&](int64_t) {
    absl::MutexLock lock(&mu);
    ids.insert(std::this_thread::get_id());
    mu.Await(absl::Condition(
        +[](std::set<std::thread::id>* s) { return s->size() >= 2; }, &ids));
  });
  EXPECT_EQ(ids.size(), 2u);
}

// Many short loops back to back, with helpers falling asleep in between some
// of them: nothing is lost or run twice (the ticket's generation check).
TEST(ComputePoolTest, ManyLoopsAndSleeps) {
  ComputePool pool;
  std::atomic<int64_t> sum{0};
  int64_t want = 0;
  for (int loop = 0; loop < 20000; ++loop) {
    const int64_t n = 1 + loop % 13;
    pool.ParallelFor(n, 4, [&](int64_t i) { sum.fetch_add(i + 1); });
    want += n * (n + 1) / 2;
    if (loop % 5000 == 0) {
      // Long enough for the helpers to stop polling and sleep on the mutex.
      absl::SleepFor(absl::Milliseconds(2));
    }
  }
  EXPECT_EQ(sum.load(), want);
}

// Two threads calling at once: one gets the helpers, the other runs alone;
// both complete every index. A loop body that calls ParallelFor runs it inline.
TEST(ComputePoolTest, ConcurrentAndNestedCalls) {
  ComputePool pool;
  std::atomic<int64_t> total{0};
  auto work = [&] {
    for (int r = 0; r < 500; ++r) {
      pool.ParallelFor(8, 3, [&](int64_t) { pool.ParallelFor(4, 3, [&](int64_t) { total.fetch_add(1); }); });
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  EXPECT_EQ(total.load(), 2 * 500 * 8 * 4);
}

// max_threads bounds the threads that run a loop's indices.
TEST(ComputePoolTest, MaxThreadsBoundsParticipants) {
  ComputePool pool;
  pool.ParallelFor(100, 4, [](int64_t) {});  // start 3 helpers
  for (int r = 0; r < 200; ++r) {
    absl::Mutex mu;
    std::set<std::thread::id> ids;
    pool.ParallelFor(64, 2, [&](int64_t) {
      absl::MutexLock lock(&mu);
      ids.insert(std::this_thread::get_id());
    });
    ASSERT_LE(ids.size(), 2u);
  }
}

}  // namespace
}  // namespace kvcache::cpu
