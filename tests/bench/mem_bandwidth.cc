#include "tests/bench/mem_bandwidth.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "worker/backend/cpu/compute_pool.h"

namespace kvcache::bench {
namespace {

// The int32 sum of the bytes' dwords (a trailing partial dword is left out).
__attribute__((target("avx2"))) int64_t SumBytes(const uint8_t* p, int64_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0;
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    a0 = _mm256_add_epi32(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi32(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
  }
  alignas(32) int32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_add_epi32(a0, a1));
  int64_t s = 0;
  for (int32_t x : t) s += x;
  for (; i + 4 <= bytes; i += 4) {
    int32_t x;
    std::memcpy(&x, p + i, sizeof(x));
    s += x;
  }
  return s;
}

constexpr int kVnniChains = 12;
constexpr int64_t kDotIters = int64_t{1} << 22;

// Returns a value depending on every chain (so none is optimised away).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t DotChainsVnni(int64_t iters) {
  __m512i acc[kVnniChains];
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

// The AVX2 chains are written in asm. As intrinsics with one shared operand pair
// (until 2026-12-06), GCC 12 computed the product once per iteration, added it
// to all 12 chains and kept 9 of them on the stack: the loop timed the
// store-to-load latency of the spilled adds while counting 12 products. On an
// AMD EPYC Zen 3 that loop gave 106-112 GMAC/s a core and these chains 158-165,
// alternating in one process (rdtsc at the nominal 2.45 GHz); engine_bench's
// figure on 2 threads went from 189-221 to 288-329 GMAC/s.
constexpr int kAvx2Chains = 8;

__attribute__((target("avx2"))) int64_t DotChainsAvx2(int64_t iters) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(5), x = _mm256_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i) {
    __m256i t;
    __asm__(
        "vpmaddubsw %[x], %[w0], %[t]\n\tvpaddw %[t], %[a0], %[a0]\n\t"
        "vpmaddubsw %[x], %[w1], %[t]\n\tvpaddw %[t], %[a1], %[a1]\n\t"
        "vpmaddubsw %[x], %[w0], %[t]\n\tvpaddw %[t], %[a2], %[a2]\n\t"
        "vpmaddubsw %[x], %[w1], %[t]\n\tvpaddw %[t], %[a3], %[a3]\n\t"
        "vpmaddubsw %[x], %[w0], %[t]\n\tvpaddw %[t], %[a4], %[a4]\n\t"
        "vpmaddubsw %[x], %[w1], %[t]\n\tvpaddw %[t], %[a5], %[a5]\n\t"
        "vpmaddubsw %[x], %[w0], %[t]\n\tvpaddw %[t], %[a6], %[a6]\n\t"
        "vpmaddubsw %[x], %[w1], %[t]\n\tvpaddw %[t], %[a7], %[a7]"
        : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5),
          [a6] "+x"(a6), [a7] "+x"(a7), [t] "=&x"(t)
        : [w0] "x"(w0), [w1] "x"(w1), [x] "x"(x));
  }
  const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3)),
                                     _mm256_add_epi16(_mm256_add_epi16(a4, a5), _mm256_add_epi16(a6, a7)));
  alignas(32) int16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  int64_t sum = 0;
  for (int16_t v : lanes) sum += v;
  return sum;
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
  const double macs_per_iteration = vnni ? 64.0 * kVnniChains : 32.0 * kAvx2Chains;
  return threads * static_cast<double>(kDotIters) * macs_per_iteration / best;
}

double MeasureReadBandwidth(int threads) {
  const int64_t n = int64_t{512} << 20;
  uint8_t* buf = static_cast<uint8_t*>(std::aligned_alloc(64, n));
  // Parts of 1 MiB, handed out to whichever thread is free.
  constexpr int64_t kPart = int64_t{1} << 20;
  std::vector<Piece> parts;
  for (int64_t p = 0; p < n / kPart; ++p) parts.push_back({buf + p * kPart, kPart});
  cpu::ComputePool::Get().ParallelFor(static_cast<int64_t>(parts.size()), threads,
                                      [&](int64_t p) { std::memset(buf + p * kPart, 1, kPart); });
  const double bw = MeasurePiecesReadBandwidth(threads, parts, 1);
  std::free(buf);
  return bw;
}

double MeasurePiecesReadBandwidth(int threads, const std::vector<Piece>& pieces, int per_task) {
  using Clock = std::chrono::steady_clock;
  const int64_t n = static_cast<int64_t>(pieces.size());
  const int64_t tasks = (n + per_task - 1) / per_task;
  double bytes = 0;
  for (const Piece& p : pieces) bytes += static_cast<double>(p.bytes);
  std::vector<int64_t> sums(static_cast<size_t>(tasks));
  cpu::ComputePool& pool = cpu::ComputePool::Get();
  double best = 1e30;
  int64_t sink = 0;
  for (int r = 0; r < 5; ++r) {
    const auto start = Clock::now();
    pool.ParallelFor(tasks, threads, [&](int64_t t) {
      int64_t s = 0;
      for (int64_t i = t * per_task; i < std::min(n, (t + 1) * per_task); ++i) {
        s += SumBytes(static_cast<const uint8_t*>(pieces[i].data), pieces[i].bytes);
      }
      sums[t] = s;
    });
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
    for (int64_t v : sums) sink += v;
  }
  if (sink == 1) return 0;  // keeps the sums alive
  return bytes / best;
}

}  // namespace kvcache::bench
