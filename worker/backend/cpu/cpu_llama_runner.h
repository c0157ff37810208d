// The CPU backend's forward pass of a Llama decoder over paged KV.
//
// A step's tokens from every sequence are flattened into one activation matrix
// [T][n_embd] (T = new tokens summed over sequences), so each linear layer reads
// its weights once per step however many sessions decode (batched decode is
// nearly free until compute bound). Per layer:
//   xn = RmsNorm(x); q,k,v = xn·Wq, xn·Wk, xn·Wv; RoPE(q, k) at each token's position
//   K/V of the new tokens -> their page slots; att = PagedAttention(q, pages)
//   x += att·Wo;  x += Wdown·(silu(xn2·Wgate) * xn2·Wup) with xn2 = RmsNorm(x)
// and finally logits = RmsNorm(x_last)·Woutᵀ for sequences that want them.
//
// Thread-safety: one Forward at a time (the engine thread). Kernels use
// cpu::NumThreads() threads.
#ifndef KVCACHE_WORKER_BACKEND_CPU_CPU_LLAMA_RUNNER_H_
#define KVCACHE_WORKER_BACKEND_CPU_CPU_LLAMA_RUNNER_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/backend/cpu/matmul.h"
#include "worker/backend/cpu/ops.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/page_layout.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_runner.h"

namespace kvcache::cpu {

// A model's matrices as the CPU kernels take them: each with its InterleaveRows16
// copy where its type has one (matmul.h), built once. Every step then reads the
// copies (about as large as the matrices they cover), not the file's mapping, whose
// pages read once here stay in the page cache, clean and reclaimable.
class CpuModelWeights {
 public:
  explicit CpuModelWeights(const model::LlamaModel& model);
  CpuModelWeights(const CpuModelWeights&) = delete;
  CpuModelWeights& operator=(const CpuModelWeights&) = delete;

  struct Layer {
    KernelWeight wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  const std::vector<Layer>& layers() const { return layers_; }
  const KernelWeight& output() const { return output_; }
  // Bytes of the interleaved copies.
  int64_t interleaved_bytes() const { return interleaved_bytes_; }

 private:
  KernelWeight Bind(const model::WeightView& w);

  std::vector<std::vector<uint8_t>> owned_;  // the copies the KernelWeights point into
  std::vector<Layer> layers_;
  KernelWeight output_;
  int64_t interleaved_bytes_ = 0;
};

struct CpuRunnerOptions {
  int max_batch_tokens = 512;  // new tokens per Forward (sizes the scratch buffers)
  int threads = 0;             // 0: leave cpu::NumThreads() as it is
};

class CpuLlamaRunner : public model::ModelRunner {
 public:
  // REQUIRES: `model` and `kv` outlive the runner; kv's shape matches the model
  // (layers, kv heads, head_dim) and its tier 0 is one host slab.
  static absl::StatusOr<std::unique_ptr<CpuLlamaRunner>> Create(const model::LlamaModel* model,
                                                                kv::KvCacheManager* kv,
                                                                CpuRunnerOptions options = {});

  const gguf::LlamaHparams& hparams() const override { return model_->hparams(); }
  int max_batch_tokens() const override { return options_.max_batch_tokens; }
  absl::Status Forward(absl::Span<const model::SequenceStep> batch, std::vector<float>* logits) override;
  // Over ComputePool, on cpu::NumThreads() threads.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) override;

  // The matrices every Forward multiplies by.
  const CpuModelWeights& weights() const { return weights_; }

 private:
  CpuLlamaRunner(const model::LlamaModel* model, kv::KvCacheManager* kv, CpuRunnerOptions options,
                 kv::PageLayout layout, RopeTable rope);

  const model::LlamaModel* const model_;
  kv::KvCacheManager* const kv_;
  const CpuRunnerOptions options_;
  const kv::PageLayout layout_;
  const RopeTable rope_;
  const CpuModelWeights weights_;

  // Scratch, sized for max_batch_tokens rows.
  std::vector<float> x_, xn_, q_, k_, v_, att_, tmp_, gate_, up_;
  std::vector<int32_t> tokens_, positions_;
};

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_CPU_LLAMA_RUNNER_H_
