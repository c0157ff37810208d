// RMSNorm and RoPE kernels (see norm_rope.h).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/kernel_math.h"
#include "worker/backend/cuda/norm_rope.h"

namespace kvcache::cuda {
namespace {

constexpr int kNormThreads = 256;

// One block per output row.
static __global__ void RmsNormKernel(const float* x, const int32_t* rows, const float* w, int64_t n,
                                     float eps, uint16_t* y) {
  const int64_t src = rows != nullptr ? rows[blockIdx.x] : blockIdx.x;
  const float* xr = x + src * n;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kNormThreads) ss = fmaf(xr[i], xr[i], ss);
  __shared__ float part[kNormThreads / 32];
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) total += part[i];
  const float scale = RmsScale(total, n, eps);
  uint16_t* yr = y + int64_t{blockIdx.x} * n;
  for (int64_t i = threadIdx.x; i < n; i += kNormThreads) {
    yr[i] = __half_as_ushort(__float2half_rn(xr[i] * scale * w[i]));
  }
}

// grid (n_heads, n_tokens), one warp per head.
static __global__ void HeadRmsNormKernel(float* x, int64_t row_stride, int head_dim, const float* w,
                                         float eps) {
  float* head = x + blockIdx.y * row_stride + int64_t{blockIdx.x} * head_dim;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < head_dim; i += 32) ss = fmaf(head[i], head[i], ss);
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float scale = RmsScale(ss, head_dim, eps);
  for (int i = threadIdx.x; i < head_dim; i += 32) head[i] = head[i] * scale * w[i];
}

// grid (ceil(n_heads * head_dim / 2 / 256), n_tokens): one thread per pair.
static __global__ void RopeKernel(float* x, int64_t row_stride, int n_heads, int head_dim, bool neox,
                                  const float2* cos_sin, const int32_t* positions) {
  const int t = blockIdx.y;
  const int half = head_dim / 2;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_heads * half) return;
  const int h = i / half, pair = i % half;
  const float2 cs = cos_sin[int64_t{positions[t]} * half + pair];
  float* head = x + t * row_stride + int64_t{h} * head_dim;
  if (neox) {
    RopeRotate(head + pair, head + pair + half, cs.x, cs.y);
  } else {
    RopeRotate(head + 2 * pair, head + 2 * pair + 1, cs.x, cs.y);
  }
}

}  // namespace

absl::Status RmsNormToF16(const float* x, const int32_t* rows, const float* weight, int n_rows, int64_t n,
                          float eps, uint16_t* y, cudaStream_t stream) {
  if (n_rows <= 0) return absl::OkStatus();
  RmsNormKernel<<<n_rows, kNormThreads, 0, stream>>>(x, rows, weight, n, eps, y);
  return LastLaunchStatus("RmsNormKernel");
}

absl::Status HeadRmsNorm(float* x, int n_tokens, int64_t row_stride, int n_heads, int head_dim,
                         const float* weight, float eps, cudaStream_t stream) {
  if (n_tokens <= 0 || n_heads <= 0) return absl::OkStatus();
  if (n_tokens > 65535) return absl::InvalidArgumentError("HeadRmsNorm: more than 65535 tokens");
  HeadRmsNormKernel<<<dim3(n_heads, n_tokens), 32, 0, stream>>>(x, row_stride, head_dim, weight, eps);
  return LastLaunchStatus("HeadRmsNormKernel");
}

absl::Status Rope(float* x, int n_tokens, int64_t row_stride, int n_heads, int head_dim, bool neox,
                  const float* cos_sin, const int32_t* positions, cudaStream_t stream) {
  if (n_tokens <= 0) return absl::OkStatus();
  if (n_tokens > 65535) return absl::InvalidArgumentError("Rope: more than 65535 tokens");
  const int pairs = n_heads * head_dim / 2;
  const dim3 grid((pairs + 255) / 256, n_tokens);
  RopeKernel<<<grid, 256, 0, stream>>>(x, row_stride, n_heads, head_dim, neox,
                                       reinterpret_cast<const float2*>(cos_sin), positions);
  return LastLaunchStatus("RopeKernel");
}

}  // namespace kvcache::cuda
