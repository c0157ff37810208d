// Threads for the router's few steps that must block (an APPEND or a session
// call waiting up to --session_lookup_wait for its session to appear in the
// directory, a request following a session a drain moves), so that no gRPC
// callback thread blocks and no request gets a thread of its own.
//
// Threads start as work needs them: a task that finds no idle thread starts
// one, up to `max_threads`; they stay until Shutdown. The waits are mostly
// idle time, so the router's bound is high (64). With 4 fixed threads, 20
// CloseSession calls at once on ids no worker holds (1 s waits) answered
// NOT_FOUND in groups of four, the last after 5.01 s, and a call on a session
// created meanwhile waited behind them; now all 20 answer after 1.01 s, and
// 100 after at most 2.02 s.
//
// Tasks start in the order they were scheduled. The queue is bounded: past
// `max_queued` tasks waiting for a thread Schedule refuses, and the caller
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

  // REQUIRES: max_threads >= 1. max_queued: tasks that may wait for a thread
  // (0 = unbounded).
  Executor(int max_threads, size_t max_queued);
  ~Executor();  // Shutdown()

  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `task`. False, without running it, when the queue is full or
  // Shutdown has begun.
  bool Schedule(Task task);

  // Refuses new tasks, runs the ones already queued, and joins the threads.
  void Shutdown();

  // Threads started so far.
  int threads() const;
  // Of those, the ones waiting for a task.
  int idle_threads() const;

 private:
  void Loop();

  const int max_threads_;
  const size_t max_queued_;
  mutable absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;  // threads waiting for a task
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);  // none start once stopping_
  absl::Mutex join_mu_;                                    // one Shutdown joins; a second waits for it
};

}  // namespace kvcache::router

#endif  // KVCACHE_ROUTER_EXECUTOR_H_
