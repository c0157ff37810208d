#include "worker/backend/backend.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/backend/cpu/cpu_features.h"
#include "worker/backend/cpu/cpu_llama_runner.h"

namespace kvcache::backend {
namespace {

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& options) : options_(options) {}

  std::string Describe() const override {
    return absl::StrCat("cpu (kernel level ", cpu::CpuKernelLevelName(cpu::GetCpuKernelLevel()), ")");
  }

  kv::TierStorageFactory MakeTierStorageFactory() override { return nullptr; }

  absl::StatusOr<model::ModelRunnerPtr> CreateRunner(const model::LlamaModel& model,
                                                     kv::KvCacheManager& kv) override {
    auto runner = cpu::CpuLlamaRunner::Create(&model, &kv, {options_.max_batch_tokens, options_.cpu_threads});
    if (!runner.ok()) return runner.status();
    return model::ModelRunnerPtr(std::move(*runner));
  }

 private:
  const BackendOptions options_;
};

// Owns the plugin's backend (which owns the device context its storages and
// runners share).
class CudaPluginBackend : public Backend {
 public:
  CudaPluginBackend(std::unique_ptr<CudaBackend> cuda, const BackendOptions& options)
      : cuda_(std::move(cuda)), options_(options) {}

  std::string Describe() const override { return cuda_->Describe(); }

  kv::TierStorageFactory MakeTierStorageFactory() override { return cuda_->MakeTierStorageFactory(); }

  absl::StatusOr<model::ModelRunnerPtr> CreateRunner(const model::LlamaModel& model,
                                                     kv::KvCacheManager& kv) override {
    return cuda_->CreateRunner(model, kv.tier_storage(0), kv.shape(),
                               {options_.max_batch_tokens, options_.cuda_graphs});
  }

 private:
  const std::unique_ptr<CudaBackend> cuda_;
  const BackendOptions options_;
};

absl::StatusOr<std::unique_ptr<Backend>> OpenCpu(const DeviceSpec&, const BackendOptions& options) {
  if (options.cpu_kernel_level.has_value()) {
    if (absl::Status st = cpu::SetCpuKernelLevel(*options.cpu_kernel_level); !st.ok()) return st;
  }
  return std::make_unique<CpuBackend>(options);
}

absl::StatusOr<std::unique_ptr<Backend>> OpenCuda(const DeviceSpec& device, const BackendOptions& options) {
  auto cuda = LoadCudaBackend(device, options.cuda_plugin);
  if (!cuda.ok()) return cuda.status();
  return std::make_unique<CudaPluginBackend>(std::move(*cuda), options);
}

struct BackendEntry {
  DeviceSpec::Kind kind;
  absl::StatusOr<std::unique_ptr<Backend>> (*open)(const DeviceSpec&, const BackendOptions&);
};

constexpr BackendEntry kBackends[] = {
    {DeviceSpec::Kind::kCpu, OpenCpu},
    {DeviceSpec::Kind::kCuda, OpenCuda},
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> OpenBackend(const DeviceSpec& device,
                                                     const BackendOptions& options) {
  for (const BackendEntry& b : kBackends) {
    if (b.kind == device.kind) return b.open(device, options);
  }
  return absl::InvalidArgumentError(absl::StrCat("--device=", device.ToString(), ": no such backend"));
}

}  // namespace kvcache::backend
