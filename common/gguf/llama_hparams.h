// Hyper-parameters of a Llama-family decoder, read from GGUF metadata
// (`general.architecture` then `<arch>.*` keys) and checked for consistency
// with the tensors.
//
// Thread-safety: plain value type.
#ifndef KVCACHE_COMMON_GGUF_LLAMA_HPARAMS_H_
#define KVCACHE_COMMON_GGUF_LLAMA_HPARAMS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/gguf/gguf_reader.h"

namespace kvcache {
namespace gguf {

struct RopeScaling {
  std::string type = "none";            // "none", "linear", "yarn", ...
  double factor = 1.0;                  // context extension factor
  int64_t original_context_length = 0;  // 0 when not given
  double attn_factor = 1.0;             // rope.scaling.attn_factor: scales RoPE's cos and sin
};

// The GGUF architectures this decoder runs, and how each differs from Llama:
//   llama  Llama 2/3.x, SmolLM, Mistral (SentencePiece vocabulary, optional
//          sliding window), Llama 3.1's rope_freqs; RoPE on adjacent pairs
//   qwen2  Qwen 2/2.5: Q/K/V projections with biases; RoPE on half-rotated pairs
//          (NeoX style)
//   qwen3  Qwen 3 (dense): per-head RMSNorm of Q and K before RoPE, NeoX RoPE,
//          head size from attention.key_length
inline constexpr const char* kSupportedArchitectures[] = {"llama", "qwen2", "qwen3"};

struct LlamaHparams {
  std::string architecture;  // one of kSupportedArchitectures
  std::string name;          // general.name, may be empty
  int64_t n_layer = 0;       // block_count
  int64_t n_embd = 0;        // embedding_length
  int64_t n_ff = 0;          // feed_forward_length
  int64_t n_head = 0;        // attention.head_count
  int64_t n_head_kv = 0;     // attention.head_count_kv (defaults to n_head)
  int64_t head_dim = 0;      // attention.key_length, else n_embd / n_head
  int64_t head_dim_v = 0;    // attention.value_length, else head_dim
  int64_t n_rot = 0;         // rope.dimension_count, else head_dim
  int64_t n_ctx_train = 0;   // context_length
  int64_t n_vocab = 0;       // tokenizer tokens, else vocab_size, else token_embd ne[1]
  double rope_freq_base = 10000.0;
  RopeScaling rope_scaling;
  double norm_rms_eps = 1e-5;
  int64_t sliding_window = 0;    // 0: full attention
  bool tied_embeddings = false;  // no output.weight: logits use token_embd
  bool has_rope_freqs = false;   // rope_freqs.weight present (Llama 3.1 style)
  bool rope_neox = false;        // rotate (x[i], x[i + n_rot/2]) instead of (x[2i], x[2i+1])
  bool qkv_bias = false;         // attn_{q,k,v}.bias tensors (qwen2)
  bool qk_norm = false;          // attn_{q,k}_norm.weight per-head RMSNorm (qwen3)

  // n_head / n_head_kv query heads share one KV head.
  int64_t gqa_ratio() const { return n_head / n_head_kv; }
  // Bytes of K and V for one token over all layers:
  // n_layer * n_head_kv * (head_dim + head_dim_v) * dtype_bytes.
  int64_t KvBytesPerToken(int64_t dtype_bytes) const {
    return n_layer * n_head_kv * (head_dim + head_dim_v) * dtype_bytes;
  }
  std::string DebugString() const;
};

// INVALID_ARGUMENT naming the key when a value is missing, mistyped or
// inconsistent; UNIMPLEMENTED naming the architecture and the supported ones for
// an architecture outside kSupportedArchitectures.
absl::StatusOr<LlamaHparams> LoadLlamaHparams(const GgufFile& file);

// The id a worker reports for the model in `file` (WorkerSnapshot.model_id): its
// name (or architecture) plus a digest of every tensor's name, type, shape and
// first bytes, and the metadata keys. Cheap (no full-file hash at start-up) yet
// different for any two real checkpoints. Routers compare it with their own.
std::string ModelId(const GgufFile& file, const LlamaHparams& hp);

}  // namespace gguf
}  // namespace kvcache

#endif  // KVCACHE_COMMON_GGUF_LLAMA_HPARAMS_H_
