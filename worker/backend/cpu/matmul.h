// Quantised matrix multiply: the linear layers of the forward pass.
//
//   y[t][r] = sum_c w[r][c] * x[t][c]     w: [rows][cols] (GGUF: cols = ne0 contiguous)
//                                         x: [n_tokens][cols] f32, y: [n_tokens][rows] f32
//
// Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K weights take llama.cpp's route:
// each activation row is quantised once per call to Q8 blocks of 32 (int8 + f32
// scale + scaled block sum, the latter for the offsets and mins of Q4_0/Q4_1/Q5_0/
// Q4_K/Q5_K, + the integer sum of each 16, for the offsets at which the kernels
// read the signed Q6_K and, at AVX-512, Q8_0 weights) and dotted with integer
// SIMD (AVX2 maddubs/madd or AVX-512 VNNI vpdpbusd). K-quant super-blocks of 256
// are read as 8 blocks of 32, each with its
// sub-block scale(s) and min, against the same Q8 activations. Each weight row is
// dotted against all tokens while it is in L1, so a decode step of 16 sessions
// reads the weights once. The kernels want a matrix re-laid once by
// InterleaveRows16 (the CPU runner does so at load, CpuModelWeights): groups of 16
// rows whose blocks hold 4 values of every row per 64 bytes, so that one
// instruction covers 4 values of 8 rows (AVX2 maddubs, one f32 lane a row) or of
// 16 (AVX-512 VNNI vpdpbusd on zmm), for any token count. Rows outside whole
// groups, and matrices passed without that layout, are dotted row by row from the
// stored layout in groups of 8 (see matmul_x86.inc). Every route of both vector
// levels rounds exactly as the scalar reference kernel does, so a token's result
// does not depend on the batch, the route, the layout or the machine's level
// (cpu_kernels_test, IntegerDotEqualsScalarBitForBit,
// InterleavedWeightsEqualScalarBitForBit). F32 weights use an FMA kernel; every
// other type DequantizeRow()s tiles of rows to f32.
// From `SgemmMinTokens()` tokens on (prefill), tiles of dequantised rows go to
// OpenBLAS sgemm instead when that is faster (see MatMulPath).
//
// Work is split over chunks of output rows on ComputePool (up to NumThreads()
// threads; a product of under ~16 KiB of weight traffic per thread uses fewer).
// Each row is computed by one thread whole, so results do not depend on the
// split. The sgemm path calls OpenBLAS from each pool thread and so sets
// openblas_set_num_threads(1) (process-wide) to avoid oversubscription.
//
// Thread-safety: reentrant; concurrent calls from different threads are safe
// (each has its own scratch) but they then share the cores.
#ifndef KVCACHE_WORKER_BACKEND_CPU_MATMUL_H_
#define KVCACHE_WORKER_BACKEND_CPU_MATMUL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/gguf/ggml_types.h"
#include "worker/model/weight_view.h"

namespace kvcache::cpu {

// The model layer's weight matrix (worker/model/weight_view.h).
using model::WeightView;

// A weight matrix as MatMul takes it: the model's view and, optionally, the same
// matrix re-laid once by InterleaveRows16. The vector kernels then read the
// interleaved bytes for every whole group of 16 rows (every token count: a decode
// step and a batch of 16 sessions read the same bytes, and neither re-lays the
// weights per call); the scalar kernels, the sgemm route and the rows after the
// last whole group read `view`. Both must hold the same matrix.
struct KernelWeight {
  KernelWeight() = default;
  KernelWeight(const WeightView& v) : view(v) {}  // NOLINT(google-explicit-constructor)
  KernelWeight(const WeightView& v, const uint8_t* i) : view(v), interleaved(i) {}
  WeightView view;
  const uint8_t* interleaved = nullptr;  // InterleaveRows16(view)'s bytes, or nullptr
};

// `w` re-laid for the kernels in groups of 16 rows (the first rows / 16 * 16 rows):
// each 32-value block of a group holds its 16 rows' scales, then its quants so
// that one 64-byte load gives 4 consecutive values of all 16 rows (a maddubs or
// vpdpbusd operand, no shuffling per call; see matmul_x86.inc). Every
// IsIntegerDotType type has this layout, the same size as the rows it covers,
// except Q4_K and Q5_K, whose 6-bit scales and mins are stored as bytes: 64 bytes
// more per 16 rows and super-block of 256, 2-3%. Other types, or fewer than 16
// rows, give an empty result. Runs once per matrix, at load, on the compute pool.
std::vector<uint8_t> InterleaveRows16(const WeightView& w);

enum class MatMulPath {
  kAuto,   // kDot below SgemmMinTokens() tokens, kSgemm from there on
  kDot,    // integer (types above) or f32 SIMD dot kernel, weights read once per call
  kSgemm,  // dequantise row tiles to f32, then cblas_sgemm per tile
};

// y = x · wᵀ. x: [n_tokens][x_stride] (first cols used), y: [n_tokens][y_stride]
// (first rows written), with w.view's rows and cols.
// REQUIRES: w.view.data holds rows * RowBytes(type, cols) bytes; w.interleaved is
//   null or InterleaveRows16(w.view)'s bytes; x and y do not overlap;
//   x_stride >= cols; y_stride >= rows; n_tokens >= 0.
// INVALID_ARGUMENT for bad shapes (cols not a whole number of blocks, strides too
// small), UNIMPLEMENTED for a weight type DequantizeRow cannot decode.
absl::Status MatMul(const KernelWeight& w, const float* x, int64_t x_stride, int n_tokens, float* y,
                    int64_t y_stride, MatMulPath path = MatMulPath::kAuto);

// Dense strides: x [n_tokens][cols], y [n_tokens][rows].
inline absl::Status MatMul(const KernelWeight& w, const float* x, int n_tokens, float* y) {
  return MatMul(w, x, w.view.cols, n_tokens, y, w.view.rows);
}

// One product of MatMulSameInput: y [n_tokens][w.rows] = x · wᵀ.
struct MatMulOutput {
  KernelWeight w;
  float* y;
};

// Several products of the same activations x [n_tokens][cols], each equal bit for
// bit to MatMul(out.w, x, n_tokens, out.y). When every weight has an integer-dot
// type and the dot route applies, they share one quantisation of x and one
// parallel loop (a layer's q/k/v or gate/up projections: fewer loops a step);
// otherwise they run one by one. Errors as MatMul's.
// REQUIRES: every out.w.view.cols equal.
absl::Status MatMulSameInput(absl::Span<const MatMulOutput> outs, const float* x, int n_tokens);

// True for the weight types with integer-dot kernels (see above): Q4_0, Q4_1,
// Q5_0, Q8_0, Q4_K, Q5_K, Q6_K. Other decodable types take the f32 route.
bool IsIntegerDotType(gguf::GgmlType type);

// How the current level's integer kernels take a call's tokens against weights of
// `type`: in tiles of up to `tile_tokens`, each tile reading every interleaved
// weight group straight from memory while the call has at most
// `max_straight_tokens` tokens (above that the call first unpacks each group once
// and its tiles share that; at avx2 that count depends on the type). Threads
// that each multiply a share of a batch's tokens by every weight (the CPU
// runner's decode groups) then prepare no weight twice while each share stays
// within max_straight_tokens, and fill whole tiles from tile_tokens on. Both 0
// at the scalar level, which has no such kernels, and for types without them.
struct MatMulTokenShape {
  int tile_tokens = 0;
  int max_straight_tokens = 0;
};
MatMulTokenShape CurrentMatMulTokenShape(gguf::GgmlType type);

// Token count from which kAuto uses the sgemm path. Default: never at kAvx512
// and kAvx2 (the integer kernels keep replies independent of prefill chunking;
// see matmul.cc), always at kScalar. SetSgemmMinTokens(n > 0) overrides it
// (INT_MAX disables sgemm); SetSgemmMinTokens(0) restores the default.
int SgemmMinTokens();
void SetSgemmMinTokens(int n_tokens);

// Overrides SgemmMinTokens for its lifetime and then restores whatever was set
// before (the per-level default included). Not for concurrent use.
class ScopedSgemmMinTokens {
 public:
  explicit ScopedSgemmMinTokens(int n_tokens);
  ~ScopedSgemmMinTokens();
  ScopedSgemmMinTokens(const ScopedSgemmMinTokens&) = delete;
  ScopedSgemmMinTokens& operator=(const ScopedSgemmMinTokens&) = delete;

 private:
  const int saved_;  // the raw setting: 0 = the level's default
};

// Activation rows quantised to Q8 blocks of 32, as the integer kernels see them
// (exposed for tests): for token t and block b,
//   x[t][32b + i] ≈ d[t][b] * q[t][32b + i],   s[t][b] = d[t][b] * sum_i q[t][32b + i].
// REQUIRES: cols % 32 == 0; q holds n_tokens*cols, d and s n_tokens*cols/32.
void QuantizeActivationsQ8(const float* x, int64_t x_stride, int n_tokens, int64_t cols, int8_t* q, float* d,
                           float* s);

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_MATMUL_H_
