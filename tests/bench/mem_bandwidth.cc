#include "tests/bench/mem_bandwidth.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "worker/backend/cpu/compute_pool.h"

namespace kvcache::bench {
namespace {

__attribute__((target("avx2"))) double SumBuffer(const float* p, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  double s = 0;
  for (float x : t) s += x;
  return s;
}

}  // namespace

double MeasureReadBandwidth(int threads) {
  using Clock = std::chrono::steady_clock;
  const int64_t n = int64_t{512} << 20 >> 2;
  float* buf = static_cast<float*>(std::aligned_alloc(64, n * 4));
  // Parts of 1 MiB, handed out to whichever thread is free.
  constexpr int64_t kPart = int64_t{1} << 18;
  const int64_t parts = n / kPart;
  cpu::ComputePool& pool = cpu::ComputePool::Get();
  pool.ParallelFor(parts, threads,
                   [&](int64_t p) { std::fill(buf + p * kPart, buf + (p + 1) * kPart, 1.0f); });
  std::vector<double> sums(static_cast<size_t>(parts));
  double best = 1e30, sink = 0;
  for (int r = 0; r < 5; ++r) {
    const auto start = Clock::now();
    pool.ParallelFor(parts, threads, [&](int64_t p) { sums[p] = SumBuffer(buf + p * kPart, kPart); });
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
    for (double v : sums) sink += v;
  }
  std::free(buf);
  if (sink == 0) return 0;  // keeps the sums alive
  return n * 4.0 / best;
}

}  // namespace kvcache::bench
