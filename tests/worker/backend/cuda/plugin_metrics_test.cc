// The metrics trap, end to end with the real plugin: a process that started the
// Prometheus exposer (ServerProcess::Init), then dlopened libkvcache_cuda.so (which
// brings in libcublas and libcublasLt), still serves /metrics. Runs on a machine
// without a GPU: cuBLAS loads without one, and creating the backend then answers
// UNAVAILABLE.
#include <dlfcn.h>

#include "common/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/gauge.h"
#include "tests/testing/child_process.h"
#include "worker/backend/backend_loader.h"

namespace kvcache {
namespace {

TEST(PluginMetricsTest, ExposerServesAfterThePluginLoadsCublas) {
  ServerOptions options;
  options.name = "plugin-metrics-test";
  auto process = ServerProcess::Init(options);
  ASSERT_TRUE(process.ok()) << process.status();
  auto& gauge = prometheus::BuildGauge()
                    .Name("cuda_plugin_loaded")
                    .Help("1 once the plugin is loaded")
                    .Register((*process)->metrics())
                    .Add({});

  auto backend = backend::LoadCudaBackend(*backend::ParseDevice("cuda:0"), KVCACHE_TEST_CUDA_PLUGIN);
  ASSERT_TRUE(backend.ok() || absl::IsUnavailable(backend.status())) << backend.status();
  // cuBLAS is in the process now (the plugin links it).
  void* lt = dlopen("libcublasLt.so." KVCACHE_CUBLAS_MAJOR, RTLD_NOW | RTLD_NOLOAD);
  void* blas = dlopen("libcublas.so." KVCACHE_CUBLAS_MAJOR, RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(lt, nullptr) << "libcublasLt not loaded by the plugin";
  ASSERT_NE(blas, nullptr) << "libcublas not loaded by the plugin";
  gauge.Set(1);

  for (int i = 0; i < 5; ++i) {
    auto body = testing::HttpGet((*process)->metrics_port(), "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    EXPECT_THAT(*body, ::testing::HasSubstr("cuda_plugin_loaded 1"));
  }
}

}  // namespace
}  // namespace kvcache
