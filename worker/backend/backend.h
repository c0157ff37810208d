// The compute backends a worker runs on, behind one interface, chosen by
// --device from a table (backend.cc):
//
//   cpu          CpuLlamaRunner over host pages (default; needs no NVIDIA driver)
//   cuda[:N]     the CUDA plugin (libkvcache_cuda.so, opened with dlopen by
//                backend_loader.h): tier 0 in device memory, tier 1 pinned host
//
// A backend says where the KV cache's pages live (a tier storage factory for
// kv::KvCacheOptions) and builds the runner that computes over them. Open a
// CUDA backend only after ServerProcess::Init started /metrics (common/server.h).
//
// Thread-safety: OpenBackend is reentrant; a Backend is used by one thread at a
// time (the worker's start-up), its runner by the engine thread.
#ifndef KVCACHE_WORKER_BACKEND_BACKEND_H_
#define KVCACHE_WORKER_BACKEND_BACKEND_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "worker/backend/backend_loader.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_runner.h"

namespace kvcache::backend {

struct BackendOptions {
  std::string cuda_plugin;     // --cuda_plugin ("" = the default candidates)
  int max_batch_tokens = 512;  // new tokens per Forward (sizes scratch buffers)
  int cpu_threads = 0;         // CPU kernel threads (0: leave cpu::NumThreads() as it is)
  bool cuda_graphs = true;     // CUDA: replay steps of up to 128 tokens from graphs
  // CPU kernel level (unset: leave cpu::GetCpuKernelLevel() as it is).
  std::optional<cpu::CpuKernelLevel> cpu_kernel_level;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu (avx512, 2 threads)", "cuda:0 (NVIDIA H200, 139.8 GiB, sm_90)".
  virtual std::string Describe() const = 0;

  // Where tier 0 and tier 1 pages live: plug into kv::KvCacheOptions. Null for
  // host memory (the KV cache's default).
  virtual kv::TierStorageFactory MakeTierStorageFactory() = 0;

  // The forward pass over `model`, reading and writing `kv`'s tier-0 pages.
  // REQUIRES: `model` and `kv` outlive the runner; `kv` was made with this
  // backend's storage factory and `model`'s KV shape.
  virtual absl::StatusOr<model::ModelRunnerPtr> CreateRunner(const model::LlamaModel& model,
                                                             kv::KvCacheManager& kv) = 0;
};

// The backend for `device`: NOT_FOUND / FAILED_PRECONDITION / UNAVAILABLE /
// INVALID_ARGUMENT as LoadCudaBackend says for CUDA.
absl::StatusOr<std::unique_ptr<Backend>> OpenBackend(const DeviceSpec& device, const BackendOptions& options);

}  // namespace kvcache::backend

#endif  // KVCACHE_WORKER_BACKEND_BACKEND_H_
