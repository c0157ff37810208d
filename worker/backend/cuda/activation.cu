// SwiGLU kernel (see activation.h).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "worker/backend/cuda/activation.h"
#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/kernel_math.h"

namespace kvcache::cuda {
namespace {

static __global__ void SwiGluKernel(const float* gate_up, int64_t total, int64_t n_ff, uint16_t* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / n_ff, c = i % n_ff;
    const float* row = gate_up + t * 2 * n_ff;
    out[i] = __half_as_ushort(__float2half_rn(SwiGluValue(row[c], row[n_ff + c])));
  }
}

static __global__ void AddBiasKernel(float* x, int64_t row_stride, int64_t n, const float* bias) {
  float* row = x + blockIdx.y * row_stride;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    row[i] += bias[i];
  }
}

}  // namespace

absl::Status AddBias(float* x, int n_tokens, int64_t row_stride, int64_t n, const float* bias,
                     cudaStream_t stream) {
  if (n_tokens <= 0 || n <= 0) return absl::OkStatus();
  if (n_tokens > 65535) return absl::InvalidArgumentError("AddBias: more than 65535 tokens");
  const int64_t blocks = (n + 255) / 256;
  AddBiasKernel<<<dim3(static_cast<unsigned>(blocks < 1024 ? blocks : 1024), n_tokens), 256, 0, stream>>>(
      x, row_stride, n, bias);
  return LastLaunchStatus("AddBiasKernel");
}

absl::Status SwiGluToF16(const float* gate_up, int n_tokens, int64_t n_ff, uint16_t* out,
                         cudaStream_t stream) {
  const int64_t total = int64_t{n_tokens} * n_ff;
  if (total <= 0) return absl::OkStatus();
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  SwiGluKernel<<<static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8), threads, 0, stream>>>(
      gate_up, total, n_ff, out);
  return LastLaunchStatus("SwiGluKernel");
}

}  // namespace kvcache::cuda
