// A fixed set of threads for the router's few steps that must block (an APPEND
// waiting a moment for its session to appear in the directory), so that no gRPC
// callback thread blocks and no request gets a thread of its own.
//
// Tasks run in the order they were scheduled, on any of the threads. The queue
// is bounded: past `max_queued` waiting tasks Schedule refuses, and the caller
// answers RESOURCE_EXHAUSTED instead of letting the backlog grow with traffic.
//
// Thread-safety: Schedule and Shutdown may be called from any thread, except
// that a task must not call Shutdown (it would join itself).
#ifndef KVCACHE_ROUTER_EXECUTOR_H_
#define KVCACHE_ROUTER_EXECUTOR_H_

#include <cstddef>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace kvcache::router {

class Executor {
 public:
  using Task = absl::AnyInvocable<void() &&>;

  // REQUIRES: threads >= 1. max_queued: tasks that may wait for a thread
  // (0 = unbounded).
  Executor(int threads, size_t max_queued);
  ~Executor();  // Shutdown()

  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `task`. False, without running it, when the queue is full or
  // Shutdown has begun.
  bool Schedule(Task task);

  // Refuses new tasks, runs the ones already queued, and joins the threads.
  void Shutdown();

  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop();

  const size_t max_queued_;
  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // written only by the constructor and Shutdown
  absl::Mutex join_mu_;               // one Shutdown joins; a second waits for it
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_EXECUTOR_H_
