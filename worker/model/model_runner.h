// The backend-neutral interface of a model's forward pass over paged KV.
//
// One call runs one engine step: a flattened batch of sequences, each with some
// new tokens (decode: 1, chunked prefill: many) at consecutive positions. The
// runner writes every new token's K and V into the sequence's tier-0 pages and
// reads earlier tokens' K/V only from pages (PagedAttention).
//
// Thread-safety: one step at a time (the engine thread); implementations need
// not be thread-safe.
#ifndef KVCACHE_WORKER_MODEL_MODEL_RUNNER_H_
#define KVCACHE_WORKER_MODEL_MODEL_RUNNER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/gguf/llama_hparams.h"
#include "worker/kv/tier_storage.h"

namespace kvcache::model {

struct SequenceStep {
  // New tokens, at positions [first_pos, first_pos + tokens.size()).
  absl::Span<const int32_t> tokens;
  int64_t first_pos = 0;
  // Tier-0 page ids covering positions [0, first_pos + tokens.size()); page i
  // holds positions [i*page_tokens, (i+1)*page_tokens). kNoPage for pages a
  // sliding window released (never read).
  absl::Span<const kv::PageId> page_table;
  // Return the logits after the last new token.
  bool want_logits = false;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  virtual const gguf::LlamaHparams& hparams() const = 0;
  // Largest number of new tokens (summed over sequences) one Forward accepts.
  virtual int max_batch_tokens() const = 0;

  // Runs the step. `logits` is resized to [n_want][n_vocab], one row per sequence
  // with want_logits, in batch order.
  // REQUIRES: every page in the page tables is step-pinned by the caller.
  // INVALID_ARGUMENT for a malformed batch (too many tokens, short page table,
  // token id out of range); INTERNAL for a backend failure (the step's K/V
  // writes are then undefined and the caller aborts the step).
  virtual absl::Status Forward(absl::Span<const SequenceStep> batch, std::vector<float>* logits) = 0;

  // The same step, its logits ([n_want][n_vocab], batch order) left in memory the
  // runner owns, valid until its next call: the engine's path, so that a runner
  // whose logits already sit in host memory of its own (the CUDA runner's pinned
  // buffer) copies nothing (at 64 sequences a step that is 12.6 MB). The default
  // runs Forward into a buffer kept for the purpose.
  virtual absl::StatusOr<absl::Span<const float>> ForwardView(absl::Span<const SequenceStep> batch) {
    absl::Status st = Forward(batch, &view_logits_);
    if (!st.ok()) return st;
    return absl::MakeConstSpan(view_logits_);
  }

  // Where the last Forward (or ForwardView) spent its time: the wall time of the
  // linear layers' products (the output head and the activations' quantisation
  // included) and of attention, so that step statistics can split a step. Both
  // zero where the runner does not time them apart (the default; the CPU runner
  // when a step runs its layers as groups, whose parts overlap on several threads).
  struct ForwardProfile {
    absl::Duration products;
    absl::Duration attention;
  };
  virtual ForwardProfile last_forward_profile() const { return {}; }

  // Calls fn(i) once for each i in [0, n) and returns when all have returned, on
  // the host threads the runner's kernels use (they idle between steps): the
  // engine samples a step's tokens this way. The default runs them in order on
  // the calling thread. fn's result must not depend on which thread runs it.
  virtual void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }

 private:
  std::vector<float> view_logits_;  // ForwardView's buffer (default implementation)
};

using ModelRunnerPtr = std::unique_ptr<ModelRunner>;

}  // namespace kvcache::model

#endif  // KVCACHE_WORKER_MODEL_MODEL_RUNNER_H_
