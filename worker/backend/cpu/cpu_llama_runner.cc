#include "worker/backend/cpu/cpu_llama_runner.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/backend/cpu/attention.h"
#include "worker/backend/cpu/compute_pool.h"
#include "worker/backend/cpu/cpu_features.h"

namespace kvcache::cpu {

CpuModelWeights::CpuModelWeights(const model::LlamaModel& model) {
  for (const model::LlamaLayer& l : model.layers()) {
    layers_.push_back(
        Layer{Bind(l.wq), Bind(l.wk), Bind(l.wv), Bind(l.wo), Bind(l.w_gate), Bind(l.w_up), Bind(l.w_down)});
  }
  output_ = Bind(model.output());
}

KernelWeight CpuModelWeights::Bind(const model::WeightView& w) {
  std::vector<uint8_t> bytes = InterleaveRows16(w);
  if (bytes.empty()) return KernelWeight(w);
  interleaved_bytes_ += static_cast<int64_t>(bytes.size());
  owned_.push_back(std::move(bytes));
  return KernelWeight(w, owned_.back().data());  // a moved vector keeps its buffer
}

absl::StatusOr<std::unique_ptr<CpuLlamaRunner>> CpuLlamaRunner::Create(const model::LlamaModel* model,
                                                                       kv::KvCacheManager* kv,
                                                                       CpuRunnerOptions options) {
  if (model == nullptr || kv == nullptr)
    return absl::InvalidArgumentError("runner needs a model and a KV cache");
  if (options.max_batch_tokens < 1) return absl::InvalidArgumentError("max_batch_tokens must be positive");
  const gguf::LlamaHparams& hp = model->hparams();
  const kv::KvShape& s = kv->shape();
  if (s.layers != hp.n_layer || s.kv_heads != hp.n_head_kv || s.head_dim != hp.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("KV shape ", s.DebugString(),
                                                   " does not match the model (", hp.n_layer, " layers, ",
                                                   hp.n_head_kv, " kv heads, head_dim ", hp.head_dim, ")"));
  }
  if (kv->tier_capacity_pages(0) > 1 && kv->Tier0PageData(1) - kv->Tier0PageData(0) != s.page_bytes()) {
    return absl::FailedPreconditionError("CPU runner needs tier 0 as one contiguous host slab");
  }
  if (kv->Tier0PageData(0) == nullptr) return absl::FailedPreconditionError("tier 0 is not host memory");
  const PageLayout layout = s.layout();
  KVCACHE_ASSIGN_OR_RETURN(const RopeParams rp, model::RopeParamsFor(hp, model->rope_freqs()));
  const int max_positions = model::RopeMaxPositions(hp);
  KVCACHE_ASSIGN_OR_RETURN(RopeTable rope, RopeTable::Create(rp, max_positions));
  if (options.threads > 0) SetNumThreads(options.threads);
  return std::unique_ptr<CpuLlamaRunner>(new CpuLlamaRunner(model, kv, options, layout, std::move(rope)));
}

CpuLlamaRunner::CpuLlamaRunner(const model::LlamaModel* model, kv::KvCacheManager* kv,
                               CpuRunnerOptions options, PageLayout layout, RopeTable rope)
    : model_(model), kv_(kv), options_(options), layout_(layout), rope_(std::move(rope)), weights_(*model) {
  const gguf::LlamaHparams& hp = model->hparams();
  const size_t t = static_cast<size_t>(options.max_batch_tokens);
  x_.resize(t * hp.n_embd);
  xn_.resize(t * hp.n_embd);
  tmp_.resize(t * hp.n_embd);
  q_.resize(t * hp.n_head * hp.head_dim);
  att_.resize(t * hp.n_head * hp.head_dim);
  k_.resize(t * hp.n_head_kv * hp.head_dim);
  v_.resize(t * hp.n_head_kv * hp.head_dim);
  gate_.resize(t * hp.n_ff);
  up_.resize(t * hp.n_ff);
}

void CpuLlamaRunner::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) {
  ComputePool::Get().ParallelFor(n, NumThreads(), fn);
}

absl::Status CpuLlamaRunner::Forward(absl::Span<const model::SequenceStep> batch,
                                     std::vector<float>* logits) {
  const gguf::LlamaHparams& hp = model_->hparams();
  const int64_t d = hp.n_embd, q_dim = hp.n_head * hp.head_dim, kv_dim = hp.n_head_kv * hp.head_dim;
  const float eps = static_cast<float>(hp.norm_rms_eps);

  // Flatten the batch and check it against the page tables.
  tokens_.clear();
  positions_.clear();
  std::vector<AttentionSeq> seqs;
  std::vector<int64_t> last_rows;  // row of the last token of sequences that want logits
  for (const model::SequenceStep& s : batch) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    const int64_t end = s.first_pos + n;
    if (n == 0 || s.first_pos < 0)
      return absl::InvalidArgumentError("empty sequence step or negative position");
    if (end > rope_.max_positions()) {
      return absl::InvalidArgumentError(
          absl::StrCat("position ", end - 1, " beyond the model context ", rope_.max_positions()));
    }
    if (static_cast<int64_t>(s.page_table.size()) * layout_.page_tokens < end) {
      return absl::InvalidArgumentError("page table shorter than the sequence");
    }
    for (int64_t i = 0; i < n; ++i) {
      if (s.tokens[i] < 0 || s.tokens[i] >= hp.n_vocab) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", s.tokens[i], " outside the vocabulary"));
      }
      tokens_.push_back(s.tokens[i]);
      positions_.push_back(static_cast<int32_t>(s.first_pos + i));
    }
    seqs.push_back(AttentionSeq{s.page_table, static_cast<int>(end), static_cast<int>(n)});
    if (s.want_logits) last_rows.push_back(static_cast<int64_t>(tokens_.size()) - 1);
  }
  const int t = static_cast<int>(tokens_.size());
  if (t > options_.max_batch_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(t, " tokens in one step; the limit is ", options_.max_batch_tokens));
  }
  void* base = kv_->Tier0PageData(0);

  // x: [t][d]
  KVCACHE_RETURN_IF_ERROR(GetRows(model_->token_embd(), tokens_, x_.data()));
  AttentionParams ap;
  ap.layout = layout_;
  ap.kv_base = base;
  ap.n_heads = static_cast<int>(hp.n_head);
  ap.sliding_window = static_cast<int>(hp.sliding_window);
  for (size_t l = 0; l < model_->layers().size(); ++l) {
    const model::LlamaLayer& L = model_->layers()[l];
    const CpuModelWeights::Layer& W = weights_.layers()[l];
    // Attention block.
    RmsNorm(x_.data(), L.attn_norm.data(), t, d, eps, xn_.data());
    // q: [t][n_head][hd], k and v: [t][n_kv][hd]
    const MatMulOutput qkv[] = {{W.wq, q_.data()}, {W.wk, k_.data()}, {W.wv, v_.data()}};
    KVCACHE_RETURN_IF_ERROR(MatMulSameInput(qkv, xn_.data(), t));
    if (hp.qkv_bias) {
      for (int i = 0; i < t; ++i) {
        Add(q_.data() + int64_t{i} * q_dim, L.bq.data(), q_dim, q_.data() + int64_t{i} * q_dim);
        Add(k_.data() + i * kv_dim, L.bk.data(), kv_dim, k_.data() + i * kv_dim);
        Add(v_.data() + i * kv_dim, L.bv.data(), kv_dim, v_.data() + i * kv_dim);
      }
    }
    if (hp.qk_norm) {  // each head's row normalised on its own
      RmsNorm(q_.data(), L.q_norm.data(), t * static_cast<int>(hp.n_head), hp.head_dim, eps, q_.data());
      RmsNorm(k_.data(), L.k_norm.data(), t * static_cast<int>(hp.n_head_kv), hp.head_dim, eps, k_.data());
    }
    KVCACHE_RETURN_IF_ERROR(rope_.Apply(q_.data(), t, static_cast<int>(hp.n_head), positions_));
    KVCACHE_RETURN_IF_ERROR(rope_.Apply(k_.data(), t, static_cast<int>(hp.n_head_kv), positions_));
    int64_t row = 0;
    for (const model::SequenceStep& s : batch) {
      const int n = static_cast<int>(s.tokens.size());
      KVCACHE_RETURN_IF_ERROR(WriteKv(layout_, base, s.page_table, static_cast<int>(l),
                                      static_cast<int>(s.first_pos), n, k_.data() + row * kv_dim,
                                      v_.data() + row * kv_dim));
      row += n;
    }
    ap.layer = static_cast<int>(l);
    KVCACHE_RETURN_IF_ERROR(PagedAttention(ap, seqs, q_.data(), att_.data()));  // att: [t][n_head][hd]
    KVCACHE_RETURN_IF_ERROR(MatMul(W.wo, att_.data(), t, tmp_.data()));         // [t][d]
    Add(x_.data(), tmp_.data(), int64_t{t} * d, x_.data());
    // Feed-forward block (SwiGLU).
    RmsNorm(x_.data(), L.ffn_norm.data(), t, d, eps, xn_.data());
    const MatMulOutput gate_up[] = {{W.w_gate, gate_.data()}, {W.w_up, up_.data()}};  // [t][n_ff] each
    KVCACHE_RETURN_IF_ERROR(MatMulSameInput(gate_up, xn_.data(), t));
    SwiGlu(gate_.data(), up_.data(), int64_t{t} * hp.n_ff, gate_.data());
    KVCACHE_RETURN_IF_ERROR(MatMul(W.w_down, gate_.data(), t, tmp_.data()));  // [t][d]
    Add(x_.data(), tmp_.data(), int64_t{t} * d, x_.data());
  }

  // Logits of the last token of each sequence that wants them: [n_want][n_vocab].
  const int n_want = static_cast<int>(last_rows.size());
  for (int i = 0; i < n_want; ++i) {
    std::copy_n(x_.data() + last_rows[i] * d, d, tmp_.data() + int64_t{i} * d);
  }
  RmsNorm(tmp_.data(), model_->output_norm().data(), n_want, d, eps, xn_.data());
  logits->resize(static_cast<size_t>(n_want) * hp.n_vocab);
  if (n_want > 0) KVCACHE_RETURN_IF_ERROR(MatMul(weights_.output(), xn_.data(), n_want, logits->data()));
  return absl::OkStatus();
}

}  // namespace kvcache::cpu
