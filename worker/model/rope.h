// Rotary position embedding of a model, one definition for every backend (the
// CPU RopeTable and the CUDA runner's table both come from RopeAt): the angle
// and magnitude of each rotated pair at each position, as llama.cpp computes
// them (ggml's rope_yarn):
//
//   theta_extrap(p, i) = p * freq_base^(-2i / head_dim) / freq_factors[i]
//   theta_interp(p, i) = freq_scale * theta_extrap(p, i)
//   none/linear: theta = theta_interp, magnitude = attn_factor
//   yarn:        theta = theta_interp * (1 - r_i) + theta_extrap * r_i, where the
//                ramp r_i is 1 below YaRN's low correction dim and 0 above its
//                high one (beta_fast = 32, beta_slow = 1 rotations over the
//                original context), and magnitude = attn_factor * (1 + 0.1 ln factor)
//
// cos and sin are multiplied by the magnitude. Llama ("NORM") style rotates the
// adjacent values (x[2i], x[2i+1]); NeoX style (Qwen) the halves (x[i], x[i + head_dim/2]).
//
// Thread-safety: free functions, reentrant.
#ifndef KVCACHE_WORKER_MODEL_ROPE_H_
#define KVCACHE_WORKER_MODEL_ROPE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "common/gguf/llama_hparams.h"

namespace kvcache::model {

struct RopeParams {
  int head_dim = 64;  // rotated dims (all of the head); REQUIRES even
  float freq_base = 10000.0f;
  float freq_scale = 1.0f;  // 1 / rope.scaling.factor for linear and YaRN scaling
  bool neox = false;
  std::vector<float> freq_factors;  // empty, or head_dim / 2 positive values (Llama 3.1's rope_freqs)
  float attn_factor = 1.0f;         // rope.scaling.attn_factor: scales cos and sin
  bool yarn = false;
  int yarn_orig_ctx = 0;  // rope.scaling.original_context_length, else context_length
  float yarn_beta_fast = 32.0f;
  float yarn_beta_slow = 1.0f;
};

struct RopeAngle {
  double cos;  // cos(theta) * magnitude
  double sin;  // sin(theta) * magnitude
};

// Pair `pair` (0 <= pair < head_dim / 2) at position `pos`, in double.
RopeAngle RopeAt(const RopeParams& params, int pos, int pair);

// A model's RoPE from its hyper-parameters and rope_freqs (empty when it has
// none). UNIMPLEMENTED naming the type for scaling other than none, linear and
// yarn.
absl::StatusOr<RopeParams> RopeParamsFor(const gguf::LlamaHparams& hp, const std::vector<float>& rope_freqs);

// Positions a backend's RoPE table covers: context_length, or the original
// context times the scaling factor when that is longer.
int RopeMaxPositions(const gguf::LlamaHparams& hp);

}  // namespace kvcache::model

#endif  // KVCACHE_WORKER_MODEL_ROPE_H_
