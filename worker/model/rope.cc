#include "worker/model/rope.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvcache::model {
namespace {

// YaRN's correction dim for `n_rotations` full rotations over the original
// context (ggml_rope_yarn_corr_dim).
double YarnCorrDim(int head_dim, int orig_ctx, double n_rotations, double base) {
  return head_dim * std::log(orig_ctx / (n_rotations * 2 * M_PI)) / (2 * std::log(base));
}

}  // namespace

RopeAngle RopeAt(const RopeParams& params, int pos, int pair) {
  const int d = params.head_dim;
  // The same operations in the same order for every backend (bit-exact tables).
  double extrap = static_cast<double>(pos) * std::pow(static_cast<double>(params.freq_base), -2.0 * pair / d);
  if (!params.freq_factors.empty() && params.freq_factors[pair] != 1.0f) {
    extrap /= static_cast<double>(params.freq_factors[pair]);
  }
  double theta = static_cast<double>(params.freq_scale) * extrap;
  double magnitude = params.attn_factor;
  if (params.yarn) {
    const double low = std::max(
        0.0, std::floor(YarnCorrDim(d, params.yarn_orig_ctx, params.yarn_beta_fast, params.freq_base)));
    const double high = std::min(
        d - 1.0, std::ceil(YarnCorrDim(d, params.yarn_orig_ctx, params.yarn_beta_slow, params.freq_base)));
    const double y = (pair - low) / std::max(0.001, high - low);
    const double ramp = 1.0 - std::min(1.0, std::max(0.0, y));
    theta = theta * (1.0 - ramp) + extrap * ramp;
    // llama.cpp's attention factor for YaRN (get_mscale(factor, 1)).
    const double factor = 1.0 / static_cast<double>(params.freq_scale);
    if (factor > 1.0) magnitude *= 1.0 + 0.1 * std::log(factor);
  }
  return {std::cos(theta) * magnitude, std::sin(theta) * magnitude};
}

absl::StatusOr<RopeParams> RopeParamsFor(const gguf::LlamaHparams& hp, const std::vector<float>& rope_freqs) {
  RopeParams p;
  p.head_dim = static_cast<int>(hp.head_dim);
  p.freq_base = static_cast<float>(hp.rope_freq_base);
  p.neox = hp.rope_neox;
  p.freq_factors = rope_freqs;
  p.attn_factor = static_cast<float>(hp.rope_scaling.attn_factor);
  const std::string& type = hp.rope_scaling.type;
  const double factor = hp.rope_scaling.factor;
  if (type == "linear" || type == "yarn") {
    if (factor > 0) p.freq_scale = static_cast<float>(1.0 / factor);
    if (type == "yarn") {
      p.yarn = true;
      p.yarn_orig_ctx = static_cast<int>(hp.rope_scaling.original_context_length > 0
                                             ? hp.rope_scaling.original_context_length
                                             : hp.n_ctx_train);
    }
  } else if (type != "none" && factor != 1.0) {
    return absl::UnimplementedError(
        absl::StrCat("rope scaling '", type, "' (supported: none, linear, yarn)"));
  }
  return p;
}

int RopeMaxPositions(const gguf::LlamaHparams& hp) {
  int64_t n = hp.n_ctx_train > 0 ? hp.n_ctx_train : 4096;
  const gguf::RopeScaling& s = hp.rope_scaling;
  if ((s.type == "linear" || s.type == "yarn") && s.factor > 1.0 && s.original_context_length > 0) {
    n = std::max<int64_t>(n, static_cast<int64_t>(s.original_context_length * s.factor));
  }
  return static_cast<int>(std::min<int64_t>(n, int64_t{1} << 24));
}

}  // namespace kvcache::model
