#include "common/gguf/tiny_llama.h"

#include <cstdio>
#include <random>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/gguf/gguf_writer.h"
#include "common/status_macros.h"

namespace kvcache {
namespace gguf {
namespace {

constexpr char kSmolLmTemplate[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

// GPT-2 byte -> printable code point, as UTF-8.
std::string ByteToken(int b) {
  auto printable = [](int c) {
    return (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
  };
  int cp = b;
  if (!printable(b)) {
    int n = 0;
    for (int c = 0; c < b; ++c) n += printable(c) ? 0 : 1;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// Merges in rank order; "Ġ" is the byte token of ' '. Later entries build on
// earlier ones.
const char* const kMerges[][2] = {
    {"Ġ", "t"},    {"h", "e"},  {"i", "n"}, {"e", "r"},  {"a", "n"},   {"o", "n"},    {"Ġt", "he"},
    {"r", "e"},    {"Ġ", "a"},  {"Ġ", "s"}, {"o", "u"},  {"a", "t"},   {"e", "n"},    {"Ġ", "w"},
    {"i", "s"},    {"Ġ", "c"},  {"i", "t"}, {"Ġ", "o"},  {"o", "r"},   {"e", "s"},    {"in", "g"},
    {"Ġ", "b"},    {"Ġ", "f"},  {"Ġ", "p"}, {"l", "l"},  {"Ġ", "m"},   {"e", "d"},    {"Ġa", "n"},
    {"Ġo", "f"},   {"Ġ", "h"},  {"a", "r"}, {"Ġ", "d"},  {"Ġan", "d"}, {"Ġ", "in"},   {"Ġt", "o"},
    {"a", "l"},    {"Ġ", "l"},  {"i", "c"}, {"l", "e"},  {"Ġ", "Ġ"},   {"Ġ", "I"},    {"Ġ", "y"},
    {"Ġy", "ou"},  {"s", "t"},  {"Ġ", "T"}, {"Ġ", "n"},  {"o", "m"},   {"Ġ", "e"},    {"Ġ", "is"},
    {"Ġw", "h"},   {"Ġs", "t"}, {"c", "h"}, {"Ġb", "e"}, {"Ġ", "g"},   {"v", "e"},    {"Ġ", "re"},
    {"Ġwh", "at"}, {"Ġ", "H"},  {"Ġ", "S"}, {"Ġ", "A"},  {"ĠH", "e"},  {"ĠHe", "ll"}, {"ĠHell", "o"},
    {"Ċ", "Ċ"},
};

// The tiny byte-level BPE vocabulary's metadata.
void AddTinyVocabulary(const std::vector<std::string>& tokens, const std::vector<int32_t>& types,
                       const std::vector<std::string>& merges, absl::string_view chat_template,
                       GgufWriter* w) {
  w->AddString("tokenizer.ggml.model", "gpt2");
  w->AddString("tokenizer.ggml.pre", "smollm");
  w->AddStringArray("tokenizer.ggml.tokens", tokens);
  w->AddInt32Array("tokenizer.ggml.token_type", types);
  w->AddStringArray("tokenizer.ggml.merges", merges);
  w->AddUint32("tokenizer.ggml.bos_token_id", kTinyImStart);
  w->AddUint32("tokenizer.ggml.eos_token_id", kTinyImEnd);
  w->AddUint32("tokenizer.ggml.unknown_token_id", kTinyEndOfText);
  w->AddUint32("tokenizer.ggml.padding_token_id", kTinyImEnd);
  w->AddBool("tokenizer.ggml.add_bos_token", false);
  w->AddBool("tokenizer.ggml.add_space_prefix", false);
  w->AddString("tokenizer.chat_template", chat_template);
}

}  // namespace

absl::StatusOr<std::string> BuildTinyLlama(const TinyLlamaOptions& o) {
  const int64_t head_dim = o.head_dim > 0 ? o.head_dim : (o.n_head > 0 ? o.n_embd / o.n_head : 0);
  if (o.n_layer <= 0 || o.n_embd <= 0 || o.n_head <= 0 || o.n_head_kv <= 0 || o.n_ff <= 0 || o.n_ctx <= 0 ||
      (o.head_dim <= 0 && o.n_embd % o.n_head != 0) || o.n_head % o.n_head_kv != 0 || head_dim % 2 != 0 ||
      head_dim <= 0) {
    return absl::InvalidArgumentError("tiny llama: inconsistent dimensions");
  }
  const std::string& arch = o.architecture;
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3") {
    return absl::InvalidArgumentError(absl::StrCat("tiny llama: unknown architecture ", arch));
  }
  std::vector<GgmlType> matrix_types = {o.weight_type};
  for (const auto& [suffix, type] : o.type_overrides) matrix_types.push_back(type);
  for (GgmlType type : matrix_types) {
    const int64_t block = TypeTraits(type).block_size;
    if (o.n_embd % block != 0 || o.n_ff % block != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tiny llama: n_embd and n_ff must be multiples of ", block, " for ", TypeName(type)));
    }
  }

  // Vocabulary.
  std::vector<std::string> tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  std::vector<int32_t> types = {3, 3, 3};
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(ByteToken(b));
    types.push_back(1);
  }
  absl::flat_hash_set<std::string> known(tokens.begin(), tokens.end());
  std::vector<std::string> merges;
  const int n_table = static_cast<int>(sizeof(kMerges) / sizeof(kMerges[0]));
  for (int i = 0; i < n_table && static_cast<int>(merges.size()) < o.n_merges; ++i) {
    const std::string l = kMerges[i][0], r = kMerges[i][1];
    if (!known.contains(l) || !known.contains(r) || known.contains(l + r)) continue;
    merges.push_back(l + " " + r);
    tokens.push_back(l + r);
    types.push_back(1);
    known.insert(l + r);
  }
  int64_t n_vocab = static_cast<int64_t>(tokens.size());
  if (o.vocab != nullptr) {
    const GgufValue* real = o.vocab->FindValue("tokenizer.ggml.tokens");
    if (real == nullptr || !real->is_array() || real->array_size() == 0) {
      return absl::InvalidArgumentError("tiny llama: the vocabulary file has no tokenizer.ggml.tokens");
    }
    n_vocab = static_cast<int64_t>(real->array_size());
  }

  GgufWriter w;
  w.AddString("general.architecture", arch);
  w.AddString("general.name", absl::StrCat("tiny-", arch, "-test"));
  const std::string key = arch + ".";
  w.AddUint32(key + "block_count", static_cast<uint32_t>(o.n_layer));
  w.AddUint32(key + "context_length", static_cast<uint32_t>(o.n_ctx));
  w.AddUint32(key + "embedding_length", static_cast<uint32_t>(o.n_embd));
  w.AddUint32(key + "feed_forward_length", static_cast<uint32_t>(o.n_ff));
  w.AddUint32(key + "attention.head_count", static_cast<uint32_t>(o.n_head));
  w.AddUint32(key + "attention.head_count_kv", static_cast<uint32_t>(o.n_head_kv));
  if (o.head_dim > 0) {
    w.AddUint32(key + "attention.key_length", static_cast<uint32_t>(head_dim));
    w.AddUint32(key + "attention.value_length", static_cast<uint32_t>(head_dim));
  }
  w.AddFloat32(key + "rope.freq_base", static_cast<float>(o.rope_freq_base));
  if (!o.rope_scaling_type.empty()) {
    w.AddString(key + "rope.scaling.type", o.rope_scaling_type);
    w.AddFloat32(key + "rope.scaling.factor", static_cast<float>(o.rope_scaling_factor));
    if (o.rope_scaling_original_ctx > 0) {
      w.AddUint32(key + "rope.scaling.original_context_length",
                  static_cast<uint32_t>(o.rope_scaling_original_ctx));
    }
  }
  w.AddFloat32(key + "attention.layer_norm_rms_epsilon", static_cast<float>(o.norm_eps));
  w.AddUint32(key + "rope.dimension_count", static_cast<uint32_t>(head_dim));
  w.AddUint32(key + "vocab_size", static_cast<uint32_t>(n_vocab));
  if (o.sliding_window > 0) {
    w.AddUint32(key + "attention.sliding_window", static_cast<uint32_t>(o.sliding_window));
  }
  w.AddUint32("general.file_type", 0);
  if (o.vocab != nullptr) {
    for (const auto& [k, v] : o.vocab->metadata()) {
      if (!absl::StartsWith(k, "tokenizer.")) continue;
      if (k == "tokenizer.chat_template" && !o.chat_template.empty()) continue;
      KVCACHE_RETURN_IF_ERROR(w.CopyValue(k, v));
    }
  } else {
    AddTinyVocabulary(tokens, types, merges, o.chat_template.empty() ? kSmolLmTemplate : o.chat_template, &w);
  }
  if (o.vocab != nullptr && !o.chat_template.empty()) w.AddString("tokenizer.chat_template", o.chat_template);

  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<float> uni(-o.weight_scale, o.weight_scale);
  auto random = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = uni(rng);
    return v;
  };
  auto norm = [&](int64_t n) {  // around 1 so activations keep their scale
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = 1.0f + uni(rng);
    return v;
  };
  auto matrix = [&](const std::string& name, int64_t ne0, int64_t ne1) {
    GgmlType type = o.weight_type;
    for (const auto& [suffix, t] : o.type_overrides) {
      if (absl::EndsWith(name, suffix)) type = t;
    }
    if (!TypeTraits(type).supported) {
      KVCACHE_ASSIGN_OR_RETURN(const int64_t row_bytes, RowBytes(type, ne0));
      return w.AddTensor(name, type, {ne0, ne1}, std::string(static_cast<size_t>(row_bytes * ne1), '\0'));
    }
    return w.AddTensorFromFloats(name, type, {ne0, ne1}, random(ne0 * ne1));
  };
  // Shapes in ggml order [ne0 = input features, ne1 = output features].
  KVCACHE_RETURN_IF_ERROR(matrix("token_embd.weight", o.n_embd, n_vocab));
  if (o.rope_freqs) {  // Llama 3.1's shape: 1 for high frequencies rising to 8 for low ones
    std::vector<float> factors(static_cast<size_t>(head_dim / 2));
    for (size_t i = 0; i < factors.size(); ++i) {
      factors[i] = 1.0f + 7.0f * static_cast<float>(i) / static_cast<float>(factors.size());
    }
    KVCACHE_RETURN_IF_ERROR(
        w.AddTensorFromFloats("rope_freqs.weight", GgmlType::kF32, {head_dim / 2}, factors));
  }
  for (int64_t l = 0; l < o.n_layer; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    KVCACHE_RETURN_IF_ERROR(
        w.AddTensorFromFloats(p + "attn_norm.weight", GgmlType::kF32, {o.n_embd}, norm(o.n_embd)));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "attn_q.weight", o.n_embd, o.n_head * head_dim));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "attn_k.weight", o.n_embd, o.n_head_kv * head_dim));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "attn_v.weight", o.n_embd, o.n_head_kv * head_dim));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "attn_output.weight", o.n_head * head_dim, o.n_embd));
    if (arch == "qwen2") {
      KVCACHE_RETURN_IF_ERROR(w.AddTensorFromFloats(p + "attn_q.bias", GgmlType::kF32, {o.n_head * head_dim},
                                                    random(o.n_head * head_dim)));
      KVCACHE_RETURN_IF_ERROR(w.AddTensorFromFloats(
          p + "attn_k.bias", GgmlType::kF32, {o.n_head_kv * head_dim}, random(o.n_head_kv * head_dim)));
      KVCACHE_RETURN_IF_ERROR(w.AddTensorFromFloats(
          p + "attn_v.bias", GgmlType::kF32, {o.n_head_kv * head_dim}, random(o.n_head_kv * head_dim)));
    }
    if (arch == "qwen3") {
      KVCACHE_RETURN_IF_ERROR(
          w.AddTensorFromFloats(p + "attn_q_norm.weight", GgmlType::kF32, {head_dim}, norm(head_dim)));
      KVCACHE_RETURN_IF_ERROR(
          w.AddTensorFromFloats(p + "attn_k_norm.weight", GgmlType::kF32, {head_dim}, norm(head_dim)));
    }
    KVCACHE_RETURN_IF_ERROR(
        w.AddTensorFromFloats(p + "ffn_norm.weight", GgmlType::kF32, {o.n_embd}, norm(o.n_embd)));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "ffn_gate.weight", o.n_embd, o.n_ff));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "ffn_up.weight", o.n_embd, o.n_ff));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "ffn_down.weight", o.n_ff, o.n_embd));
  }
  KVCACHE_RETURN_IF_ERROR(
      w.AddTensorFromFloats("output_norm.weight", GgmlType::kF32, {o.n_embd}, norm(o.n_embd)));
  if (!o.tied_embeddings) KVCACHE_RETURN_IF_ERROR(matrix("output.weight", o.n_embd, n_vocab));
  return w.Serialize();
}

std::vector<NamedTinyModel> ArchitectureReferenceModels() {
  // Weights large enough that attention is far from uniform, so that position
  // handling (RoPE style, frequency factors) moves the logits well above the
  // two engines' rounding differences.
  constexpr float kScale = 0.2f;
  std::vector<NamedTinyModel> out;
  {  // Llama 3.1 style: GQA, untied output, rope_freqs.
    TinyLlamaOptions o;
    o.n_layer = 2;
    o.tied_embeddings = false;
    o.rope_freqs = true;
    o.rope_freq_base = 500000.0;
    o.seed = 11;
    o.weight_scale = kScale;
    out.push_back({"llama31", o, ""});
  }
  {  // Qwen 2.5 style: Q/K/V biases, NeoX RoPE, tied output.
    TinyLlamaOptions o;
    o.architecture = "qwen2";
    o.rope_freq_base = 1000000.0;
    o.norm_eps = 1e-6;
    o.seed = 12;
    o.weight_scale = kScale;
    out.push_back({"qwen2", o, ""});
  }
  {  // Qwen 3 style: per-head Q/K RMSNorm, head size 32 from key_length with a
     // 64-wide model (q_dim 128 != n_embd), untied output.
    TinyLlamaOptions o;
    o.architecture = "qwen3";
    o.head_dim = 32;
    o.tied_embeddings = false;
    o.rope_freq_base = 1000000.0;
    o.norm_eps = 1e-6;
    o.seed = 13;
    o.weight_scale = kScale;
    out.push_back({"qwen3", o, ""});
  }
  {  // Qwen 2.5 with Q8_0 weights: the quantised matmuls with biases.
    TinyLlamaOptions o;
    o.architecture = "qwen2";
    o.weight_type = GgmlType::kQ8_0;
    o.seed = 14;
    o.weight_scale = kScale;
    out.push_back({"qwen2_q8_0", o, ""});
  }
  {  // Real vocabularies: n_vocab (and the output matrix) at the families' sizes.
    TinyLlamaOptions o;
    o.architecture = "qwen2";
    o.rope_freq_base = 1000000.0;
    o.seed = 21;
    o.weight_scale = kScale;
    out.push_back({"qwen2_real_vocab", o, "qwen2"});
    o.architecture = "llama";
    o.rope_freqs = true;
    o.rope_freq_base = 500000.0;
    o.seed = 22;
    out.push_back({"llama3_real_vocab", o, "llama-bpe"});
    o.rope_freqs = false;
    o.rope_freq_base = 10000.0;
    o.seed = 23;
    out.push_back({"llama_spm_real_vocab", o, "llama-spm"});
  }
  {  // Qwen 2.5 / Qwen 3 "128K" files: YaRN, factor 4 over a 32-token original
     // context, so the 12 test positions span the ramp between extrapolated and
     // interpolated pairs (correction dims 0 and 2 of 8), cos and sin scaled by
     // 1 + 0.1 ln 4.
    TinyLlamaOptions o;
    o.architecture = "qwen2";
    o.rope_freq_base = 10000.0;
    o.rope_scaling_type = "yarn";
    o.rope_scaling_factor = 4.0;
    o.rope_scaling_original_ctx = 32;
    o.seed = 15;
    o.weight_scale = kScale;
    out.push_back({"qwen2_yarn", o, ""});
  }
  return out;
}

absl::Status WriteTinyLlama(const TinyLlamaOptions& options, const std::string& path) {
  KVCACHE_ASSIGN_OR_RETURN(std::string bytes, BuildTinyLlama(options));
  FILE* f = fopen(path.c_str(), "wb");
  if (f == nullptr) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  const bool ok = fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  if (fclose(f) != 0 || !ok) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace gguf
}  // namespace kvcache
