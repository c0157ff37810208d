// Helpers for GPU tests: skip (the only acceptable skip) when no CUDA device.
#ifndef KVCACHE_TESTS_WORKER_BACKEND_CUDA_GPU_TEST_UTIL_H_
#define KVCACHE_TESTS_WORKER_BACKEND_CUDA_GPU_TEST_UTIL_H_

#include <cuda_runtime_api.h>

#include <memory>

#include "worker/backend/cuda/device_context.h"

namespace kvcache::cuda::testing {

inline bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

// One context per test binary.
inline std::shared_ptr<DeviceContext> Context() {
  static std::shared_ptr<DeviceContext> ctx = [] {
    auto c = DeviceContext::Create(0);
    return c.ok() ? *c : nullptr;
  }();
  return ctx;
}

}  // namespace kvcache::cuda::testing

#define KVCACHE_REQUIRE_GPU()                                                   \
  do {                                                                          \
    if (!::kvcache::cuda::testing::HaveGpu()) GTEST_SKIP() << "no CUDA device"; \
    ASSERT_NE(::kvcache::cuda::testing::Context(), nullptr);                    \
  } while (0)

#endif  // KVCACHE_TESTS_WORKER_BACKEND_CUDA_GPU_TEST_UTIL_H_
