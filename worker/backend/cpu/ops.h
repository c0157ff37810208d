// Element-wise and small kernels of the Llama forward pass: RMSNorm, RoPE, SwiGLU,
// residual add, softmax, embedding lookup, argmax.
//
// Activations are f32, row-major, one row per token. In-place use (out == in) is
// allowed wherever noted. Each kernel dispatches on GetCpuKernelLevel() (AVX2
// vector code or the scalar reference) and runs on the calling thread: these
// kernels are memory-light next to MatMul, so they do not fork threads.
//
// Thread-safety: free functions are reentrant; RopeTable is immutable after
// Create() and safe to share between threads.
#ifndef KVCACHE_WORKER_BACKEND_CPU_OPS_H_
#define KVCACHE_WORKER_BACKEND_CPU_OPS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/backend/cpu/matmul.h"
#include "worker/model/rope.h"

namespace kvcache::cpu {

// y[t][i] = x[t][i] / sqrt(mean_j x[t][j]^2 + eps) * weight[i].
// x, y: [n_tokens][n]; weight: [n]. y may equal x.
void RmsNorm(const float* x, const float* weight, int n_tokens, int64_t n, float eps, float* y);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g). out may equal gate or up.
void SwiGlu(const float* gate, const float* up, int64_t n, float* out);

// out[i] = a[i] + b[i] (residual add). out may equal a or b.
void Add(const float* a, const float* b, int64_t n, float* out);

// In-place softmax of each row of x: [n_rows][n], computed as e^(x - max) / sum.
// REQUIRES: every row holds at least one finite value.
void Softmax(float* x, int n_rows, int64_t n);

// Embedding lookup: out[i][:] = dequant(table row ids[i]). table: [rows = vocab][cols
// = d_model] of any type DequantizeRow decodes; out: [ids.size()][table.cols].
// INVALID_ARGUMENT when an id is outside [0, table.rows).
absl::Status GetRows(const WeightView& table, absl::Span<const int32_t> ids, float* out);

// Rotary position embedding: the model's RoPE (worker/model/rope.h: angles,
// frequency factors, linear and YaRN scaling) as a table.
using model::RopeParams;

// cos/sin of every position below max_positions (model::RopeAt, in double,
// magnitude included), stored as f32 in the form the rotation consumes. Pair i
// of position p is the slots (a, b) = (2i, 2i+1), or (i, i + head_dim/2) for NeoX:
//   cos_row(p)[a] = cos_row(p)[b] = cos_i(p),
//   sin_row(p)[a] = -sin_i(p), sin_row(p)[b] = +sin_i(p),
// so x' = x * cos_row + swap(x) * sin_row, swap exchanging each pair's slots.
class RopeTable {
 public:
  // INVALID_ARGUMENT unless head_dim is even and positive, freq_base > 0,
  // freq_scale > 0, max_positions > 0 and freq_factors is empty or holds
  // head_dim / 2 positive values.
  static absl::StatusOr<RopeTable> Create(const RopeParams& params, int max_positions);

  // Rotates x: [n_tokens][n_heads][head_dim] in place; token t is at positions[t].
  // INVALID_ARGUMENT when positions.size() != n_tokens or a position is outside
  // [0, max_positions()).
  absl::Status Apply(float* x, int n_tokens, int n_heads, absl::Span<const int32_t> positions) const;

  int max_positions() const { return max_positions_; }
  int head_dim() const { return params_.head_dim; }
  // [head_dim] each; REQUIRES 0 <= pos < max_positions().
  const float* cos_row(int pos) const { return cos_.data() + int64_t{pos} * params_.head_dim; }
  const float* sin_row(int pos) const { return sin_.data() + int64_t{pos} * params_.head_dim; }

 private:
  RopeTable(const RopeParams& params, int max_positions);
  RopeParams params_;
  int max_positions_;
  std::vector<float> cos_;  // [max_positions][head_dim]
  std::vector<float> sin_;  // [max_positions][head_dim]
};

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_OPS_H_
