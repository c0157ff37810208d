// The CUDA backend's plugin ABI: what the worker sees of libkvcache_cuda.so.
//
// The worker never links CUDA: prometheus-cpp's civetweb cannot start threads in
// a process *linked* against libcublasLt (static TLS), so the backend is a shared
// library the worker opens with dlopen after ServerProcess::Init started /metrics
// (worker/backend/backend_loader.h). The plugin exports one C symbol,
//
//   extern "C" kvcache::backend::CudaBackendFactory* kvcache_cuda_backend_v1();
//
// returning a process-lifetime factory. Types crossing the boundary are the
// project's own (absl::Status, kv::TierStorage, model::ModelRunner), so the plugin
// and the worker must come from one build (same compiler, same abseil); the
// factory's abi_version() guards against a stale plugin. The plugin keeps its own
// copies of the project libraries it uses, hidden (--exclude-libs), so nothing
// interposes.
//
// This header includes no CUDA header.
//
// Thread-safety: the factory is immutable; a CudaBackend is safe to share, its
// tier storages and runners follow their own interfaces' rules.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_CUDA_BACKEND_H_
#define KVCACHE_WORKER_BACKEND_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/kv/kv_shape.h"
#include "worker/kv/tier_storage.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_runner.h"

namespace kvcache::backend {

// Bumped whenever a class below changes layout or a virtual is added.
inline constexpr int kCudaBackendAbiVersion = 1;
inline constexpr char kCudaBackendEntryPoint[] = "kvcache_cuda_backend_v1";
inline constexpr char kCudaPluginFileName[] = "libkvcache_cuda.so";

struct CudaBackendOptions {
  int device = 0;  // cuda:N
};

struct CudaRunnerOptions {
  int max_batch_tokens = 512;  // new tokens per Forward (sizes device scratch)
  bool cuda_graphs = true;     // replay steps of up to 128 tokens from CUDA graphs
};

// One device. Owns the CUDA context state (streams, cuBLAS handle) that its tier
// storages and runners share; it must outlive them.
class CudaBackend {
 public:
  virtual ~CudaBackend() = default;

  // "cuda:0 (NVIDIA H200, 139.8 GiB, sm_90)".
  virtual std::string Describe() const = 0;

  // Tier 0: one cudaMalloc slab on the device; tier 1: one cudaHostAlloc (pinned)
  // slab. Offload/restore run on the backend's copy stream. Plug into
  // kv::KvCacheOptions::storage_factory. Out of memory is RESOURCE_EXHAUSTED
  // naming --tier0_bytes / --tier1_bytes.
  virtual kv::TierStorageFactory MakeTierStorageFactory() = 0;

  // A forward pass on this device. Weights are uploaded here in their file
  // encoding (device memory = the file's matrix bytes). REQUIRES: `model` and
  // `tier0` outlive the runner; `tier0` was made by this backend's factory
  // (FAILED_PRECONDITION otherwise) with `shape`'s pages.
  virtual absl::StatusOr<model::ModelRunnerPtr> CreateRunner(const model::LlamaModel& model,
                                                             kv::TierStorage& tier0, const kv::KvShape& shape,
                                                             const CudaRunnerOptions& options) = 0;
};

class CudaBackendFactory {
 public:
  virtual int abi_version() const = 0;
  // UNAVAILABLE "no CUDA device: ..." when the driver or device is missing;
  // INVALID_ARGUMENT when options.device is out of range.
  virtual absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options) const = 0;

 protected:
  ~CudaBackendFactory() = default;  // process lifetime; never deleted by callers
};

using CudaBackendEntryFn = CudaBackendFactory* (*)();

}  // namespace kvcache::backend

#endif  // KVCACHE_WORKER_BACKEND_CUDA_CUDA_BACKEND_H_
