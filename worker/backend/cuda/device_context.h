// Per-device CUDA state shared by the backend's tier storages and runners: the
// device index, a compute stream (kernels, cuBLAS), a copy stream (offload,
// restore, page import/export) and the cuBLAS handle; plus RAII owners of device
// and pinned host allocations.
//
// Stream discipline: kernels run on compute_stream(). A page copy first makes the
// copy stream wait for everything already queued on the compute stream
// (CopyAfterCompute), and the copying call waits for its own completion before it
// returns, so a page is never read or freed while a copy is in flight.
//
// Internal to worker/backend/cuda (includes CUDA headers).
//
// Thread-safety: immutable after Create; every entry point that may run on a new
// thread calls Activate() (cudaSetDevice) first. The cuBLAS handle is used by one
// Forward at a time (ModelRunner's contract); a runner capturing a CUDA graph
// binds it to its capture stream for the capture's length.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_DEVICE_CONTEXT_H_
#define KVCACHE_WORKER_BACKEND_CUDA_DEVICE_CONTEXT_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache::cuda {

class DeviceContext {
 public:
  // UNAVAILABLE "no CUDA device: ..." when the driver is missing or reports no
  // device; INVALID_ARGUMENT when `device` is out of range.
  static absl::StatusOr<std::shared_ptr<DeviceContext>> Create(int device);
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  int device() const { return device_; }
  cudaStream_t compute_stream() const { return compute_; }
  cudaStream_t copy_stream() const { return copy_; }
  cublasHandle_t cublas() const { return cublas_; }
  const std::string& name() const { return name_; }
  int64_t total_bytes() const { return total_bytes_; }

  // cudaSetDevice(device()).
  absl::Status Activate() const;
  // Makes the copy stream wait for work queued on the compute stream so far.
  absl::Status CopyAfterCompute() const;
  // Blocks until the copy stream is idle.
  absl::Status SyncCopy(absl::string_view what) const;
  // "cuda:0 (NVIDIA H200, 139.8 GiB, sm_90)".
  std::string Describe() const;

 private:
  DeviceContext() = default;

  int device_ = 0;
  std::string name_;
  int cc_major_ = 0, cc_minor_ = 0;
  int64_t total_bytes_ = 0;
  cudaStream_t compute_ = nullptr;
  cudaStream_t copy_ = nullptr;
  cudaEvent_t compute_mark_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
};

// Owns one cudaMalloc allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // RESOURCE_EXHAUSTED (naming `what`) when the device is out of memory.
  static absl::StatusOr<DeviceBuffer> Allocate(int64_t bytes, absl::string_view what);
  void Reset();
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  int64_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

// Owns one cudaHostAlloc (pinned, portable, mapped into the device's address space) allocation.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { Reset(); }
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  static absl::StatusOr<PinnedBuffer> Allocate(int64_t bytes, absl::string_view what);
  void Reset();
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  int64_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

// y[t][r] (+)= sum_c w[r][c] x[t][c] with cublasGemmEx: f16 inputs, f32 output and
// accumulation (CUBLAS_COMPUTE_32F, tensor cores).
//   w: [rows][cols] f16 (row-major, as GGUF), x: [n_tokens][cols] f16,
//   y: [n_tokens][ldy] f32; beta = 1 adds into y (residual connections).
absl::Status GemmF16(cublasHandle_t handle, const uint16_t* w, int64_t rows, int64_t cols, const uint16_t* x,
                     int n_tokens, float* y, int64_t ldy, float beta);

}  // namespace kvcache::cuda

#endif  // KVCACHE_WORKER_BACKEND_CUDA_DEVICE_CONTEXT_H_
