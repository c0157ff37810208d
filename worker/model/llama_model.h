// A Llama-architecture decoder's weights, bound to a GGUF file without copying:
// every linear weight stays in its quantised form inside the memory map, and
// the backends multiply against it directly (model::WeightView).
// Norm weights are small and kept as f32 vectors.
//
//   token_embd: [n_vocab][n_embd]       (the output projection too, when tied)
//   per layer:  attn_norm [n_embd], wq [n_head*hd][n_embd], wk/wv [n_head_kv*hd][n_embd],
//               wo [n_embd][n_head*hd], ffn_norm [n_embd], w_gate/w_up [n_ff][n_embd],
//               w_down [n_embd][n_ff]
//   output_norm [n_embd], output [n_vocab][n_embd]
// and by architecture (gguf::LlamaHparams): qwen2's bq/bk/bv [q_dim]/[kv_dim]
// added after the projections, qwen3's q_norm/k_norm [head_dim] applied to each
// head before RoPE, and Llama 3.1's rope_freqs [n_rot/2] dividing each pair's
// rotation frequency.
//
// Thread-safety: immutable after Load; safe to share between threads.
#ifndef KVCACHE_WORKER_MODEL_LLAMA_MODEL_H_
#define KVCACHE_WORKER_MODEL_LLAMA_MODEL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/gguf/gguf_reader.h"
#include "common/gguf/llama_hparams.h"
#include "worker/model/weight_view.h"

namespace kvcache::model {

struct LlamaLayer {
  std::vector<float> attn_norm;  // [n_embd]
  WeightView wq, wk, wv, wo;
  std::vector<float> bq, bk, bv;      // empty unless hparams().qkv_bias
  std::vector<float> q_norm, k_norm;  // [head_dim]; empty unless hparams().qk_norm
  std::vector<float> ffn_norm;        // [n_embd]
  WeightView w_gate, w_up, w_down;
};

class LlamaModel {
 public:
  // Opens and validates the GGUF at `path` (NOT_FOUND naming scripts/setup.sh when
  // the file is missing).
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const std::string& path);
  // Binds an already opened file (tests build tiny models in memory).
  static absl::StatusOr<std::unique_ptr<LlamaModel>> FromFile(std::unique_ptr<gguf::GgufFile> file);

  const gguf::LlamaHparams& hparams() const { return hparams_; }
  const gguf::GgufFile& file() const { return *file_; }
  const std::vector<LlamaLayer>& layers() const { return layers_; }
  const WeightView& token_embd() const { return token_embd_; }
  const WeightView& output() const { return output_; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  // [n_rot / 2] frequency divisors; empty unless hparams().has_rope_freqs.
  const std::vector<float>& rope_freqs() const { return rope_freqs_; }
  // Identifies the model in prefix hashes and migrations: general.name plus a
  // digest of the tensor table and metadata, so two different files never share
  // cache pages.
  const std::string& model_id() const { return model_id_; }
  // Bytes of all weights read per decoded token.
  int64_t weight_bytes() const { return weight_bytes_; }

 private:
  LlamaModel() = default;

  std::unique_ptr<gguf::GgufFile> file_;
  gguf::LlamaHparams hparams_;
  std::vector<LlamaLayer> layers_;
  WeightView token_embd_;
  WeightView output_;
  std::vector<float> output_norm_;
  std::vector<float> rope_freqs_;
  std::string model_id_;
  int64_t weight_bytes_ = 0;
};

}  // namespace kvcache::model

#endif  // KVCACHE_WORKER_MODEL_LLAMA_MODEL_H_
