// Parallel loops for the CPU kernels: the calling thread plus helper threads that
// join while they are awake, never a fork/join that waits for every thread.
//
// Why not OpenMP: an OpenMP region ends only when every thread of its team has
// arrived, so a region waits for a helper that the OS has not scheduled yet. A
// decode step of a small model is hundreds of regions of tens of microseconds,
// and with two worker processes on the same cores (the main job, the load
// benchmark, tests) a step then waits out scheduler slices: measured 35 tokens/s
// per process against 99 with single-threaded matmuls (engine_bench, SmolLM2,
// 2 processes x 2 threads on 2 cores). Here the caller takes chunks itself and
// waits only for chunks a helper has already started, so a descheduled helper
// costs nothing; on idle cores every thread takes part (the same engine_bench
// decode ran 1.6x faster with every matmul on two threads than with one).
//
// Helpers poll for 100 us after a loop (back-to-back loops of a step find them
// awake), yielding the core every few polls in case another process's thread
// wants it, then sleep on a mutex until the next loop.
//
// Thread-safety: ParallelFor may be called from any thread. One loop runs on the
// helpers at a time; a call that finds the pool busy (another thread's loop), or
// a call from inside a loop's body, runs its loop on the calling thread alone.
#ifndef KVCACHE_WORKER_BACKEND_CPU_COMPUTE_POOL_H_
#define KVCACHE_WORKER_BACKEND_CPU_COMPUTE_POOL_H_

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace kvcache::cpu {

class ComputePool {
 public:
  // The process's pool; helpers are started on first use, as many as loops ask for.
  static ComputePool& Get();

  ComputePool() = default;
  ~ComputePool();  // stops and joins the helpers
  ComputePool(const ComputePool&) = delete;
  ComputePool& operator=(const ComputePool&) = delete;

  // Calls fn(i) once for every i in [0, n), on the calling thread and at most
  // max_threads - 1 helpers, and returns when every call has returned. Which
  // thread runs which i is not fixed: fn's result must not depend on it.
  // REQUIRES: fn does not throw.
  void ParallelFor(int64_t n, int max_threads, absl::FunctionRef<void(int64_t)> fn);

  // Helpers started so far (tests).
  int helpers() const;

 private:
  void EnsureHelpers(int count);
  // Helper `index` (1-based; the caller is 0); `seen`: the last loop it knows of.
  void HelperLoop(int index, uint32_t seen);
  // Takes and runs chunks of loop `gen` until none is left.
  void RunChunks(uint32_t gen);

  // The members that threads write while a loop runs (ticket_, done_) and those
  // only read then (fn_, n_, max_threads_) sit on cache lines of their own: on
  // one line, each claim and each finished index moved it between the cores
  // twice (a loop of 16 empty indices on 2 threads took 0.9-2.8 us on a 2-core
  // Intel Xeon VM, and 0.25-0.75 us apart, in a throwaway timing loop).
  //
  // gen (high 32 bits) | next unclaimed index of that loop (low 32 bits; all ones
  // once the loop has finished). A helper claims index i of loop g by
  // compare-and-swap from (g, i) to (g, i + 1), so it can never claim an index of
  // a loop other than the one it read.
  alignas(64) std::atomic<uint64_t> ticket_{0};
  // The current loop, written before ticket_ announces it and not again until
  // every claimed index has finished (read only between a helper's load of
  // ticket_ and its compare-and-swap, which fails if they are stale).
  alignas(64) std::atomic<const absl::FunctionRef<void(int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> n_{0};
  std::atomic<int> max_threads_{0};
  // Indices of the current loop that have returned: each thread adds its count
  // once, when it finds no index left to claim.
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<bool> busy_{false};  // a thread's loop owns the helpers
  std::atomic<int> sleepers_{0};               // helpers asleep (or going to sleep) on mu_
  std::atomic<bool> stopping_{false};          // set once, by the destructor

  mutable absl::Mutex mu_;
  std::vector<std::thread> helpers_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> n_helpers_{0};
};

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_COMPUTE_POOL_H_
