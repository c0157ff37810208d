// prometheus-cpp serves /metrics through civetweb, which cannot start its
// threads in a process that was *linked* against libcublasLt (its ~94 KB of
// static TLS does not fit civetweb's small thread stacks). The worker therefore
// never links cuBLAS: the CUDA backend is a plugin opened with dlopen after the
// exposer is up. This test runs that sequence on a machine without a GPU (cuBLAS
// loads without one) and proves /metrics keeps answering.
#include <dlfcn.h>

#include <string>

#include "common/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/gauge.h"
#include "tests/testing/child_process.h"

namespace kvcache {
namespace {

TEST(MetricsWithCublasTest, ExposerKeepsServingAfterCublasLoads) {
  ServerOptions options;
  options.name = "metrics-cublas-test";
  auto process = ServerProcess::Init(options);
  ASSERT_TRUE(process.ok()) << process.status();
  auto& gauge = prometheus::BuildGauge()
                    .Name("cublas_loaded")
                    .Help("1 once cuBLAS is loaded")
                    .Register((*process)->metrics())
                    .Add({});

  const std::string dir = KVCACHE_CUDA_LIB_DIR;
  void* lt = dlopen((dir + "/libcublasLt.so").c_str(), RTLD_NOW | RTLD_GLOBAL);
  ASSERT_NE(lt, nullptr) << dlerror();
  void* blas = dlopen((dir + "/libcublas.so").c_str(), RTLD_NOW | RTLD_GLOBAL);
  ASSERT_NE(blas, nullptr) << dlerror();
  // Prove the library is really usable, not just mapped.
  ASSERT_NE(dlsym(blas, "cublasCreate_v2"), nullptr);
  gauge.Set(1);

  for (int i = 0; i < 5; ++i) {
    auto body = testing::HttpGet((*process)->metrics_port(), "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    EXPECT_THAT(*body, ::testing::HasSubstr("cublas_loaded 1"));
  }
}

}  // namespace
}  // namespace kvcache
