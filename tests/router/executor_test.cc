#include "router/executor.h"

#include <atomic>
#include <set>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace kvcache::router {
namespace {

TEST(ExecutorTest, RunsEveryTaskOnItsOwnFixedThreads) {
  Executor ex(3, 0);
  absl::Mutex mu;
  std::set<std::thread::id> seen;
  std::atomic<int> ran{0};
  absl::Notification all;
  constexpr int kTasks = 500;
  for (int i = 0; i < kTasks; ++i) {
    ASSERT_TRUE(ex.Schedule([&] {
      {
        absl::MutexLock lock(&mu);
        seen.insert(std::this_thread::get_id());
      }
      if (ran.fetch_add(1) + 1 == kTasks) all.Notify();
    }));
  }
  all.WaitForNotification();
  ex.Shutdown();
  EXPECT_EQ(ran.load(), kTasks);
  EXPECT_LE(seen.size(), 3u);  // never a thread per task
  EXPECT_EQ(seen.count(std::this_thread::get_id()), 0u);
}

TEST(ExecutorTest, RefusesPastItsQueueBound) {
  Executor ex(1, 2);
  absl::Notification started, release;
  ASSERT_TRUE(ex.Schedule([&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();  // the only thread is busy: the rest queue
  int ran = 0;
  EXPECT_TRUE(ex.Schedule([&] { ++ran; }));
  EXPECT_TRUE(ex.Schedule([&] { ++ran; }));
  EXPECT_FALSE(ex.Schedule([&] { ++ran; })) << "a third waiting task is over the bound";
  release.Notify();
  ex.Shutdown();
  EXPECT_EQ(ran, 2);
}

TEST(ExecutorTest, ShutdownRunsWhatIsQueuedThenRefuses) {
  Executor ex(1, 0);
  absl::Notification started, release;
  ASSERT_TRUE(ex.Schedule([&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(ex.Schedule([&] { ran.fetch_add(1); }));
  std::thread stopper([&] { ex.Shutdown(); });
  release.Notify();
  stopper.join();
  EXPECT_EQ(ran.load(), 10) << "every queued task owes its caller an answer";
  EXPECT_FALSE(ex.Schedule([] {}));
  ex.Shutdown();  // again: a no-op
}

}  // namespace
}  // namespace kvcache::router
