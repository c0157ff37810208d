// The worker's backend table: --device=cpu gives a CPU backend whose runner
// computes over host pages; --device=cuda with no plugin is a clear NOT_FOUND.
#include "worker/backend/backend.h"

#include <vector>

#include "common/gguf/tiny_llama.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/backend/cpu/cpu_features.h"

namespace kvcache::backend {
namespace {

using ::testing::HasSubstr;

TEST(BackendTest, CpuBackendRunsTheModelOnHostPages) {
  auto backend = OpenBackend(*ParseDevice("cpu"), {});
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_THAT((*backend)->Describe(), HasSubstr("cpu"));
  EXPECT_EQ((*backend)->MakeTierStorageFactory(), nullptr);  // the KV cache's host slabs

  auto bytes = gguf::BuildTinyLlama(gguf::TinyLlamaOptions{});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto file = gguf::GgufFile::OpenFromBuffer(std::move(*bytes));
  ASSERT_TRUE(file.ok()) << file.status();
  auto model = model::LlamaModel::FromFile(std::move(*file));
  ASSERT_TRUE(model.ok()) << model.status();
  const auto& hp = (*model)->hparams();
  kv::KvCacheOptions ko;
  ko.shape = kv::KvShape{static_cast<int>(hp.n_layer),
                         static_cast<int>(hp.n_head_kv),
                         static_cast<int>(hp.head_dim),
                         kv::KvDtype::kF16,
                         16,
                         0};
  ko.model_id = (*model)->model_id();
  ko.tier0_bytes = 4 * ko.shape.page_bytes();
  ko.storage_factory = (*backend)->MakeTierStorageFactory();
  auto kv = kv::KvCacheManager::Create(ko);
  ASSERT_TRUE(kv.ok()) << kv.status();
  auto runner = (*backend)->CreateRunner(**model, **kv);
  ASSERT_TRUE(runner.ok()) << runner.status();

  const std::vector<int32_t> tokens = {5, 17, 42};
  ASSERT_TRUE((*kv)->CreateSession("s", "t").ok());
  auto res = (*kv)->BeginStep("s", static_cast<int64_t>(tokens.size()));
  ASSERT_TRUE(res.ok()) << res.status();
  model::SequenceStep step;
  step.tokens = tokens;
  step.first_pos = res->first_pos;
  step.page_table = res->page_table;
  step.want_logits = true;
  std::vector<float> logits;
  ASSERT_TRUE((*runner)->Forward({step}, &logits).ok());
  EXPECT_EQ(static_cast<int64_t>(logits.size()), static_cast<int64_t>(hp.n_vocab));
  ASSERT_TRUE((*kv)->CommitStep("s", tokens).ok());
}

TEST(BackendTest, CpuKernelLevelIsParsedAndApplied) {
  using cpu::CpuKernelLevel;
  EXPECT_EQ(*cpu::ParseCpuKernelLevel("scalar"), CpuKernelLevel::kScalar);
  EXPECT_EQ(*cpu::ParseCpuKernelLevel("auto"), cpu::MaxSupportedCpuKernelLevel());
  for (CpuKernelLevel level : cpu::SupportedCpuKernelLevels()) {
    EXPECT_EQ(*cpu::ParseCpuKernelLevel(cpu::CpuKernelLevelName(level)), level);
  }
  for (const char* bad : {"", "AVX2", "sse4", "avx512 ", "cuda"}) {
    auto parsed = cpu::ParseCpuKernelLevel(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(parsed.status().message(), HasSubstr("want auto, avx512, avx2 or scalar")) << bad;
  }
  if (cpu::MaxSupportedCpuKernelLevel() < CpuKernelLevel::kAvx512) {
    auto parsed = cpu::ParseCpuKernelLevel("avx512");
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr("not supported by this CPU"));
  }

  const CpuKernelLevel before = cpu::GetCpuKernelLevel();
  BackendOptions options;
  options.cpu_kernel_level = CpuKernelLevel::kScalar;
  auto backend = OpenBackend(*ParseDevice("cpu"), options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ(cpu::GetCpuKernelLevel(), CpuKernelLevel::kScalar);
  EXPECT_THAT((*backend)->Describe(), HasSubstr("kernel level scalar"));
  ASSERT_TRUE(cpu::SetCpuKernelLevel(before).ok());
}

TEST(BackendTest, CudaWithoutPluginIsNotFound) {
  BackendOptions options;
  options.cuda_plugin = "/nonexistent/dir/libkvcache_cuda.so";
  auto backend = OpenBackend(*ParseDevice("cuda:0"), options);
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(backend.status().message(), HasSubstr("/nonexistent/dir/libkvcache_cuda.so"));
}

}  // namespace
}  // namespace kvcache::backend
