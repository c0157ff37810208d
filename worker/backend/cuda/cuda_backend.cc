// The plugin's entry point and CudaBackend implementation (see cuda_backend.h).
#include "worker/backend/cuda/cuda_backend.h"

#include <memory>
#include <utility>

#include "worker/backend/cuda/cuda_llama_runner.h"
#include "worker/backend/cuda/cuda_tier_storage.h"
#include "worker/backend/cuda/device_context.h"

namespace kvcache::backend {
namespace {

class CudaBackendImpl final : public CudaBackend {
 public:
  explicit CudaBackendImpl(std::shared_ptr<cuda::DeviceContext> ctx) : ctx_(std::move(ctx)) {}

  std::string Describe() const override { return ctx_->Describe(); }

  kv::TierStorageFactory MakeTierStorageFactory() override {
    std::shared_ptr<const cuda::DeviceContext> ctx = ctx_;
    return [ctx](int tier, int64_t n_pages, int64_t page_bytes) -> absl::StatusOr<kv::TierStoragePtr> {
      absl::StatusOr<std::unique_ptr<cuda::CudaTierStorage>> s = cuda::CudaTierStorage::Create(
          ctx, tier == 0 ? cuda::TierMemory::kDevice : cuda::TierMemory::kPinnedHost, n_pages, page_bytes,
          tier == 0 ? "--tier0_bytes" : "--tier1_bytes");
      if (!s.ok()) return s.status();
      return kv::TierStoragePtr(std::move(*s));
    };
  }

  absl::StatusOr<model::ModelRunnerPtr> CreateRunner(const model::LlamaModel& model, kv::TierStorage& tier0,
                                                     const kv::KvShape& shape,
                                                     const CudaRunnerOptions& options) override {
    auto* storage = dynamic_cast<cuda::CudaTierStorage*>(&tier0);
    if (storage == nullptr || &storage->context() != ctx_.get()) {
      return absl::FailedPreconditionError("CUDA runner needs tier 0 made by this backend's storage factory");
    }
    return cuda::CreateCudaLlamaRunner(model, *storage, shape, options);
  }

 private:
  std::shared_ptr<cuda::DeviceContext> ctx_;
};

class CudaBackendFactoryImpl final : public CudaBackendFactory {
 public:
  int abi_version() const override { return kCudaBackendAbiVersion; }
  absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options) const override {
    absl::StatusOr<std::shared_ptr<cuda::DeviceContext>> ctx = cuda::DeviceContext::Create(options.device);
    if (!ctx.ok()) return ctx.status();
    return std::unique_ptr<CudaBackend>(new CudaBackendImpl(std::move(*ctx)));
  }
};

}  // namespace
}  // namespace kvcache::backend

extern "C" __attribute__((visibility("default"))) kvcache::backend::CudaBackendFactory*
kvcache_cuda_backend_v1() {
  static kvcache::backend::CudaBackendFactoryImpl* factory = new kvcache::backend::CudaBackendFactoryImpl();
  return factory;
}
