// CUDA / cuBLAS error checking that yields absl::Status (never aborts).
//
//   KVCACHE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, n, stream), "zero tier 0");
//
// Internal to worker/backend/cuda (includes CUDA headers).
//
// Thread-safety: pure functions.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_CUDA_CHECK_H_
#define KVCACHE_WORKER_BACKEND_CUDA_CUDA_CHECK_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace kvcache::cuda {

// OK for cudaSuccess. cudaErrorMemoryAllocation -> RESOURCE_EXHAUSTED; no driver /
// no device -> UNAVAILABLE; anything else -> INTERNAL. The message is
// "<what>: <cudaGetErrorName>: <cudaGetErrorString>".
absl::Status CudaStatus(cudaError_t err, absl::string_view what);
// OK for CUBLAS_STATUS_SUCCESS; CUBLAS_STATUS_ALLOC_FAILED -> RESOURCE_EXHAUSTED;
// otherwise INTERNAL, "<what>: <cublasGetStatusName>".
absl::Status CublasStatus(cublasStatus_t st, absl::string_view what);
// The launch error of the last kernel (cudaGetLastError), as a Status.
absl::Status LastLaunchStatus(absl::string_view kernel);

}  // namespace kvcache::cuda

#define KVCACHE_CUDA_RETURN_IF_ERROR(expr, what)                                   \
  do {                                                                             \
    ::absl::Status _kvcache_cuda_st = ::kvcache::cuda::CudaStatus((expr), (what)); \
    if (!_kvcache_cuda_st.ok()) return _kvcache_cuda_st;                           \
  } while (0)

#define KVCACHE_CUBLAS_RETURN_IF_ERROR(expr, what)                                     \
  do {                                                                                 \
    ::absl::Status _kvcache_cublas_st = ::kvcache::cuda::CublasStatus((expr), (what)); \
    if (!_kvcache_cublas_st.ok()) return _kvcache_cublas_st;                           \
  } while (0)

#endif  // KVCACHE_WORKER_BACKEND_CUDA_CUDA_CHECK_H_
