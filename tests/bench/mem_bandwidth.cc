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

constexpr int kChains = 12;
constexpr int64_t kDotIters = int64_t{1} << 22;

// Returns a value depending on every chain (so none is optimised away).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t DotChainsVnni(int64_t iters) {
  __m512i acc[kChains];
  for (__m512i& a : acc) a = _mm512_setzero_si512();
  __m512i w = _mm512_set1_epi8(3);
  const __m512i x = _mm512_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i) {
    for (__m512i& a : acc) a = _mm512_dpbusd_epi32(a, w, x);
    __asm__("" : "+v"(w));  // an operand the compiler cannot hoist
  }
  int64_t s = 0;
  for (const __m512i& a : acc) s += _mm512_reduce_add_epi32(a);
  return s;
}

__attribute__((target("avx2"))) int64_t DotChainsAvx2(int64_t iters) {
  __m256i acc[kChains];
  for (__m256i& a : acc) a = _mm256_setzero_si256();
  __m256i w = _mm256_set1_epi8(3);
  const __m256i x = _mm256_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i) {
    for (__m256i& a : acc) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x));
    __asm__("" : "+x"(w));
  }
  alignas(32) int16_t lanes[16];
  int64_t s = 0;
  for (const __m256i& a : acc) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
    for (int16_t v : lanes) s += v;
  }
  return s;
}

}  // namespace

double MeasureInt8DotPeak(int threads, bool vnni) {
  using Clock = std::chrono::steady_clock;
  cpu::ComputePool& pool = cpu::ComputePool::Get();
  std::vector<int64_t> sinks(static_cast<size_t>(threads));
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const auto start = Clock::now();
    pool.ParallelFor(threads, threads, [&](int64_t t) {
      sinks[t] += vnni ? DotChainsVnni(kDotIters) : DotChainsAvx2(kDotIters);
    });
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  int64_t sink = 0;
  for (int64_t v : sinks) sink += v;
  if (sink == 1) return 0;  // keeps the chains alive
  const double macs_per_instruction = vnni ? 64 : 32;
  return threads * static_cast<double>(kDotIters) * kChains * macs_per_instruction / best;
}

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
