#include "router/executor.h"

#include <pthread.h>

#include <cassert>
#include <utility>

namespace kvcache::router {

Executor::Executor(int threads, size_t max_queued) : max_queued_(max_queued) {
  assert(threads >= 1);
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "kv-executor");
      Loop();
    });
  }
}

Executor::~Executor() { Shutdown(); }

bool Executor::Schedule(Task task) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || (max_queued_ > 0 && queue_.size() >= max_queued_)) return false;
  queue_.push_back(std::move(task));
  return true;
}

void Executor::Shutdown() {
  absl::MutexLock join(&join_mu_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void Executor::Loop() {
  while (true) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      // Queued tasks still run after Shutdown began: each one owes its caller
      // an answer.
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(task)();
  }
}

}  // namespace kvcache::router
