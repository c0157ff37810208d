#include "common/gguf/tiny_llama.h"

#include <cstdio>
#include <random>
#include <vector>

#include "absl/container/flat_hash_set.h"
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

}  // namespace

absl::StatusOr<std::string> BuildTinyLlama(const TinyLlamaOptions& o) {
  if (o.n_layer <= 0 || o.n_embd <= 0 || o.n_head <= 0 || o.n_head_kv <= 0 || o.n_ff <= 0 || o.n_ctx <= 0 ||
      o.n_embd % o.n_head != 0 || o.n_head % o.n_head_kv != 0 || (o.n_embd / o.n_head) % 2 != 0) {
    return absl::InvalidArgumentError("tiny llama: inconsistent dimensions");
  }
  const int64_t block = TypeTraits(o.weight_type).block_size;
  if (o.n_embd % block != 0 || o.n_ff % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tiny llama: n_embd and n_ff must be multiples of ", block,
                                                   " for ", TypeName(o.weight_type)));
  }
  const int64_t head_dim = o.n_embd / o.n_head;

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
  const int64_t n_vocab = static_cast<int64_t>(tokens.size());

  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddString("general.name", "tiny-llama-test");
  w.AddUint32("llama.block_count", static_cast<uint32_t>(o.n_layer));
  w.AddUint32("llama.context_length", static_cast<uint32_t>(o.n_ctx));
  w.AddUint32("llama.embedding_length", static_cast<uint32_t>(o.n_embd));
  w.AddUint32("llama.feed_forward_length", static_cast<uint32_t>(o.n_ff));
  w.AddUint32("llama.attention.head_count", static_cast<uint32_t>(o.n_head));
  w.AddUint32("llama.attention.head_count_kv", static_cast<uint32_t>(o.n_head_kv));
  w.AddFloat32("llama.rope.freq_base", static_cast<float>(o.rope_freq_base));
  w.AddFloat32("llama.attention.layer_norm_rms_epsilon", static_cast<float>(o.norm_eps));
  w.AddUint32("llama.rope.dimension_count", static_cast<uint32_t>(head_dim));
  w.AddUint32("llama.vocab_size", static_cast<uint32_t>(n_vocab));
  if (o.sliding_window > 0) {
    w.AddUint32("llama.attention.sliding_window", static_cast<uint32_t>(o.sliding_window));
  }
  w.AddUint32("general.file_type", 0);
  w.AddString("tokenizer.ggml.model", "gpt2");
  w.AddString("tokenizer.ggml.pre", "smollm");
  w.AddStringArray("tokenizer.ggml.tokens", tokens);
  w.AddInt32Array("tokenizer.ggml.token_type", types);
  w.AddStringArray("tokenizer.ggml.merges", merges);
  w.AddUint32("tokenizer.ggml.bos_token_id", kTinyImStart);
  w.AddUint32("tokenizer.ggml.eos_token_id", kTinyImEnd);
  w.AddUint32("tokenizer.ggml.unknown_token_id", kTinyEndOfText);
  w.AddUint32("tokenizer.ggml.padding_token_id", kTinyImEnd);
  w.AddBool("tokenizer.ggml.add_bos_token", false);
  w.AddBool("tokenizer.ggml.add_space_prefix", false);
  w.AddString("tokenizer.chat_template", kSmolLmTemplate);

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
    return w.AddTensorFromFloats(name, o.weight_type, {ne0, ne1}, random(ne0 * ne1));
  };
  // Shapes in ggml order [ne0 = input features, ne1 = output features].
  KVCACHE_RETURN_IF_ERROR(matrix("token_embd.weight", o.n_embd, n_vocab));
  for (int64_t l = 0; l < o.n_layer; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    KVCACHE_RETURN_IF_ERROR(
        w.AddTensorFromFloats(p + "attn_norm.weight", GgmlType::kF32, {o.n_embd}, norm(o.n_embd)));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "attn_q.weight", o.n_embd, o.n_head * head_dim));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "attn_k.weight", o.n_embd, o.n_head_kv * head_dim));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "attn_v.weight", o.n_embd, o.n_head_kv * head_dim));
    KVCACHE_RETURN_IF_ERROR(matrix(p + "attn_output.weight", o.n_head * head_dim, o.n_embd));
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
