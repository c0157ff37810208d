// Writes complete, tiny Llama GGUF models with random weights: real
// hyper-parameters, tensors of a chosen type, a small byte-level BPE vocabulary
// (256 byte tokens, ChatML control tokens and a few merges) and the SmolLM2
// ChatML template. A whole model loads and runs in milliseconds in tests.
//
// Thread-safety: pure functions (deterministic given options.seed).
#ifndef KVCACHE_COMMON_GGUF_TINY_LLAMA_H_
#define KVCACHE_COMMON_GGUF_TINY_LLAMA_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_reader.h"

namespace kvcache {
namespace gguf {

struct TinyLlamaOptions {
  // "llama", "qwen2" (adds attn_{q,k,v}.bias) or "qwen3" (adds
  // attn_{q,k}_norm.weight and writes attention.key_length/value_length).
  std::string architecture = "llama";
  int64_t n_layer = 2;
  int64_t n_embd = 64;  // multiple of the weight type's block size
  int64_t n_head = 4;
  int64_t n_head_kv = 2;
  int64_t n_ff = 128;    // multiple of the weight type's block size
  int64_t head_dim = 0;  // 0: n_embd / n_head
  int64_t n_ctx = 256;
  int64_t sliding_window = 0;  // written when > 0
  double rope_freq_base = 10000.0;
  // Written when rope_scaling_type is not empty: rope.scaling.type, .factor and
  // .original_context_length (when > 0).
  std::string rope_scaling_type;
  double rope_scaling_factor = 1.0;
  int64_t rope_scaling_original_ctx = 0;
  double norm_eps = 1e-5;
  bool tied_embeddings = true;  // false: also write output.weight
  bool rope_freqs = false;      // write rope_freqs.weight (Llama 3.1 style, factors 1..8)
  // Type of the 2-D weight matrices (token_embd, attention, FFN, output);
  // norms are always F32.
  GgmlType weight_type = GgmlType::kF32;
  // Per-matrix exceptions: a matrix whose name ends with `first` (e.g.
  // "attn_v.weight") takes type `second`, as llama.cpp's mixed quantisations do
  // (Q4_K_M keeps V and FFN-down in Q6_K). A type this library cannot
  // quantise (Q2_K, Q3_K, the IQ types) is written as zero blocks: a file for
  // tests of what refuses it.
  std::vector<std::pair<std::string, GgmlType>> type_overrides;
  float weight_scale = 0.05f;  // weights ~ uniform(-scale, scale)
  uint64_t seed = 1;
  int n_merges = 64;  // extra merge tokens after the 256 byte tokens
  // A real vocabulary: every tokenizer.* key of this file (e.g. llama.cpp's
  // models/ggml-vocab-qwen2.gguf) replaces the tiny one, chat template included,
  // and n_vocab follows it. Not owned; null: the tiny vocabulary.
  const GgufFile* vocab = nullptr;
  // Non-empty: written as tokenizer.chat_template instead of the vocabulary's.
  std::string chat_template;
};

// SmolLM2-135M's shapes (30 layers, 576 wide, 9 query / 3 KV heads, FFN 1536,
// 8k context, RoPE base 1e5) with synthetic Q4_1 weights: for machines where
// the real model file cannot go (the GPU device takes at most 64 MiB).
inline TinyLlamaOptions SmolLM2ShapedOptions() {
  TinyLlamaOptions o;
  o.n_layer = 30;
  o.n_embd = 576;
  o.n_head = 9;
  o.n_head_kv = 3;
  o.n_ff = 1536;
  o.n_ctx = 8192;
  o.rope_freq_base = 100000.0;
  o.weight_type = GgmlType::kQ4_1;
  return o;
}

// Token ids of the tiny vocabulary: 0 <|endoftext|>, 1 <|im_start|>,
// 2 <|im_end|> (control), 3..258 the 256 byte tokens, then merge results.
constexpr int32_t kTinyEndOfText = 0;
constexpr int32_t kTinyImStart = 1;
constexpr int32_t kTinyImEnd = 2;

// One tiny model per supported architecture feature (f32 or Q8_0 weights), and
// one per family carrying its real vocabulary (Qwen 2.5, Llama 3, Llama 2 /
// Mistral SentencePiece), that
// tests/worker/model/arch_reference_test.cc checks against llama.cpp's logits
// (tests/data/arch_reference.json, recorded by tests/data/record_arch_reference.py
// from the files `kvcache-tiny-model --out_dir` writes). Changing one changes its
// bytes: the test then fails on the recorded digest until it is re-recorded.
struct NamedTinyModel {
  std::string name;
  TinyLlamaOptions options;
  // "": the tiny vocabulary. Else llama.cpp's models/ggml-vocab-<vocab>.gguf,
  // which the caller opens and sets as options.vocab.
  std::string vocab;
};
std::vector<NamedTinyModel> ArchitectureReferenceModels();

// The GGUF bytes. INVALID_ARGUMENT for inconsistent options.
absl::StatusOr<std::string> BuildTinyLlama(const TinyLlamaOptions& options);
absl::Status WriteTinyLlama(const TinyLlamaOptions& options, const std::string& path);

}  // namespace gguf
}  // namespace kvcache

#endif  // KVCACHE_COMMON_GGUF_TINY_LLAMA_H_
