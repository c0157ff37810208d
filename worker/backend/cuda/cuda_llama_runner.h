// The CUDA backend's forward pass of a Llama decoder over paged KV (tier 0 on the
// device). Same math and batch as the CPU runner (cpu_llama_runner.h): the step's
// new tokens are flattened into [T][n_embd] f32 activations; per layer
//   xn = RmsNorm(x) (f16); qkv = xn·[Wq;Wk;Wv] (one GEMM); RoPE(q, k)
//   K/V of the new tokens -> their page slots; att = PagedAttention(q, pages) (f16)
//   x += att·Wo (GEMM with beta = 1); xn = RmsNorm(x); gu = xn·[Wgate;Wup]
//   x += SwiGlu(gu)·Wdown
// then logits = RmsNorm(x_last)·Woutᵀ for sequences that want them, copied back
// to the host for the engine's CPU sampler. Weights stay in their file encoding
// on the device (weight_kernels.h): a step of up to kMatVecMaxTokens tokens
// decodes them in registers (MatVec); a larger one dequantises them in slices to
// f16 and multiplies with cublasGemmEx (f32 accumulation, tensor cores). The
// activations that feed a product are f16. Everything runs on the device
// context's compute stream; a step's only host synchronisation is the logits
// copy at its end. A step of up to 128 new tokens (every decode step, short
// turns) replays a CUDA graph captured once per padded width (see
// kGraphTokenBuckets in the .cc) unless CudaRunnerOptions::cuda_graphs is off.
//
// Errors: a CUDA or cuBLAS failure fails the step (INTERNAL, the CUDA error named);
// the process keeps running. A sticky device error (e.g. an illegal address)
// leaves the context unusable, so every later step fails the same way.
//
// Thread-safety: one Forward at a time (ModelRunner's contract).
#ifndef KVCACHE_WORKER_BACKEND_CUDA_CUDA_LLAMA_RUNNER_H_
#define KVCACHE_WORKER_BACKEND_CUDA_CUDA_LLAMA_RUNNER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/backend/cuda/cuda_backend.h"
#include "worker/backend/cuda/cuda_tier_storage.h"
#include "worker/kv/kv_shape.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_runner.h"

namespace kvcache::cuda {

// REQUIRES: model and tier0 outlive the runner; tier0 is a kDevice CudaTierStorage
// with shape.page_bytes() pages; shape matches the model.
// INVALID_ARGUMENT / FAILED_PRECONDITION / UNIMPLEMENTED for mismatches or shapes
// the kernels do not handle; RESOURCE_EXHAUSTED when weights do not fit.
absl::StatusOr<model::ModelRunnerPtr> CreateCudaLlamaRunner(const model::LlamaModel& model,
                                                            CudaTierStorage& tier0, const kv::KvShape& shape,
                                                            const backend::CudaRunnerOptions& options);

// What a runner did with CUDA graphs, for tests and benchmarks.
struct CudaGraphStats {
  int64_t captures = 0;     // graphs captured
  int64_t replays = 0;      // steps run by replaying one
  int64_t eager_steps = 0;  // steps run launch by launch
  std::string error;        // why graphs were turned off, if they were
};
// Zeros for a runner CreateCudaLlamaRunner did not make.
CudaGraphStats GetCudaGraphStats(const model::ModelRunner& runner);

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_CUDA_LLAMA_RUNNER_H_
