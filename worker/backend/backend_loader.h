// Chooses the compute device from --device and opens the CUDA backend plugin.
//
//   --device=cpu          the CPU backend (default; needs no NVIDIA driver)
//   --device=cuda[:N]     the CUDA backend on device N (default 0), loaded from
//                         libkvcache_cuda.so with dlopen (see cuda/cuda_backend.h)
//
// The worker binary never links CUDA; call LoadCudaBackend only after
// ServerProcess::Init started /metrics (common/server.h explains why).
// This file includes no CUDA header.
//
// Thread-safety: functions are reentrant; the loaded plugin stays mapped for the
// life of the process (CUDA libraries do not support being unloaded).
#ifndef KVCACHE_WORKER_BACKEND_BACKEND_LOADER_H_
#define KVCACHE_WORKER_BACKEND_BACKEND_LOADER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/backend/cuda/cuda_backend.h"

namespace kvcache::backend {

struct DeviceSpec {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;  // cuda:N

  std::string ToString() const;
};

// Parses "cpu", "cuda" or "cuda:N" (N a non-negative integer).
// INVALID_ARGUMENT naming --device otherwise.
absl::StatusOr<DeviceSpec> ParseDevice(const std::string& text);

// Where the plugin is looked for, in order: `flag_path` alone when non-empty
// (--cuda_plugin); else libkvcache_cuda.so beside the running executable, then
// in $KVCACHE_BUILD_DIR/worker and $KVCACHE_BUILD_DIR.
std::vector<std::string> CudaPluginCandidates(const std::string& flag_path);

// Opens the plugin and creates the backend for device `device.index`.
// NOT_FOUND: no plugin file at any candidate (the message lists them and says how
//   to build it); FAILED_PRECONDITION: the file exists but cannot be loaded (a
//   missing libcudart/libcublas, a stale ABI) with dlerror's text;
// UNAVAILABLE "no CUDA device: ...": no NVIDIA driver or no device;
// INVALID_ARGUMENT: device index out of range.
// REQUIRES: device.kind == kCuda.
absl::StatusOr<std::unique_ptr<CudaBackend>> LoadCudaBackend(const DeviceSpec& device,
                                                             const std::string& flag_path);

}  // namespace kvcache::backend

#endif  // KVCACHE_WORKER_BACKEND_BACKEND_LOADER_H_
