// The machine's memory read bandwidth, the yardstick of the bandwidth-fraction
// ratios (attention_bw_fraction, weight-stream fractions), measured in the same
// run as the figure it divides.
//
// Thread-safety: reentrant; uses `threads` ComputePool threads and 512 MiB.
#ifndef KVCACHE_TESTS_BENCH_MEM_BANDWIDTH_H_
#define KVCACHE_TESTS_BENCH_MEM_BANDWIDTH_H_

namespace kvcache::bench {

// Bytes per second of an AVX2 read-and-sum over a 512 MiB buffer split across
// `threads` threads: the fastest of 5 passes (the cores are shared, slower passes
// measure the neighbours).
double MeasureReadBandwidth(int threads);

}  // namespace kvcache::bench

#endif  // KVCACHE_TESTS_BENCH_MEM_BANDWIDTH_H_
