// Embedding lookup kernel of the GPU forward pass.
//
// Host-only header: no CUDA include.
//
// Thread-safety: launchers are reentrant; ordering is the stream's.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_EMBEDDING_H_
#define KVCACHE_WORKER_BACKEND_CUDA_EMBEDDING_H_

#include <cstdint>

#include "absl/status/status.h"
#include "worker/backend/cuda/stream.h"

namespace kvcache::cuda {

// out[t][:] = f32(table[ids[t]][:]).  table: [vocab][n_embd] f16 bits (dequantised
// at load), ids: device [n_tokens] (checked against the vocabulary by the caller),
// out: [n_tokens][n_embd] f32.
absl::Status EmbeddingLookup(const uint16_t* table, const int32_t* ids, int n_tokens, int64_t n_embd,
                             float* out, cudaStream_t stream);

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_EMBEDDING_H_
