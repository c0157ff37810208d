#include "worker/backend/cpu/compute_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <chrono>

namespace kvcache::cpu {
namespace {

// How long a helper polls for the next loop before it sleeps. The loops of one
// step follow each other within microseconds, and steps within tens; waking a
// sleeping thread costs about as much on a VM. Polling longer would take a
// contended core from another process for nothing.
constexpr auto kSpin = std::chrono::microseconds(100);
// Helpers a pool starts at most (a larger max_threads just uses these).
constexpr int kMaxHelpers = 255;
constexpr uint64_t kIndexMask = 0xFFFFFFFFu;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

inline uint32_t GenOf(uint64_t ticket) { return static_cast<uint32_t>(ticket >> 32); }

}  // namespace

ComputePool& ComputePool::Get() {
  // Never destroyed: helpers may still be polling while static destructors run.
  static ComputePool* pool = new ComputePool;
  return *pool;
}

ComputePool::~ComputePool() {
  std::vector<std::thread> helpers;
  {
    absl::MutexLock lock(&mu_);
    // Sleeping helpers re-evaluate their condition when mu_ is released.
    stopping_.store(true);
    helpers.swap(helpers_);
  }
  for (std::thread& t : helpers) t.join();
}

int ComputePool::helpers() const { return n_helpers_.load(); }

void ComputePool::EnsureHelpers(int count) {
  if (count > kMaxHelpers) count = kMaxHelpers;
  if (n_helpers_.load() >= count) return;
  absl::MutexLock lock(&mu_);
  if (stopping_.load()) return;
  while (static_cast<int>(helpers_.size()) < count) {
    const int index = static_cast<int>(helpers_.size()) + 1;  // the caller is thread 0
    const uint32_t seen = GenOf(ticket_.load());              // joins the next loop
    helpers_.emplace_back([this, index, seen] { HelperLoop(index, seen); });
  }
  n_helpers_.store(static_cast<int>(helpers_.size()));
}

void ComputePool::RunChunks(uint32_t gen) {
  int64_t ran = 0;
  for (;;) {
    uint64_t ticket = ticket_.load();
    if (GenOf(ticket) != gen) break;
    // Read after ticket_: they belong to `gen` or, if that loop has finished
    // meanwhile, to a later one, and then the compare-and-swap below fails.
    const int64_t n = n_.load();
    const absl::FunctionRef<void(int64_t)>* fn = fn_.load();
    const int64_t i = static_cast<int64_t>(ticket & kIndexMask);
    if (i >= n) break;
    if (!ticket_.compare_exchange_weak(ticket, ticket + 1)) continue;
    (*fn)(i);
    ++ran;
  }
  if (ran > 0) done_.fetch_add(ran);
}

void ComputePool::HelperLoop(int index, uint32_t seen) {
  using Clock = std::chrono::steady_clock;
  for (;;) {
    uint32_t gen = GenOf(ticket_.load());
    if (gen == seen) {
      const Clock::time_point give_up = Clock::now() + kSpin;
      for (int spins = 1; gen == seen; ++spins) {
        if (stopping_.load(std::memory_order_relaxed)) return;
        CpuRelax();
        // Yielding now and then hands the core to another runnable thread (another
        // process's step) when there is one, and costs a syscall when there is not.
        if (spins % 16 == 0) std::this_thread::yield();
        if (spins % 16 == 0 && Clock::now() > give_up) {
          // Announce the sleep before the last look at ticket_: a caller that
          // publishes after this reads sleepers_ > 0 and wakes us (both seq_cst).
          sleepers_.fetch_add(1);
          {
            absl::MutexLock lock(&mu_);
            auto ready = [this, seen] { return stopping_.load() || GenOf(ticket_.load()) != seen; };
            mu_.Await(absl::Condition(&ready));
          }
          sleepers_.fetch_sub(1);
          if (stopping_.load()) return;
        }
        gen = GenOf(ticket_.load());
      }
    }
    seen = gen;
    if (index < max_threads_.load()) RunChunks(gen);
  }
}

void ComputePool::ParallelFor(int64_t n, int max_threads, absl::FunctionRef<void(int64_t)> fn) {
  if (n <= 0) return;
  // Alone: one thread wanted, one index, an index the ticket cannot hold, or the
  // helpers already serve a loop (another thread's, or the one calling us).
  if (max_threads <= 1 || n == 1 || n >= static_cast<int64_t>(kIndexMask) || busy_.exchange(true)) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  EnsureHelpers(max_threads - 1);
  fn_.store(&fn);
  n_.store(n);
  max_threads_.store(max_threads);
  done_.store(0);
  const uint32_t gen = GenOf(ticket_.load()) + 1;
  ticket_.store(uint64_t{gen} << 32);
  if (sleepers_.load() > 0) {
    // Await conditions are re-evaluated when mu_ is released.
    absl::MutexLock lock(&mu_);
  }
  RunChunks(gen);
  // Every index is claimed; wait for the ones helpers are still running.
  for (int spins = 1; done_.load() < n; ++spins) {
    CpuRelax();
    if (spins % 1024 == 0) std::this_thread::yield();  // a helper preempted on this core
  }
  // Close the loop before the next one's fn_ and n_ are written: a helper that
  // read ticket (gen, n) and then a later n_ would otherwise claim index n of the
  // next loop under this generation, and run it twice.
  ticket_.store((uint64_t{gen} << 32) | kIndexMask);
  busy_.store(false);
}

}  // namespace kvcache::cpu
