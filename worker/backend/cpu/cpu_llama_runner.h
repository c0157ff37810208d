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
// Threads: by default every product, attention and SwiGLU of a layer is split
// over cpu::NumThreads() threads (each product by rows, so each weight is read
// once a step), with the norms, adds, RoPE and K/V writes on the calling thread.
// A decode step of many short sequences may instead run its layers as groups of
// whole sequences, one group per thread with no barrier between them (PlanGroups
// says when: only at the vector levels, for models whose layers all have
// integer-dot weights); the output head stays split by rows. Every token's
// logits are then the same bits either way: those kernels compute a token's
// values from that token alone, and attention a sequence's from its own pages
// (key ranges are cut only from 512 keys on, where the cut depends on the
// step's whole batch either way).
//
// Thread-safety: one Forward at a time (the engine thread).
#ifndef KVCACHE_WORKER_BACKEND_CPU_CPU_LLAMA_RUNNER_H_
#define KVCACHE_WORKER_BACKEND_CPU_CPU_LLAMA_RUNNER_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/backend/cpu/attention.h"
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
  // Bytes every pass through the layers reads (their matrices, as stored), and
  // the multiply-accumulates it takes per token.
  int64_t layer_bytes() const { return layer_bytes_; }
  double layer_macs() const { return layer_macs_; }
  // Whether every layer matrix has an interleaved copy (an integer-dot type).
  bool layers_interleaved() const { return layers_interleaved_; }
  // The distinct types of the layer matrices.
  const std::vector<gguf::GgmlType>& layer_types() const { return layer_types_; }
  // Bytes of the interleaved copies.
  int64_t interleaved_bytes() const { return interleaved_bytes_; }

 private:
  KernelWeight Bind(const model::WeightView& w);

  std::vector<std::vector<uint8_t>> owned_;  // the copies the KernelWeights point into
  std::vector<Layer> layers_;
  KernelWeight output_;
  int64_t interleaved_bytes_ = 0;
  int64_t layer_bytes_ = 0;
  double layer_macs_ = 0;
  bool layers_interleaved_ = true;
  std::vector<gguf::GgmlType> layer_types_;
};

struct CpuRunnerOptions {
  int max_batch_tokens = 512;  // new tokens per Forward (sizes the scratch buffers)
  int threads = 0;             // 0: leave cpu::NumThreads() as it is
  // Layers as one group of sequences per thread: where PlanGroups' cost model
  // expects them to pay (kAuto), never, or in every step with at least two
  // sequences and threads (kAlways: tests; the results are the same bits).
  enum class Groups { kAuto, kNever, kAlways };
  Groups groups = Groups::kAuto;
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
  // Timed on the calling thread, for steps whose products are split over the
  // threads (zero for a step run as groups: PlanGroups).
  ForwardProfile last_forward_profile() const override { return profile_; }
  // Over ComputePool, on cpu::NumThreads() threads.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) override;

  // The matrices every Forward multiplies by.
  const CpuModelWeights& weights() const { return weights_; }

  // Where Forward(batch) would run its layers as groups, one per thread: the
  // index of each group's first sequence, then batch.size(); empty when every
  // product is split over the threads instead (see cpu_llama_runner.cc).
  std::vector<size_t> PlanGroups(absl::Span<const model::SequenceStep> batch) const;

 private:
  CpuLlamaRunner(const model::LlamaModel* model, kv::KvCacheManager* kv, CpuRunnerOptions options,
                 kv::PageLayout layout, RopeTable rope);

  // Every layer for `batch` (one group, or the whole step), whose tokens are rows
  // [row0, row0 + n_tokens) of the scratch; seqs[i] is batch[i]'s. Adds the wall
  // time of the products and of attention to *profile when it is not null.
  absl::Status RunLayers(absl::Span<const model::SequenceStep> batch, absl::Span<const AttentionSeq> seqs,
                         int64_t row0, int n_tokens, ForwardProfile* profile);

  const model::LlamaModel* const model_;
  kv::KvCacheManager* const kv_;
  const CpuRunnerOptions options_;
  const kv::PageLayout layout_;
  const RopeTable rope_;
  const CpuModelWeights weights_;
  // The context length at which a decode token's attention costs about as much
  // as its pass through the layers' products (PlanGroups' cost model).
  const double keys_per_token_cost_;

  ForwardProfile profile_;  // the last Forward's (last_forward_profile)

  // Scratch, sized for max_batch_tokens rows.
  std::vector<float> x_, xn_, q_, k_, v_, att_, tmp_, gate_, up_;
  std::vector<int32_t> tokens_, positions_;
};

}  // namespace kvcache::cpu

#endif  // KVCACHE_WORKER_BACKEND_CPU_CPU_LLAMA_RUNNER_H_
