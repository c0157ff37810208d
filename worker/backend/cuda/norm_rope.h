// RMSNorm and RoPE kernels of the GPU forward pass.
//
// Host-only header: no CUDA include.
//
// Thread-safety: launchers are reentrant; ordering is the stream's.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_NORM_ROPE_H_
#define KVCACHE_WORKER_BACKEND_CUDA_NORM_ROPE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "worker/backend/cuda/stream.h"

namespace kvcache::model {
struct RopeParams;  // worker/model/rope.h
}  // namespace kvcache::model

namespace kvcache::cuda {

// y[r][i] = f16(x[rows[r]][i] * RmsScale(sum_j x[rows[r]][j]^2, n, eps) * weight[i]).
//   x: [*][n] f32, weight: [n] f32, y: [n_rows][n] f16 bits (the next GEMM's input).
//   rows: device [n_rows] row indices into x, or null for rows 0..n_rows-1.
absl::Status RmsNormToF16(const float* x, const int32_t* rows, const float* weight, int n_rows, int64_t n,
                          float eps, uint16_t* y, cudaStream_t stream);

// Per-head RMSNorm in place (Qwen 3's Q/K norms): every [head_dim] head h in
// [0, n_heads) of each row becomes head * RmsScale(head) * weight.
//   x: row t at x + t * row_stride, [n_heads][head_dim] f32; weight: device [head_dim]
absl::Status HeadRmsNorm(float* x, int n_tokens, int64_t row_stride, int n_heads, int head_dim,
                         const float* weight, float eps, cudaStream_t stream);

// Rotates heads [0, n_heads) of each row in place; pair i is (2i, 2i+1) (llama
// NORM RoPE) or (i, i + head_dim/2) when neox (Qwen):
//   x: row t at x + t * row_stride, [n_heads][head_dim] f32
//   cos_sin: device [max_positions][head_dim / 2] float2 (cos, sin), see RopeCosSinTable
//   positions: device [n_tokens]
absl::Status Rope(float* x, int n_tokens, int64_t row_stride, int n_heads, int head_dim, bool neox,
                  const float* cos_sin, const int32_t* positions, cudaStream_t stream);

// Host table for Rope: [max_positions][head_dim / 2] (cos, sin) pairs of the
// model's RoPE (model::RopeAt in double, then rounded to f32, as the CPU
// backend's RopeTable does). Defined in rope_table.cc (host code).
void RopeCosSinTable(const model::RopeParams& params, int max_positions, float* out);

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_NORM_ROPE_H_
