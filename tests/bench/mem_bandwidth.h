// Yardsticks of the machine, measured in the same run as the figures they
// divide: its memory read bandwidth (attention_bw_fraction, weight-stream
// fractions) and the peak rate of its integer-dot instructions (what bounds a
// compute-bound batched step).
//
// Thread-safety: reentrant; uses `threads` ComputePool threads and 512 MiB.
#ifndef KVCACHE_TESTS_BENCH_MEM_BANDWIDTH_H_
#define KVCACHE_TESTS_BENCH_MEM_BANDWIDTH_H_

#include <cstdint>
#include <vector>

namespace kvcache::bench {

// Bytes per second of an AVX2 read-and-sum over a 512 MiB buffer split across
// `threads` threads: the fastest of 5 passes (the cores are shared, slower passes
// measure the neighbours).
double MeasureReadBandwidth(int threads);

// A range of bytes that MeasurePiecesReadBandwidth reads.
struct Piece {
  const void* data;
  int64_t bytes;
};

// Bytes per second of a read-and-sum of `pieces` in their order, in tasks of
// `per_task` consecutive pieces handed out to whichever of `threads` threads is
// free: the fastest of 5 passes. What memory gives a kernel that reads those
// bytes in that order and does nothing else (engine_bench: a session's K/V
// pages as attention reads them, scattered as a page table scatters them).
double MeasurePiecesReadBandwidth(int threads, const std::vector<Piece>& pieces, int per_task);

// Multiply-accumulates per second of the integer-dot instruction a CPU kernel
// level is built on, on `threads` threads at once, in independent chains a thread
// (more than the latency x throughput of any core we run on): 12 of vpdpbusd on
// zmm (64 u8 x s8 products into int32) when `vnni`, else 8 of AVX2 vpmaddubsw on
// ymm plus the int16 add that accumulates it (32 products), each on operands of
// its own. No kernel that issues these instructions can exceed it; the fastest
// of 5 runs.
double MeasureInt8DotPeak(int threads, bool vnni);

}  // namespace kvcache::bench

#endif  // KVCACHE_TESTS_BENCH_MEM_BANDWIDTH_H_
