#include "worker/backend/cuda/cuda_llama_runner.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/gguf/fp16.h"
#include "common/gguf/ggml_types.h"
#include "common/status_macros.h"
#include "worker/backend/cuda/activation.h"
#include "worker/backend/cuda/attention.h"
#include "worker/backend/cuda/cuda_check.h"
#include "worker/backend/cuda/device_context.h"
#include "worker/backend/cuda/kernel_math.h"
#include "worker/backend/cuda/norm_rope.h"
#include "worker/backend/cuda/weight_kernels.h"
#include "worker/model/rope.h"

namespace kvcache::cuda {
namespace {

// A weight matrix on the device in its file encoding, or several matrices
// stacked by rows (Q;K;V, gate;up). Stacked matrices of one type share one part
// (one kernel or GEMM per step); a type change starts a new part, which writes
// its rows at row_offset of the product.
struct WeightPart {
  DeviceBuffer buf;
  DeviceWeight w;
  int64_t row_offset = 0;
};
using StackedWeight = std::vector<WeightPart>;

// Copies `views` (stacked by rows; equal cols) to the device unchanged.
absl::StatusOr<StackedWeight> UploadWeights(std::initializer_list<const model::WeightView*> views,
                                            absl::string_view what) {
  const int64_t cols = (*views.begin())->cols;
  StackedWeight parts;
  int64_t row_offset = 0;
  for (auto first = views.begin(); first != views.end();) {
    // [first, end): the run of views of first's type.
    const gguf::GgmlType type = (*first)->type;
    auto end = first;
    int64_t rows = 0;
    for (; end != views.end() && (*end)->type == type; ++end) {
      if ((*end)->cols != cols || (*end)->data == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": weights of different widths or missing"));
      }
      rows += (*end)->rows;
    }
    KVCACHE_RETURN_IF_ERROR(WeightKernelsSupport(type, cols));
    KVCACHE_ASSIGN_OR_RETURN(const int64_t row_bytes, gguf::RowBytes(type, cols));
    WeightPart part;
    KVCACHE_ASSIGN_OR_RETURN(part.buf,
                             DeviceBuffer::Allocate(rows * row_bytes, absl::StrCat("weights ", what)));
    int64_t at = 0;
    for (; first != end; ++first) {
      const int64_t bytes = (*first)->rows * row_bytes;
      KVCACHE_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(part.buf.as<uint8_t>() + at, (*first)->data, bytes, cudaMemcpyHostToDevice),
          absl::StrCat("upload ", what));
      at += bytes;
    }
    part.w = DeviceWeight{type, rows, cols, row_bytes, part.buf.as<uint8_t>()};
    part.row_offset = row_offset;
    row_offset += rows;
    parts.push_back(std::move(part));
  }
  return parts;
}

absl::StatusOr<DeviceBuffer> UploadF32(const std::vector<float>& v, absl::string_view what) {
  KVCACHE_ASSIGN_OR_RETURN(DeviceBuffer buf,
                           DeviceBuffer::Allocate(static_cast<int64_t>(v.size()) * 4, what));
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaMemcpy(buf.get(), v.data(), v.size() * 4, cudaMemcpyHostToDevice),
                               absl::StrCat("upload ", what));
  return buf;
}

// Grows `buf` to at least `bytes` (contents are not kept).
absl::Status Reserve(DeviceBuffer* buf, int64_t bytes, absl::string_view what) {
  if (buf->bytes() >= bytes) return absl::OkStatus();
  buf->Reset();
  KVCACHE_ASSIGN_OR_RETURN(*buf, DeviceBuffer::Allocate(bytes + bytes / 4, what));
  return absl::OkStatus();
}
absl::Status Reserve(PinnedBuffer* buf, int64_t bytes, absl::string_view what) {
  if (buf->bytes() >= bytes) return absl::OkStatus();
  buf->Reset();
  KVCACHE_ASSIGN_OR_RETURN(*buf, PinnedBuffer::Allocate(bytes + bytes / 4, what));
  return absl::OkStatus();
}

struct DeviceLayer {
  DeviceBuffer attn_norm, ffn_norm;  // f32 [n_embd]
  DeviceBuffer bqkv;                 // f32 [(n_head + 2 n_head_kv) hd] when hparams.qkv_bias
  DeviceBuffer q_norm, k_norm;       // f32 [hd] when hparams.qk_norm
  StackedWeight wqkv;                // [(n_head + 2 n_head_kv) hd][n_embd]
  StackedWeight wo;                  // [n_embd][n_head hd]
  StackedWeight w_gate_up;           // [2 n_ff][n_embd]
  StackedWeight w_down;              // [n_embd][n_ff]
};

// Rows of f16 scratch that one DequantizeRowsToF16 + GEMM pass covers: at most
// kDequantScratchElems elements (16 MiB), so a large matrix (an 8B model's FFN
// or output head) is multiplied in row slices.
constexpr int64_t kDequantScratchElems = int64_t{8} << 20;
int64_t DequantSliceRows(const DeviceWeight& w) {
  return std::min(w.rows, std::max<int64_t>(1, kDequantScratchElems / w.cols));
}

// CUDA graphs. A step of up to kMaxGraphTokens new tokens is padded to the next
// of kGraphTokenBuckets and replayed from a graph captured once per (tokens,
// logit rows, attention splits) bucket, as vLLM and TensorRT-LLM do for decode:
// one launch instead of ~15 per layer, whose host and launch costs dominate a
// small model's step. Padding rows read token 0 at position 0, write no K/V
// (page -1) and attend to nothing (item position -1); every kernel treats rows
// independently, so real rows come out as in an eager step of the same width.
// Larger steps (long prefill chunks) run eagerly: there the work dwarfs the launches.
constexpr int kGraphTokenBuckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128};
constexpr int kMaxGraphTokens = 128;
// Graphs kept per runner; past this the cache starts again (a graph is a few
// hundred nodes: host memory, no device memory of its own).
constexpr size_t kMaxGraphs = 64;

int GraphBucket(int n) {
  for (int b : kGraphTokenBuckets) {
    if (n <= b) return b;
  }
  return 0;
}

int PowerOfTwoAtLeast(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

struct GraphKey {
  int tokens = 0;  // padded new tokens (T)
  int want = 0;    // padded logit rows (W)
  int splits = 0;  // attention splits the scratch is laid out for (S)
  bool operator==(const GraphKey& o) const {
    return tokens == o.tokens && want == o.want && splits == o.splits;
  }
  template <typename H>
  friend H AbslHashValue(H h, const GraphKey& k) {
    return H::combine(std::move(h), k.tokens, k.want, k.splits);
  }
};

// An instantiated graph, destroyed with its owner.
class StepGraph {
 public:
  explicit StepGraph(cudaGraphExec_t exec) : exec_(exec) {}
  ~StepGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  }
  StepGraph(StepGraph&& o) noexcept : exec_(o.exec_) { o.exec_ = nullptr; }
  StepGraph& operator=(StepGraph&&) = delete;
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;
  cudaGraphExec_t get() const { return exec_; }

 private:
  cudaGraphExec_t exec_;
};

class CudaLlamaRunner final : public model::ModelRunner {
 public:
  CudaLlamaRunner(const model::LlamaModel& model, CudaTierStorage& tier0, const kv::KvShape& shape,
                  backend::CudaRunnerOptions options)
      : model_(model), tier0_(tier0), ctx_(tier0.context()), options_(options), layout_(shape.layout()) {}
  ~CudaLlamaRunner() override;

  absl::Status Init();
  CudaGraphStats graph_stats() const { return stats_; }

  const gguf::LlamaHparams& hparams() const override { return model_.hparams(); }
  int max_batch_tokens() const override { return options_.max_batch_tokens; }
  absl::Status Forward(absl::Span<const model::SequenceStep> batch, std::vector<float>* logits) override;
  // The logits stay in the pinned buffer the step copied them to.
  absl::StatusOr<absl::Span<const float>> ForwardView(absl::Span<const model::SequenceStep> batch) override;

 private:
  // The step laid out by ForwardView: `key` its (padded) widths, graph whether
  // it replays a graph. The logits land in logits_host_.
  absl::Status RunStep(const GraphKey& key, bool graph, int64_t meta_ints);
  // Queues the whole step (every layer, the logits and their copy to the host) on
  // `stream`, with `blas` bound to it: run eagerly, or captured into a graph.
  absl::Status Enqueue(const GraphKey& key, cudaStream_t stream, cublasHandle_t blas);
  // The graph for `key`, captured now if it is new. An error disables graphs.
  absl::StatusOr<cudaGraphExec_t> GraphFor(const GraphKey& key);
  // y[i][row_offset + r] (+)= W·x[i] for i < t over every part of W: MatVec for up
  // to kMatVecMaxTokens tokens, else cuBLAS (on the f16 weights directly, or on
  // slices dequantised into dequant_).
  absl::Status MatMul(const StackedWeight& W, const uint16_t* x, int t, float* y, int64_t ldy, float beta,
                      cudaStream_t stream, cublasHandle_t blas);

  const model::LlamaModel& model_;
  CudaTierStorage& tier0_;
  const DeviceContext& ctx_;
  const backend::CudaRunnerOptions options_;
  const kv::PageLayout layout_;
  int max_positions_ = 0;
  int64_t qkv_rows_ = 0;

  std::vector<DeviceLayer> layers_;
  StackedWeight embd_, output_;  // output_ empty when tied to embd_
  DeviceBuffer output_norm_, rope_;
  DeviceBuffer dequant_;  // f16 slices of quantised weights for cuBLAS
  // Activations for max_batch_tokens rows.
  DeviceBuffer x_, xn16_, qkv_, att16_, gate_up_, h16_;
  // Grown on demand.
  DeviceBuffer attn_scratch_, logits_dev_, meta_dev_;
  PinnedBuffer logits_host_, meta_host_;

  // Graph capture: a stream of the runner's own (nothing else queues work on it,
  // so a capture never takes in another thread's event), the workspace its
  // GEMMs use in graphs, the graphs by key, and what happened.
  cudaStream_t graph_stream_ = nullptr;
  DeviceBuffer graph_blas_workspace_;
  bool graphs_enabled_ = false;
  absl::flat_hash_map<GraphKey, StepGraph> graphs_;
  CudaGraphStats stats_;

  // Step metadata: int32 offsets into meta (see ForwardView).
  int64_t off_tokens_ = 0, off_pos_ = 0, off_page_ = 0, off_slot_ = 0, off_items_ = 0, off_seq_ = 0,
          off_tables_ = 0, off_rows_ = 0;
};

CudaLlamaRunner::~CudaLlamaRunner() {
  if (!ctx_.Activate().ok()) return;
  graphs_.clear();
  if (graph_stream_ != nullptr) cudaStreamDestroy(graph_stream_);
}

absl::Status CudaLlamaRunner::Init() {
  const gguf::LlamaHparams& hp = model_.hparams();
  KVCACHE_RETURN_IF_ERROR(ctx_.Activate());
  KVCACHE_RETURN_IF_ERROR(AttentionSupports(layout_, static_cast<int>(hp.n_head)));
  KVCACHE_ASSIGN_OR_RETURN(const model::RopeParams rope_params,
                           model::RopeParamsFor(hp, model_.rope_freqs()));
  max_positions_ = model::RopeMaxPositions(hp);
  const int64_t d = hp.n_embd, hd = hp.head_dim, ff = hp.n_ff;
  qkv_rows_ = (hp.n_head + 2 * hp.n_head_kv) * hd;

  // Weights, in their file encoding.
  layers_.resize(model_.layers().size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const model::LlamaLayer& L = model_.layers()[l];
    DeviceLayer& D = layers_[l];
    const std::string n = absl::StrCat("layer ", l);
    KVCACHE_ASSIGN_OR_RETURN(D.attn_norm, UploadF32(L.attn_norm, n));
    KVCACHE_ASSIGN_OR_RETURN(D.ffn_norm, UploadF32(L.ffn_norm, n));
    KVCACHE_ASSIGN_OR_RETURN(D.wqkv, UploadWeights({&L.wq, &L.wk, &L.wv}, n));
    if (hp.qkv_bias) {
      std::vector<float> b = L.bq;
      b.insert(b.end(), L.bk.begin(), L.bk.end());
      b.insert(b.end(), L.bv.begin(), L.bv.end());
      KVCACHE_ASSIGN_OR_RETURN(D.bqkv, UploadF32(b, n));
    }
    if (hp.qk_norm) {
      KVCACHE_ASSIGN_OR_RETURN(D.q_norm, UploadF32(L.q_norm, n));
      KVCACHE_ASSIGN_OR_RETURN(D.k_norm, UploadF32(L.k_norm, n));
    }
    KVCACHE_ASSIGN_OR_RETURN(D.wo, UploadWeights({&L.wo}, n));
    KVCACHE_ASSIGN_OR_RETURN(D.w_gate_up, UploadWeights({&L.w_gate, &L.w_up}, n));
    KVCACHE_ASSIGN_OR_RETURN(D.w_down, UploadWeights({&L.w_down}, n));
  }
  KVCACHE_ASSIGN_OR_RETURN(embd_, UploadWeights({&model_.token_embd()}, "token_embd"));
  if (model_.output().data != model_.token_embd().data) {
    KVCACHE_ASSIGN_OR_RETURN(output_, UploadWeights({&model_.output()}, "output"));
  }
  // One f16 slice buffer, as large as the largest slice of a quantised matrix.
  int64_t slice_elems = 0;
  auto grow = [&](const StackedWeight& W) {
    for (const WeightPart& p : W) {
      if (p.w.type != gguf::GgmlType::kF16)
        slice_elems = std::max(slice_elems, DequantSliceRows(p.w) * p.w.cols);
    }
  };
  for (const DeviceLayer& D : layers_) {
    for (const StackedWeight* W : {&D.wqkv, &D.wo, &D.w_gate_up, &D.w_down}) grow(*W);
  }
  grow(output_.empty() ? embd_ : output_);
  if (options_.max_batch_tokens > kMatVecMaxTokens && slice_elems > 0) {
    KVCACHE_ASSIGN_OR_RETURN(dequant_, DeviceBuffer::Allocate(slice_elems * 2, "dequantised weight slices"));
  }
  KVCACHE_ASSIGN_OR_RETURN(output_norm_, UploadF32(model_.output_norm(), "output_norm"));
  std::vector<float> rope(static_cast<size_t>(max_positions_) * hd);
  RopeCosSinTable(rope_params, max_positions_, rope.data());
  KVCACHE_ASSIGN_OR_RETURN(rope_, UploadF32(rope, "rope table"));

  const int64_t t = options_.max_batch_tokens;
  KVCACHE_ASSIGN_OR_RETURN(x_, DeviceBuffer::Allocate(t * d * 4, "activations"));
  KVCACHE_ASSIGN_OR_RETURN(xn16_, DeviceBuffer::Allocate(t * d * 2, "activations"));
  KVCACHE_ASSIGN_OR_RETURN(qkv_, DeviceBuffer::Allocate(t * qkv_rows_ * 4, "activations"));
  KVCACHE_ASSIGN_OR_RETURN(att16_, DeviceBuffer::Allocate(t * hp.n_head * hd * 2, "activations"));
  KVCACHE_ASSIGN_OR_RETURN(gate_up_, DeviceBuffer::Allocate(t * 2 * ff * 4, "activations"));
  KVCACHE_ASSIGN_OR_RETURN(h16_, DeviceBuffer::Allocate(t * ff * 2, "activations"));
  // Padding rows of a graph step may read attention rows no item wrote: zeros.
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaMemset(att16_.get(), 0, att16_.bytes()), "clear activations");

  if (options_.cuda_graphs) {
    constexpr int64_t kBlasWorkspaceBytes = int64_t{4} << 20;  // enough for the step's small GEMMs
    KVCACHE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&graph_stream_, cudaStreamNonBlocking),
                                 "graph capture stream");
    KVCACHE_ASSIGN_OR_RETURN(graph_blas_workspace_,
                             DeviceBuffer::Allocate(kBlasWorkspaceBytes, "cuBLAS workspace (graphs)"));
    graphs_enabled_ = true;
  }
  return absl::OkStatus();
}

absl::Status CudaLlamaRunner::Forward(absl::Span<const model::SequenceStep> batch,
                                      std::vector<float>* logits) {
  logits->clear();
  KVCACHE_ASSIGN_OR_RETURN(const absl::Span<const float> view, ForwardView(batch));
  logits->assign(view.begin(), view.end());
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const float>> CudaLlamaRunner::ForwardView(
    absl::Span<const model::SequenceStep> batch) {
  const gguf::LlamaHparams& hp = model_.hparams();
  const int window = static_cast<int>(hp.sliding_window);
  // Validate and count, as the CPU runner does.
  int64_t t = 0, n_pages = 0;
  int n_want = 0, max_splits = 0;
  for (const model::SequenceStep& s : batch) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    const int64_t end = s.first_pos + n;
    if (n == 0 || s.first_pos < 0)
      return absl::InvalidArgumentError("empty sequence step or negative position");
    if (end > max_positions_) {
      return absl::InvalidArgumentError(
          absl::StrCat("position ", end - 1, " beyond the model context ", max_positions_));
    }
    if (static_cast<int64_t>(s.page_table.size()) * layout_.page_tokens < end) {
      return absl::InvalidArgumentError("page table shorter than the sequence");
    }
    for (int32_t tok : s.tokens) {
      if (tok < 0 || tok >= hp.n_vocab) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", tok, " outside the vocabulary"));
      }
    }
    t += n;
    n_pages += static_cast<int64_t>(s.page_table.size());
    n_want += s.want_logits ? 1 : 0;
    max_splits = std::max(max_splits, AttentionSplits(static_cast<int>(end - 1), window));
  }
  if (t > options_.max_batch_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(t, " tokens in one step; the limit is ", options_.max_batch_tokens));
  }
  if (t == 0) return absl::Span<const float>();

  // The step's widths: exact for an eager step; padded to buckets for a graph,
  // so that a few graphs serve every step (the splits only set the attention
  // scratch's layout: splits past an item's keys do nothing).
  // (A bucket wider than max_batch_tokens would overrun the activations: eager.)
  const bool graph = graphs_enabled_ && t <= kMaxGraphTokens &&
                     GraphBucket(static_cast<int>(t)) <= options_.max_batch_tokens;
  GraphKey key{static_cast<int>(t), n_want, max_splits};
  if (graph) {
    key = GraphKey{GraphBucket(static_cast<int>(t)), n_want == 0 ? 0 : GraphBucket(n_want),
                   PowerOfTwoAtLeast(max_splits)};
  }
  const int64_t T = key.tokens, W = key.want;

  // Step metadata, one int32 array uploaded with one copy; every offset depends
  // on T and W only, so a graph's kernels find it where they were captured:
  //   tokens[T] positions[T] dst_page[T] dst_slot[T] items[T][2] logit_rows[W]
  //   seq_page_offset[T] (n_seq <= T) page_tables[n_pages]
  const int64_t n_seq = static_cast<int64_t>(batch.size());
  off_tokens_ = 0;
  off_pos_ = T;
  off_page_ = 2 * T;
  off_slot_ = 3 * T;
  off_items_ = 4 * T;
  off_rows_ = 6 * T;
  off_seq_ = off_rows_ + W;
  off_tables_ = off_seq_ + T;
  const int64_t meta_ints = off_tables_ + n_pages;
  KVCACHE_RETURN_IF_ERROR(ctx_.Activate());
  KVCACHE_RETURN_IF_ERROR(Reserve(&meta_host_, meta_ints * 4, "step metadata"));
  int32_t* m = meta_host_.as<int32_t>();
  std::memset(m, 0, static_cast<size_t>(off_tables_) * sizeof(int32_t));
  int64_t row = 0, table_at = off_tables_, want = 0;
  for (int64_t si = 0; si < n_seq; ++si) {
    const model::SequenceStep& s = batch[si];
    m[off_seq_ + si] = static_cast<int32_t>(table_at - off_tables_);
    for (size_t i = 0; i < s.tokens.size(); ++i, ++row) {
      const int32_t pos = static_cast<int32_t>(s.first_pos + static_cast<int64_t>(i));
      const kv::PageId page = s.page_table[pos / layout_.page_tokens];
      if (page < 0 || page >= tier0_.num_pages()) {
        return absl::InvalidArgumentError(
            absl::StrCat("page id ", page, " for position ", pos, " is not a tier-0 page"));
      }
      m[off_tokens_ + row] = s.tokens[i];
      m[off_pos_ + row] = pos;
      m[off_page_ + row] = page;
      m[off_slot_ + row] = pos % layout_.page_tokens;
      m[off_items_ + 2 * row] = static_cast<int32_t>(si);
      m[off_items_ + 2 * row + 1] = pos;
    }
    // Pages the window released (kNoPage) are never read: the kernels start at
    // FirstVisibleKey. Copy the table as is.
    std::memcpy(m + table_at, s.page_table.data(), s.page_table.size() * sizeof(int32_t));
    table_at += static_cast<int64_t>(s.page_table.size());
    if (s.want_logits) m[off_rows_ + want++] = static_cast<int32_t>(row - 1);
  }
  // Padding rows (token 0, position 0, logit row 0 from the memset) write no K/V
  // and attend to nothing.
  for (; row < T; ++row) {
    m[off_page_ + row] = -1;
    m[off_items_ + 2 * row + 1] = -1;
  }
  const absl::Status st = RunStep(key, graph, meta_ints);
  if (!st.ok() && !absl::IsInvalidArgument(st)) {
    return absl::InternalError(absl::StrCat("CUDA step failed on ", ctx_.Describe(), ": ", st.message()));
  }
  if (!st.ok()) return st;
  return absl::MakeConstSpan(logits_host_.as<float>(), static_cast<size_t>(int64_t{n_want} * hp.n_vocab));
}

absl::Status CudaLlamaRunner::RunStep(const GraphKey& key, bool graph, int64_t meta_ints) {
  const gguf::LlamaHparams& hp = model_.hparams();
  const int64_t vocab = hp.n_vocab;
  cudaStream_t stream = ctx_.compute_stream();
  tier0_.DropRestoreRecords();  // kernels are about to write pages

  // Buffers a graph captured by address: growing one drops the graphs.
  const void* before[] = {meta_dev_.get(), attn_scratch_.get(), logits_dev_.get(), logits_host_.get()};
  KVCACHE_RETURN_IF_ERROR(Reserve(&meta_dev_, meta_ints * 4, "step metadata"));
  KVCACHE_RETURN_IF_ERROR(Reserve(&attn_scratch_,
                                  AttentionScratchFloats(key.tokens, static_cast<int>(hp.n_head),
                                                         static_cast<int>(hp.head_dim), key.splits) *
                                      4,
                                  "attention scratch"));
  KVCACHE_RETURN_IF_ERROR(Reserve(&logits_dev_, int64_t{std::max(key.want, 1)} * vocab * 4, "logits"));
  KVCACHE_RETURN_IF_ERROR(Reserve(&logits_host_, int64_t{std::max(key.want, 1)} * vocab * 4, "logits"));
  const void* after[] = {meta_dev_.get(), attn_scratch_.get(), logits_dev_.get(), logits_host_.get()};
  if (!std::equal(std::begin(before), std::end(before), std::begin(after))) graphs_.clear();
  KVCACHE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(meta_dev_.get(), meta_host_.get(), meta_ints * 4, cudaMemcpyHostToDevice, stream),
      "upload step metadata");

  bool replayed = false;
  if (graph) {
    absl::StatusOr<cudaGraphExec_t> exec = GraphFor(key);
    if (exec.ok()) {
      KVCACHE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(*exec, stream), "launch the step's graph");
      ++stats_.replays;
      replayed = true;
    }
  }
  if (!replayed) {
    // Eagerly, at the same widths (a failed capture has disabled graphs).
    KVCACHE_RETURN_IF_ERROR(Enqueue(key, stream, ctx_.cublas()));
    ++stats_.eager_steps;
  }
  KVCACHE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "wait for the step");
  return absl::OkStatus();
}

absl::StatusOr<cudaGraphExec_t> CudaLlamaRunner::GraphFor(const GraphKey& key) {
  if (auto it = graphs_.find(key); it != graphs_.end()) return it->second.get();
  if (graphs_.size() >= kMaxGraphs) graphs_.clear();
  // Thread-local capture: other threads (offload, migration) keep using the
  // device's streams meanwhile; only this thread's calls are captured.
  // The context's cuBLAS handle (only runners use it, on the engine thread)
  // follows the capture stream with a workspace of the graphs' own, and goes back
  // to the compute stream and its default workspace after.
  cublasHandle_t blas = ctx_.cublas();
  absl::Status st = CublasStatus(cublasSetStream(blas, graph_stream_), "cuBLAS on the capture stream");
  if (st.ok()) {
    st = CublasStatus(cublasSetWorkspace(blas, graph_blas_workspace_.get(), graph_blas_workspace_.bytes()),
                      "cuBLAS workspace for graphs");
  }
  if (st.ok()) {
    st = CudaStatus(cudaStreamBeginCapture(graph_stream_, cudaStreamCaptureModeThreadLocal),
                    "begin graph capture");
  }
  cudaGraph_t g = nullptr;
  if (st.ok()) {
    st = Enqueue(key, graph_stream_, blas);
    const absl::Status end = CudaStatus(cudaStreamEndCapture(graph_stream_, &g), "end graph capture");
    if (st.ok()) st = end;
  }
  const absl::Status back =
      CublasStatus(cublasSetStream(blas, ctx_.compute_stream()), "cuBLAS back on the compute stream");
  if (st.ok()) st = back;
  cudaGraphExec_t exec = nullptr;
  if (st.ok()) st = CudaStatus(cudaGraphInstantiate(&exec, g, 0), "instantiate the step's graph");
  if (g != nullptr) cudaGraphDestroy(g);
  if (!st.ok()) {
    if (absl::IsInvalidArgument(st)) return st;  // the step itself is bad: eager says so too
    (void)cudaGetLastError();                    // capture errors are not sticky
    graphs_enabled_ = false;
    graphs_.clear();
    stats_.error = st.ToString();
    std::fprintf(stderr, "kvcache cuda: CUDA graphs disabled on %s: %s\n", ctx_.Describe().c_str(),
                 stats_.error.c_str());
    return st;
  }
  ++stats_.captures;
  return graphs_.emplace(key, StepGraph(exec)).first->second.get();
}

absl::Status CudaLlamaRunner::Enqueue(const GraphKey& key, cudaStream_t stream, cublasHandle_t blas) {
  const gguf::LlamaHparams& hp = model_.hparams();
  const int64_t d = hp.n_embd, hd = hp.head_dim, ff = hp.n_ff, vocab = hp.n_vocab;
  const int nh = static_cast<int>(hp.n_head), nkv = static_cast<int>(hp.n_head_kv);
  const float eps = static_cast<float>(hp.norm_rms_eps);
  const int t = key.tokens, n_want = key.want;
  const int32_t* meta = meta_dev_.as<int32_t>();
  float* x = x_.as<float>();
  uint16_t* xn16 = xn16_.as<uint16_t>();
  float* qkv = qkv_.as<float>();

  KVCACHE_RETURN_IF_ERROR(EmbeddingLookup(embd_.front().w, meta + off_tokens_, t, x, stream));
  WriteKvArgs w;
  w.layout = layout_;
  w.kv_base = tier0_.slab();
  w.n_tokens = t;
  w.k = qkv + nh * hd;
  w.v = qkv + (nh + nkv) * hd;
  w.row_stride = qkv_rows_;
  w.dst_page = meta + off_page_;
  w.dst_slot = meta + off_slot_;
  AttentionArgs a;
  a.layout = layout_;
  a.kv_base = tier0_.slab();
  a.n_heads = nh;
  a.sliding_window = static_cast<int>(hp.sliding_window);
  a.page_tables = meta + off_tables_;
  a.seq_page_offset = meta + off_seq_;
  a.items = reinterpret_cast<const AttentionItem*>(meta + off_items_);
  a.n_items = t;
  a.max_splits = key.splits;
  a.q = qkv;
  a.q_row_stride = qkv_rows_;
  a.scratch = attn_scratch_.as<float>();
  a.out_f16 = att16_.as<uint16_t>();
  for (size_t l = 0; l < layers_.size(); ++l) {
    const DeviceLayer& L = layers_[l];
    KVCACHE_RETURN_IF_ERROR(RmsNormToF16(x, nullptr, L.attn_norm.as<float>(), t, d, eps, xn16, stream));
    KVCACHE_RETURN_IF_ERROR(MatMul(L.wqkv, xn16, t, qkv, qkv_rows_, 0.0f, stream, blas));
    if (hp.qkv_bias)
      KVCACHE_RETURN_IF_ERROR(AddBias(qkv, t, qkv_rows_, qkv_rows_, L.bqkv.as<float>(), stream));
    if (hp.qk_norm) {
      KVCACHE_RETURN_IF_ERROR(
          HeadRmsNorm(qkv, t, qkv_rows_, nh, static_cast<int>(hd), L.q_norm.as<float>(), eps, stream));
      KVCACHE_RETURN_IF_ERROR(HeadRmsNorm(qkv + nh * hd, t, qkv_rows_, nkv, static_cast<int>(hd),
                                          L.k_norm.as<float>(), eps, stream));
    }
    KVCACHE_RETURN_IF_ERROR(Rope(qkv, t, qkv_rows_, nh + nkv, static_cast<int>(hd), hp.rope_neox,
                                 rope_.as<float>(), meta + off_pos_, stream));
    w.layer = a.layer = static_cast<int>(l);
    KVCACHE_RETURN_IF_ERROR(WriteKv(w, stream));
    KVCACHE_RETURN_IF_ERROR(PagedAttention(a, stream));
    KVCACHE_RETURN_IF_ERROR(MatMul(L.wo, att16_.as<uint16_t>(), t, x, d, 1.0f, stream, blas));
    KVCACHE_RETURN_IF_ERROR(RmsNormToF16(x, nullptr, L.ffn_norm.as<float>(), t, d, eps, xn16, stream));
    KVCACHE_RETURN_IF_ERROR(MatMul(L.w_gate_up, xn16, t, gate_up_.as<float>(), 2 * ff, 0.0f, stream, blas));
    KVCACHE_RETURN_IF_ERROR(SwiGluToF16(gate_up_.as<float>(), t, ff, h16_.as<uint16_t>(), stream));
    KVCACHE_RETURN_IF_ERROR(MatMul(L.w_down, h16_.as<uint16_t>(), t, x, d, 1.0f, stream, blas));
  }
  if (n_want > 0) {
    KVCACHE_RETURN_IF_ERROR(
        RmsNormToF16(x, meta + off_rows_, output_norm_.as<float>(), n_want, d, eps, xn16, stream));
    KVCACHE_RETURN_IF_ERROR(MatMul(output_.empty() ? embd_ : output_, xn16, n_want, logits_dev_.as<float>(),
                                   vocab, 0.0f, stream, blas));
    KVCACHE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits_host_.get(), logits_dev_.get(),
                                                 int64_t{n_want} * vocab * 4, cudaMemcpyDeviceToHost, stream),
                                 "copy logits to the host");
  }
  return absl::OkStatus();
}

absl::Status CudaLlamaRunner::MatMul(const StackedWeight& W, const uint16_t* x, int t, float* y, int64_t ldy,
                                     float beta, cudaStream_t stream, cublasHandle_t blas) {
  for (const WeightPart& p : W) {
    const DeviceWeight& w = p.w;
    float* yp = y + p.row_offset;
    if (t <= kMatVecMaxTokens) {
      KVCACHE_RETURN_IF_ERROR(MatVec(w, x, t, yp, ldy, beta, stream));
    } else if (w.type == gguf::GgmlType::kF16) {
      KVCACHE_RETURN_IF_ERROR(
          GemmF16(blas, reinterpret_cast<const uint16_t*>(w.data), w.rows, w.cols, x, t, yp, ldy, beta));
    } else {
      // Stream order keeps a slice's GEMM ahead of the next slice's dequantisation.
      const int64_t slice = DequantSliceRows(w);
      uint16_t* f16 = dequant_.as<uint16_t>();
      for (int64_t r0 = 0; r0 < w.rows; r0 += slice) {
        const int64_t n = std::min(slice, w.rows - r0);
        KVCACHE_RETURN_IF_ERROR(DequantizeRowsToF16(w, r0, n, f16, stream));
        KVCACHE_RETURN_IF_ERROR(GemmF16(blas, f16, n, w.cols, x, t, yp + r0, ldy, beta));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<model::ModelRunnerPtr> CreateCudaLlamaRunner(const model::LlamaModel& model,
                                                            CudaTierStorage& tier0, const kv::KvShape& shape,
                                                            const backend::CudaRunnerOptions& options) {
  const gguf::LlamaHparams& hp = model.hparams();
  if (options.max_batch_tokens < 1 || options.max_batch_tokens > 65535) {
    return absl::InvalidArgumentError("max_batch_tokens must be in [1, 65535]");
  }
  if (shape.layers != hp.n_layer || shape.kv_heads != hp.n_head_kv || shape.head_dim != hp.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV shape ", shape.layers, "x", shape.kv_heads, "x", shape.head_dim, " does not match the model (",
        hp.n_layer, " layers, ", hp.n_head_kv, " kv heads, head_dim ", hp.head_dim, ")"));
  }
  if (tier0.memory() != TierMemory::kDevice || tier0.page_bytes() != shape.page_bytes()) {
    return absl::FailedPreconditionError("CUDA runner needs tier 0 as a device slab of the shape's pages");
  }
  auto runner = std::make_unique<CudaLlamaRunner>(model, tier0, shape, options);
  KVCACHE_RETURN_IF_ERROR(runner->Init());
  return model::ModelRunnerPtr(std::move(runner));
}

CudaGraphStats GetCudaGraphStats(const model::ModelRunner& runner) {
  const auto* cuda = dynamic_cast<const CudaLlamaRunner*>(&runner);
  return cuda != nullptr ? cuda->graph_stats() : CudaGraphStats{};
}

}  // namespace kvcache::cuda
