#include "worker/backend/cpu/cpu_llama_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "worker/backend/cpu/attention.h"
#include "worker/backend/cpu/compute_pool.h"
#include "worker/backend/cpu/cpu_features.h"

namespace kvcache::cpu {

namespace {

// fn()'s status, with its wall time added to *total when total is not null.
template <class Fn>
absl::Status Timed(absl::Duration* total, Fn&& fn) {
  if (total == nullptr) return fn();
  const auto start = std::chrono::steady_clock::now();
  absl::Status st = fn();
  *total += absl::FromChrono(std::chrono::steady_clock::now() - start);
  return st;
}

// What a quantised product's multiply-accumulate costs against attention's (f32
// scores and P·V over f16 K/V): 16-session SmolLM2 steps ran their products at
// 230-330 and attention at 26-39 GMAC/s (Intel Xeon, avx512, a temporary per-op
// timer and a PagedAttention driver). Only PlanGroups' balance uses it.
constexpr double kAttentionMacCost = 10.0;

// A grouped step takes as long as its largest group; splitting every product
// over the threads costs each of them a barrier and a quantisation of the
// activations per product (about 120 a step). Groups run when the largest is
// within this factor of an even share.
constexpr double kMaxGroupImbalance = 1.1;

}  // namespace

CpuModelWeights::CpuModelWeights(const model::LlamaModel& model) {
  for (const model::LlamaLayer& l : model.layers()) {
    layers_.push_back(
        Layer{Bind(l.wq), Bind(l.wk), Bind(l.wv), Bind(l.wo), Bind(l.w_gate), Bind(l.w_up), Bind(l.w_down)});
    const Layer& b = layers_.back();
    for (const KernelWeight* w : {&b.wq, &b.wk, &b.wv, &b.wo, &b.w_gate, &b.w_up, &b.w_down}) {
      layer_bytes_ += w->view.rows * gguf::RowBytes(w->view.type, w->view.cols).value_or(0);
      layer_macs_ += static_cast<double>(w->view.rows) * static_cast<double>(w->view.cols);
      layers_interleaved_ = layers_interleaved_ && w->interleaved != nullptr;
      if (std::find(layer_types_.begin(), layer_types_.end(), w->view.type) == layer_types_.end())
        layer_types_.push_back(w->view.type);
    }
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
    : model_(model),
      kv_(kv),
      options_(options),
      layout_(layout),
      rope_(std::move(rope)),
      weights_(*model),
      // A token's multiply-accumulates in the layers' products, against one key's in
      // attention (scores and P·V of every query head of every layer).
      keys_per_token_cost_(weights_.layer_macs() /
                           (kAttentionMacCost * 2.0 * static_cast<double>(model->hparams().n_layer) *
                            static_cast<double>(model->hparams().n_head) *
                            static_cast<double>(model->hparams().head_dim))) {
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
  const int64_t d = hp.n_embd;
  const float eps = static_cast<float>(hp.norm_rms_eps);
  profile_ = ForwardProfile{};

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

  // x: [t][d]
  KVCACHE_RETURN_IF_ERROR(GetRows(model_->token_embd(), tokens_, x_.data()));
  const std::vector<size_t> groups = PlanGroups(batch);
  if (groups.empty()) {
    KVCACHE_RETURN_IF_ERROR(RunLayers(batch, seqs, 0, t, &profile_));
  } else {
    // One group per thread; a group's kernels find the pool busy with this loop
    // and run on their own thread.
    const int n_groups = static_cast<int>(groups.size()) - 1;
    std::vector<int64_t> row0(groups.size(), 0);
    for (int g = 0; g < n_groups; ++g) {
      row0[g + 1] = row0[g];
      for (size_t i = groups[g]; i < groups[g + 1]; ++i)
        row0[g + 1] += static_cast<int64_t>(batch[i].tokens.size());
    }
    std::vector<absl::Status> status(n_groups);
    ComputePool::Get().ParallelFor(n_groups, n_groups, [&](int64_t g) {
      status[g] = RunLayers(batch.subspan(groups[g], groups[g + 1] - groups[g]),
                            absl::MakeConstSpan(seqs).subspan(groups[g], groups[g + 1] - groups[g]), row0[g],
                            static_cast<int>(row0[g + 1] - row0[g]), nullptr);
    });
    for (const absl::Status& st : status) KVCACHE_RETURN_IF_ERROR(st);
  }

  // Logits of the last token of each sequence that wants them: [n_want][n_vocab].
  const int n_want = static_cast<int>(last_rows.size());
  for (int i = 0; i < n_want; ++i) {
    std::copy_n(x_.data() + last_rows[i] * d, d, tmp_.data() + int64_t{i} * d);
  }
  RmsNorm(tmp_.data(), model_->output_norm().data(), n_want, d, eps, xn_.data());
  logits->resize(static_cast<size_t>(n_want) * hp.n_vocab);
  if (n_want > 0) {
    KVCACHE_RETURN_IF_ERROR(Timed(groups.empty() ? &profile_.products : nullptr, [&] {
      return MatMul(weights_.output(), xn_.data(), n_want, logits->data());
    }));
  }
  return absl::OkStatus();
}

std::vector<size_t> CpuLlamaRunner::PlanGroups(absl::Span<const model::SequenceStep> batch) const {
  // Groups skip the barrier and the per-thread quantisation of every product,
  // and run the norms, adds, RoPE and K/V writes on every thread instead of one.
  // In exchange each thread reads every layer weight once a step, so they run
  // only where that costs nothing twice (kAuto):
  //   - every layer matrix has integer kernels (other types are dequantised
  //     per call, which each group would repeat), and each group's tokens fill
  //     whole token tiles and stay within the count those kernels read straight
  //     from the weights, without preparing them per call
  //     (CurrentMatMulTokenShape: 8 to 16 at avx512, and 4 to 16 at avx2 for
  //     Q4_0, Q4_1 and Q8_0; at avx2 a group of 8 would unpack every weight
  //     group of the other types again);
  //   - the L3 holds a layer's weights for every thread: the groups are of
  //     equal cost and take the layers in order, so each layer's second read
  //     comes from the cache, not DRAM, while the threads stay within a layer
  //     or so of each other (a model whose layers are larger stays split by
  //     rows). 16-session SmolLM2 steps (2.2 MB a layer, 66 MB in all) on a
  //     Zen 4 with a 32 MiB L3, at avx512, six engine_bench --sections=batched
  //     runs of each rule alternating: split by rows (when this asked for all
  //     the layers' bytes) 10.9-16.6 ms a step (median of the runs' medians
  //     14.2), in groups 10.0-12.3 (11.4), 16 sessions 916-1,446 -> 1,289-1,517
  //     tokens/s;
  //   - the largest group, by tokens and their attention over the context,
  //     is within kMaxGroupImbalance of an even share.
  // 16-session SmolLM2 Q4_1 decode steps (2 threads, Intel Xeon with a 260 MiB
  // L3), the two ways alternating step by step in one process behind a
  // temporary switch, 90 steps each, two engine_bench --sections=batched runs:
  // layers 7.95 / 7.69 -> 6.72 / 6.49 ms (median) at avx512; at avx2, 8-token
  // groups that unpacked every weight group again 15.23 / 15.32 -> 15.50 /
  // 15.62 ms. Since avx2 reads Q4_1 straight up to 16 tokens, its groups cost
  // nothing twice and run; Zen 4, whole Forwards of 16 decodes alternating in
  // one process (a throwaway test, 60 steps each, three runs), groups over rows:
  // paired median 0.995 / 1.020 / 0.969 at avx2 (no gain, no loss), 0.894 /
  // 0.885 / 0.875 at avx512.
  const bool always = options_.groups == CpuRunnerOptions::Groups::kAlways;
  const int threads = NumThreads();
  if (options_.groups == CpuRunnerOptions::Groups::kNever || threads < 2) return {};
  if (!always && batch.size() < static_cast<size_t>(threads)) return {};
  const int n_groups = static_cast<int>(std::min<size_t>(threads, batch.size()));
  if (n_groups < 2) return {};
  // The shape every layer matrix allows (their types may differ: Q4_K_M files mix
  // Q4_K with Q6_K).
  MatMulTokenShape shape;
  for (size_t i = 0; i < weights_.layer_types().size(); ++i) {
    const MatMulTokenShape of = CurrentMatMulTokenShape(weights_.layer_types()[i]);
    shape = i == 0 ? of
                   : MatMulTokenShape{std::min(shape.tile_tokens, of.tile_tokens),
                                      std::min(shape.max_straight_tokens, of.max_straight_tokens)};
  }
  const int64_t bytes_per_layer =
      weights_.layer_bytes() / std::max<int64_t>(1, static_cast<int64_t>(weights_.layers().size()));
  if (!always && (shape.tile_tokens == 0 || !weights_.layers_interleaved() ||
                  n_groups * bytes_per_layer > L3CacheBytes())) {
    return {};
  }

  // Contiguous groups of about equal cost: a sequence joins a group while its
  // middle lies before the group's share of the total.
  std::vector<double> cost(batch.size());
  double total = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const double n = static_cast<double>(batch[i].tokens.size());
    const double keys = static_cast<double>(batch[i].first_pos) + n;
    cost[i] = n * (1.0 + keys / keys_per_token_cost_);
    total += cost[i];
  }
  std::vector<size_t> bounds = {0};
  double acc = 0;
  size_t i = 0;
  for (int g = 1; g < n_groups; ++g) {
    const double goal = total * g / n_groups;
    while (i + (n_groups - g) < batch.size() && (i == bounds.back() || acc + cost[i] / 2 <= goal)) {
      acc += cost[i++];
    }
    bounds.push_back(i);
  }
  bounds.push_back(batch.size());
  if (always) return bounds;
  for (int g = 0; g < n_groups; ++g) {
    int64_t tokens = 0;
    double group_cost = 0;
    for (size_t j = bounds[g]; j < bounds[g + 1]; ++j) {
      tokens += static_cast<int64_t>(batch[j].tokens.size());
      group_cost += cost[j];
    }
    if (tokens < shape.tile_tokens || tokens > shape.max_straight_tokens ||
        group_cost > kMaxGroupImbalance * total / n_groups) {
      return {};
    }
  }
  return bounds;
}

absl::Status CpuLlamaRunner::RunLayers(absl::Span<const model::SequenceStep> batch,
                                       absl::Span<const AttentionSeq> seqs, int64_t row0, int n_tokens,
                                       ForwardProfile* profile) {
  absl::Duration* const products = profile != nullptr ? &profile->products : nullptr;
  absl::Duration* const attention = profile != nullptr ? &profile->attention : nullptr;
  const gguf::LlamaHparams& hp = model_->hparams();
  const int64_t d = hp.n_embd, q_dim = hp.n_head * hp.head_dim, kv_dim = hp.n_head_kv * hp.head_dim;
  const float eps = static_cast<float>(hp.norm_rms_eps);
  const int t = n_tokens;
  void* base = kv_->Tier0PageData(0);
  // This call's rows of the scratch.
  float* const x = x_.data() + row0 * d;
  float* const xn = xn_.data() + row0 * d;
  float* const tmp = tmp_.data() + row0 * d;
  float* const q = q_.data() + row0 * q_dim;
  float* const att = att_.data() + row0 * q_dim;
  float* const k = k_.data() + row0 * kv_dim;
  float* const v = v_.data() + row0 * kv_dim;
  float* const gate = gate_.data() + row0 * hp.n_ff;
  float* const up = up_.data() + row0 * hp.n_ff;
  const absl::Span<const int32_t> positions = absl::MakeConstSpan(positions_).subspan(row0, t);
  AttentionParams ap;
  ap.layout = layout_;
  ap.kv_base = base;
  ap.n_heads = static_cast<int>(hp.n_head);
  ap.sliding_window = static_cast<int>(hp.sliding_window);
  for (size_t l = 0; l < model_->layers().size(); ++l) {
    const model::LlamaLayer& L = model_->layers()[l];
    const CpuModelWeights::Layer& W = weights_.layers()[l];
    // Attention block.
    RmsNorm(x, L.attn_norm.data(), t, d, eps, xn);
    // q: [t][n_head][hd], k and v: [t][n_kv][hd]
    const MatMulOutput qkv[] = {{W.wq, q}, {W.wk, k}, {W.wv, v}};
    KVCACHE_RETURN_IF_ERROR(Timed(products, [&] { return MatMulSameInput(qkv, xn, t); }));
    if (hp.qkv_bias) {
      for (int i = 0; i < t; ++i) {
        Add(q + int64_t{i} * q_dim, L.bq.data(), q_dim, q + int64_t{i} * q_dim);
        Add(k + i * kv_dim, L.bk.data(), kv_dim, k + i * kv_dim);
        Add(v + i * kv_dim, L.bv.data(), kv_dim, v + i * kv_dim);
      }
    }
    if (hp.qk_norm) {  // each head's row normalised on its own
      RmsNorm(q, L.q_norm.data(), t * static_cast<int>(hp.n_head), hp.head_dim, eps, q);
      RmsNorm(k, L.k_norm.data(), t * static_cast<int>(hp.n_head_kv), hp.head_dim, eps, k);
    }
    KVCACHE_RETURN_IF_ERROR(rope_.Apply(q, t, static_cast<int>(hp.n_head), positions));
    KVCACHE_RETURN_IF_ERROR(rope_.Apply(k, t, static_cast<int>(hp.n_head_kv), positions));
    int64_t row = 0;
    for (const model::SequenceStep& s : batch) {
      const int n = static_cast<int>(s.tokens.size());
      KVCACHE_RETURN_IF_ERROR(WriteKv(layout_, base, s.page_table, static_cast<int>(l),
                                      static_cast<int>(s.first_pos), n, k + row * kv_dim, v + row * kv_dim));
      row += n;
    }
    ap.layer = static_cast<int>(l);
    KVCACHE_RETURN_IF_ERROR(
        Timed(attention, [&] { return PagedAttention(ap, seqs, q, att); }));              // [t][n_head][hd]
    KVCACHE_RETURN_IF_ERROR(Timed(products, [&] { return MatMul(W.wo, att, t, tmp); }));  // [t][d]
    Add(x, tmp, int64_t{t} * d, x);
    // Feed-forward block (SwiGLU).
    RmsNorm(x, L.ffn_norm.data(), t, d, eps, xn);
    const MatMulOutput gate_up[] = {{W.w_gate, gate}, {W.w_up, up}};  // [t][n_ff] each
    KVCACHE_RETURN_IF_ERROR(Timed(products, [&] { return MatMulSameInput(gate_up, xn, t); }));
    SwiGlu(gate, up, int64_t{t} * hp.n_ff, gate);
    KVCACHE_RETURN_IF_ERROR(Timed(products, [&] { return MatMul(W.w_down, gate, t, tmp); }));  // [t][d]
    Add(x, tmp, int64_t{t} * d, x);
  }
  return absl::OkStatus();
}

}  // namespace kvcache::cpu
