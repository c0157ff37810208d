#include "worker/model/llama_model.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/gguf/model_path.h"
#include "common/status_macros.h"

namespace kvcache::model {
namespace {

// A tensor as a weight matrix, checking its shape: ne0 = cols, ne1 = rows.
absl::StatusOr<WeightView> Matrix(const gguf::GgufFile& f, const std::string& name, int64_t rows,
                                  int64_t cols) {
  KVCACHE_ASSIGN_OR_RETURN(const gguf::GgufTensorInfo* t, f.GetTensor(name));
  if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor %s has shape %s, want [%d, %d]", name, t->ShapeString(), cols, rows));
  }
  // A type no kernel decodes (Q2_K, Q3_K, the IQ and ternary types) is refused
  // here, at start, not by every request's first step.
  if (absl::Status st = gguf::CheckRow(t->type, cols); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("tensor ", name, ": ", st.message()));
  }
  return WeightView{t->type, t->data, rows, cols};
}

absl::StatusOr<std::vector<float>> Vector(const gguf::GgufFile& f, const std::string& name, int64_t n) {
  KVCACHE_ASSIGN_OR_RETURN(const gguf::GgufTensorInfo* t, f.GetTensor(name));
  if (t->num_elements() != n || t->ne[0] != n) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor %s has shape %s, want [%d]", name, t->ShapeString(), n));
  }
  std::vector<float> v(static_cast<size_t>(n));
  KVCACHE_RETURN_IF_ERROR(gguf::GgufFile::DequantizeTensorRow(*t, 0, v.data()));
  return v;
}

int64_t Bytes(const WeightView& w) { return *gguf::RowBytes(w.type, w.cols) * w.rows; }

}  // namespace

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& path) {
  KVCACHE_ASSIGN_OR_RETURN(auto file, gguf::OpenModelFile(path));
  return FromFile(std::move(file));
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::FromFile(std::unique_ptr<gguf::GgufFile> file) {
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  KVCACHE_ASSIGN_OR_RETURN(m->hparams_, gguf::LoadLlamaHparams(*file));
  const gguf::LlamaHparams& hp = m->hparams_;
  if (hp.head_dim != hp.head_dim_v) {
    return absl::UnimplementedError("models with different K and V head sizes are not supported");
  }
  if (hp.n_rot != hp.head_dim) {
    return absl::UnimplementedError("partial rotary embeddings (rope.dimension_count < head_dim)");
  }
  if (hp.has_rope_freqs) {
    KVCACHE_ASSIGN_OR_RETURN(m->rope_freqs_, Vector(*file, "rope_freqs.weight", hp.n_rot / 2));
    for (float v : m->rope_freqs_) {
      if (!(v > 0.0f) || !std::isfinite(v)) {
        return absl::InvalidArgumentError("rope_freqs.weight holds a value that is not a positive number");
      }
    }
  }
  const int64_t d = hp.n_embd, q_dim = hp.n_head * hp.head_dim, kv_dim = hp.n_head_kv * hp.head_dim;
  const gguf::GgufFile& f = *file;
  KVCACHE_ASSIGN_OR_RETURN(m->token_embd_, Matrix(f, "token_embd.weight", hp.n_vocab, d));
  if (hp.tied_embeddings) {
    m->output_ = m->token_embd_;
  } else {
    KVCACHE_ASSIGN_OR_RETURN(m->output_, Matrix(f, "output.weight", hp.n_vocab, d));
  }
  KVCACHE_ASSIGN_OR_RETURN(m->output_norm_, Vector(f, "output_norm.weight", d));
  for (int64_t l = 0; l < hp.n_layer; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    LlamaLayer layer;
    KVCACHE_ASSIGN_OR_RETURN(layer.attn_norm, Vector(f, p + "attn_norm.weight", d));
    KVCACHE_ASSIGN_OR_RETURN(layer.wq, Matrix(f, p + "attn_q.weight", q_dim, d));
    KVCACHE_ASSIGN_OR_RETURN(layer.wk, Matrix(f, p + "attn_k.weight", kv_dim, d));
    KVCACHE_ASSIGN_OR_RETURN(layer.wv, Matrix(f, p + "attn_v.weight", kv_dim, d));
    KVCACHE_ASSIGN_OR_RETURN(layer.wo, Matrix(f, p + "attn_output.weight", d, q_dim));
    if (hp.qkv_bias) {
      KVCACHE_ASSIGN_OR_RETURN(layer.bq, Vector(f, p + "attn_q.bias", q_dim));
      KVCACHE_ASSIGN_OR_RETURN(layer.bk, Vector(f, p + "attn_k.bias", kv_dim));
      KVCACHE_ASSIGN_OR_RETURN(layer.bv, Vector(f, p + "attn_v.bias", kv_dim));
    }
    if (hp.qk_norm) {
      KVCACHE_ASSIGN_OR_RETURN(layer.q_norm, Vector(f, p + "attn_q_norm.weight", hp.head_dim));
      KVCACHE_ASSIGN_OR_RETURN(layer.k_norm, Vector(f, p + "attn_k_norm.weight", hp.head_dim));
    }
    KVCACHE_ASSIGN_OR_RETURN(layer.ffn_norm, Vector(f, p + "ffn_norm.weight", d));
    KVCACHE_ASSIGN_OR_RETURN(layer.w_gate, Matrix(f, p + "ffn_gate.weight", hp.n_ff, d));
    KVCACHE_ASSIGN_OR_RETURN(layer.w_up, Matrix(f, p + "ffn_up.weight", hp.n_ff, d));
    KVCACHE_ASSIGN_OR_RETURN(layer.w_down, Matrix(f, p + "ffn_down.weight", d, hp.n_ff));
    for (const WeightView* w :
         {&layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.w_gate, &layer.w_up, &layer.w_down}) {
      m->weight_bytes_ += Bytes(*w);
    }
    m->layers_.push_back(std::move(layer));
  }
  m->weight_bytes_ += Bytes(m->output_);

  m->model_id_ = gguf::ModelId(f, hp);
  m->file_ = std::move(file);
  return m;
}

}  // namespace kvcache::model
