#include "common/gguf/llama_hparams.h"

#include <xxhash.h>

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace kvcache {
namespace gguf {
namespace {

constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxDim = 1 << 20;

absl::StatusOr<int64_t> RequiredInt(const GgufFile& f, const std::string& key, int64_t lo, int64_t hi) {
  const GgufValue* v = f.FindValue(key);
  if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat("metadata '", key, "' is missing"));
  auto r = v->AsInt64();
  if (!r.ok() || *r < lo || *r > hi) {
    return absl::InvalidArgumentError(absl::StrCat("metadata '", key, "' = ", v->DebugString(),
                                                   " must be an integer in [", lo, ", ", hi, "]"));
  }
  return *r;
}

absl::StatusOr<int64_t> OptionalInt(const GgufFile& f, const std::string& key, int64_t dflt, int64_t lo,
                                    int64_t hi) {
  if (f.FindValue(key) == nullptr) return dflt;
  return RequiredInt(f, key, lo, hi);
}

absl::StatusOr<double> OptionalDouble(const GgufFile& f, const std::string& key, double dflt) {
  const GgufValue* v = f.FindValue(key);
  if (v == nullptr) return dflt;
  auto r = v->AsDouble();
  if (!r.ok() || !(*r > 0) || *r > 1e30) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata '", key, "' = ", v->DebugString(), " must be a positive number"));
  }
  return *r;
}

}  // namespace

std::string LlamaHparams::DebugString() const {
  return absl::StrCat("arch=", architecture, " layers=", n_layer, " embd=", n_embd, " ff=", n_ff,
                      " heads=", n_head, " kv_heads=", n_head_kv, " head_dim=", head_dim, " rot=", n_rot,
                      " ctx=", n_ctx_train, " vocab=", n_vocab, " rope_base=", rope_freq_base,
                      " rope_scaling=", rope_scaling.type, "x", rope_scaling.factor, " eps=", norm_rms_eps,
                      " swa=", sliding_window, " tied=", tied_embeddings ? "yes" : "no",
                      rope_neox ? " rope=neox" : "", qkv_bias ? " qkv_bias" : "", qk_norm ? " qk_norm" : "",
                      has_rope_freqs ? " rope_freqs" : "");
}

absl::StatusOr<LlamaHparams> LoadLlamaHparams(const GgufFile& f) {
  LlamaHparams h;
  KVCACHE_ASSIGN_OR_RETURN(absl::string_view arch, f.GetString("general.architecture"));
  if (std::find(std::begin(kSupportedArchitectures), std::end(kSupportedArchitectures), arch) ==
      std::end(kSupportedArchitectures)) {
    return absl::UnimplementedError(
        absl::StrCat("model architecture '", arch,
                     "' is not supported; supported: ", absl::StrJoin(kSupportedArchitectures, ", ")));
  }
  h.architecture = std::string(arch);
  h.rope_neox = arch == "qwen2" || arch == "qwen3";
  h.qkv_bias = arch == "qwen2";
  h.qk_norm = arch == "qwen3";
  if (auto n = f.GetString("general.name"); n.ok()) h.name = std::string(*n);
  const std::string p = h.architecture + ".";

  KVCACHE_ASSIGN_OR_RETURN(h.n_layer, RequiredInt(f, p + "block_count", 1, kMaxLayers));
  KVCACHE_ASSIGN_OR_RETURN(h.n_embd, RequiredInt(f, p + "embedding_length", 1, kMaxDim));
  KVCACHE_ASSIGN_OR_RETURN(h.n_ff, RequiredInt(f, p + "feed_forward_length", 1, 16 * kMaxDim));
  KVCACHE_ASSIGN_OR_RETURN(h.n_head, RequiredInt(f, p + "attention.head_count", 1, 4096));
  KVCACHE_ASSIGN_OR_RETURN(h.n_head_kv, OptionalInt(f, p + "attention.head_count_kv", h.n_head, 1, h.n_head));
  if (h.n_head % h.n_head_kv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_count ", h.n_head, " is not a multiple of head_count_kv ", h.n_head_kv));
  }
  const bool has_key_length = f.FindValue(p + "attention.key_length") != nullptr;
  if (!has_key_length && h.n_embd % h.n_head != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding_length ", h.n_embd, " is not a multiple of head_count ", h.n_head));
  }
  KVCACHE_ASSIGN_OR_RETURN(h.head_dim,
                           OptionalInt(f, p + "attention.key_length", h.n_embd / h.n_head, 1, 65536));
  KVCACHE_ASSIGN_OR_RETURN(h.head_dim_v, OptionalInt(f, p + "attention.value_length", h.head_dim, 1, 65536));
  KVCACHE_ASSIGN_OR_RETURN(h.n_rot, OptionalInt(f, p + "rope.dimension_count", h.head_dim, 0, h.head_dim));
  if (h.n_rot % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("rope.dimension_count ", h.n_rot, " is odd"));
  }
  KVCACHE_ASSIGN_OR_RETURN(h.n_ctx_train, RequiredInt(f, p + "context_length", 1, int64_t{1} << 32));
  KVCACHE_ASSIGN_OR_RETURN(h.rope_freq_base, OptionalDouble(f, p + "rope.freq_base", 10000.0));
  KVCACHE_ASSIGN_OR_RETURN(h.norm_rms_eps, OptionalDouble(f, p + "attention.layer_norm_rms_epsilon", 1e-5));
  if (auto t = f.GetString(p + "rope.scaling.type"); t.ok()) {
    h.rope_scaling.type = std::string(*t);
  }
  KVCACHE_ASSIGN_OR_RETURN(h.rope_scaling.factor, OptionalDouble(f, p + "rope.scaling.factor", 1.0));
  if (f.FindValue(p + "rope.scale_linear") != nullptr) {  // older files
    KVCACHE_ASSIGN_OR_RETURN(h.rope_scaling.factor, OptionalDouble(f, p + "rope.scale_linear", 1.0));
    if (h.rope_scaling.type == "none") h.rope_scaling.type = "linear";
  }
  KVCACHE_ASSIGN_OR_RETURN(
      h.rope_scaling.original_context_length,
      OptionalInt(f, p + "rope.scaling.original_context_length", 0, 0, int64_t{1} << 32));
  KVCACHE_ASSIGN_OR_RETURN(h.rope_scaling.attn_factor,
                           OptionalDouble(f, p + "rope.scaling.attn_factor", 1.0));
  KVCACHE_ASSIGN_OR_RETURN(h.sliding_window,
                           OptionalInt(f, p + "attention.sliding_window", 0, 0, int64_t{1} << 32));

  const GgufTensorInfo* embd = f.FindTensor("token_embd.weight");
  if (embd == nullptr) {
    return absl::InvalidArgumentError("tensor 'token_embd.weight' is missing");
  }
  if (const GgufValue* toks = f.FindValue("tokenizer.ggml.tokens"); toks != nullptr) {
    if (!toks->is_array()) {
      return absl::InvalidArgumentError("metadata 'tokenizer.ggml.tokens' is not an array");
    }
    h.n_vocab = static_cast<int64_t>(toks->array_size());
  } else if (f.FindValue(p + "vocab_size") != nullptr) {
    KVCACHE_ASSIGN_OR_RETURN(h.n_vocab, RequiredInt(f, p + "vocab_size", 1, int64_t{1} << 31));
  } else {
    h.n_vocab = embd->ne[1];
  }
  if (embd->n_dims != 2 || embd->ne[0] != h.n_embd || embd->ne[1] != h.n_vocab) {
    return absl::InvalidArgumentError(absl::StrCat("token_embd.weight has shape ", embd->ShapeString(),
                                                   ", expected [", h.n_embd, ", ", h.n_vocab, "]"));
  }
  h.tied_embeddings = f.FindTensor("output.weight") == nullptr;
  h.has_rope_freqs = f.FindTensor("rope_freqs.weight") != nullptr;
  return h;
}

std::string ModelId(const GgufFile& f, const LlamaHparams& hp) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (const auto& t : f.tensors()) {
    XXH3_64bits_update(st, t.name.data(), t.name.size());
    XXH3_64bits_update(st, &t.type, sizeof(t.type));
    XXH3_64bits_update(st, t.ne.data(), sizeof(t.ne));
    XXH3_64bits_update(st, t.data, static_cast<size_t>(std::min<int64_t>(t.size_bytes, 4096)));
  }
  for (const auto& [key, value] : f.metadata()) XXH3_64bits_update(st, key.data(), key.size());
  const uint64_t digest = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return absl::StrFormat("%s@%016x", hp.name.empty() ? hp.architecture : hp.name, digest);
}

}  // namespace gguf
}  // namespace kvcache
