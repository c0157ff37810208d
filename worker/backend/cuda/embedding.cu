// Embedding lookup kernel (see embedding.h).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/embedding.h"

namespace kvcache::cuda {
namespace {

// grid (ceil(n_embd / 256), n_tokens).
static __global__ void EmbeddingKernel(const uint16_t* table, const int32_t* ids, int64_t n_embd,
                                       float* out) {
  const int t = blockIdx.y;
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n_embd) return;
  out[t * n_embd + i] = __half2float(__ushort_as_half(table[int64_t{ids[t]} * n_embd + i]));
}

}  // namespace

absl::Status EmbeddingLookup(const uint16_t* table, const int32_t* ids, int n_tokens, int64_t n_embd,
                             float* out, cudaStream_t stream) {
  if (n_tokens <= 0) return absl::OkStatus();
  if (n_tokens > 65535) return absl::InvalidArgumentError("EmbeddingLookup: more than 65535 tokens");
  const dim3 grid(static_cast<unsigned>((n_embd + 255) / 256), n_tokens);
  EmbeddingKernel<<<grid, 256, 0, stream>>>(table, ids, n_embd, out);
  return LastLaunchStatus("EmbeddingKernel");
}

}  // namespace kvcache::cuda
