#include "router/executor.h"

#include <pthread.h>

#include <cassert>
#include <utility>

namespace kvcache::router {

Executor::Executor(int max_threads, size_t max_queued) : max_threads_(max_threads), max_queued_(max_queued) {
  assert(max_threads >= 1);
}

Executor::~Executor() { Shutdown(); }

bool Executor::Schedule(Task task) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || (max_queued_ > 0 && queue_.size() >= max_queued_)) return false;
  queue_.push_back(std::move(task));
  // Idle threads take the queued tasks one each; a task left over starts one.
  if (queue_.size() > static_cast<size_t>(idle_) && threads_.size() < static_cast<size_t>(max_threads_)) {
    threads_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "kv-executor");
      Loop();
    });
  }
  return true;
}

int Executor::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(threads_.size());
}

int Executor::idle_threads() const {
  absl::MutexLock lock(&mu_);
  return idle_;
}

void Executor::Shutdown() {
  absl::MutexLock join(&join_mu_);
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

void Executor::Loop() {
  while (true) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      ++idle_;
      mu_.Await(absl::Condition(&ready));
      --idle_;
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
