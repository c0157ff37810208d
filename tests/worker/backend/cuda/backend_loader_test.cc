// The worker's device selection and plugin loading, on any machine: a missing
// plugin is a clear NOT_FOUND, a broken file FAILED_PRECONDITION, and (when the
// plugin was built) a machine without an NVIDIA driver a clear UNAVAILABLE.
#include "worker/backend/backend_loader.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::backend {
namespace {

using ::testing::HasSubstr;

TEST(BackendLoaderTest, ParsesDevices) {
  auto cpu = ParseDevice("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(cpu->kind, DeviceSpec::Kind::kCpu);
  auto cuda = ParseDevice("cuda");
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ(cuda->kind, DeviceSpec::Kind::kCuda);
  EXPECT_EQ(cuda->index, 0);
  auto cuda3 = ParseDevice("cuda:3");
  ASSERT_TRUE(cuda3.ok());
  EXPECT_EQ(cuda3->index, 3);
  EXPECT_EQ(cuda3->ToString(), "cuda:3");
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:+1", "cuda:x", "CPU", ""}) {
    auto s = ParseDevice(bad);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.status().message(), HasSubstr("--device")) << bad;
  }
}

TEST(BackendLoaderTest, MissingPluginIsNotFound) {
  auto s = LoadCudaBackend(*ParseDevice("cuda"), "/nonexistent/dir/libkvcache_cuda.so");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.status().message(), HasSubstr("/nonexistent/dir/libkvcache_cuda.so"));
  EXPECT_THAT(s.status().message(), HasSubstr("--cuda_plugin"));
}

TEST(BackendLoaderTest, DefaultSearchListsCandidates) {
  const std::string dir = ::testing::TempDir() + "/empty_build";
  setenv("KVCACHE_BUILD_DIR", dir.c_str(), 1);
  const std::vector<std::string> c = CudaPluginCandidates("");
  ASSERT_EQ(c.size(), 3u);
  EXPECT_THAT(c[0], HasSubstr("libkvcache_cuda.so"));  // beside this executable
  EXPECT_EQ(c[1], dir + "/worker/libkvcache_cuda.so");
  EXPECT_EQ(CudaPluginCandidates("/x.so"), std::vector<std::string>{"/x.so"});
}

TEST(BackendLoaderTest, NotAPluginIsFailedPrecondition) {
  const std::string path = ::testing::TempDir() + "/libkvcache_cuda.so";
  std::ofstream(path) << "not an ELF file";
  auto s = LoadCudaBackend(*ParseDevice("cuda:0"), path);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr(path));
}

TEST(BackendLoaderTest, CpuIsNotLoaded) {
  EXPECT_EQ(LoadCudaBackend(*ParseDevice("cpu"), "").status().code(), absl::StatusCode::kInvalidArgument);
}

#ifdef KVCACHE_TEST_CUDA_PLUGIN
// The real plugin: on a machine with no NVIDIA driver (CI) creating the backend
// is UNAVAILABLE "no CUDA device"; with a GPU it succeeds and a bad index is
// INVALID_ARGUMENT.
TEST(BackendLoaderTest, RealPluginWithoutDriverIsUnavailable) {
  auto s = LoadCudaBackend(*ParseDevice("cuda:0"), KVCACHE_TEST_CUDA_PLUGIN);
  if (s.ok()) {
    EXPECT_THAT((*s)->Describe(), HasSubstr("cuda:0"));
    auto far = LoadCudaBackend(*ParseDevice("cuda:4096"), KVCACHE_TEST_CUDA_PLUGIN);
    EXPECT_EQ(far.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(far.status().message(), HasSubstr("out of range"));
    return;
  }
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("no CUDA device"));
}
#endif

}  // namespace
}  // namespace kvcache::backend
