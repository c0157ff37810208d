// SwiGLU and bias kernels of the GPU forward pass.
//
// Host-only header: no CUDA include.
//
// Thread-safety: launchers are reentrant; ordering is the stream's.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_ACTIVATION_H_
#define KVCACHE_WORKER_BACKEND_CUDA_ACTIVATION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "worker/backend/cuda/stream.h"

namespace kvcache::cuda {

// out[t][i] = f16(SwiGluValue(gate_up[t][i], gate_up[t][n_ff + i])).
//   gate_up: [n_tokens][2 * n_ff] f32 (the fused gate|up GEMM), out: [n_tokens][n_ff] f16 bits.
absl::Status SwiGluToF16(const float* gate_up, int n_tokens, int64_t n_ff, uint16_t* out,
                         cudaStream_t stream);

// x[t][i] += bias[i] for i < n: the Q/K/V projection biases (Qwen 2) on the
// fused QKV GEMM's output. x: row t at x + t * row_stride, f32; bias: device [n].
absl::Status AddBias(float* x, int n_tokens, int64_t row_stride, int64_t n, const float* bias,
                     cudaStream_t stream);

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_ACTIVATION_H_
